//! Greedy decoding as a function of the context, and what a migrated
//! request sends: a prompt that is another's prompt plus its first output
//! tokens goes on with that request's next tokens; `return_token_ids`
//! returns the ids; chat continues an open final message.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use kvmesh_engine_sim::{Engine, SimConfig, SimHandle};
use serde_json::{json, Value};

async fn engine() -> SimHandle {
    Engine::start_local(SimConfig::new("sim").with_time_scale(100.0))
        .await
        .unwrap()
}

/// The output ids of a streamed completion, and its prompt's ids.
async fn streamed_ids(e: &SimHandle, prompt: Value, max_tokens: u64) -> (Vec<u64>, Vec<u64>) {
    let body = json!({"model": "sim", "prompt": prompt, "max_tokens": max_tokens,
        "stream": true, "return_token_ids": true, "temperature": 0});
    let (s, b) = request(e.addr(), "POST", "/v1/completions", Some(&body)).await;
    assert_eq!(s, 200);
    let events = sse_events(&b);
    let ids = |v: &Value| -> Vec<u64> {
        v.as_array()
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default()
    };
    let prompt = ids(&events[0]["choices"][0]["prompt_token_ids"]);
    let out = events
        .iter()
        .flat_map(|e| ids(&e["choices"][0]["token_ids"]))
        .collect();
    assert!(events[1..]
        .iter()
        .all(|e| e["choices"][0]["prompt_token_ids"].is_null()));
    (prompt, out)
}

#[tokio::test]
async fn a_prompt_with_the_first_outputs_goes_on_with_the_rest() {
    let e = engine().await;
    let (prompt, whole) = streamed_ids(&e, json!("tell me a story"), 12).await;
    assert_eq!(whole.len(), 12);
    assert_eq!(prompt[0], 1, "the prompt's ids start with BOS");
    let mut resumed = prompt.clone();
    resumed.extend_from_slice(&whole[..5]);
    let (echoed, rest) = streamed_ids(&e, json!(resumed), 7).await;
    assert_eq!(echoed, resumed);
    assert_eq!(rest, whole[5..]);
    // Another prompt gives other tokens.
    let (_, other) = streamed_ids(&e, json!("tell me a poem"), 12).await;
    assert_ne!(other, whole);
    e.shutdown().await;
}

#[tokio::test]
async fn token_ids_in_a_whole_answer() {
    let e = engine().await;
    let body =
        json!({"model": "sim", "prompt": "count", "max_tokens": 3, "return_token_ids": true});
    let (s, v) = post(e.addr(), "/v1/completions", &body).await;
    assert_eq!(s, 200);
    assert_eq!(v["choices"][0]["token_ids"].as_array().unwrap().len(), 3);
    assert!(v["choices"][0]["prompt_token_ids"].is_array());
    // Not asked: null, as vLLM.
    let (_, v) = post(e.addr(), "/v1/completions", &completion("count", 3)).await;
    assert!(v["choices"][0]["token_ids"].is_null());
    e.shutdown().await;
}

#[tokio::test]
async fn chat_continues_an_open_final_message() {
    let e = engine().await;
    let msgs = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]);
    let open = json!({"model": "sim", "messages": msgs, "max_tokens": 2,
        "continue_final_message": true, "add_generation_prompt": false});
    let (s, v) = post(e.addr(), "/v1/chat/completions", &open).await;
    assert_eq!(s, 200, "{v}");
    // The open message is one token shorter than the closed one (its "\n").
    let closed =
        json!({"model": "sim", "messages": msgs, "max_tokens": 2, "add_generation_prompt": false});
    let (_, c) = post(e.addr(), "/v1/chat/completions", &closed).await;
    let prompt = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(prompt(&v) + 1, prompt(&c));
    // Both at once is vLLM's 400.
    let both = json!({"model": "sim", "messages": msgs, "continue_final_message": true});
    assert_eq!(post(e.addr(), "/v1/chat/completions", &both).await.0, 400);
    e.shutdown().await;
}
