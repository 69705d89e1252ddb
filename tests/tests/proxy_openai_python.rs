//! The official OpenAI Python client, talking to a fake vLLM engine through the
//! proxy: completions and chat, streaming and not. Uses `$KVMESH_PYTHON` (set
//! by `scripts/test`), else runs `scripts/setup-python` itself.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use kvmesh_tests::sidecar::start_for;

const SCRIPT: &str = r#"
import json, sys
import openai

base = sys.argv[1]
c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=20)
out = {}

r = c.completions.create(model="tiny-llama", prompt="The capital of France", max_tokens=3)
out["completion"] = r.choices[0].text
out["completion_usage"] = r.usage.completion_tokens

s = c.completions.create(model="tiny-llama", prompt="Once", max_tokens=4, stream=True)
out["completion_stream"] = "".join(ch.choices[0].text for ch in s if ch.choices)

r = c.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
out["chat"] = r.choices[0].message.content
out["chat_role"] = r.choices[0].message.role

s = c.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True)
out["chat_stream"] = "".join((ch.choices[0].delta.content or "") for ch in s if ch.choices)

out["models"] = [m.id for m in c.models.list()]

try:
    c.chat.completions.create(model="tiny-llama", messages="not a list", max_tokens=1)
    out["bad_request"] = "no error"
except openai.BadRequestError as e:
    out["bad_request"] = e.status_code

print(json.dumps(out))
"#;

fn python() -> PathBuf {
    kvmesh_tests::python::interpreter()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_client_through_the_proxy() {
    let python = tokio::task::spawn_blocking(python).await.unwrap();
    let engine = kvmesh_tests::fake_vllm::start().await;
    let proxy = start_for(engine.addr()).await;
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("client.py");
    std::fs::write(&script, SCRIPT).unwrap();
    let child = tokio::process::Command::new(&python)
        .arg(&script)
        .arg(format!("http://{}", proxy.addr()))
        .env_remove("OPENAI_BASE_URL")
        .env_remove("OPENAI_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start python");
    let out = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output())
        .await
        .expect("python finished within 120 s")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python failed:\n{}\n{}",
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["completion"], " is is is");
    assert_eq!(v["completion_usage"], 3);
    assert_eq!(v["completion_stream"], " is is is is");
    assert_eq!(v["chat"], " is is");
    assert_eq!(v["chat_role"], "assistant");
    assert_eq!(v["chat_stream"], " is is is is is");
    assert_eq!(v["models"], serde_json::json!(["tiny-llama"]));
    // The proxy rejected the malformed chat body itself, as the SDK expects a 400.
    assert_eq!(v["bad_request"], 400);
    // Five calls reached the engine (the bad one did not), each with a request id.
    let seen = engine.calls();
    assert_eq!(seen.len(), 5);
    assert!(seen.iter().all(|s| s.headers.contains_key("x-request-id")));
    proxy.shutdown().await;
}
