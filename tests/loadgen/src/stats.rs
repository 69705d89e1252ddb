//! Statistics over request records: percentiles, means, rates, throughput and
//! the prefix-cache hit rate.
//!
//! Percentiles use the **nearest-rank** method: for `n` sorted samples the
//! p-th percentile is the sample at rank `ceil(p / 100 * n)` (1-based; rank 1
//! for p = 0). It always returns an observed value, never an interpolation,
//! so a p99 over 50 samples is the maximum: read small-sample tails with that
//! in mind.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::record::RequestRecord;

/// Percentiles, mean and extremes of one set of samples (milliseconds).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Dist {
    pub count: usize,
    pub mean: f64,
    pub min: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// Nearest-rank percentile of sorted samples; `None` when there are none.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let n = sorted.len();
    let rank = ((p / 100.0) * n as f64).ceil() as usize;
    let idx = rank.clamp(1, n) - 1;
    sorted.get(idx).copied()
}

impl Dist {
    /// Summarizes `samples` (any order); `None` when empty. NaNs are dropped.
    pub fn of(samples: &[f64]) -> Option<Dist> {
        let mut v: Vec<f64> = samples.iter().copied().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let sum: f64 = v.iter().sum();
        Some(Dist {
            count: v.len(),
            mean: sum / v.len() as f64,
            min: v[0],
            p50: percentile(&v, 50.0)?,
            p90: percentile(&v, 90.0)?,
            p99: percentile(&v, 99.0)?,
            max: v[v.len() - 1],
        })
    }
}

/// The figures of one run (or one stage of a rate ladder).
///
/// Field names are the JSON names the demo and the harness print
/// (`ttft_p50_ms`, `hit_rate`, `throughput_tok_s`, ...). Latency fields are
/// `None` (JSON `null`) when no request produced that measurement.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests sent.
    pub requests: u64,
    /// Requests that completed with a 2xx status and a complete body.
    pub ok: u64,
    /// Requests that failed (status, transport, timeout or broken stream).
    pub errors: u64,
    /// Wall time the figures are rated over, seconds.
    pub duration_s: f64,
    /// Successful requests per second.
    pub req_per_s: f64,
    /// Output (completion) tokens per second over successful requests.
    pub throughput_tok_s: f64,
    pub ttft_mean_ms: Option<f64>,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub itl_mean_ms: Option<f64>,
    pub itl_p50_ms: Option<f64>,
    pub itl_p90_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
    pub e2e_mean_ms: Option<f64>,
    pub e2e_p50_ms: Option<f64>,
    pub e2e_p90_ms: Option<f64>,
    pub e2e_p99_ms: Option<f64>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
    /// Sum of `cached_tokens` / sum of `prompt_tokens`, over the successful
    /// requests whose usage reported `cached_tokens`; `None` when none did.
    pub hit_rate: Option<f64>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn per_s(count: f64, duration_s: f64) -> f64 {
    if duration_s > 0.0 {
        count / duration_s
    } else {
        0.0
    }
}

impl Summary {
    /// Summarizes `records` over `duration` of wall time. Latencies come from
    /// successful requests only (a failed request's latency measures the
    /// failure, not the service); errors are counted.
    pub fn from_records<'a>(
        records: impl IntoIterator<Item = &'a RequestRecord>,
        duration: Duration,
    ) -> Summary {
        let (mut requests, mut ok) = (0u64, 0u64);
        let (mut ttft, mut itl, mut e2e) = (Vec::new(), Vec::new(), Vec::new());
        let (mut prompt, mut completion) = (0u64, 0u64);
        let (mut hit_prompt, mut hit_cached) = (0u64, 0u64);
        for r in records {
            requests += 1;
            if !r.is_ok() {
                continue;
            }
            ok += 1;
            e2e.push(ms(r.e2e));
            if let Some(t) = r.ttft {
                ttft.push(ms(t));
            }
            itl.extend(r.itl.iter().map(|d| ms(*d)));
            let p = r.prompt_tokens.unwrap_or(0);
            prompt += p;
            completion += r.completion_tokens.unwrap_or(0);
            if let Some(c) = r.cached_tokens {
                hit_prompt += p;
                hit_cached += c;
            }
        }
        let duration_s = duration.as_secs_f64();
        let (t, i, e) = (Dist::of(&ttft), Dist::of(&itl), Dist::of(&e2e));
        Summary {
            requests,
            ok,
            errors: requests - ok,
            duration_s,
            req_per_s: per_s(ok as f64, duration_s),
            throughput_tok_s: per_s(completion as f64, duration_s),
            ttft_mean_ms: t.map(|d| d.mean),
            ttft_p50_ms: t.map(|d| d.p50),
            ttft_p90_ms: t.map(|d| d.p90),
            ttft_p99_ms: t.map(|d| d.p99),
            itl_mean_ms: i.map(|d| d.mean),
            itl_p50_ms: i.map(|d| d.p50),
            itl_p90_ms: i.map(|d| d.p90),
            itl_p99_ms: i.map(|d| d.p99),
            e2e_mean_ms: e.map(|d| d.mean),
            e2e_p50_ms: e.map(|d| d.p50),
            e2e_p90_ms: e.map(|d| d.p90),
            e2e_p99_ms: e.map(|d| d.p99),
            prompt_tokens: prompt,
            completion_tokens: completion,
            cached_tokens: hit_cached,
            hit_rate: (hit_prompt > 0).then(|| hit_cached as f64 / hit_prompt as f64),
        }
    }
}

#[cfg(test)]
#[path = "stats_tests.rs"]
mod tests;
