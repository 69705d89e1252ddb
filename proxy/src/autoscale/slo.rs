//! How many pods a pool needs to meet its SLO: a queueing model of a vLLM
//! pod, fed the pool's measured workload ([`Workload`]) and one pod's step
//! costs ([`PodProfile`]).
//!
//! A pod runs steps back to back. A step of `b` running sequences costs
//! `d(b) = step_base + b × k`, `k` the per-sequence decode cost at the mean
//! decode context (prompt plus half the output); prefill work rides in the
//! steps (chunked prefill) and takes the share `ρ_p = λ_pod × s_p` of the
//! GPU, `s_p` one request's prefill time. Then, for `c` pods at a rate `λ`:
//!
//! - **Decode.** Each request holds a sequence for its output tokens, so by
//!   Little's law `b = λ_pod × output × ITL`, with the mean ITL `d(b) / (1 -
//!   ρ_p)`. That solves to one `b`; none when decode cannot keep up.
//! - **ITL p99.** Where more than 1% of steps carry a prefill chunk, the
//!   99th percentile is such a step: `d(b)` plus the chunk's prefill time
//!   (what P/D removes); otherwise `d(b)`.
//! - **KV and sequences.** `b × (prompt + output / 2)` tokens must fit in
//!   `target_kv_usage` of the pod's KV cache, and `b` in `max_num_seqs`;
//!   past that, requests wait for KV (the engine's admission), unbounded in
//!   this model, so the size fails.
//! - **TTFT p90.** Prefill time `s_p`, plus one step and a half (the step
//!   the request joins, and the residue of the one it waits out), plus the
//!   90th percentile of the wait for prefill capacity, M/M/c over the pool
//!   (Erlang C): the pool's router spreads requests over its pods.
//!
//! The pool needs the fewest pods whose prediction meets both targets.

use serde::Serialize;

use super::rates::Workload;
use crate::config::autoscale::PodProfile;

/// What the model predicts for a pool of a given size.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Prediction {
    /// TTFT p90 and ITL p99, ms (infinite where the size cannot keep up).
    pub ttft_p90_ms: f64,
    pub itl_p99_ms: f64,
    /// Running sequences per pod.
    pub batch_per_pod: f64,
    /// Share of a pod's KV cache those sequences hold.
    pub kv_usage: f64,
    /// What fails at this size: `prefill`, `decode`, `kv`, `max_num_seqs`,
    /// `ttft` or `itl`; `None` when the SLO holds.
    pub limit: Option<&'static str>,
}

/// The targets: TTFT p90 and ITL p99 in ms, and the KV share a pod may fill.
#[derive(Debug, Clone, Copy)]
pub struct Targets {
    pub ttft_p90_ms: f64,
    pub itl_p99_ms: f64,
    pub kv_usage: f64,
}

/// The model's prediction for `pods` pods serving `w`.
pub fn predict(p: &PodProfile, t: &Targets, w: &Workload, pods: u32) -> Prediction {
    let fail = |limit| Prediction {
        ttft_p90_ms: f64::INFINITY,
        itl_p99_ms: f64::INFINITY,
        batch_per_pod: f64::INFINITY,
        kv_usage: f64::INFINITY,
        limit: Some(limit),
    };
    let c = f64::from(pods.max(1));
    let rate = w.arrival_rate.max(0.0) / c; // per pod, req/s
    let uncached = w.uncached_tokens.max(0.0);
    let prompt = w.prompt_tokens.max(uncached);
    let output = w.output_tokens.max(0.0);
    // One request's prefill: each computed token attends to the cached
    // prefix and half of the computed part, on average.
    let attended_k = (prompt - uncached + uncached / 2.0) / 1000.0;
    let prefill_ms = uncached * (p.prefill_ms_per_token + attended_k * p.prefill_ms_per_token_kctx);
    let rho_p = rate * prefill_ms / 1000.0;
    if rho_p >= 1.0 {
        return fail("prefill");
    }
    // Decode: b = x (B + b k), x = rate × output / (1000 (1 - ρ_p)).
    let k = p.decode_ms_per_seq + (prompt + output / 2.0) / 1000.0 * p.decode_ms_per_kctx;
    let x = rate * output / (1000.0 * (1.0 - rho_p));
    if x * k >= 1.0 {
        return fail("decode");
    }
    let b = x * p.step_base_ms / (1.0 - x * k);
    let step_ms = p.step_base_ms + b * k;
    let itl_mean = step_ms / (1.0 - rho_p);
    let kv_usage = b * (prompt + output / 2.0) / p.kv_cache_tokens as f64;
    if kv_usage > t.kv_usage {
        return Prediction {
            kv_usage,
            ..fail("kv")
        };
    }
    if b > f64::from(p.max_num_seqs) {
        return fail("max_num_seqs");
    }
    let budget = f64::from(p.max_num_batched_tokens);
    let chunk = uncached.min(budget);
    let chunk_ms = chunk * (p.prefill_ms_per_token + attended_k * p.prefill_ms_per_token_kctx);
    let chunks_per_s = rate * (uncached / budget).ceil();
    let steps_with_prefill = (chunks_per_s * itl_mean / 1000.0).min(1.0);
    let itl_p99 = if output <= 1.0 {
        0.0 // a prefill pod streams no tokens after the first
    } else if steps_with_prefill > 0.01 {
        step_ms + chunk_ms
    } else {
        step_ms
    };
    let wait_p90 = erlang_c_wait_p90(c, rate * c, prefill_ms);
    let ttft_p90 = wait_p90 + prefill_ms + 1.5 * step_ms;
    let limit = if ttft_p90 > t.ttft_p90_ms {
        Some("ttft")
    } else if itl_p99 > t.itl_p99_ms {
        Some("itl")
    } else {
        None
    };
    Prediction {
        ttft_p90_ms: ttft_p90,
        itl_p99_ms: itl_p99,
        batch_per_pod: b,
        kv_usage,
        limit,
    }
}

/// The fewest pods in `1..=max` that meet the targets, with their
/// prediction; `max` and its prediction when none does.
pub fn pods_needed(p: &PodProfile, t: &Targets, w: &Workload, max: u32) -> (u32, Prediction) {
    let max = max.max(1);
    let meets = |c| predict(p, t, w, c).limit.is_none();
    if !meets(max) {
        return (max, predict(p, t, w, max));
    }
    // More pods never predict worse, so the smallest size is a bisection.
    let (mut lo, mut hi) = (0u32, max); // lo fails (or is 0), hi meets
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if meets(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    (hi, predict(p, t, w, hi))
}

/// The highest rate one pod of a pool of `pods` sustains within the
/// targets, for requests shaped like `w` (req/s).
pub fn rate_per_pod(p: &PodProfile, t: &Targets, w: &Workload, pods: u32) -> f64 {
    let c = pods.max(1);
    let at = |rate: f64| Workload {
        arrival_rate: rate * f64::from(c),
        ..*w
    };
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    // Grow the bracket (bounded: 1e6 req/s per pod is past any GPU).
    while predict(p, t, &at(hi), c).limit.is_none() && hi < 1e6 {
        lo = hi;
        hi *= 2.0;
    }
    for _ in 0..40 {
        let mid = (lo + hi) / 2.0;
        if predict(p, t, &at(mid), c).limit.is_none() {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The 90th percentile of the wait in an M/M/c queue of `c` servers at
/// `rate` req/s with mean service `service_ms` (0 when fewer than 10% wait).
fn erlang_c_wait_p90(c: f64, rate: f64, service_ms: f64) -> f64 {
    if service_ms <= 0.0 || rate <= 0.0 {
        return 0.0;
    }
    let a = rate * service_ms / 1000.0; // offered load, erlangs
    if a >= c {
        return f64::INFINITY;
    }
    // Erlang B by its recurrence (stable for large c), then C from B.
    let servers = c as u64;
    let mut b = 1.0f64;
    for n in 1..=servers {
        b = a * b / (n as f64 + a * b);
    }
    let rho = a / c;
    let waits = b / (1.0 - rho + rho * b);
    if waits <= 0.1 {
        return 0.0;
    }
    // P(W > t) = C e^{-(c - a) t / s}.
    service_ms / (c - a) * (waits / 0.1).ln()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// `kvmesh-engine-sim profile --profile gpu:qwen3-32b@h100`, rounded.
    fn qwen3_32b_h100() -> PodProfile {
        PodProfile {
            step_base_ms: 26.0,
            prefill_ms_per_token: 0.1326,
            prefill_ms_per_token_kctx: 0.0042,
            decode_ms_per_seq: 0.1326,
            decode_ms_per_kctx: 0.0978,
            kv_cache_tokens: 29_424,
            max_num_seqs: 1024,
            max_num_batched_tokens: 8192,
        }
    }

    fn targets() -> Targets {
        Targets {
            ttft_p90_ms: 2000.0,
            itl_p99_ms: 100.0,
            kv_usage: 0.9,
        }
    }

    /// The Azure 2023 conversation trace's mean request: 1155 prompt
    /// tokens, 211 generated.
    fn conv(rate: f64) -> Workload {
        Workload {
            arrival_rate: rate,
            prompt_tokens: 1155.0,
            uncached_tokens: 1155.0,
            output_tokens: 211.0,
            window_s: 60.0,
        }
    }

    #[test]
    fn pods_grow_with_the_rate_and_the_smallest_size_meets_the_slo() {
        let (p, t) = (qwen3_32b_h100(), targets());
        let mut last = 0;
        for rate in [0.5, 2.0, 5.0, 10.0, 20.0] {
            let (n, pred) = pods_needed(&p, &t, &conv(rate), 64);
            assert!(n >= last, "{rate}: {n} < {last}");
            assert_eq!(pred.limit, None, "{rate}: {pred:?}");
            assert!(pred.ttft_p90_ms <= 2000.0 && pred.itl_p99_ms <= 100.0);
            if n > 1 {
                let fewer = predict(&p, &t, &conv(rate), n - 1);
                assert!(fewer.limit.is_some(), "{rate}: {} pods would do", n - 1);
            }
            last = n;
        }
        assert!(
            last >= 4,
            "20 req/s of conversation on one H100 each: {last}"
        );
    }

    #[test]
    fn a_kv_starved_pod_is_limited_by_kv_and_more_kv_needs_fewer_pods() {
        let t = Targets {
            itl_p99_ms: 250.0,
            ..targets()
        };
        let mut p = qwen3_32b_h100();
        p.kv_cache_tokens = 8_000; // ~6 sequences of 1.3k tokens
        let w = conv(3.0);
        let one = predict(&p, &t, &w, 1);
        assert_eq!(one.limit, Some("kv"), "{one:?}");
        let (small, _) = pods_needed(&p, &t, &w, 64);
        p.kv_cache_tokens = 80_000;
        let (large, _) = pods_needed(&p, &t, &w, 64);
        assert!(small > large, "{small} vs {large}");
    }

    #[test]
    fn prefill_chunks_in_decode_steps_set_the_itl_tail_and_a_prefill_pool_has_none() {
        let t = targets();
        let mut p = qwen3_32b_h100();
        p.kv_cache_tokens = 400_000; // room for the long contexts: ITL decides
        let long = Workload {
            prompt_tokens: 6000.0,
            uncached_tokens: 6000.0,
            ..conv(2.0)
        };
        let agg = predict(&p, &t, &long, 4);
        // A 6000-token chunk costs ~0.87 s: the ITL tail is that step.
        assert!(agg.itl_p99_ms > 700.0, "{agg:?}");
        assert_eq!(agg.limit, Some("itl"));
        let prefill_pool = Workload {
            output_tokens: 1.0,
            ..long
        };
        let pre = predict(&p, &t, &prefill_pool, 4);
        assert_eq!((pre.itl_p99_ms, pre.limit), (0.0, None), "{pre:?}");
        let decode_pool = Workload {
            uncached_tokens: 0.0,
            ..long
        };
        assert_eq!(predict(&p, &t, &decode_pool, 4).limit, None);
    }

    #[test]
    fn a_saturated_prefill_pool_needs_another_pod() {
        // 6000-token prompts at 24 req/s: past what two prefill pods
        // compute (each would be busy 3.2 s a second).
        let p = PodProfile {
            step_base_ms: 16.0,
            prefill_ms_per_token: 0.04,
            prefill_ms_per_token_kctx: 0.0013,
            ..qwen3_32b_h100()
        };
        let w = Workload {
            arrival_rate: 24.0,
            prompt_tokens: 6000.0,
            uncached_tokens: 6000.0,
            output_tokens: 1.0,
            window_s: 60.0,
        };
        let two = predict(&p, &targets(), &w, 2);
        assert_eq!(two.limit, Some("prefill"), "{two:?}");
        let (n, pred) = pods_needed(&p, &targets(), &w, 64);
        assert!(n >= 3, "{n} {pred:?}");
    }

    #[test]
    fn the_rate_per_pod_is_where_the_slo_breaks() {
        let p = qwen3_32b_h100();
        // An ITL target above a 1155-token prefill step (~180 ms), so
        // aggregated pods may take prefills while they decode.
        let t = Targets {
            itl_p99_ms: 250.0,
            ..targets()
        };
        let r = rate_per_pod(&p, &t, &conv(1.0), 4);
        assert!(r > 0.5 && r < 20.0, "{r}");
        assert_eq!(predict(&p, &t, &conv(r * 4.0 * 0.99), 4).limit, None);
        assert!(predict(&p, &t, &conv(r * 4.0 * 1.05), 4).limit.is_some());
    }

    #[test]
    fn erlang_c_matches_m_m_1_and_grows_near_saturation() {
        // M/M/1 at ρ = 0.5: P(W > t) = 0.5 e^{-(1-ρ) t / s}; p90 = 2 s ln 5.
        let w = erlang_c_wait_p90(1.0, 5.0, 100.0);
        assert!((w - 200.0 * 5f64.ln()).abs() < 1e-6, "{w}");
        assert_eq!(erlang_c_wait_p90(4.0, 1.0, 100.0), 0.0);
        assert!(erlang_c_wait_p90(4.0, 39.0, 100.0) > erlang_c_wait_p90(4.0, 30.0, 100.0));
        assert!(erlang_c_wait_p90(4.0, 40.0, 100.0).is_infinite());
    }
}
