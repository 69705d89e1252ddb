//! The SGLang flavor: SGLang's metric names and types, and signed 64-bit
//! block hashes in its events.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use kvmesh_engine_sim::{Engine, Flavor, KvEventsConfig, KvSubscriber, SimConfig};

fn families(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(n, t)| (n.to_string(), t.to_string()))
        .collect()
}

#[tokio::test]
async fn sglang_metrics_follow_sglang() {
    let cfg = SimConfig::new("sim")
        .with_time_scale(100.0)
        .with_flavor(Flavor::Sglang)
        .with_num_blocks(256);
    let e = Engine::start_local(cfg).await.unwrap();
    let prompt = words("s", 40);
    post(e.addr(), "/v1/completions", &completion(&prompt, 2)).await;
    post(e.addr(), "/v1/completions", &completion(&prompt, 2)).await;
    let text = get_text(e.addr(), "/metrics").await;
    let ours = families(&text);
    let theirs = families(
        &std::fs::read_to_string(format!("{FIXTURES}/sglang-cpu/metrics-single.txt")).unwrap(),
    );
    for (name, kind) in &ours {
        if name == "sglang:cache_config_info" {
            continue; // what llm-d reads; SGLang 0.5.23 itself has page_size/num_pages gauges
        }
        assert_eq!(theirs.get(name), Some(kind), "{name}");
    }
    for must in [
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:token_usage",
        "sglang:cache_config_info",
    ] {
        assert!(ours.contains_key(must), "{must}");
    }
    assert!(!text.contains("vllm:"));
    assert!(
        text.contains("num_pages=\"256\",page_size=\"16\""),
        "{text}"
    );
    assert!(text.contains("sglang:cached_tokens_total{cache_source=\"device\",engine_type=\"unified\",model_name=\"sim\"} 32.0"));
    e.shutdown().await;
}

#[tokio::test]
async fn sglang_events_carry_signed_hashes() {
    let mut k = KvEventsConfig::new("tcp://127.0.0.1:0");
    k.bind = Some(true);
    let cfg = SimConfig::new("sim")
        .with_time_scale(100.0)
        .with_flavor(Flavor::Sglang)
        .with_kv_events(k);
    let e = Engine::start_local(cfg).await.unwrap();
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
    post(
        e.addr(),
        "/v1/completions",
        &completion(&words("neg", 400), 1),
    )
    .await;
    let m = sub.recv(Duration::from_secs(5)).await.unwrap();
    let ev = &m.decode().unwrap().events[0];
    let raw = ev.raw.as_map().unwrap();
    let keys: Vec<&str> = raw.iter().map(|(k, _)| k.as_str().unwrap()).collect();
    assert_eq!(
        keys,
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium"
        ]
    );
    let hashes = raw[1].1.as_array().unwrap();
    assert_eq!(hashes.len(), 25);
    assert!(
        hashes.iter().all(|h| h.as_i64().is_some()),
        "all fit i64 (signed)"
    );
    assert!(
        hashes.iter().any(|h| h.as_i64().unwrap() < 0),
        "SGLang hashes are signed"
    );
    e.shutdown().await;
}
