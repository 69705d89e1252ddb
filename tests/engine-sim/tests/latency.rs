//! The virtual batch scheduler behaves like an engine under load: TTFT grows
//! with the queue and the `vllm-cpu-tiny` profile reproduces the real vLLM CPU
//! probe. A long prefill slowing the decodes that share its steps, by exactly
//! the modelled cost, is `mixed_batches.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use kvmesh_engine_sim::{Engine, LatencyProfile, SimConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttft_grows_with_queue_depth() {
    let cfg = SimConfig::new("sim")
        .with_time_scale(20.0)
        .with_max_num_seqs(2);
    let e = Engine::start_local(cfg).await.unwrap();
    let addr = e.addr();
    let mut tasks = Vec::new();
    for i in 0..8 {
        tasks.push(tokio::spawn(async move {
            post(
                addr,
                "/v1/completions",
                &completion(&words(&format!("q{i}z"), 200), 30),
            )
            .await
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().0, 200);
    }
    let mut done = e.completed_requests();
    assert_eq!(done.len(), 8);
    done.sort_by(|a, b| a.ttft_s.total_cmp(&b.ttft_s));
    let (first, last) = (&done[0], &done[7]);
    // Two run at a time: with all eight arriving together the last waits for
    // three pairs (~30 steps of ~7.5 ms each, ~0.7 s), the first for none.
    // Arrivals are stamped in real time, so on a loaded machine they spread
    // and the wait shrinks; the property is that the last waited at least
    // one pair's whole service time (~0.24 s) more than the first.
    assert!(
        last.ttft_s - first.ttft_s > 0.2,
        "first {first:?} last {last:?}"
    );
    assert!(
        last.queue_s > first.queue_s + 0.2,
        "queued for at least one batch: {last:?}"
    );
    let text = e.metrics_text();
    assert!(
        text.contains("vllm:request_queue_time_seconds_count{engine=\"0\",model_name=\"sim\"} 8.0")
    );
    e.shutdown().await;
}

#[tokio::test]
async fn cpu_tiny_profile_matches_the_real_probe() {
    let cfg = SimConfig::new("sim")
        .with_time_scale(20.0)
        .with_block_size(128)
        .with_profile(LatencyProfile::vllm_cpu_tiny());
    let e = Engine::start_local(cfg).await.unwrap();
    let prompt = words("cal", 499); // 500 tokens with BOS
    let (_, r) = post(e.addr(), "/v1/completions", &completion(&prompt, 1)).await;
    assert_eq!(r["usage"]["prompt_tokens"], 500);
    let (_, r) = post(e.addr(), "/v1/completions", &completion(&prompt, 1)).await;
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 384);
    post(e.addr(), "/v1/completions", &completion(&prompt, 16)).await;
    let d = e.completed_requests();
    let ms = |x: f64| x * 1000.0;
    // Real vLLM: 35.9 ms cold, 23.0 ms warm, 70.5 ms for 16 tokens warm.
    assert!((33.0..39.0).contains(&ms(d[0].e2e_s)), "cold {:?}", d[0]);
    assert!((20.0..25.0).contains(&ms(d[1].e2e_s)), "warm {:?}", d[1]);
    assert!(
        (64.0..77.0).contains(&ms(d[2].e2e_s)),
        "16 tokens {:?}",
        d[2]
    );
    e.shutdown().await;
}

/// Simulated TTFTs of `n` requests sent one at a time (no queue), sorted.
async fn sequential_ttfts_ms(profile: LatencyProfile, n: usize) -> Vec<f64> {
    let cfg = SimConfig::new("sim")
        .with_time_scale(2.0)
        .with_seed(11)
        .with_profile(profile);
    let e = Engine::start_local(cfg).await.unwrap();
    for i in 0..n {
        let (s, _) = post(
            e.addr(),
            "/v1/completions",
            &completion(&words(&format!("j{i}x"), 40), 1),
        )
        .await;
        assert_eq!(s, 200);
    }
    let mut ttfts: Vec<f64> = e
        .completed_requests()
        .iter()
        .map(|r| r.ttft_s * 1000.0)
        .collect();
    e.shutdown().await;
    assert_eq!(ttfts.len(), n);
    ttfts.sort_by(f64::total_cmp);
    ttfts
}

/// A profile's `api_overhead_std_ms` scatters the TTFTs of identical requests around the same
/// median; without it they all take the modelled time (give or take the machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_overhead_spread_scatters_ttft_around_the_same_median() {
    let exact = LatencyProfile::vllm_cpu_tiny();
    let spread = LatencyProfile {
        api_overhead_std_ms: 4.0,
        ..exact.clone()
    };
    let n = 60;
    let a = sequential_ttfts_ms(exact, n).await;
    let b = sequential_ttfts_ms(spread, n).await;
    let iqr = |v: &[f64]| v[n * 3 / 4] - v[n / 4];
    let median = |v: &[f64]| v[n / 2];
    // A normal's interquartile range is 1.35 standard deviations: ~5.4 ms for 4 ms.
    assert!(
        iqr(&b) > iqr(&a) + 2.5,
        "spread: IQR {:.2} ms, exact: IQR {:.2} ms",
        iqr(&b),
        iqr(&a)
    );
    assert!(
        (median(&b) - median(&a)).abs() < 2.5,
        "medians {:.2} vs {:.2} ms",
        median(&b),
        median(&a)
    );
}

/// A stream's first token leaves when the prefill step that sampled it ends, as vLLM's does, not
/// with the next token: the simulator once held every token back one event (to put
/// `finish_reason` on the last), so its TTFT measured at the client included a decode step. Here
/// a decode step takes a simulated minute; the first chunk must come long before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_first_token_leaves_with_its_prefill_step() {
    let profile = LatencyProfile {
        api_overhead_ms: 0.0,
        step_base_ms: 1.0,
        prefill_ms_per_token: 0.01,
        decode_ms_per_seq: 60_000.0,
        ..LatencyProfile::vllm_cpu_tiny()
    };
    let e = Engine::start_local(SimConfig::new("sim").with_profile(profile))
        .await
        .unwrap();
    let stream = tokio::net::TcpStream::connect(e.addr()).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    let mut body = completion(&words("first", 40), 2);
    body["stream"] = serde_json::json!(true);
    let req = http::Request::post("/v1/completions")
        .header("host", e.addr().to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let first = tokio::time::timeout(DEADLINE, async {
        let mut resp = send.send_request(req).await.unwrap().into_body();
        loop {
            let frame = resp.frame().await.expect("a frame").unwrap();
            if let Some(data) = frame.data_ref().filter(|d| !d.is_empty()) {
                return data.clone();
            }
        }
    })
    .await
    .expect("the first token came with its prefill step, not after the minute-long decode");
    let events = sse_events(&first);
    assert_eq!(events.len(), 1, "one token chunk: {events:?}");
    assert!(events[0]["choices"][0]["finish_reason"].is_null());
    assert_eq!(
        e.completed_requests().len(),
        0,
        "the decode is still running"
    );
    conn.abort();
    e.shutdown().await;
}
