//! Prefix cache and KV events: repeated prefixes hit (and say so in usage and
//! metrics), pressure evicts with `BlockRemoved`, events carry vLLM's framing,
//! sequence and replay, both encodings decode, and a restart starts over.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use kvmesh_engine_sim::{
    replay, DecodedEvent, Engine, KvEventsConfig, KvEventsFormat, KvMessage, KvSubscriber,
    SimConfig, SimHandle,
};

const WAIT: Duration = Duration::from_secs(5);

fn events_cfg(format: KvEventsFormat) -> KvEventsConfig {
    let mut k = KvEventsConfig::new("tcp://127.0.0.1:0");
    k.bind = Some(true);
    k.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    k.topic = "kv@sim@sim".into();
    k.format = format;
    k
}

async fn engine_with_events(
    num_blocks: usize,
    format: KvEventsFormat,
) -> (SimHandle, KvSubscriber) {
    let cfg = SimConfig::new("sim")
        .with_time_scale(100.0)
        .with_num_blocks(num_blocks)
        .with_kv_events(events_cfg(format));
    let e = Engine::start_local(cfg).await.unwrap();
    let ep = e.kv_endpoints().unwrap().events.clone();
    let mut sub = KvSubscriber::connect(&ep).await.unwrap();
    // Readiness: a PUB drops messages until the SUB's subscription arrives, so
    // clear the (empty) cache until its AllBlocksCleared comes through.
    let mut synced = false;
    for _ in 0..50 {
        assert!(e.reset_prefix_cache().await);
        if let Some(m) = sub.recv(Duration::from_millis(100)).await {
            assert_eq!(m.decode().unwrap().events[0].kind, "AllBlocksCleared");
            synced = true;
            break;
        }
    }
    assert!(synced, "subscriber never saw the engine's events");
    // Drain clears that raced with the subscription.
    while sub.recv(Duration::from_millis(50)).await.is_some() {}
    (e, sub)
}

async fn next_events(sub: &mut KvSubscriber) -> (KvMessage, Vec<DecodedEvent>) {
    let m = sub.recv(WAIT).await.expect("no KV event batch");
    let evs = m.decode().expect("undecodable batch").events;
    (m, evs)
}

#[tokio::test]
async fn repeated_prefix_hits_the_cache() {
    let (e, mut sub) = engine_with_events(4096, KvEventsFormat::Map).await;
    let system = words("sys", 100); // 101 tokens with BOS: 6 full blocks
    let (s, r1) = post(
        e.addr(),
        "/v1/completions",
        &completion(&format!("{system} first question"), 2),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(r1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (m, evs) = next_events(&mut sub).await;
    assert_eq!(m.topic.as_ref(), b"kv@sim@sim");
    let stored: Vec<_> = evs.iter().filter(|e| e.kind == "BlockStored").collect();
    assert_eq!(stored.len(), 1);
    assert_eq!(
        stored[0].block_hashes.len(),
        6,
        "103 prompt tokens: 6 full blocks of 16"
    );
    assert_eq!(stored[0].token_ids.len(), 96);
    assert_eq!(stored[0].parent_block_hash, None);
    assert_eq!(stored[0].block_size, 16);
    let (s, r2) = post(
        e.addr(),
        "/v1/completions",
        &completion(&format!("{system} second question"), 2),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(r2["usage"]["prompt_tokens_details"]["cached_tokens"], 96);
    let st = e.stats();
    assert_eq!(st.prefix_hits, 96);
    let text = e.metrics_text();
    assert!(
        text.contains("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"sim\"} 96.0"),
        "{text}"
    );
    assert!(text.contains("source=\"local_cache_hit\"} 96.0"));
    let done = e.completed_requests();
    assert_eq!(done.len(), 2);
    assert!(
        done[1].ttft_s < done[0].ttft_s,
        "a hit makes prefill cheaper: {done:?}"
    );
    e.shutdown().await;
}

#[tokio::test]
async fn pressure_evicts_lru_blocks_with_block_removed() {
    // 12 blocks of 16 tokens; each prompt needs 5 (4 full + 1 partial).
    let (e, mut sub) = engine_with_events(12, KvEventsFormat::Map).await;
    let mut first_hashes = Vec::new();
    for i in 0..3 {
        let (s, _) = post(
            e.addr(),
            "/v1/completions",
            &completion(&words(&format!("p{i}x"), 70), 1),
        )
        .await;
        assert_eq!(s, 200);
        let (_, evs) = next_events(&mut sub).await;
        if i == 0 {
            first_hashes = evs
                .iter()
                .filter(|e| e.kind == "BlockStored")
                .flat_map(|e| e.block_hashes.clone())
                .collect();
        }
        if i == 2 {
            let removed: Vec<u64> = evs
                .iter()
                .filter(|e| e.kind == "BlockRemoved")
                .flat_map(|e| e.block_hashes.clone())
                .collect();
            assert!(!removed.is_empty(), "the third prompt must evict: {evs:?}");
            assert!(
                removed.iter().all(|h| first_hashes.contains(h)),
                "LRU: the oldest prompt goes first"
            );
            // vLLM: one hash per BlockRemoved, removals before the store.
            assert!(evs
                .iter()
                .filter(|e| e.kind == "BlockRemoved")
                .all(|e| e.block_hashes.len() == 1));
            assert_eq!(evs.last().unwrap().kind, "BlockStored");
        }
    }
    // The evicted prompt is no longer (fully) cached.
    let (_, r) = post(
        e.addr(),
        "/v1/completions",
        &completion(&words("p0x", 70), 1),
    )
    .await;
    assert!(
        r["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            < 64
    );
    e.shutdown().await;
}

#[tokio::test]
async fn sequence_replay_and_restart() {
    let (e, mut sub) = engine_with_events(4096, KvEventsFormat::Array).await;
    let mut seqs = Vec::new();
    for i in 0..3 {
        post(
            e.addr(),
            "/v1/completions",
            &completion(&words(&format!("r{i}y"), 40), 1),
        )
        .await;
        let (m, evs) = next_events(&mut sub).await;
        // Legacy array encoding: ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name].
        assert!(
            evs[0].raw.is_array() && evs[0].raw.as_array().unwrap().len() == 8,
            "{:?}",
            evs[0].raw
        );
        seqs.push(m.seq);
    }
    assert_eq!(seqs[1], seqs[0] + 1);
    assert_eq!(seqs[2], seqs[1] + 1);
    let rep = e.kv_endpoints().unwrap().replay.clone().unwrap();
    let got = replay(&rep, seqs[1], WAIT).await.unwrap();
    assert_eq!(
        got.iter().map(|m| m.seq).collect::<Vec<_>>(),
        vec![seqs[1], seqs[2]]
    );
    assert_eq!(got[0].topic.as_ref(), b"kv@sim@sim");
    let all = replay(&rep, 0, WAIT).await.unwrap();
    assert_eq!(
        all.first().unwrap().seq,
        0,
        "the buffer holds the sync clears too"
    );
    e.restart().await.unwrap();
    assert!(
        replay(&rep, 0, WAIT).await.unwrap().is_empty(),
        "restart empties the replay buffer"
    );
    post(
        e.addr(),
        "/v1/completions",
        &completion(&words("after", 40), 1),
    )
    .await;
    let (m, _) = next_events(&mut sub).await;
    assert_eq!(m.seq, 0, "sequence starts again at 0 after a restart");
    e.shutdown().await;
}

#[tokio::test]
async fn engine_connects_when_the_endpoint_is_concrete() {
    // vLLM's rule: a concrete host means connect; the consumer binds.
    let (mut sub, ep) = KvSubscriber::bind("tcp://127.0.0.1:0").await.unwrap();
    let mut k = KvEventsConfig::new(ep.clone());
    k.topic = "t".into();
    let cfg = SimConfig::new("sim")
        .with_time_scale(100.0)
        .with_kv_events(k);
    let e = Engine::start_local(cfg).await.unwrap();
    assert_eq!(e.kv_endpoints().unwrap().events, ep);
    let mut got = None;
    for _ in 0..50 {
        e.reset_prefix_cache().await;
        if let Some(m) = sub.recv(Duration::from_millis(100)).await {
            got = Some(m);
            break;
        }
    }
    let m = got.expect("no event through the engine's connected PUB");
    assert_eq!(m.decode().unwrap().events[0].kind, "AllBlocksCleared");
    assert_eq!(m.decode().unwrap().dp_rank, Some(0));
    e.shutdown().await;
}

#[tokio::test]
async fn map_encoding_has_vllms_fields() {
    let (e, mut sub) = engine_with_events(4096, KvEventsFormat::Map).await;
    let body = serde_json::json!({"model": "sim", "prompt": words("salted", 40), "max_tokens": 1, "cache_salt": "tenant-a"});
    post(e.addr(), "/v1/completions", &body).await;
    let (m, evs) = next_events(&mut sub).await;
    let keys: Vec<String> = evs[0]
        .raw
        .as_map()
        .unwrap()
        .iter()
        .map(|(k, _)| k.as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        keys,
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind"
        ]
    );
    let raw = &evs[0].raw;
    let extra = raw
        .as_map()
        .unwrap()
        .iter()
        .find(|(k, _)| k.as_str() == Some("extra_keys"))
        .unwrap()
        .1
        .clone();
    assert_eq!(
        extra.as_array().unwrap()[0].as_array().unwrap()[0].as_str(),
        Some("tenant-a")
    );
    // Frame 2 is msgpack [ts, events, dp_rank] with uint64 hashes.
    assert_eq!(m.payload[0], 0x93);
    e.shutdown().await;
}
