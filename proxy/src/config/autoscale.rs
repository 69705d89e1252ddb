//! The `autoscale` section of `proxy.yaml`: the targets the autoscaling hook
//! sizes each pool against (docs/autoscaling.md). Without `slo` the hook sizes
//! pools by their queue and KV usage; with it, by the pods a pool needs to
//! meet the SLO at the rate and request sizes the fleet measures.

use serde::{Deserialize, Serialize};

use super::units::Fraction;
use super::Duration;

/// See the module docs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Autoscale {
    /// Requests waiting per pod that a pool should average (queue depth).
    pub target_waiting_per_pod: u32,
    /// KV-cache usage a pool should average.
    pub target_kv_usage: Fraction,
    /// No change while the pool's load is within this fraction of its target
    /// (as the HPA's tolerance), so small swings do not flap.
    pub tolerance: Fraction,
    /// Bounds of every pool's answer.
    pub min_replicas: u32,
    pub max_replicas: u32,
    /// Pods whose load is older than this are left out (not counted, not averaged).
    pub max_load_age: Duration,
    /// Size pools for this SLO (`None`: by queue and KV usage alone).
    pub slo: Option<Slo>,
}

/// The latency targets a pool is sized for, how its workload is measured,
/// and what one pod can do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Slo {
    /// Time to first token that 90% of requests should meet; or, set
    /// instead (exactly one of the three), that 95% or 99% should.
    #[serde(default)]
    pub ttft_p90: Option<Duration>,
    #[serde(default)]
    pub ttft_p95: Option<Duration>,
    #[serde(default)]
    pub ttft_p99: Option<Duration>,
    /// Inter-token latency that 99% of tokens should meet.
    pub itl_p99: Duration,
    /// The arrival rate and tokens per request are measured over this window
    /// (a rate over a recent span, two sample intervals up to half the
    /// window, counts at once when it is past the noise of the rate before
    /// it: pools grow as soon as a burst shows; docs/autoscaling.md).
    #[serde(default = "default_window")]
    pub window: Duration,
    /// How often every sidecar samples the fleet's counters, polled or not.
    #[serde(default = "default_sample_interval")]
    pub sample_interval: Duration,
    /// Pools are sized for this many times the measured rate (1 to 10): the
    /// headroom that absorbs a burst that comes faster than a pod starts,
    /// paid for in pods all the time (as an HPA's target utilisation below
    /// 100%; docs/autoscaling.md).
    #[serde(default = "default_headroom")]
    pub headroom: f64,
    /// One pod's costs (every pool's; the decode pool's too unless `decode_pod`).
    pub pod: PodProfile,
    /// The decode pool's pods, when their GPUs differ.
    #[serde(default)]
    pub decode_pod: Option<PodProfile>,
}

fn default_window() -> Duration {
    Duration::from_secs(60)
}

fn default_sample_interval() -> Duration {
    Duration::from_secs(5)
}

fn default_headroom() -> f64 {
    1.0
}

// `headroom` is validated finite, so comparing bits is an equivalence.
impl Eq for Slo {}

/// What one engine step costs and what one pod holds: the terms
/// `kvmesh-engine-sim profile --profile gpu:MODEL@GPU` prints (derived from
/// the GPU's datasheet, docs/gpu-profiles.md), or a fit to a measured
/// sweep of the real engine. A step of `b` running sequences of `ctx`
/// context tokens each that also prefills `n` tokens takes
/// `step_base_ms + b × (decode_ms_per_seq + ctx/1000 × decode_ms_per_kctx)
/// + n × (prefill_ms_per_token + ctx/1000 × prefill_ms_per_token_kctx)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodProfile {
    pub step_base_ms: f64,
    pub prefill_ms_per_token: f64,
    #[serde(default)]
    pub prefill_ms_per_token_kctx: f64,
    pub decode_ms_per_seq: f64,
    #[serde(default)]
    pub decode_ms_per_kctx: f64,
    /// Tokens the pod's KV cache holds.
    pub kv_cache_tokens: u64,
    /// The engine's running-sequence limit (vLLM `max_num_seqs`).
    #[serde(default = "default_max_num_seqs")]
    pub max_num_seqs: u32,
    /// Tokens one step computes at most (vLLM `max_num_batched_tokens`).
    #[serde(default = "default_max_num_batched_tokens")]
    pub max_num_batched_tokens: u32,
}

// Every cost is validated finite, so comparing bits is an equivalence.
impl Eq for PodProfile {}

fn default_max_num_seqs() -> u32 {
    256
}

fn default_max_num_batched_tokens() -> u32 {
    8192
}

impl PodProfile {
    fn validate(&self, field: &str) -> Result<(), (String, String)> {
        let costs = [
            ("step_base_ms", self.step_base_ms),
            ("prefill_ms_per_token", self.prefill_ms_per_token),
            ("prefill_ms_per_token_kctx", self.prefill_ms_per_token_kctx),
            ("decode_ms_per_seq", self.decode_ms_per_seq),
            ("decode_ms_per_kctx", self.decode_ms_per_kctx),
        ];
        for (name, v) in costs {
            if !(v.is_finite() && v >= 0.0) {
                return Err((
                    format!("{field}.{name}"),
                    format!("{v} is not a cost in milliseconds (finite, not negative)"),
                ));
            }
        }
        for (name, v) in [
            ("step_base_ms", self.step_base_ms),
            ("prefill_ms_per_token", self.prefill_ms_per_token),
        ] {
            if v == 0.0 {
                return Err((
                    format!("{field}.{name}"),
                    "must be above 0: a step and a prefill take time".to_owned(),
                ));
            }
        }
        for (name, v) in [
            ("kv_cache_tokens", self.kv_cache_tokens),
            ("max_num_seqs", u64::from(self.max_num_seqs)),
            (
                "max_num_batched_tokens",
                u64::from(self.max_num_batched_tokens),
            ),
        ] {
            if v == 0 {
                return Err((format!("{field}.{name}"), "must be at least 1".to_owned()));
            }
        }
        Ok(())
    }
}

impl Slo {
    /// The TTFT target and the share of requests that should meet it.
    pub fn ttft(&self) -> (Duration, f64) {
        let (_, d, q) = self.ttft_given();
        (d, q)
    }

    /// The TTFT key set, its target and its share (the first set; validation
    /// requires exactly one).
    fn ttft_given(&self) -> (&'static str, Duration, f64) {
        [
            ("ttft_p90", self.ttft_p90, 0.9),
            ("ttft_p95", self.ttft_p95, 0.95),
            ("ttft_p99", self.ttft_p99, 0.99),
        ]
        .into_iter()
        .find_map(|(k, d, q)| d.map(|d| (k, d, q)))
        .unwrap_or(("ttft_p90", Duration::from_secs(0), 0.9))
    }

    fn validate(&self) -> Result<(), (String, String)> {
        let given = [self.ttft_p90, self.ttft_p95, self.ttft_p99]
            .iter()
            .filter(|d| d.is_some())
            .count();
        if given != 1 {
            return Err((
                "autoscale.slo.ttft_p90".to_owned(),
                format!("give one TTFT target: ttft_p90, ttft_p95 or ttft_p99 ({given} given)"),
            ));
        }
        for (name, d) in [
            (self.ttft_given().0, self.ttft().0),
            ("itl_p99", self.itl_p99),
            ("sample_interval", self.sample_interval),
        ] {
            if d.get().is_zero() {
                return Err((
                    format!("autoscale.slo.{name}"),
                    "must be above 0".to_owned(),
                ));
            }
        }
        if self.window.get() < self.sample_interval.get() * 2 {
            return Err((
                "autoscale.slo.window".to_owned(),
                format!(
                    "{} holds fewer than two samples {} apart: a rate needs two",
                    self.window, self.sample_interval
                ),
            ));
        }
        if !(1.0..=10.0).contains(&self.headroom) {
            return Err((
                "autoscale.slo.headroom".to_owned(),
                format!(
                    "{} is not a multiple of the measured rate from 1 (none) to 10",
                    self.headroom
                ),
            ));
        }
        self.pod.validate("autoscale.slo.pod")?;
        if let Some(d) = &self.decode_pod {
            d.validate("autoscale.slo.decode_pod")?;
        }
        Ok(())
    }
}

impl Default for Autoscale {
    fn default() -> Self {
        Self {
            target_waiting_per_pod: 2,
            target_kv_usage: Fraction::new(0.75).unwrap_or(Fraction::ONE),
            tolerance: Fraction::new(0.1).unwrap_or(Fraction::ONE),
            min_replicas: 1,
            max_replicas: 64,
            max_load_age: Duration::from_secs(10),
            slo: None,
        }
    }
}

impl Autoscale {
    /// Rules that span fields; `(field, message)` on the first broken one.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.target_waiting_per_pod == 0 {
            return Err((
                "autoscale.target_waiting_per_pod".to_owned(),
                "must be at least 1".to_owned(),
            ));
        }
        if self.min_replicas == 0 {
            return Err((
                "autoscale.min_replicas".to_owned(),
                "must be at least 1: a pool scaled to zero has no load to scale it up again"
                    .to_owned(),
            ));
        }
        if self.min_replicas > self.max_replicas {
            return Err((
                "autoscale.min_replicas".to_owned(),
                format!(
                    "{} is above max_replicas ({})",
                    self.min_replicas, self.max_replicas
                ),
            ));
        }
        if let Some(slo) = &self.slo {
            slo.validate()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use crate::config::from_yaml_str;

    #[test]
    fn targets_load_and_bad_values_name_their_field() {
        let c = from_yaml_str(
            "autoscale:\n  target_kv_usage: 0.8\n  max_replicas: 8\n",
            "proxy.yaml",
        )
        .unwrap();
        assert!((c.autoscale.target_kv_usage.get() - 0.8).abs() < 1e-12);
        assert_eq!(c.autoscale.max_replicas, 8);
        for (yaml, field) in [
            (
                "autoscale:\n  target_kv_usage: 1.5\n",
                "autoscale.target_kv_usage",
            ),
            ("autoscale:\n  tolerance: 0\n", "autoscale.tolerance"),
            (
                "autoscale:\n  target_waiting_per_pod: 0\n",
                "autoscale.target_waiting_per_pod",
            ),
            (
                "autoscale:\n  min_replicas: 9\n  max_replicas: 8\n",
                "autoscale.min_replicas",
            ),
            ("autoscale:\n  min_replicas: 0\n", "autoscale.min_replicas"),
            (
                "autoscale:\n  slo: {ttft_p90: 2s, itl_p99: 0s, pod: {step_base_ms: 20, prefill_ms_per_token: 0.1, decode_ms_per_seq: 0.1, kv_cache_tokens: 30000}}\n",
                "autoscale.slo.itl_p99",
            ),
            (
                "autoscale:\n  slo: {ttft_p90: 2s, itl_p99: 80ms, pod: {step_base_ms: 20, prefill_ms_per_token: -1, decode_ms_per_seq: 0.1, kv_cache_tokens: 30000}}\n",
                "autoscale.slo.pod.prefill_ms_per_token",
            ),
            (
                "autoscale:\n  slo: {ttft_p90: 2s, itl_p99: 80ms, window: 5s, pod: {step_base_ms: 20, prefill_ms_per_token: 0.1, decode_ms_per_seq: 0.1, kv_cache_tokens: 30000}}\n",
                "autoscale.slo.window",
            ),
            (
                "autoscale:\n  slo: {ttft_p90: 2s, itl_p99: 80ms, pod: {step_base_ms: 20, prefill_ms_per_token: 0.1, decode_ms_per_seq: 0.1, kv_cache_tokens: 0}}\n",
                "autoscale.slo.pod.kv_cache_tokens",
            ),
            (
                "autoscale:\n  slo: {ttft_p90: 2s, ttft_p99: 3s, itl_p99: 80ms, pod: {step_base_ms: 20, prefill_ms_per_token: 0.1, decode_ms_per_seq: 0.1, kv_cache_tokens: 30000}}\n",
                "one TTFT target",
            ),
            (
                "autoscale:\n  slo: {itl_p99: 80ms, pod: {step_base_ms: 20, prefill_ms_per_token: 0.1, decode_ms_per_seq: 0.1, kv_cache_tokens: 30000}}\n",
                "one TTFT target",
            ),
            (
                "autoscale:\n  slo: {ttft_p99: 0s, itl_p99: 80ms, pod: {step_base_ms: 20, prefill_ms_per_token: 0.1, decode_ms_per_seq: 0.1, kv_cache_tokens: 30000}}\n",
                "autoscale.slo.ttft_p99",
            ),
            (
                "autoscale:\n  slo: {ttft_p90: 2s, itl_p99: 80ms, headroom: 0.8, pod: {step_base_ms: 20, prefill_ms_per_token: 0.1, decode_ms_per_seq: 0.1, kv_cache_tokens: 30000}}\n",
                "autoscale.slo.headroom",
            ),
            (
                "autoscale:\n  slo: {ttft_p90: 2s, itl_p99: 80ms, headroom: .nan, pod: {step_base_ms: 20, prefill_ms_per_token: 0.1, decode_ms_per_seq: 0.1, kv_cache_tokens: 30000}}\n",
                "autoscale.slo.headroom",
            ),
        ] {
            let e = from_yaml_str(yaml, "proxy.yaml").unwrap_err().to_string();
            assert!(e.contains(field), "{yaml}: {e}");
        }
    }
}
