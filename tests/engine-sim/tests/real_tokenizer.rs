//! With the real tiny-llama tokenizer the simulator sees the token ids vLLM
//! saw, so it publishes the very block hashes the real vLLM published
//! (`fixtures/vllm-cpu/capture-1`, `sha256_cbor`, block size 32).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use kvmesh_engine_sim::{Engine, KvEventsConfig, KvSubscriber, SimConfig, TokenizerChoice};
use serde_json::Value;

fn capture() -> Vec<Value> {
    let text =
        std::fs::read_to_string(format!("{FIXTURES}/vllm-cpu/capture-1/requests.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test]
async fn same_tokens_and_block_hashes_as_real_vllm() {
    let dir = std::path::PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../fixtures/tiny-llama"
    ));
    let mut k = KvEventsConfig::new("tcp://127.0.0.1:0");
    k.bind = Some(true);
    let cfg = SimConfig::new("tiny-llama")
        .with_time_scale(100.0)
        .with_block_size(32)
        .with_max_model_len(1024)
        .with_tokenizer(TokenizerChoice::HfDir(dir))
        .with_kv_events(k);
    let e = Engine::start_local(cfg).await.unwrap();
    let steps = capture();
    for name in ["tokenize-completion", "tokenize-chat"] {
        let step = steps.iter().find(|s| s["step"]["name"] == name).unwrap();
        let want: Value = serde_json::from_str(step["response"].as_str().unwrap()).unwrap();
        let (s, got) = post(e.addr(), "/tokenize", &step["step"]["body"]).await;
        assert_eq!(s, 200);
        assert_eq!(got["tokens"], want["tokens"], "{name}");
    }
    let mut sub = KvSubscriber::connect(&e.kv_endpoints().unwrap().events)
        .await
        .unwrap();
    let mut synced = false;
    for _ in 0..50 {
        e.reset_prefix_cache().await;
        if sub.recv(Duration::from_millis(100)).await.is_some() {
            synced = true;
            break;
        }
    }
    assert!(synced);
    while sub.recv(Duration::from_millis(50)).await.is_some() {}
    let doc = steps
        .iter()
        .find(|s| s["step"]["name"] == "completion-doc")
        .unwrap();
    let (s, _) = post(e.addr(), "/v1/completions", &doc["step"]["body"]).await;
    assert_eq!(s, 200);
    let ours = sub
        .recv(Duration::from_secs(5))
        .await
        .unwrap()
        .decode()
        .unwrap();
    let vectors: Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{FIXTURES}/vllm-cpu/hash_vectors.json")).unwrap(),
    )
    .unwrap();
    let want: Vec<u64> = vectors["vectors"][0]["block_hashes_u64"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap())
        .collect();
    assert_eq!(ours.events[0].block_hashes, want);
    e.shutdown().await;
}
