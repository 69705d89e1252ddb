//! A fake engine that answers in vLLM's shapes (as captured from vLLM 0.32 in
//! `tests/fixtures/vllm-cpu/probe/`): completions and chat, streaming (one SSE
//! event per token, a usage event, `data: [DONE]`) and not, `/v1/models` and
//! `/health`. Output is a fixed word repeated `max_tokens` times; enough for
//! clients such as the official OpenAI SDK to parse every field they read.

use bytes::Bytes;
use serde_json::{json, Value};

use crate::fake_upstream::{FakeUpstream, Reply, Seen};

pub const MODEL: &str = "tiny-llama";
const CREATED: u64 = 1_795_934_960;
const WORD: &str = " is";

/// Starts the fake vLLM engine.
pub async fn start() -> FakeUpstream {
    FakeUpstream::builder()
        .route("/health", |_| Reply::text(200, ""))
        .route("/v1/models", |_| Reply::json(200, models().to_string()))
        .route("/v1/completions", |s| generate(s, false))
        .route("/v1/chat/completions", |s| generate(s, true))
        .start()
        .await
}

fn models() -> Value {
    json!({"object": "list", "data": [{
        "id": MODEL, "object": "model", "created": CREATED, "owned_by": "vllm",
        "root": MODEL, "parent": null, "max_model_len": 2048
    }]})
}

fn generate(seen: &Seen, chat: bool) -> Reply {
    let Ok(req) = serde_json::from_slice::<Value>(&seen.body) else {
        return Reply::json(
            400,
            r#"{"error":{"message":"bad json","type":"BadRequestError","param":null,"code":400}}"#,
        );
    };
    let n = req
        .get("max_completion_tokens")
        .or_else(|| req.get("max_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(4)
        .clamp(1, 32) as usize;
    let stream = req.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let id = if chat {
        "chatcmpl-fake0001"
    } else {
        "cmpl-fake0001"
    };
    let usage = json!({"prompt_tokens": 10, "total_tokens": 10 + n, "completion_tokens": n});
    if !stream {
        let body = if chat {
            json!({"id": id, "object": "chat.completion", "created": CREATED, "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": WORD.repeat(n)},
                    "logprobs": null, "finish_reason": "length", "stop_reason": null}],
                "usage": usage})
        } else {
            json!({"id": id, "object": "text_completion", "created": CREATED, "model": MODEL,
                "choices": [{"index": 0, "text": WORD.repeat(n), "logprobs": null,
                    "finish_reason": "length", "stop_reason": null}],
                "usage": usage})
        };
        return Reply::json(200, body.to_string());
    }
    let mut events = Vec::with_capacity(n + 3);
    if chat {
        events.push(json!({"id": id, "object": "chat.completion.chunk", "created": CREATED, "model": MODEL,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]}));
    }
    for i in 0..n {
        let finish = if i + 1 == n {
            json!("length")
        } else {
            Value::Null
        };
        events.push(if chat {
            json!({"id": id, "object": "chat.completion.chunk", "created": CREATED, "model": MODEL,
                "choices": [{"index": 0, "delta": {"content": WORD}, "logprobs": null, "finish_reason": finish}]})
        } else {
            json!({"id": id, "object": "text_completion", "created": CREATED, "model": MODEL,
                "choices": [{"index": 0, "text": WORD, "logprobs": null, "finish_reason": finish, "stop_reason": null}]})
        });
    }
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    events.push(json!({"id": id, "object": object, "created": CREATED, "model": MODEL, "choices": [], "usage": usage}));
    let mut chunks: Vec<Bytes> = events
        .into_iter()
        .map(|e| Bytes::from(format!("data: {e}\n\n")))
        .collect();
    chunks.push(Bytes::from_static(b"data: [DONE]\n\n"));
    Reply::sse_chunks(chunks)
}
