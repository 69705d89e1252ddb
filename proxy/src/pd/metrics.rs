//! P/D metrics: requests by connector and outcome (so the fraction served
//! aggregated after a prefill failure is `outcome="fallback_aggregated"` over
//! the total), prefill retries, and each leg's time to its response head.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

/// How a disaggregated request ended up being served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Prefill handed its KV cache to decode.
    Disaggregated,
    /// Prefill answered without transfer parameters: decode recomputed.
    Recompute,
    /// Prefill failed for good: the decode pod served the request whole.
    FallbackAggregated,
    /// The decode pod failed before any byte reached the client (it refused the connection, the
    /// connection broke before a response head, or it answered 5xx), and its leg could not be
    /// sent again (another connector, no parameters, no other decode pod, the re-send limit):
    /// the request went on to the plan's next fallback pod, served whole (the prompt recomputed
    /// there).
    DecodeRefused,
    /// The decode pod failed before any byte, and the decode leg, sent again with the same
    /// `kv_transfer_params` to another decode pod while the prefill pod's lease held, was served
    /// there: the prompt was not computed again.
    DecodeResent,
    /// The decode pod failed before any byte after the prefill pod's lease
    /// (`migration.pd_kv_lease`) had passed: served whole on the next pod.
    DecodeLeaseExpired,
    /// A re-sent decode leg was answered 500, as vLLM answers one whose KV it could not load:
    /// served whole on the next pod.
    DecodeKvGone,
    /// The request failed.
    Failed,
}

impl Outcome {
    /// How a request whose decode leg failed with `e` ended: refused (the execute stage tries the
    /// next pod) or failed.
    pub fn of_decode_error(e: &crate::error::ProxyError) -> Self {
        if crate::error::next_target_may_serve(e) {
            Self::DecodeRefused
        } else {
            Self::Failed
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Disaggregated => "disaggregated",
            Self::Recompute => "recompute",
            Self::FallbackAggregated => "fallback_aggregated",
            Self::DecodeRefused => "decode_refused",
            Self::DecodeResent => "decode_resent",
            Self::DecodeLeaseExpired => "decode_lease_expired",
            Self::DecodeKvGone => "decode_kv_gone",
            Self::Failed => "failed",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RequestLabels {
    connector: &'static str,
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ConnectorLabels {
    connector: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct LegLabels {
    leg: &'static str,
}

/// Handles to the P/D metrics.
pub struct PdMetrics {
    requests: Family<RequestLabels, Counter>,
    prefill_retries: Counter,
    abandoned: Family<ConnectorLabels, Counter>,
    leg_latency: Family<LegLabels, Histogram, fn() -> Histogram>,
    /// Split requests and, of them, those not served disaggregated, by
    /// recompute or by a re-sent decode leg (fallback, refused, failed), for
    /// `stat`.
    splits: AtomicU64,
    failures: AtomicU64,
}

/// 1 ms .. ~33 s, doubling: a prefill of a long prompt takes seconds.
fn leg_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

impl PdMetrics {
    /// Creates the metrics and registers them in `r` (prefix `kvmesh`).
    pub fn register(r: &mut Registry) -> Self {
        let m = Self {
            requests: Family::default(),
            prefill_retries: Counter::default(),
            abandoned: Family::default(),
            leg_latency: Family::new_with_constructor(leg_histogram as fn() -> Histogram),
            splits: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        };
        r.register(
            "pd_requests",
            "Disaggregated requests by connector and outcome (disaggregated, recompute, fallback_aggregated, decode_refused, decode_resent, decode_lease_expired, decode_kv_gone, failed)",
            m.requests.clone(),
        );
        r.register(
            "pd_prefill_retries",
            "Prefill legs sent again after a connect error or a retryable status",
            m.prefill_retries.clone(),
        );
        r.register(
            "pd_abandoned_transfers",
            "Prefill KV handed to a decode leg that failed before serving it: the prefill engine holds those blocks until their hold expires (vLLM 0.32: the NIXL lease, kv_lease_duration; earlier: VLLM_NIXL_ABORT_REQUEST_TIMEOUT)",
            m.abandoned.clone(),
        );
        r.register_with_unit(
            "pd_leg_latency",
            "Time from sending a P/D leg to its response head (prefill: its whole response)",
            Unit::Seconds,
            m.leg_latency.clone(),
        );
        // Every outcome and leg starts at 0, so the failure ratio and the
        // alerts on it exist before the first split.
        for connector in ["nixl", "sglang", "kvagent"] {
            let _ = m.abandoned.get_or_create(&ConnectorLabels { connector });
            for outcome in [
                Outcome::Disaggregated,
                Outcome::Recompute,
                Outcome::FallbackAggregated,
                Outcome::DecodeRefused,
                Outcome::DecodeResent,
                Outcome::DecodeLeaseExpired,
                Outcome::DecodeKvGone,
                Outcome::Failed,
            ] {
                let _ = m.requests.get_or_create(&RequestLabels {
                    connector,
                    outcome: outcome.label(),
                });
            }
        }
        for leg in ["prefill", "decode"] {
            let _ = m.leg_latency.get_or_create(&LegLabels { leg });
        }
        m
    }

    pub fn outcome(&self, connector: &'static str, outcome: Outcome) {
        crate::access::pd_outcome(outcome.label());
        self.splits.fetch_add(1, Ordering::Relaxed);
        if !matches!(
            outcome,
            Outcome::Disaggregated | Outcome::Recompute | Outcome::DecodeResent
        ) {
            self.failures.fetch_add(1, Ordering::Relaxed);
        }
        self.requests
            .get_or_create(&RequestLabels {
                connector,
                outcome: outcome.label(),
            })
            .inc();
    }

    /// P/D outcomes counted so far, and of them the failures (see the fields).
    pub fn totals(&self) -> (u64, u64) {
        (
            self.splits.load(Ordering::Relaxed),
            self.failures.load(Ordering::Relaxed),
        )
    }

    /// A decode leg given prefill's transfer parameters failed before it served them.
    pub fn abandoned(&self, connector: &'static str) {
        self.abandoned
            .get_or_create(&ConnectorLabels { connector })
            .inc();
    }

    pub fn prefill_retry(&self) {
        self.prefill_retries.inc();
    }

    pub fn leg(&self, leg: &'static str, secs: f64) {
        self.leg_latency
            .get_or_create(&LegLabels { leg })
            .observe(secs);
    }
}
