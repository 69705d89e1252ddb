//! What the demo found: per workload, one row per policy with TTFT and
//! inter-token latency percentiles, output throughput and prefix-cache hit
//! rate, in simulated time, and the ratio of each to the baseline
//! (round-robin). Rendered as a text table or as JSON
//! (`{"workloads": [{"name", "policies": [{"policy", "ttft_p50_ms", ...}]}]}`).

use std::collections::BTreeMap;
use std::fmt::Write;

use kvmesh_loadgen::report::ratio;
use kvmesh_loadgen::Summary;
use serde::Serialize;

/// The whole demo.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DemoReport {
    pub workloads: Vec<WorkloadReport>,
    /// What every latency and rate is measured in.
    pub time_unit: String,
    /// Simulated seconds per wall second.
    pub time_scale: f64,
    /// The latency profile the engines imitate.
    pub profile: String,
    pub engines: usize,
    pub seed: u64,
    /// Wall time the whole demo took, seconds.
    pub wall_s: f64,
}

/// One workload under every policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkloadReport {
    pub name: String,
    /// The workload in one line (sizes, load).
    pub description: String,
    /// The policy ratios are taken against.
    pub baseline: String,
    pub policies: Vec<PolicyReport>,
}

/// One policy on one workload.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyReport {
    pub policy: String,
    /// False when the set-up cannot run in this build (the row has no figures).
    pub available: bool,
    /// Why it is unavailable, or something to know about its figures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Figures in simulated time (see `DemoReport::time_unit`); absent when
    /// unavailable.
    #[serde(flatten)]
    pub summary: Option<Summary>,
    /// Each figure divided by the baseline's (TTFT/ITL below 1 and
    /// throughput/hit rate above 1 are better).
    pub vs_baseline: Ratios,
    /// The autoscaling hook's largest answer per pool while the policy ran
    /// (`prefill`, `decode`, `aggregated`; pools with pods only).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub autoscale_peak: BTreeMap<String, PoolPeak>,
}

/// A pool's size and the most pods the autoscaling hook asked for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PoolPeak {
    pub pods: u32,
    pub desired: u32,
}

/// Ratios to the baseline policy; `None` when either side is missing or the
/// baseline is zero.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Ratios {
    pub ttft_p50: Option<f64>,
    pub ttft_p90: Option<f64>,
    pub ttft_p99: Option<f64>,
    pub itl_p50: Option<f64>,
    pub itl_p99: Option<f64>,
    pub throughput: Option<f64>,
    pub hit_rate: Option<f64>,
}

impl PolicyReport {
    /// A policy that ran, with figures already in simulated time.
    pub fn ran(policy: &str, summary: Summary, note: Option<String>) -> Self {
        Self {
            policy: policy.to_owned(),
            available: true,
            note,
            summary: Some(summary),
            vs_baseline: Ratios::default(),
            autoscale_peak: BTreeMap::new(),
        }
    }

    /// A policy this build cannot run, and why.
    pub fn unavailable(policy: &str, why: String) -> Self {
        Self {
            policy: policy.to_owned(),
            available: false,
            note: Some(why),
            summary: None,
            vs_baseline: Ratios::default(),
            autoscale_peak: BTreeMap::new(),
        }
    }
}

impl WorkloadReport {
    /// Fills every row's ratios against the baseline row (if it ran).
    pub fn compute_ratios(&mut self) {
        let Some(base) = self
            .policies
            .iter()
            .find(|p| p.policy == self.baseline)
            .and_then(|p| p.summary.clone())
        else {
            return;
        };
        for p in &mut self.policies {
            if let Some(s) = &p.summary {
                p.vs_baseline = Ratios {
                    ttft_p50: ratio(s.ttft_p50_ms, base.ttft_p50_ms),
                    ttft_p90: ratio(s.ttft_p90_ms, base.ttft_p90_ms),
                    ttft_p99: ratio(s.ttft_p99_ms, base.ttft_p99_ms),
                    itl_p50: ratio(s.itl_p50_ms, base.itl_p50_ms),
                    itl_p99: ratio(s.itl_p99_ms, base.itl_p99_ms),
                    throughput: ratio(Some(s.throughput_tok_s), Some(base.throughput_tok_s)),
                    hit_rate: ratio(s.hit_rate, base.hit_rate),
                };
            }
        }
    }

    /// The row of `policy`.
    pub fn policy(&self, policy: &str) -> Option<&PolicyReport> {
        self.policies.iter().find(|p| p.policy == policy)
    }
}

/// Converts wall-clock figures into simulated time: the engines run
/// `scale` simulated seconds per wall second, so latencies grow by `scale`
/// and rates shrink by it. The hit rate and counts do not change.
pub fn to_simulated(s: &Summary, scale: f64) -> Summary {
    let t = |v: Option<f64>| v.map(|v| v * scale);
    Summary {
        duration_s: s.duration_s * scale,
        req_per_s: s.req_per_s / scale,
        throughput_tok_s: s.throughput_tok_s / scale,
        ttft_mean_ms: t(s.ttft_mean_ms),
        ttft_p50_ms: t(s.ttft_p50_ms),
        ttft_p90_ms: t(s.ttft_p90_ms),
        ttft_p99_ms: t(s.ttft_p99_ms),
        itl_mean_ms: t(s.itl_mean_ms),
        itl_p50_ms: t(s.itl_p50_ms),
        itl_p90_ms: t(s.itl_p90_ms),
        itl_p99_ms: t(s.itl_p99_ms),
        e2e_mean_ms: t(s.e2e_mean_ms),
        e2e_p50_ms: t(s.e2e_p50_ms),
        e2e_p90_ms: t(s.e2e_p90_ms),
        e2e_p99_ms: t(s.e2e_p99_ms),
        ..s.clone()
    }
}

const HEADERS: [&str; 12] = [
    "policy",
    "ok/reqs",
    "ttft p50",
    "ttft p90",
    "ttft p99",
    "itl p50",
    "itl p99",
    "tok/s",
    "hit",
    "ttft p50 x",
    "ttft p90 x",
    "tok/s x",
];

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.0}"))
}

fn times(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.2}x"))
}

fn row(p: &PolicyReport) -> Vec<String> {
    let Some(s) = &p.summary else {
        let mut r = vec![p.policy.clone(), "not available".to_owned()];
        r.resize(HEADERS.len(), String::new());
        return r;
    };
    let r = &p.vs_baseline;
    vec![
        p.policy.clone(),
        format!("{}/{}", s.ok, s.requests),
        ms(s.ttft_p50_ms),
        ms(s.ttft_p90_ms),
        ms(s.ttft_p99_ms),
        ms(s.itl_p50_ms),
        ms(s.itl_p99_ms),
        format!("{:.0}", s.throughput_tok_s),
        s.hit_rate
            .map_or_else(|| "-".into(), |h| format!("{:.0}%", h * 100.0)),
        times(r.ttft_p50),
        times(r.ttft_p90),
        times(r.throughput),
    ]
}

impl DemoReport {
    /// The comparison table, one block per workload.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "Times in {}.", self.time_unit);
        for w in &self.workloads {
            let _ = writeln!(out, "\n{}: {}", w.name, w.description);
            let mut rows = vec![HEADERS.iter().map(|h| (*h).to_owned()).collect::<Vec<_>>()];
            rows.extend(w.policies.iter().map(row));
            let widths: Vec<usize> = (0..HEADERS.len())
                .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
                .collect();
            for r in &rows {
                let mut line = String::new();
                for (c, cell) in r.iter().enumerate() {
                    if c == 0 {
                        let _ = write!(line, "{cell:<w$}", w = widths[c]);
                    } else {
                        let _ = write!(line, "  {cell:>w$}", w = widths[c]);
                    }
                }
                let _ = writeln!(out, "  {}", line.trim_end());
            }
            for p in &w.policies {
                if let Some(n) = &p.note {
                    let _ = writeln!(out, "  {}: {n}", p.policy);
                }
            }
            let peaks: Vec<String> = w
                .policies
                .iter()
                .filter(|p| !p.autoscale_peak.is_empty())
                .map(|p| {
                    let pools: Vec<String> = p
                        .autoscale_peak
                        .iter()
                        .map(|(pool, k)| format!("{pool} {} -> {}", k.pods, k.desired))
                        .collect();
                    format!("{} {}", p.policy, pools.join(", "))
                })
                .collect();
            if !peaks.is_empty() {
                let _ = writeln!(
                    out,
                    "  autoscale hook, most pods asked for during the run (pods -> asked): {}",
                    peaks.join("; ")
                );
            }
        }
        let _ = writeln!(
            out,
            "\nx columns: ratio to {} (TTFT below 1.00x and tok/s above 1.00x are better). \
             hit: prompt tokens served from the engine's prefix cache (usage.cached_tokens).",
            self.workloads
                .first()
                .map_or("the baseline", |w| w.baseline.as_str())
        );
        out
    }

    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        // Serializing plain structs of numbers and strings cannot fail; NaNs
        // would become null.
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// The workload named `name`.
    pub fn workload(&self, name: &str) -> Option<&WorkloadReport> {
        self.workloads.iter().find(|w| w.name == name)
    }
}
