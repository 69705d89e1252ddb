//! The prefix stage's and the KV event feed's metrics, held by
//! [`super::PrefixState`] and registered into the sidecar's one registry
//! (prefix `kvmesh`) when it is built. Label values come from closed
//! sets of `&'static str`, so the number of series is bounded.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use crate::metrics::StaticSeries;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// Handles to the prefix and KV-event metrics.
pub struct PrefixMetrics {
    tokenize: StaticSeries<1, OutcomeLabels, Counter>,
    tokenize_latency: Histogram,
    capped: Counter,
    inexact: Family<ReasonLabels, Counter>,
    cache_reused: Gauge,
    cache_tokenized: Gauge,
    events: Family<KindLabels, Counter>,
    batches: Counter,
    gaps: Counter,
    replays: Family<OutcomeLabels, Counter>,
    decode_errors: Counter,
    restarts: Counter,
    silence_checks: Counter,
    silent_streams: Counter,
    connected: Gauge,
    index_blocks: Gauge,
    index_keys: Gauge,
    index_bytes: Gauge,
}

impl PrefixMetrics {
    /// Creates the metrics and registers them in `r`.
    pub fn register(r: &mut Registry) -> Self {
        let m = Self {
            tokenize: StaticSeries::new(|[outcome]| OutcomeLabels { outcome }),
            // 1 µs .. ~0.5 s, doubling.
            tokenize_latency: Histogram::new(exponential_buckets(0.000_001, 2.0, 20)),
            capped: Counter::default(),
            inexact: Family::default(),
            cache_reused: Gauge::default(),
            cache_tokenized: Gauge::default(),
            events: Family::default(),
            batches: Counter::default(),
            gaps: Counter::default(),
            replays: Family::default(),
            decode_errors: Counter::default(),
            restarts: Counter::default(),
            silence_checks: Counter::default(),
            silent_streams: Counter::default(),
            connected: Gauge::default(),
            index_blocks: Gauge::default(),
            index_keys: Gauge::default(),
            index_bytes: Gauge::default(),
        };
        r.register(
            "prefix_tokenize",
            "Inference prompts turned into block keys, by outcome (ok, capped, error, none)",
            m.tokenize.family(),
        );
        r.register_with_unit(
            "prefix_tokenize_latency",
            "Time to tokenize and hash one prompt (including an engine /tokenize call)",
            Unit::Seconds,
            m.tokenize_latency.clone(),
        );
        r.register(
            "prefix_tokenize_capped",
            "Prompts longer than prefix.max_tokenize_bytes, tokenized only up to it",
            m.capped.clone(),
        );
        // Every reason is listed from the start, at 0.
        for reason in kvmesh_filters::prefix::tokenize::Inexact::ALL {
            drop(m.inexact.get_or_create(&ReasonLabels {
                reason: reason.as_str(),
            }));
        }
        r.register(
            "prefix_inexact_keys",
            "Inference requests a precise tokenizer keyed on their text alone, since the engine keys their shape differently, by reason (multimodal, responses_item, previous_response, unsupported_field, template_error)",
            m.inexact.clone(),
        );
        r.register(
            "prefix_token_cache_reused_bytes",
            "Prompt text bytes whose token ids came from the token prefix cache",
            m.cache_reused.clone(),
        );
        r.register(
            "prefix_token_cache_tokenized_bytes",
            "Prompt text bytes actually tokenized",
            m.cache_tokenized.clone(),
        );
        r.register(
            "kv_events",
            "KV cache events applied from the local engine, by kind (stored, removed, cleared)",
            m.events.clone(),
        );
        r.register(
            "kv_event_batches",
            "KV event batches applied from the local engine (live and replayed)",
            m.batches.clone(),
        );
        r.register(
            "kv_event_gaps",
            "Missing sequence numbers detected on the local KV event stream",
            m.gaps.clone(),
        );
        r.register(
            "kv_event_replays",
            "Replays asked of the engine's replay socket, by outcome (ok, incomplete, failed)",
            m.replays.clone(),
        );
        r.register(
            "kv_event_decode_errors",
            "KV event messages that could not be decoded (skipped)",
            m.decode_errors.clone(),
        );
        r.register(
            "kv_event_restarts",
            "Engine restarts detected (sequence going backwards): the pod was cleared and resynced",
            m.restarts.clone(),
        );
        r.register(
            "kv_event_silence_checks",
            "Replays asked after kv_events.silence_check without a live batch",
            m.silence_checks.clone(),
        );
        r.register(
            "kv_event_silent_streams",
            "Times the live KV event stream stayed silent for kv_events.silence_check while the replay socket held newer batches (applied; the socket was reopened)",
            m.silent_streams.clone(),
        );
        r.register(
            "kv_events_connected",
            "1 while the KV event socket is connected or bound",
            m.connected.clone(),
        );
        r.register(
            "prefix_index_blocks",
            "(block, pod, medium) entries in the prefix index, all pods",
            m.index_blocks.clone(),
        );
        r.register(
            "prefix_index_keys",
            "Distinct block keys in the prefix index",
            m.index_keys.clone(),
        );
        r.register_with_unit(
            "prefix_index_memory",
            "Heap bytes of the prefix index",
            Unit::Bytes,
            m.index_bytes.clone(),
        );
        m
    }

    pub fn tokenized(&self, outcome: &'static str, secs: f64) {
        self.tokenize.get([outcome]).inc();
        self.tokenize_latency.observe(secs);
        if outcome == "capped" {
            self.capped.inc();
        }
    }

    /// A request keyed on its text alone, for `reason` (an
    /// `Inexact::as_str`, a closed set).
    pub fn inexact(&self, reason: &'static str) {
        self.inexact.get_or_create(&ReasonLabels { reason }).inc();
    }

    pub fn token_cache(&self, reused: u64, tokenized: u64) {
        self.cache_reused
            .set(i64::try_from(reused).unwrap_or(i64::MAX));
        self.cache_tokenized
            .set(i64::try_from(tokenized).unwrap_or(i64::MAX));
    }

    pub fn events(&self, kind: &'static str, n: usize) {
        if n > 0 {
            self.events
                .get_or_create(&KindLabels { kind })
                .inc_by(n as u64);
        }
    }

    pub fn batch(&self) {
        self.batches.inc();
    }

    pub fn gap(&self, missing: u64) {
        self.gaps.inc_by(missing);
    }

    pub fn replay(&self, outcome: &'static str) {
        self.replays.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    pub fn decode_error(&self) {
        self.decode_errors.inc();
    }

    pub fn restart(&self) {
        self.restarts.inc();
    }

    /// One silence check; `missed`: it found batches the stream had not
    /// delivered.
    pub fn silence_check(&self, missed: bool) {
        self.silence_checks.inc();
        if missed {
            self.silent_streams.inc();
        }
    }

    pub fn connected(&self, up: bool) {
        self.connected.set(i64::from(up));
    }

    pub fn index(&self, s: kvmesh_filters::prefix::index::IndexStats) {
        let g = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.index_blocks.set(g(s.entries));
        self.index_keys.set(g(s.keys));
        self.index_bytes.set(g(s.memory_bytes));
    }
}
