//! The simulator's HTTP surface has vLLM's shape: the same JSON keys and value
//! types, recursively, as the real vLLM 0.32 captures; the same metric names
//! and types; vLLM's error body.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;

use common::*;
use kvmesh_engine_sim::{Engine, SimConfig};
use serde_json::{json, Value};

fn capture_requests() -> Vec<Value> {
    let text =
        std::fs::read_to_string(format!("{FIXTURES}/vllm-cpu/capture-1/requests.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn captured_response(name: &str) -> Value {
    let r = capture_requests()
        .into_iter()
        .find(|r| r["step"]["name"] == name)
        .unwrap();
    serde_json::from_str(r["response"].as_str().unwrap()).unwrap()
}

async fn engine() -> kvmesh_engine_sim::SimHandle {
    Engine::start_local(SimConfig::new("sim").with_time_scale(100.0))
        .await
        .unwrap()
}

#[tokio::test]
async fn non_streaming_bodies_match_vllm() {
    let e = engine().await;
    let (s, ours) = post(
        e.addr(),
        "/v1/completions",
        &completion("The quick brown fox", 4),
    )
    .await;
    assert_eq!(s, 200);
    assert_same_shape("completion", &ours, &captured_response("completion-doc"));
    assert_eq!(ours["usage"]["completion_tokens"], 4);
    assert_eq!(ours["choices"][0]["finish_reason"], "length");
    let chat = json!({"model": "sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3});
    let (s, ours) = post(e.addr(), "/v1/chat/completions", &chat).await;
    assert_eq!(s, 200);
    let mut theirs = captured_response("chat-shared-system");
    // vLLM reports newly cached tokens here on some requests, null on others.
    theirs["usage"]["prompt_tokens_details"]["created_cache_tokens"] = Value::Null;
    assert_same_shape("chat", &ours, &theirs);
    assert_eq!(ours["choices"][0]["message"]["role"], "assistant");
    e.shutdown().await;
}

fn captured_stream(file: &str) -> Vec<Value> {
    sse_events(capture_body(file).as_bytes())
}

#[tokio::test]
async fn streams_match_vllm_chunk_for_chunk() {
    let e = engine().await;
    for (path, file, body) in [
        (
            "/v1/completions",
            "vllm-cpu/probe/completions_stream.txt",
            json!({"model": "sim", "prompt": "a b c", "max_tokens": 4}),
        ),
        (
            "/v1/chat/completions",
            "vllm-cpu/probe/chat_stream.txt",
            json!({"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        ),
    ] {
        let mut body = body;
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let (s, raw) = request(e.addr(), "POST", path, Some(&body)).await;
        assert_eq!(s, 200);
        let ours = sse_events(&raw);
        let theirs = captured_stream(file);
        assert_eq!(ours.len(), theirs.len(), "{path}: chunk count\n{ours:?}");
        assert_eq!(ours.last(), Some(&Value::String("[DONE]".into())));
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            let mut a = a.clone();
            // The simulator also reports cached tokens in the stream's usage.
            if let Some(u) = a.get_mut("usage").and_then(Value::as_object_mut) {
                assert!(u.remove("prompt_tokens_details").is_some());
            }
            assert_same_shape(&format!("{path} chunk {i}"), &a, b);
        }
    }
    // Without include_usage the last token chunk carries the fingerprint.
    let body = json!({"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": true});
    let (_, raw) = request(e.addr(), "POST", "/v1/chat/completions", Some(&body)).await;
    let ours = sse_events(&raw);
    let theirs = sse_events(
        std::fs::read_to_string(format!("{FIXTURES}/vllm-cpu/probe/pd_probe2.txt"))
            .unwrap()
            .split_once("chat decode stream")
            .unwrap()
            .1
            .split_once('\n')
            .unwrap()
            .1
            .as_bytes(),
    );
    assert_eq!(ours.len(), theirs.len());
    for (a, b) in ours.iter().zip(&theirs) {
        assert_same_shape("chat stream without usage", a, b);
    }
    e.shutdown().await;
}

#[tokio::test]
async fn models_tokenize_health_and_errors_match_vllm() {
    let e = engine().await;
    let (s, models) = request(e.addr(), "GET", "/v1/models", None).await;
    assert_eq!(s, 200);
    let models: Value = serde_json::from_slice(&models).unwrap();
    assert_same_shape("models", &models, &captured_response("models"));
    assert_eq!(models["data"][0]["max_model_len"], 8192);
    let (s, tok) = post(
        e.addr(),
        "/tokenize",
        &json!({"model": "sim", "prompt": "hello world"}),
    )
    .await;
    assert_eq!(s, 200);
    assert_same_shape("tokenize", &tok, &captured_response("tokenize-completion"));
    assert_eq!(tok["count"], 3, "BOS + two words");
    let (s, _) = request(e.addr(), "GET", "/health", None).await;
    assert_eq!(s, 200);
    let (s, err) = post(
        e.addr(),
        "/v1/completions",
        &json!({"model": "other", "prompt": "x"}),
    )
    .await;
    assert_eq!(s, 404);
    assert_eq!(err["error"]["type"], "NotFoundError");
    assert_eq!(err["error"]["code"], 404);
    let long = words("w", 9000);
    let (s, err) = post(e.addr(), "/v1/completions", &completion(&long, 4)).await;
    assert_eq!(s, 400);
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length"));
    let (s, _) = request(e.addr(), "GET", "/nope", None).await;
    assert_eq!(s, 404);
    e.shutdown().await;
}

/// `# TYPE` lines of a metrics text, by family name.
fn families(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(n, t)| (n.to_string(), t.to_string()))
        .collect()
}

#[tokio::test]
async fn metric_names_and_types_are_vllms() {
    let e = engine().await;
    let (s, _) = post(e.addr(), "/v1/completions", &completion("one two three", 3)).await;
    assert_eq!(s, 200);
    let ours = families(&get_text(e.addr(), "/metrics").await);
    let theirs = families(
        &std::fs::read_to_string(format!("{FIXTURES}/vllm-cpu/probe/metrics1.txt")).unwrap(),
    );
    let ours_vllm: Vec<_> = ours.keys().filter(|k| k.starts_with("vllm:")).collect();
    assert!(ours_vllm.len() >= 20, "{ours_vllm:?}");
    for name in ours_vllm {
        assert_eq!(
            theirs.get(name),
            ours.get(name),
            "{name}: not in vLLM's /metrics with the same type"
        );
    }
    let text = e.metrics_text();
    assert!(
        text.contains("vllm:cache_config_info{block_size=\"16\""),
        "{text}"
    );
    assert!(text.contains("num_gpu_blocks=\"4096\""));
    assert!(text.contains("vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"sim\",source=\"local_compute\"} 4.0"));
    assert!(text
        .contains("vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"sim\"} 1.0"));
    e.shutdown().await;
}
