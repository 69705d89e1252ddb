//! Chunked prefill as vLLM schedules it, on a known case: a long prompt
//! arriving while a request decodes is split into `max_num_batched_tokens - 1`
//! chunks (the decode takes one token of each step's budget first), and each
//! step it shares lengthens the decode's inter-token gap by exactly the
//! profile's cost of that chunk.
//!
//! While the engine is busy its virtual clock advances by exactly the planned
//! step costs, so the measured decode time (`e2e - ttft`, virtual seconds) is
//! compared with the profile's sum to within a microsecond.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use kvmesh_engine_sim::profile::StepLoad;
use kvmesh_engine_sim::{CompletedRequest, Engine, LatencyProfile, SimConfig};
use serde_json::json;

const DECODE_TOKENS: usize = 300;

fn profile() -> LatencyProfile {
    LatencyProfile::load("gpu:llama-3.1-8b@h100").unwrap()
}

/// The streamed decode request, the long prompt's request (if sent), and the
/// engine's `/metrics` text.
async fn run(long_words: Option<usize>) -> (CompletedRequest, Option<CompletedRequest>, String) {
    let cfg = SimConfig::new("sim")
        .with_time_scale(10.0)
        .with_max_model_len(32_768)
        .with_profile(profile());
    let e = Engine::start_local(cfg).await.unwrap();
    let addr = e.addr();
    let body = json!({"model": "sim", "prompt": "decode me please", "max_tokens": DECODE_TOKENS,
                      "stream": true});
    let streamer =
        tokio::spawn(async move { request(addr, "POST", "/v1/completions", Some(&body)).await });
    if let Some(n) = long_words {
        // Readiness: the decode has its first token before the long prompt is sent.
        for _ in 0..2000 {
            if e.stats().generation_tokens > 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        let (s, _) = post(addr, "/v1/completions", &completion(&words("long", n), 1)).await;
        assert_eq!(s, 200);
    }
    assert_eq!(streamer.await.unwrap().0, 200);
    let done = e.completed_requests();
    let decode = done
        .iter()
        .find(|r| r.completion_tokens == DECODE_TOKENS)
        .unwrap()
        .clone();
    let long = done.iter().find(|r| r.completion_tokens == 1).cloned();
    let metrics = e.metrics_text();
    e.shutdown().await;
    (decode, long, metrics)
}

/// Inter-token gaps recorded longer than `le` seconds, and all of them.
fn itl_gaps_over(metrics: &str, le: &str) -> (f64, f64) {
    let value = |prefix: &str, needle: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(prefix) && l.contains(needle))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap()
    };
    let count = value("vllm:inter_token_latency_seconds_count", "");
    let under = value(
        "vllm:inter_token_latency_seconds_bucket",
        &format!("le=\"{le}\""),
    );
    (count - under, count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prefill_lengthens_shared_decode_gaps_by_the_modelled_chunk_cost() {
    let p = profile();
    let (alone, _, _) = run(None).await;
    let (shared, long, metrics) = run(Some(19_999)).await;
    let long = long.unwrap();
    let plen = long.prompt_tokens;
    assert!(plen > 2 * p.max_num_batched_tokens, "prompt {plen}");

    // Alone: 299 decode steps, the context growing from the prompt's length.
    let prompt = alone.prompt_tokens;
    let alone_s: f64 = (0..DECODE_TOKENS - 1)
        .map(|j| p.step_seconds(&StepLoad::decode(1, prompt + j)))
        .sum();
    let alone_measured = alone.e2e_s - alone.ttft_s;
    assert!(
        (alone_measured - alone_s).abs() < 1e-6,
        "{alone_measured} vs {alone_s}"
    );

    // Shared: each chunk step costs the decode the chunk's prefill, attention included.
    let chunk = p.max_num_batched_tokens - 1;
    let (mut start, mut extra_s, mut chunks) = (0, 0.0, 0);
    while start < plen {
        let len = chunk.min(plen - start);
        let with = StepLoad::decode(1, 0).with_chunk(start, len);
        extra_s += p.step_seconds(&with) - p.step_seconds(&StepLoad::decode(1, 0));
        start += len;
        chunks += 1;
    }
    let shared_measured = shared.e2e_s - shared.ttft_s;
    println!(
        "{chunks} chunks of {plen} prompt tokens: decode {:.4} s alone, {:.4} s shared, \
         +{:.4} s modelled",
        alone_measured, shared_measured, extra_s
    );
    assert!(
        (shared_measured - alone_measured - extra_s).abs() < 1e-6,
        "shared {shared_measured} alone {alone_measured} modelled extra {extra_s}"
    );
    // Exactly the shared steps are long ones (~0.2-0.4 s against ~7.5 ms alone).
    let (long_gaps, all_gaps) = itl_gaps_over(&metrics, "0.1");
    assert_eq!(long_gaps, chunks as f64, "of {all_gaps} gaps");
    assert_eq!(all_gaps, (DECODE_TOKENS - 1) as f64);
}
