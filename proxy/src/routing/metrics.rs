//! The routing stage's metrics: decisions by kind and reason, the time one
//! scheduling cycle takes, filter-config reloads (good and bad) and failed
//! engine scrapes, held by [`super::Routing`] and registered into the
//! sidecar's one registry when it is built. Every label value is a `&'static str`
//! from a closed set, so the number of series is bounded.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use crate::metrics::StaticSeries;

/// Where a request was sent: `local`, `peer`, `disaggregated` or `error`.
pub type DecisionKind = &'static str;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DecisionLabels {
    decision: &'static str,
    reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ScrapeLabels {
    reason: &'static str,
}

/// Handles to the routing metrics.
pub struct RoutingMetrics {
    decisions: StaticSeries<2, DecisionLabels, Counter>,
    latency: Histogram,
    decision_latency: Histogram,
    reloads: Counter,
    reload_errors: Counter,
    scrape_errors: Family<ScrapeLabels, Counter>,
}

impl RoutingMetrics {
    /// Creates the metrics and registers them in `r` (prefix `kvmesh`).
    pub fn register(r: &mut Registry) -> Self {
        let m = Self {
            decisions: StaticSeries::new(|[decision, reason]| DecisionLabels { decision, reason }),
            // 1 µs .. ~0.5 s, doubling: a decision is tens of µs; a slow one shows.
            latency: Histogram::new(exponential_buckets(0.000_001, 2.0, 20)),
            // 10 µs .. ~1.3 s in steps of 1.25x: a p99 of a fraction of a
            // millisecond reads off the buckets within an eighth.
            decision_latency: Histogram::new(exponential_buckets(0.000_01, 1.25, 53)),
            reloads: Counter::default(),
            reload_errors: Counter::default(),
            scrape_errors: Family::default(),
        };
        r.register(
            "routing_decisions",
            "Scheduling decisions by where the request went (local, peer, disaggregated, error) and why",
            m.decisions.family(),
        );
        r.register_with_unit(
            "scheduling_latency",
            "Time of one scheduling cycle (endpoint views, filters, scorers, picker)",
            Unit::Seconds,
            m.latency.clone(),
        );
        r.register_with_unit(
            "routing_decision_latency",
            "Time of the schedule stage: the index lookup (with index.backend valkey) and the scheduling cycle",
            Unit::Seconds,
            m.decision_latency.clone(),
        );
        r.register(
            "filters_reloads",
            "Filter config files loaded after a change on disk",
            m.reloads.clone(),
        );
        r.register(
            "filters_reload_errors",
            "Changed filter config files rejected (the previous config stays active)",
            m.reload_errors.clone(),
        );
        r.register(
            "engine_scrape_errors",
            "Failed scrapes of the local engine's metrics, by reason",
            m.scrape_errors.clone(),
        );
        m
    }

    pub fn decision(&self, decision: DecisionKind, reason: &'static str) {
        self.decisions.get([decision, reason]).inc();
    }

    pub fn scheduling_latency(&self, secs: f64) {
        self.latency.observe(secs);
    }

    pub fn decision_latency(&self, secs: f64) {
        self.decision_latency.observe(secs);
    }

    pub fn reloaded(&self) {
        self.reloads.inc();
    }

    pub fn reload_failed(&self) {
        self.reload_errors.inc();
    }

    /// `reason`: `timeout`, `connect`, `status` or `parse`.
    pub fn scrape_failed(&self, reason: &'static str) {
        self.scrape_errors
            .get_or_create(&ScrapeLabels { reason })
            .inc();
    }
}
