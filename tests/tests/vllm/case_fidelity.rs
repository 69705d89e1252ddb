//! Case 6: the simulator's `vllm-cpu-tiny` profile predicts real vLLM.
//!
//! The same small workload runs against real vLLM and against the engine simulator configured like it
//! (tiny-llama's tokenizer, block size 32, the same KV-cache size and running limit, real time): a few
//! groups of requests sharing a long system prefix, each with its own question, sent one after another
//! and streamed. Time to first token is measured the same way on both (first body frame of the stream,
//! at the client) and the prefix-cache hit rate comes from each engine's own
//! `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`. TTFT p50 and the hit rate must
//! agree within 20%; both are printed side by side.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvmesh_engine_sim::{Engine as SimEngine, LatencyProfile, SimConfig, TokenizerChoice};
use serde_json::json;

use super::report::note;
use super::{counter, long_prompt, model_dir, BLOCK_SIZE, MODEL};

/// The agreement the case requires, relative to real vLLM.
const TOLERANCE: f64 = 0.20;

/// What one engine did with the workload.
#[derive(Debug, Clone, Copy)]
pub struct Observed {
    pub ttft_p50_ms: f64,
    pub hit_rate: f64,
}

/// The workload: `groups` shared prefixes, `per_group` requests each, sent sequentially.
fn workload() -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for g in 0..3 {
        let prefix = long_prompt(&format!("fidelity-{g}"), 160);
        for q in 0..4 {
            let prompt = format!("{prefix}\nQuestion {q}: which pod serves request {g}-{q} first?");
            out.push(
                json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                            "ignore_eos": true, "stream": true}),
            );
        }
    }
    out
}

/// Runs the workload against `base_url` and reads the hit rate from its `/metrics`.
pub async fn observe(base_url: &str) -> Result<Observed> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let metrics = |c: &Client<_, Full<Bytes>>| {
        let c = c.clone();
        let url = format!("{base_url}/metrics");
        async move {
            let resp = tokio::time::timeout(Duration::from_secs(10), c.get(url.parse()?)).await??;
            let body = resp.into_body().collect().await?.to_bytes();
            anyhow::Ok(String::from_utf8_lossy(&body).into_owned())
        }
    };
    let before = metrics(&client).await?;
    let mut ttfts = Vec::new();
    for body in workload() {
        let req = hyper::Request::post(format!("{base_url}/v1/completions"))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(serde_json::to_vec(&body)?)))?;
        let sent = Instant::now();
        let run = async {
            let resp = client.request(req).await?;
            ensure!(resp.status().is_success(), "HTTP {}", resp.status());
            let mut body = resp.into_body();
            let mut first = None;
            while let Some(frame) = body.frame().await {
                let frame = frame?;
                if first.is_none() && frame.data_ref().is_some_and(|d| !d.is_empty()) {
                    first = Some(sent.elapsed());
                }
            }
            first.context("empty stream")
        };
        let ttft = tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .context("request timed out")??;
        ttfts.push(ttft.as_secs_f64() * 1000.0);
    }
    let after = metrics(&client).await?;
    let delta = |name: &str| -> Result<f64> {
        Ok(counter(&after, name, &[])? - counter(&before, name, &[])?)
    };
    let hits = delta("vllm:prefix_cache_hits_total")?;
    let queries = delta("vllm:prefix_cache_queries_total")?;
    ensure!(queries > 0.0, "no prefix-cache queries counted");
    ttfts.sort_by(f64::total_cmp);
    Ok(Observed {
        ttft_p50_ms: ttfts[ttfts.len() / 2],
        hit_rate: hits / queries,
    })
}

/// Starts the simulator configured like the real engine (`kv_cache_blocks`, `max_num_seqs`).
pub async fn start_sim(
    kv_cache_blocks: usize,
    max_num_seqs: usize,
) -> Result<kvmesh_engine_sim::SimHandle> {
    let profile = LatencyProfile::builtin("vllm-cpu-tiny").context("the vllm-cpu-tiny profile")?;
    let config = SimConfig::new(MODEL)
        .with_block_size(BLOCK_SIZE)
        .with_num_blocks(kv_cache_blocks)
        .with_max_num_seqs(max_num_seqs)
        .with_max_model_len(1024)
        .with_profile(profile)
        .with_time_scale(1.0)
        .with_tokenizer(TokenizerChoice::HfDir(model_dir()));
    Ok(SimEngine::start_local(config).await?)
}

/// Prints both side by side and checks the 20% agreement.
pub fn compare(real: Observed, sim: Observed) -> Result<()> {
    let rel = |s: f64, r: f64| {
        if r == 0.0 {
            if s == 0.0 {
                0.0
            } else {
                f64::INFINITY
            }
        } else {
            (s - r).abs() / r
        }
    };
    note(&format!(
        "single: fidelity (sim profile vllm-cpu-tiny vs real vLLM)\n\
         {:>24} {:>10} {:>10} {:>8}\n\
         {:>24} {:>10.1} {:>10.1} {:>7.0}%\n\
         {:>24} {:>10.3} {:>10.3} {:>7.0}%",
        "",
        "real",
        "sim",
        "diff",
        "TTFT p50 (ms)",
        real.ttft_p50_ms,
        sim.ttft_p50_ms,
        100.0 * rel(sim.ttft_p50_ms, real.ttft_p50_ms),
        "prefix-cache hit rate",
        real.hit_rate,
        sim.hit_rate,
        100.0 * rel(sim.hit_rate, real.hit_rate),
    ));
    ensure!(
        rel(sim.hit_rate, real.hit_rate) <= TOLERANCE,
        "hit rate: sim {:.3} vs real {:.3} (more than {:.0}% apart)",
        sim.hit_rate,
        real.hit_rate,
        TOLERANCE * 100.0
    );
    ensure!(
        rel(sim.ttft_p50_ms, real.ttft_p50_ms) <= TOLERANCE,
        "TTFT p50: sim {:.1} ms vs real {:.1} ms (more than {:.0}% apart)",
        sim.ttft_p50_ms,
        real.ttft_p50_ms,
        TOLERANCE * 100.0
    );
    Ok(())
}
