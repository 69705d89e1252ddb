//! The `gpu:` profiles against published vLLM measurements (docs/gpu-profiles.md,
//! "Checked against published figures"): each prediction within 25% of its
//! figure, or a documented miss asserted as such.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvmesh_engine_sim::profile::StepLoad;
use kvmesh_engine_sim::LatencyProfile;

fn profile(name: &str) -> LatencyProfile {
    LatencyProfile::load(name).unwrap()
}

/// `vllm bench latency` (offline, no API server): `batch` prompts of `input`
/// tokens prefilled in one step, then `output - 1` decode steps, ms.
fn bench_latency_ms(p: &LatencyProfile, batch: usize, input: usize, output: usize) -> f64 {
    let mut prefill = StepLoad::default();
    for _ in 0..batch {
        prefill = prefill.with_chunk(0, input);
    }
    let mut s = p.step_seconds(&prefill);
    for i in 1..output {
        s += p.step_seconds(&StepLoad::decode(batch, batch * (input + i)));
    }
    s * 1000.0
}

/// Decode gap of one sequence with `ctx` tokens of context, ms.
fn tpot_ms(p: &LatencyProfile, ctx: usize) -> f64 {
    p.step_seconds(&StepLoad::decode(1, ctx)) * 1000.0
}

fn within(what: &str, predicted: f64, published: f64, tolerance: f64) {
    let ratio = predicted / published;
    println!("{what}: predicted {predicted:.1}, published {published:.1} ({ratio:.2}x)");
    assert!(
        (ratio - 1.0).abs() <= tolerance,
        "{what}: predicted {predicted:.1} vs published {published:.1} ({ratio:.2}x)"
    );
}

/// vLLM's nightly performance benchmark, Buildkite build 9515, H200, latency
/// tests: 32 input tokens, 128 output tokens, batch 8, mean end-to-end latency.
#[test]
fn vllm_nightly_latency_on_h200() {
    let cases = [
        ("gpu:llama-3.1-8b@h200", 833.4),
        ("gpu:llama-3.1-70b@h200x4", 2077.5),
        ("gpu:mixtral-8x7b@h200x2", 1917.4),
    ];
    for (name, published) in cases {
        within(
            name,
            bench_latency_ms(&profile(name), 8, 32, 128),
            published,
            0.25,
        );
    }
}

/// Llama-3.1-8B on one A100 40GB, vLLM 0.23, 1024 in / 128 out, one request at
/// a time: about 75 output tokens/s (johnmusgrave.com).
#[test]
fn llama_8b_single_stream_on_a100_40gb() {
    let p = profile("gpu:llama-3.1-8b@a100-40gb");
    within(
        "llama-3.1-8b@a100-40gb TPOT",
        tpot_ms(&p, 1024 + 64),
        1000.0 / 75.0,
        0.25,
    );
}

/// vLLM's startup log for Llama 3.1 8B on one H100 80GB (vllm-project/vllm#19996):
/// "GPU KV cache size: 410,128 tokens".
#[test]
fn llama_8b_kv_capacity_on_h100() {
    let tokens = profile("gpu:llama-3.1-8b@h100").kv_cache_tokens.unwrap();
    within(
        "llama-3.1-8b@h100 KV tokens",
        tokens as f64,
        410_128.0,
        0.25,
    );
    // The alias is the same profile.
    assert_eq!(profile("small-gpu").kv_cache_tokens, Some(tokens));
}

/// Qwen3-30B-A3B on one A100 (80GB: its 61 GB of weights do not fit 40GB),
/// 128 in / 128 out, concurrency 1: TPOT 9.6 ms (tenstorrent/tt-inference-server#340).
///
/// A documented miss: the model reads only the 8 routed experts' weights (6.6 GB)
/// and predicts ~5.6 ms; vLLM's fused-MoE kernels at batch 1 are far from the
/// bandwidth roofline (docs/gpu-profiles.md). Asserted as the miss it is.
#[test]
fn qwen3_moe_single_stream_on_a100_is_a_documented_miss() {
    let p = profile("gpu:qwen3-30b-a3b@a100");
    let ratio = tpot_ms(&p, 128 + 64) / 9.6;
    println!(
        "qwen3-30b-a3b@a100 TPOT: {:.2}x the published 9.6 ms",
        ratio
    );
    assert!((0.5..0.7).contains(&ratio), "ratio {ratio:.2}");
}

/// The profiles the issue names all derive, and tensor parallelism and faster
/// memory move the figures the right way.
#[test]
fn named_profiles_derive_and_order_sensibly() {
    for name in kvmesh_engine_sim::profile::catalog::NAMED {
        let p = profile(&format!("gpu:{name}"));
        assert!(p.kv_cache_tokens.unwrap() > 100_000, "{name}: {p:?}");
    }
    let tpot = |name: &str| tpot_ms(&profile(name), 2048);
    assert!(tpot("gpu:llama-3.1-70b@h100x8") < tpot("gpu:llama-3.1-70b@h100x4"));
    assert!(tpot("gpu:llama-3.1-70b@h100x8") < tpot("gpu:llama-3.1-70b@a100x8"));
    assert!(tpot("gpu:llama-3.1-8b@h200") < tpot("gpu:llama-3.1-8b@h100"));
}
