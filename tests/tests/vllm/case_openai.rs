//! Case 1: the OpenAI API through a kvmesh sidecar in front of real vLLM.
//!
//! What a user notices: the official Python client works through the sidecar for completions and
//! chat, streamed and not, and gets the same answers as from vLLM directly; a response, streamed or
//! not, arrives byte for byte as vLLM sent it. The sidecar reaches vLLM through a recording relay, so
//! "as vLLM sent it" is checked against the very bytes vLLM produced for that request (vLLM groups
//! tokens into stream events differently from one request to the next when it is busy).

use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};

use super::http::{Http, Reply};
use super::pyclient::run_openai_calls;
use super::recorder::Recorder;
use super::report::note;
use super::setup::Venv;
use super::MODEL;

/// The Python client against vLLM directly and through the sidecar: identical results.
pub fn python_client(venv: &Venv, engine_url: &str, sidecar_url: &str) -> Result<()> {
    let mut direct =
        run_openai_calls(venv, engine_url).context("OpenAI client against vLLM directly")?;
    let mut proxied =
        run_openai_calls(venv, sidecar_url).context("OpenAI client through the sidecar")?;
    // How many chunks a stream has depends on timing: vLLM coalesces tokens into one event when
    // it is busy. The texts, finish reasons and token counts are compared.
    for call in ["completion_stream", "chat_stream"] {
        for r in [&mut direct, &mut proxied] {
            if let Some(o) = r[call].as_object_mut() {
                o.remove("chunks");
            }
        }
    }
    for call in ["completion", "completion_stream", "chat", "chat_stream"] {
        let text = proxied[call]["text"].as_str().unwrap_or_default();
        ensure!(
            !text.is_empty(),
            "{call}: empty text through the sidecar: {proxied}"
        );
    }
    ensure!(
        direct == proxied,
        "the OpenAI client saw different results through the sidecar\n direct:  {direct}\n sidecar: {proxied}"
    );
    // Greedy decoding: streaming must not change the answer.
    for (plain, streamed) in [("completion", "completion_stream"), ("chat", "chat_stream")] {
        ensure!(
            proxied[plain]["text"] == proxied[streamed]["text"],
            "{plain} and {streamed} differ: {proxied}"
        );
    }
    note(&format!(
        "single: OpenAI client, same results direct and through the sidecar: {proxied}"
    ));
    Ok(())
}

/// Raw bodies, streamed and not, completions and chat: what the client gets through the sidecar is
/// exactly a body vLLM sent (recorded between sidecar and vLLM); non-streamed bodies also equal those
/// of the same request sent to vLLM directly, but for `id` and `created`.
pub async fn raw_bytes(
    http: &Http,
    engine_url: &str,
    sidecar_url: &str,
    recorder: &Recorder,
) -> Result<()> {
    let completion = json!({"model": MODEL, "prompt": "Once upon a time, in a quiet valley,",
                            "max_tokens": 12, "temperature": 0});
    let chat = json!({"model": MODEL, "max_tokens": 12, "temperature": 0,
                      "messages": [{"role": "user", "content": "Tell me a short story about a fox."}]});
    let cases = [
        ("/v1/completions", completion.clone(), false),
        ("/v1/completions", with_stream(&completion), true),
        ("/v1/chat/completions", chat.clone(), false),
        ("/v1/chat/completions", with_stream(&chat), true),
    ];
    for (path, body, stream) in cases {
        let what = format!("{path} stream={stream}");
        // A first request fills the prefix cache, so the two compared below see the same cache
        // state (`cached_tokens` in usage is part of the bytes).
        http.post_json(&format!("{engine_url}{path}"), &body)
            .await?
            .json()
            .ok();
        let direct = http
            .post_json(&format!("{engine_url}{path}"), &body)
            .await?;
        recorder.clear();
        let proxied = http
            .post_json(&format!("{sidecar_url}{path}"), &body)
            .await?;
        let sent_by_vllm = recorder.bodies();
        ensure!(
            sent_by_vllm.iter().any(|b| b[..] == proxied.body[..]),
            "{what}: the client's body is not one vLLM sent\n client: {:?}\n vLLM sent: {:?}",
            proxied.text(),
            sent_by_vllm
                .iter()
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .collect::<Vec<_>>()
        );
        compare(&what, stream, &direct, &proxied)?;
    }
    Ok(())
}

fn with_stream(body: &Value) -> Value {
    let mut b = body.clone();
    b["stream"] = json!(true);
    b["stream_options"] = json!({"include_usage": true});
    b
}

fn compare(what: &str, stream: bool, direct: &Reply, proxied: &Reply) -> Result<()> {
    ensure!(
        direct.status.is_success(),
        "{what}: vLLM answered HTTP {}: {}",
        direct.status,
        direct.text()
    );
    ensure!(
        proxied.status == direct.status,
        "{what}: sidecar answered HTTP {} ({}), vLLM {}",
        proxied.status,
        proxied.text(),
        direct.status
    );
    ensure!(
        proxied.content_type == direct.content_type,
        "{what}: content-type {:?} through the sidecar, {:?} from vLLM",
        proxied.content_type,
        direct.content_type
    );
    let (a, b) = (
        blank_volatile(&direct.text()),
        blank_volatile(&proxied.text()),
    );
    if stream {
        ensure!(
            b.starts_with("data: ") && b.ends_with("data: [DONE]\n\n"),
            "{what}: not an SSE stream: {b}"
        );
    } else {
        ensure!(
            a == b,
            "{what}: bodies differ\n vLLM:    {a:?}\n sidecar: {b:?}"
        );
    }
    Ok(())
}

/// The body with the values of `"id"` and `"created"` blanked: vLLM makes them fresh for every request.
/// Everything else (spacing, key order, chunk boundaries between events) is compared as sent.
pub fn blank_volatile(body: &str) -> String {
    let mut out = String::with_capacity(body.len());
    let mut rest = body;
    loop {
        let id = rest.find("\"id\":\"");
        let created = rest.find("\"created\":");
        let (at, key_len, is_string) = match (id, created) {
            (Some(i), Some(c)) if i < c => (i, 6, true),
            (Some(i), None) => (i, 6, true),
            (_, Some(c)) => (c, 10, false),
            (None, None) => break,
        };
        out.push_str(&rest[..at + key_len]);
        rest = &rest[at + key_len..];
        let end = if is_string {
            rest.find('"').unwrap_or(rest.len())
        } else {
            rest.find(|c: char| !c.is_ascii_digit())
                .unwrap_or(rest.len())
        };
        out.push('_');
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::blank_volatile;

    #[test]
    fn blanks_only_id_and_created() {
        let a = r#"data: {"id":"cmpl-1","created":17,"x":"id","tool_call_id":"k"}"#;
        assert_eq!(
            blank_volatile(a),
            r#"data: {"id":"_","created":_,"x":"id","tool_call_id":"k"}"#
        );
    }
}
