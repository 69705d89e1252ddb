//! A data-parallel engine behind one sidecar (`engine.data_parallel_size: 2`
//! before a simulator with `--data-parallel-size 2`): the sidecar reads each
//! rank's KV events (`dp_rank`, on the endpoint's port + rank) and load (the
//! `engine="rank"` series), picks the rank of every request it runs on its
//! engine and names it in `X-data-parallel-rank`, and `/debug/route` shows
//! the rank and why. A shared prefix follows the rank that holds it even
//! when that rank is the busier one (without the header the engine would
//! balance it to the idle rank), and a fresh prompt goes to the idle rank.
//! Each call to the engine's span (`kvmesh.forward`) carries the rank it
//! named (`kvmesh.dp_rank`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use kvmesh_engine_sim::{Engine, KvEventsConfig, SimConfig, SimHandle};
use kvmesh_proxy::config::{OtlpProtocol, Tracing};
use kvmesh_proxy::SidecarHandle;
use kvmesh_tests::client::{admin_get, fetch, http1, post_json, request};
use kvmesh_tests::otlp::Collector;
use kvmesh_tests::prefix::{kv_config, words, BLOCK};
use kvmesh_tests::route::MODEL;
use kvmesh_tests::sidecar::start;
use serde_json::{json, Value};

/// A port `p` with `p + 1` also free: vLLM puts rank r's KV events on the
/// configured port + r, so the two ranks need two consecutive ports. Asked
/// of the OS, then released for the engine to bind (the window is short).
fn consecutive_ports() -> u16 {
    for _ in 0..100 {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = a.local_addr().unwrap().port();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no two consecutive free ports in 100 tries");
}

async fn dp_fleet(collector: &Collector) -> (SimHandle, SidecarHandle) {
    let base = consecutive_ports();
    let endpoint = format!("tcp://127.0.0.1:{base}");
    let mut kv = KvEventsConfig::new(endpoint.clone());
    kv.bind = Some(true);
    let sim = Engine::start_local(
        SimConfig::new(MODEL)
            .with_block_size(BLOCK)
            .with_data_parallel_size(2)
            .with_kv_events(kv),
    )
    .await
    .expect("simulator starts");
    let eps: Vec<&str> = sim
        .kv_endpoints_by_rank()
        .iter()
        .map(|e| e.events.as_str())
        .collect();
    let rank1 = format!("tcp://127.0.0.1:{}", base + 1);
    assert_eq!(eps, [endpoint.as_str(), rank1.as_str()]);
    let mut c = kv_config(&sim, &endpoint, None);
    c.engine.data_parallel_size = 2;
    c.tracing = Some(Tracing {
        otlp_endpoint: collector.endpoint().parse().unwrap(),
        protocol: OtlpProtocol::Http,
        sample_ratio: 1.0,
    });
    let sidecar = start(c).await;
    (sim, sidecar)
}

fn completion(prompt: &str, max_tokens: u32) -> String {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}).to_string()
}

/// A completion straight to the engine, on `rank`.
async fn on_rank(sim: &SimHandle, rank: &str, prompt: &str, max_tokens: u32) -> u16 {
    let r = fetch(
        &http1(),
        request(
            "POST",
            sim.addr(),
            "/v1/completions",
            completion(prompt, max_tokens),
            &[
                ("content-type", "application/json"),
                ("x-data-parallel-rank", rank),
            ],
        ),
    )
    .await;
    r.status.as_u16()
}

async fn debug_route(h: &SidecarHandle, prompt: &str) -> Value {
    let r = fetch(
        &http1(),
        post_json(h.admin_addr(), "/debug/route", &completion(prompt, 1)),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// Polls `/debug/route` for `prompt` until `ok` holds of its
/// `data_parallel` view (bounded: 10 s).
async fn route_until(
    h: &SidecarHandle,
    prompt: &str,
    what: &str,
    ok: impl Fn(&Value) -> bool,
) -> Value {
    let mut last = Value::Null;
    for _ in 0..500 {
        last = debug_route(h, prompt).await;
        if ok(&last["data_parallel"]) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{what}: not within 10 s; last /debug/route: {last}");
}

/// Per-rank prompt tokens and prefix-cache hits, from the engine's metrics.
async fn per_rank(sim: &SimHandle, name: &str) -> [f64; 2] {
    let text = admin_get(sim.addr(), "/metrics").await.text();
    let of = |rank: u32| {
        text.lines()
            .filter(|l| l.starts_with(name) && l.contains(&format!("engine=\"{rank}\"")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    [of(0), of(1)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_follows_its_rank_and_a_fresh_prompt_the_idle_one() {
    let collector = Collector::start().await;
    let (sim, h) = dp_fleet(&collector).await;
    let shared = words("shared", 0, 120);
    // Rank 0 computes the shared prefix (straight to the engine); the
    // sidecar learns it from rank 0's KV events, under rank 0.
    assert_eq!(on_rank(&sim, "0", &format!("{shared} one"), 1).await, 200);
    let probe = format!("{shared} two");
    let v = route_until(&h, &probe, "rank 0's blocks indexed", |dp| {
        dp["ranks"][0]["matched_blocks"].as_u64().unwrap_or(0) > 0
    })
    .await;
    assert_eq!(v["data_parallel"]["ranks"][1]["matched_blocks"], 0, "{v}");
    assert_eq!(v["data_parallel"]["rank"], 0, "{v}");
    assert_eq!(v["data_parallel"]["size"], 2);

    // Rank 0 gets busy with a long request; the sidecar sees its load.
    let addr = sim.addr();
    let long = tokio::spawn(async move {
        let body = completion(&words("long", 0, 40), 6000);
        fetch(
            &http1(),
            request(
                "POST",
                addr,
                "/v1/completions",
                body,
                &[
                    ("content-type", "application/json"),
                    ("x-data-parallel-rank", "0"),
                ],
            ),
        )
        .await
    });
    let fresh = words("fresh", 0, 60);
    let v = route_until(&h, &fresh, "rank 0's load seen", |dp| {
        dp["ranks"][0]["running"].as_u64().unwrap_or(0) >= 1
    })
    .await;
    assert_eq!(v["data_parallel"]["ranks"][1]["running"], 0, "{v}");
    assert_eq!(
        v["data_parallel"]["rank"], 1,
        "a fresh prompt goes to the idle rank: {v}"
    );

    // Through the sidecar: the shared prefix lands on rank 0 (it holds the
    // prefix), although the engine alone would balance it to idle rank 1.
    let hits0 = per_rank(&sim, "vllm:prefix_cache_hits_total").await;
    let tokens0 = per_rank(&sim, "vllm:prompt_tokens_total").await;
    let r = fetch(
        &http1(),
        post_json(h.addr(), "/v1/completions", &completion(&probe, 1)),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let hits1 = per_rank(&sim, "vllm:prefix_cache_hits_total").await;
    let tokens1 = per_rank(&sim, "vllm:prompt_tokens_total").await;
    assert!(
        hits1[0] > hits0[0],
        "rank 0 served it from cache: {hits0:?} -> {hits1:?}"
    );
    assert_eq!(tokens1[1], tokens0[1], "rank 1 served nothing");

    // A fresh prompt through the sidecar goes to rank 1.
    let r = fetch(
        &http1(),
        post_json(h.addr(), "/v1/completions", &completion(&fresh, 1)),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let tokens2 = per_rank(&sim, "vllm:prompt_tokens_total").await;
    assert!(
        tokens2[1] > tokens1[1],
        "rank 1 served the fresh prompt: {tokens1:?} -> {tokens2:?}"
    );
    assert_eq!(tokens2[0], tokens1[0]);

    // The sidecar named the rank: rank 0's requests carry its header.
    let named: Vec<String> = sim
        .received_requests()
        .iter()
        .filter(|r| r.path == "/v1/completions")
        .filter_map(|r| {
            r.headers
                .iter()
                .find(|(k, _)| k == "x-data-parallel-rank")
                .map(|(_, v)| v.clone())
        })
        .collect();
    assert!(named.iter().all(|v| v == "0"), "{named:?}");
    assert_eq!(
        named.len(),
        3,
        "two by the test, one by the sidecar: {named:?}"
    );
    long.abort();
    h.shutdown().await;

    // The span of each call to the engine names the rank its request got:
    // the probe went to rank 0 (the simulator records rank 0's requests, with
    // the span's traceparent and the header), the fresh prompt to rank 1.
    let on_rank0: Vec<(String, String)> = sim
        .received_requests()
        .iter()
        .filter_map(|r| {
            let tp = r.header("traceparent")?.to_owned();
            Some((tp, r.header("x-data-parallel-rank")?.to_owned()))
        })
        .collect();
    let spans = collector.spans();
    let mut forwards: Vec<_> = spans
        .iter()
        .filter(|s| s.name() == "kvmesh.forward")
        .map(|f| {
            let tp = format!("00-{}-{}-01", f.trace_id(), f.span_id());
            (f.attr("kvmesh.dp_rank"), tp)
        })
        .collect();
    forwards.sort();
    assert_eq!(
        forwards.len(),
        2,
        "the sidecar's two requests: {forwards:?}"
    );
    assert_eq!(forwards[0].0.as_deref(), Some("0"), "{forwards:?}");
    assert_eq!(forwards[1].0.as_deref(), Some("1"), "{forwards:?}");
    assert!(
        on_rank0.contains(&(forwards[0].1.clone(), "0".to_owned())),
        "{forwards:?} {on_rank0:?}"
    );
    sim.shutdown().await;
}
