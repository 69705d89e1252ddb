//! The official OpenAI Python client (from the vLLM venv) as a user would run it.
//!
//! One script makes the four calls a user makes (completions and chat, each streamed and not, greedy)
//! against a base URL and prints what the client returned as one JSON object. The case runs it once
//! against vLLM directly and once through a sidecar and compares.

use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::setup::Venv;
use super::MODEL;

const SCRIPT: &str = r#"
import json, sys
import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=60.0, max_retries=0)
prompt = "The quick brown fox jumps over the lazy dog. Once upon a time"
messages = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]
out = {}

r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
out["completion"] = {"text": r.choices[0].text, "finish_reason": r.choices[0].finish_reason,
                     "prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens}

text, finish, chunks = "", None, 0
for c in client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True):
    chunks += 1
    if c.choices:
        text += c.choices[0].text or ""
        finish = c.choices[0].finish_reason or finish
out["completion_stream"] = {"text": text, "finish_reason": finish, "chunks": chunks}

r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
out["chat"] = {"text": r.choices[0].message.content, "finish_reason": r.choices[0].finish_reason,
               "prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens}

text, finish, chunks = "", None, 0
stream = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                        stream=True, stream_options={"include_usage": True})
usage = None
for c in stream:
    chunks += 1
    if c.choices:
        text += c.choices[0].delta.content or ""
        finish = c.choices[0].finish_reason or finish
    if c.usage:
        usage = c.usage.completion_tokens
out["chat_stream"] = {"text": text, "finish_reason": finish, "chunks": chunks, "completion_tokens": usage}

models = client.models.list()
out["models"] = sorted(m.id for m in models.data)
print(json.dumps(out))
"#;

/// Runs the client script against `base_url` (`http://host:port`, no `/v1`) and returns its JSON.
pub fn run_openai_calls(venv: &Venv, base_url: &str) -> Result<Value> {
    let mut child = Command::new(&venv.python)
        .arg("-c")
        .arg(SCRIPT)
        .arg(base_url)
        .arg(MODEL)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the OpenAI Python client")?;
    // The client's own timeout is 60 s per call; this bounds the whole script.
    let deadline = std::time::Instant::now() + Duration::from_secs(180);
    loop {
        if child.try_wait()?.is_some() || std::time::Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if child.try_wait()?.is_none() {
        let _ = child.kill();
        let _ = child.wait();
        bail!("the OpenAI client script did not finish within 180 s");
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "the OpenAI client failed against {base_url} ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "client output is not JSON: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}
