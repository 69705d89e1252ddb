//! Data parallelism (`--data-parallel-size`): independent ranks behind one
//! port, chosen by `X-data-parallel-rank` or by load, each with its own
//! prefix cache, `engine="rank"` metrics and KV events carrying its rank.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use kvmesh_engine_sim::{Engine, KvEventsConfig, KvSubscriber, SimConfig, SimHandle};

async fn dp_engine(n: usize) -> SimHandle {
    let mut k = KvEventsConfig::new("tcp://127.0.0.1:0");
    k.bind = Some(true);
    k.topic = "kv@sim@sim".into();
    let cfg = SimConfig::new("sim")
        .with_time_scale(100.0)
        .with_data_parallel_size(n)
        .with_kv_events(k);
    Engine::start_local(cfg).await.unwrap()
}

async fn on_rank(e: &SimHandle, rank: &str, prompt: &str) -> (u16, serde_json::Value) {
    let (s, b) = try_request(
        e.addr(),
        "POST",
        "/v1/completions",
        Some(&completion(prompt, 2)),
        &[("x-data-parallel-rank", rank)],
    )
    .await
    .unwrap();
    (s, serde_json::from_slice(&b).unwrap_or_default())
}

/// The value of the series whose line starts with `series` (labels included).
fn series(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[tokio::test]
async fn each_rank_has_its_own_cache_and_metrics() {
    let e = dp_engine(2).await;
    let prompt = words("dp", 200);
    let (s, first) = on_rank(&e, "1", &prompt).await;
    assert_eq!(s, 200, "{first}");
    // The same prompt again on rank 1 hits; on rank 0, whose cache is its
    // own, it does not.
    let (_, again) = on_rank(&e, "1", &prompt).await;
    let (_, other) = on_rank(&e, "0", &prompt).await;
    let cached =
        |v: &serde_json::Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert!(cached(&again).unwrap_or(0) > 0, "{again}");
    assert_eq!(cached(&other).unwrap_or(0), 0, "{other}");

    let text = get_text(e.addr(), "/metrics").await;
    let prompt_tokens = |rank: &str| {
        series(
            &text,
            &format!("vllm:prompt_tokens_total{{engine=\"{rank}\",model_name=\"sim\"}}"),
        )
    };
    let tokens = first["usage"]["prompt_tokens"].as_f64().unwrap();
    assert_eq!(prompt_tokens("1"), Some(2.0 * tokens), "{text}");
    assert_eq!(prompt_tokens("0"), Some(tokens), "{text}");
    assert_eq!(
        text.matches("# TYPE vllm:num_requests_waiting ").count(),
        1,
        "one family header for both ranks"
    );

    let (s, _) = on_rank(&e, "2", &prompt).await;
    assert_eq!(s, 400, "a rank the engine does not have");
    e.shutdown().await;
}

#[tokio::test]
async fn kv_events_carry_the_rank_on_its_own_endpoint() {
    let e = dp_engine(2).await;
    let eps = e.kv_endpoints_by_rank();
    assert_eq!(eps.len(), 2);
    assert_ne!(eps[0].events, eps[1].events);
    let mut sub = KvSubscriber::connect(&eps[1].events).await.unwrap();
    // Readiness: a PUB drops messages until the subscription arrives; rank
    // 1's cache resets (empty) until its AllBlocksCleared comes through.
    let mut synced = false;
    for _ in 0..50 {
        let (s, _) = try_request(
            e.addr(),
            "POST",
            "/reset_prefix_cache",
            None,
            &[("x-data-parallel-rank", "1")],
        )
        .await
        .unwrap();
        assert_eq!(s, 200);
        if sub.recv(Duration::from_millis(100)).await.is_some() {
            synced = true;
            break;
        }
    }
    assert!(synced, "rank 1's events never arrived");
    while sub.recv(Duration::from_millis(50)).await.is_some() {}
    let (s, _) = on_rank(&e, "1", &words("events", 64)).await;
    assert_eq!(s, 200);
    let m = sub.recv(DEADLINE).await.expect("a batch from rank 1");
    let batch = m.decode().unwrap();
    assert_eq!(batch.dp_rank, Some(1));
    assert!(batch.events.iter().any(|ev| ev.kind == "BlockStored"));
    e.shutdown().await;
}

#[tokio::test]
async fn without_the_header_the_least_loaded_rank_serves() {
    let e = dp_engine(2).await;
    // Rank 0 is busy with a long request; the next one goes to rank 1.
    let addr = e.addr();
    let long = tokio::spawn(async move {
        try_request(
            addr,
            "POST",
            "/v1/completions",
            Some(&completion(&words("long", 50), 4000)),
            &[("x-data-parallel-rank", "0")],
        )
        .await
    });
    let mut running = false;
    for _ in 0..200 {
        let text = get_text(e.addr(), "/metrics").await;
        if series(
            &text,
            "vllm:num_requests_running{engine=\"0\",model_name=\"sim\"}",
        ) == Some(1.0)
        {
            running = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(running, "rank 0 never ran the long request");
    let (s, _) = post(
        e.addr(),
        "/v1/completions",
        &completion(&words("short", 20), 2),
    )
    .await;
    assert_eq!(s, 200);
    let text = get_text(e.addr(), "/metrics").await;
    let done = |rank: &str| {
        series(
            &text,
            &format!(
                "vllm:request_success_total{{engine=\"{rank}\",finished_reason=\"length\",model_name=\"sim\"}}"
            ),
        )
    };
    assert_eq!(done("1"), Some(1.0), "{text}");
    long.abort();
    e.shutdown().await;
}
