//! The Valkey index's metrics: lookups by outcome and their latency, writes
//! of the pod's blocks, registrations and rewrites, and whether Valkey is
//! reachable. (The whole routing decision's latency, lookup included, is
//! the routing stage's: `kvmesh_routing_decision_latency_seconds`.) Every label value is a
//! `&'static str` from a closed set.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use crate::metrics::StaticSeries;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// Handles to the index metrics.
pub struct IndexMetrics {
    lookups: StaticSeries<1, OutcomeLabels, Counter>,
    lookup_latency: Histogram,
    candidates: Counter<u64, AtomicU64>,
    writes: StaticSeries<1, OutcomeLabels, Counter>,
    blocks_written: Counter<u64, AtomicU64>,
    pending: Gauge,
    registrations: StaticSeries<1, ReasonLabels, Counter>,
    rewritten: Counter<u64, AtomicU64>,
    up: Gauge,
    guesses: StaticSeries<1, OutcomeLabels, Counter>,
}

/// 10 µs .. ~1.3 s in steps of 1.25x: fine enough to read a p99 of a
/// fraction of a millisecond off the buckets.
fn fine_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.000_01, 1.25, 53))
}

impl std::fmt::Debug for IndexMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexMetrics").finish_non_exhaustive()
    }
}

/// Metrics registered nowhere: for writers and lookups run outside a
/// sidecar (`kvmesh bench scale`'s emulated pods).
impl Default for IndexMetrics {
    fn default() -> Self {
        Self::register(&mut Registry::default())
    }
}

impl IndexMetrics {
    /// Creates the metrics and registers them in `r` (prefix `kvmesh`).
    pub fn register(r: &mut Registry) -> Self {
        let m = Self {
            lookups: StaticSeries::new(|[outcome]| OutcomeLabels { outcome }),
            lookup_latency: fine_buckets(),
            candidates: Counter::default(),
            writes: StaticSeries::new(|[outcome]| OutcomeLabels { outcome }),
            blocks_written: Counter::default(),
            pending: Gauge::default(),
            registrations: StaticSeries::new(|[reason]| ReasonLabels { reason }),
            rewritten: Counter::default(),
            up: Gauge::default(),
            guesses: StaticSeries::new(|[outcome]| OutcomeLabels { outcome }),
        };
        r.register(
            "index_lookups",
            "Index lookups by outcome (ok, cached, partial; timeout, down, error, bad_reply: routed on what the sidecar knows)",
            m.lookups.family(),
        );
        r.register_with_unit(
            "index_lookup_latency",
            "Time of one index lookup (every stripe, in parallel)",
            Unit::Seconds,
            m.lookup_latency.clone(),
        );
        r.register(
            "index_candidates",
            "Pods the index lookups returned, summed (divide by the lookups)",
            m.candidates.clone(),
        );
        r.register(
            "index_writes",
            "Writes of the pod's block changes to the index, by outcome",
            m.writes.family(),
        );
        r.register(
            "index_blocks_written",
            "Block changes written to the index",
            m.blocks_written.clone(),
        );
        r.register(
            "index_pending_blocks",
            "Block changes waiting to be written",
            m.pending.clone(),
        );
        r.register(
            "index_registrations",
            "Registrations of this pod in the index, by reason (start, lease_lost, cleared, lagged, overflow)",
            m.registrations.family(),
        );
        r.register(
            "index_rewritten_blocks",
            "Blocks rewritten whole (after a registration, or the periodic refresh)",
            m.rewritten.clone(),
        );
        r.register(
            "index_guesses",
            "Approximate mode: block keys of routing decisions written to the index as guesses, \
             by outcome (written; skipped: written for that pod lately; unknown_pod: no lookup \
             named the pod's member yet; fenced; dropped: the writer fell behind; error)",
            m.guesses.family(),
        );
        r.register(
            "index_up",
            "1 while the sidecar has a connection to the index's Valkey",
            m.up.clone(),
        );
        m
    }

    pub fn lookup(&self, outcome: &'static str, secs: f64, candidates: usize) {
        self.lookups.get([outcome]).inc();
        self.lookup_latency.observe(secs);
        self.candidates.inc_by(candidates as u64);
    }

    /// Lookups answered by Valkey or the cache, so far.
    pub fn lookups_answered(&self) -> u64 {
        ["ok", "cached", "partial"]
            .into_iter()
            .map(|o| self.lookups.get([o]).get())
            .sum()
    }

    /// Lookups that failed so far (the request was routed on what the
    /// sidecar knew).
    pub fn lookups_failed(&self) -> u64 {
        ["timeout", "down", "error", "bad_reply"]
            .into_iter()
            .map(|o| self.lookups.get([o]).get())
            .sum()
    }

    /// Registrations so far (every reason).
    pub fn registrations_total(&self) -> u64 {
        ["start", "lease_lost", "cleared", "lagged", "overflow"]
            .into_iter()
            .map(|r| self.registrations.get([r]).get())
            .sum()
    }

    /// Block changes written so far.
    pub fn blocks_written(&self) -> u64 {
        self.blocks_written.get()
    }

    pub fn write(&self, outcome: &'static str, blocks: usize) {
        self.writes.get([outcome]).inc();
        if outcome == "ok" {
            self.blocks_written.inc_by(blocks as u64);
        }
    }

    pub fn pending(&self, n: usize) {
        self.pending.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub fn registered(&self, reason: &'static str) {
        self.registrations.get([reason]).inc();
    }

    pub fn rewritten(&self, n: usize) {
        self.rewritten.inc_by(n as u64);
    }

    /// `keys` block keys of guesses ended with `outcome`.
    pub fn guesses(&self, outcome: &'static str, keys: usize) {
        self.guesses.get([outcome]).inc_by(keys as u64);
    }

    /// Guess keys written so far.
    pub fn guesses_written(&self) -> u64 {
        self.guesses.get(["written"]).get()
    }

    pub fn up(&self, up: bool) {
        self.up.set(i64::from(up));
    }
}
