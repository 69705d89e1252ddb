//! The sidecar's own Prometheus metrics, as the proxy observed them: requests
//! by route and status, in flight, upstream latency to the response head, and on
//! streams the time to first token and the gaps between chunks.
//!
//! The families are grouped by who counts in them ([`ClientMetrics`],
//! [`RequestMetrics`], [`UpstreamMetrics`], [`OutlierMetrics`]), so that each
//! request stage's handle borrows its group alone.
//!
//! Label values come from closed sets ([`Route`], HTTP status codes), so the
//! number of series is bounded. The per-route series every request touches
//! are resolved once and kept ([`PerRoute`], `series.rs`): a family lookup
//! takes a lock shared by every worker thread and hashes the labels.

use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

mod series;

use series::PerRoute;
pub use series::StaticSeries;

/// Which part of the API a request used; the metric label and the classify key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    Completions,
    ChatCompletions,
    /// `/v1/responses`, routed as chat is.
    Responses,
    Embeddings,
    Models,
    /// Any other path: passed through untouched.
    Other,
}

impl EncodeLabelValue for Route {
    fn encode(&self, enc: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        use std::fmt::Write;
        enc.write_str(match self {
            Self::Completions => "completions",
            Self::ChatCompletions => "chat_completions",
            Self::Responses => "responses",
            Self::Embeddings => "embeddings",
            Self::Models => "models",
            Self::Other => "other",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StatusLabels {
    route: Route,
    status: u16,
}

/// Why a listener cut a client before answering it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// The request head did not arrive within `timeouts.request_head`
    /// (trickled headers, or an idle keep-alive connection past it).
    HeaderTimeout,
    /// The request head was larger than the listener accepts (HTTP/1.1: 431).
    HeaderTooLarge,
    /// The request body did not arrive within `timeouts.request_body` (408).
    BodyTimeout,
    /// The TLS handshake failed or timed out.
    TlsHandshake,
}

impl RejectReason {
    const ALL: [RejectReason; 4] = [
        Self::HeaderTimeout,
        Self::HeaderTooLarge,
        Self::BodyTimeout,
        Self::TlsHandshake,
    ];
}

impl EncodeLabelValue for RejectReason {
    fn encode(&self, enc: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        use std::fmt::Write;
        enc.write_str(match self {
            Self::HeaderTimeout => "header_timeout",
            Self::HeaderTooLarge => "header_too_large",
            Self::BodyTimeout => "body_timeout",
            Self::TlsHandshake => "tls_handshake",
        })
    }
}

/// Which listener cut the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Listener {
    Client,
    Mesh,
}

impl EncodeLabelValue for Listener {
    fn encode(&self, enc: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        use std::fmt::Write;
        enc.write_str(match self {
            Self::Client => "client",
            Self::Mesh => "mesh",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ThreadLabels {
    thread: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RejectLabels {
    listener: Listener,
    reason: RejectReason,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RouteLabels {
    route: Route,
}

impl Route {
    const COUNT: usize = 6;

    fn index(self) -> usize {
        match self {
            Self::Completions => 0,
            Self::ChatCompletions => 1,
            Self::Embeddings => 2,
            Self::Models => 3,
            Self::Other => 4,
            Self::Responses => 5,
        }
    }
}

/// The request path's families, and the registry `/metrics` encodes. Each
/// subsystem owns its own families and registers them in the same
/// registry ([`registry`]) before this is built: routing's in [`Routing`],
/// the prefix state's in [`PrefixState`], the mesh's in [`Mesh`], P/D's and
/// the autoscaling hook's in `App`. Cheap to share behind an `Arc`.
///
/// The families are grouped by who counts in them, so that each stage's
/// handle (`path/handles.rs`) borrows its group alone: classify
/// [`ClientMetrics`], observe [`RequestMetrics`], the upstream calls (and
/// so execute) [`UpstreamMetrics`], the accounting stage [`OutlierMetrics`].
///
/// [`Routing`]: crate::routing::Routing
/// [`PrefixState`]: crate::prefix::PrefixState
/// [`Mesh`]: crate::mesh::Mesh
pub struct Metrics {
    registry: Registry,
    /// Counted by the listeners and the classify stage.
    pub clients: ClientMetrics,
    /// Counted at the request path's entry (in flight) and by the observe stage.
    pub requests: RequestMetrics,
    /// Counted by the upstream calls and the relays of their bodies (each
    /// relayed body holds a reference).
    pub upstream: Arc<UpstreamMetrics>,
    /// Counted by the accounting stage, and set at each scrape.
    pub outliers: OutlierMetrics,
    /// 1 while the local engine answers its health check (set at each scrape).
    pub engine_ready: Gauge,
}

/// What the clients did on the way in: connections accepted, clients cut,
/// request body bytes.
pub struct ClientMetrics {
    /// Client connections accepted, by serving thread.
    connections: Family<ThreadLabels, Counter>,
    /// Connections or requests cut for a slow or oversize client.
    rejected: Family<RejectLabels, Counter>,
    bytes_in: PerRoute<Counter<u64, AtomicU64>>,
}

/// Requests answered, by route and status, and those still in flight.
pub struct RequestMetrics {
    requests: Family<StatusLabels, Counter>,
    /// `requests{status="200"}` per route, the series nearly every request counts.
    requests_ok: [OnceLock<Counter>; Route::COUNT],
    in_flight: Gauge<i64, AtomicI64>,
}

/// The upstream calls: latency to the response head, targets that refused,
/// and what the relay sees as a body flows to the client (time to first
/// token and the gaps between chunks on streams, bytes).
pub struct UpstreamMetrics {
    latency: PerRoute<Histogram>,
    ttft: PerRoute<Histogram>,
    itl: PerRoute<Histogram>,
    bytes_out: PerRoute<Counter<u64, AtomicU64>>,
    /// Targets that refused a request before any byte was sent.
    fallbacks: Counter,
    /// Streams whose upstream failed after bytes reached the client, by
    /// what became of them (`request/migrate/`).
    migrations: Family<OutcomeLabels, Counter>,
    /// Tokens already generated when a stream migrated, carried to the next pod.
    migrated_tokens: Counter,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

/// Pods ejected as outliers (`fleet/outlier.rs`).
pub struct OutlierMetrics {
    ejections: Counter,
    /// Pods ejected now (set at each scrape).
    pub ejected_pods: Gauge,
}

/// Decrements the in-flight gauge when the response body is finished or dropped.
pub struct InFlight {
    gauge: Gauge<i64, AtomicI64>,
    /// The fleet's count of requests towards the pod serving this one, held
    /// exactly as long (until the response body ends).
    target: Option<CountGuard>,
    /// The prompt tokens it has to prefill there, counted on that pod until
    /// its first byte comes back.
    prefill: Option<AmountGuard>,
}

/// Holds `amount` of a counter, already added, until dropped: a request's
/// prompt tokens waiting to be prefilled on a pod.
#[derive(Debug)]
pub struct AmountGuard(Arc<AtomicU64>, u64);

impl AmountGuard {
    /// Adds `amount` to `counter` and holds it.
    pub fn new(counter: Arc<AtomicU64>, amount: u64) -> Self {
        counter.fetch_add(amount, Ordering::Relaxed);
        Self(counter, amount)
    }
}

impl Drop for AmountGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::Relaxed);
    }
}

/// Counts one request towards a pod (and, for a request a peer forwarded
/// here, among those received) until dropped: the fleet's in-flight counts.
#[derive(Debug)]
pub struct CountGuard(Arc<AtomicU32>, Option<Arc<AtomicU32>>);

impl CountGuard {
    /// Holds one count of `counter`, already incremented.
    pub fn new(counter: Arc<AtomicU32>) -> Self {
        Self(counter, None)
    }

    /// Holds one count of `also` too, already incremented.
    pub fn and(mut self, also: Arc<AtomicU32>) -> Self {
        self.1 = Some(also);
        self
    }
}

impl Drop for CountGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        if let Some(r) = &self.1 {
            r.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

fn latency_histogram() -> Histogram {
    // 0.5 ms .. ~65 s, doubling: covers a fast fake engine and a long prefill.
    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
}

/// The registry `/metrics` encodes: every family's name starts `kvmesh_`.
/// The subsystems register theirs in it, then [`Metrics::with_registry`]
/// adds the request families and keeps it.
pub fn registry() -> Registry {
    Registry::with_prefix("kvmesh")
}

impl Metrics {
    /// The request families alone, in a registry of their own.
    pub fn new() -> Self {
        Self::with_registry(registry())
    }

    /// The request families, registered in `registry` beside the
    /// subsystems' families already there.
    pub fn with_registry(mut registry: Registry) -> Self {
        let clients = ClientMetrics::new();
        let requests = RequestMetrics::new();
        let upstream = UpstreamMetrics::new();
        let outliers = OutlierMetrics::new();
        let engine_ready = Gauge::default();
        // One list across the groups: the exposition lists the families in
        // the order they are registered here.
        registry.register(
            "requests",
            "Requests answered by the sidecar, by route and HTTP status",
            requests.requests.clone(),
        );
        registry.register(
            "requests_in_flight",
            "Requests whose response has not finished",
            requests.in_flight.clone(),
        );
        registry.register_with_unit(
            "upstream_latency",
            "Time from sending a request upstream to its response head",
            Unit::Seconds,
            upstream.latency.family.clone(),
        );
        registry.register_with_unit(
            "time_to_first_token",
            "Streams: time from the request's arrival to the first body chunk sent to the client",
            Unit::Seconds,
            upstream.ttft.family.clone(),
        );
        registry.register_with_unit(
            "inter_token_latency",
            "Streams: time between consecutive body chunks sent to the client",
            Unit::Seconds,
            upstream.itl.family.clone(),
        );
        registry.register(
            "outlier_ejections",
            "Pods ejected after consecutive failed calls (refused, broken before the head, 5xx); the scheduler skips an ejected pod for a period growing with each ejection",
            outliers.ejections.clone(),
        );
        registry.register(
            "outlier_ejected_pods",
            "Pods ejected as outliers now, as this sidecar judges its own calls",
            outliers.ejected_pods.clone(),
        );
        registry.register(
            "fallbacks",
            "Targets that refused a request before any byte was sent (the plan's next fallback pod, if any, takes it)",
            upstream.fallbacks.clone(),
        );
        registry.register(
            "migrations",
            "Streams whose upstream failed after bytes reached the client, by outcome: migrated (continued on another pod), kv_resent (a P/D decode stream that broke before its first token, its decode leg sent again to another decode pod), or why not (limit, deadline, unsupported, no_target, continuation_failed, ...); retried_unreachable: a call with no response head whose pod was cut off (its mesh stream silent), its request retried on another pod",
            upstream.migrations.clone(),
        );
        registry.register(
            "migrated_tokens",
            "Tokens already generated when a stream migrated, carried to the next pod in its continuation",
            upstream.migrated_tokens.clone(),
        );
        registry.register(
            "engine_ready",
            "1 while the local engine answers its health check (what /ready says), else 0",
            engine_ready.clone(),
        );
        registry.register_with_unit(
            "request",
            "Request body bytes received from clients",
            Unit::Bytes,
            clients.bytes_in.family.clone(),
        );
        registry.register_with_unit(
            "response",
            "Response body bytes sent to clients",
            Unit::Bytes,
            upstream.bytes_out.family.clone(),
        );
        registry.register(
            "client_connections",
            "Client connections accepted, by serving thread (runtime.worker_threads; 0 is the first): how evenly the kernel spreads them",
            clients.connections.clone(),
        );
        registry.register(
            "client_connections_rejected",
            "Clients cut before an answer, by listener and reason (slow or oversize request heads, slow bodies, failed TLS handshakes)",
            clients.rejected.clone(),
        );
        Self {
            registry,
            clients,
            requests,
            upstream: Arc::new(upstream),
            outliers,
            engine_ready,
        }
    }

    /// Prometheus text format (0.0.4).
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(8192);
        // Writing into a String cannot fail; an Err would only drop the tail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn route_counters() -> PerRoute<Counter<u64, AtomicU64>> {
    PerRoute::new(Family::new_with_constructor(Counter::default))
}

fn route_histograms() -> PerRoute<Histogram> {
    PerRoute::new(Family::new_with_constructor(latency_histogram))
}

impl ClientMetrics {
    /// The families, registered nowhere yet.
    fn new() -> Self {
        let rejected = Family::<RejectLabels, Counter>::default();
        for listener in [Listener::Client, Listener::Mesh] {
            for reason in RejectReason::ALL {
                // Closed sets start at 0, so a rate() sees the first one.
                let _ = rejected.get_or_create(&RejectLabels { listener, reason });
            }
        }
        Self {
            connections: Family::default(),
            rejected,
            bytes_in: route_counters(),
        }
    }

    /// The counter of client connections serving thread `thread` accepted,
    /// shown at 0 from the call on.
    pub fn connections(&self, thread: u16) -> Counter {
        self.connections
            .get_or_create(&ThreadLabels { thread })
            .clone()
    }

    /// A listener cut a client (slow or oversize request, failed handshake).
    pub fn rejected(&self, listener: Listener, reason: RejectReason) {
        self.rejected
            .get_or_create(&RejectLabels { listener, reason })
            .inc();
    }

    pub fn bytes_in(&self, route: Route, n: u64) {
        self.bytes_in.get(route).inc_by(n);
    }
}

impl RequestMetrics {
    /// The families, registered nowhere yet.
    fn new() -> Self {
        Self {
            requests: Family::default(),
            requests_ok: Default::default(),
            in_flight: Gauge::default(),
        }
    }

    /// Counts a request in flight until the returned guard is dropped.
    pub fn in_flight(&self) -> InFlight {
        self.in_flight.inc();
        InFlight {
            gauge: self.in_flight.clone(),
            target: None,
            prefill: None,
        }
    }

    /// A request was answered with `status`.
    pub fn done(&self, route: Route, status: u16) {
        let labels = || StatusLabels { route, status };
        if status == 200 {
            self.requests_ok[route.index()]
                .get_or_init(|| self.requests.get_or_create(&labels()).clone())
                .inc();
        } else {
            self.requests.get_or_create(&labels()).inc();
        }
    }
}

impl UpstreamMetrics {
    /// The families, registered nowhere yet.
    pub(crate) fn new() -> Self {
        Self {
            latency: route_histograms(),
            ttft: route_histograms(),
            itl: route_histograms(),
            bytes_out: route_counters(),
            fallbacks: Counter::default(),
            migrations: Family::default(),
            migrated_tokens: Counter::default(),
        }
    }

    /// A response head came `secs` after its request was sent upstream.
    pub fn latency(&self, route: Route, secs: f64) {
        self.latency.get(route).observe(secs);
    }

    pub fn ttft(&self, route: Route, secs: f64) {
        self.ttft.get(route).observe(secs);
    }

    pub fn itl(&self, route: Route, secs: f64) {
        self.itl.get(route).observe(secs);
    }

    pub fn bytes_out(&self, route: Route, n: u64) {
        self.bytes_out.get(route).inc_by(n);
    }

    /// A target refused the request before any byte was sent.
    pub fn fallback(&self) {
        self.fallbacks.inc();
    }

    /// A stream's upstream failed after bytes reached the client: `outcome`
    /// is `migrated` (it went on elsewhere) or why it could not.
    pub fn migration(&self, outcome: &'static str) {
        self.migrations
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    /// `n` tokens generated before a migration were carried to the next pod.
    pub fn migrated_tokens(&self, n: u64) {
        self.migrated_tokens.inc_by(n);
    }

    /// The migrations counted with `outcome`, and the tokens carried (tests).
    #[cfg(test)]
    pub(crate) fn migration_counts(&self, outcome: &'static str) -> (u64, u64) {
        let n = self
            .migrations
            .get_or_create(&OutcomeLabels { outcome })
            .get();
        (n, self.migrated_tokens.get())
    }
}

impl OutlierMetrics {
    /// The families, registered nowhere yet.
    fn new() -> Self {
        Self {
            ejections: Counter::default(),
            ejected_pods: Gauge::default(),
        }
    }

    /// A pod was ejected as an outlier.
    pub fn ejected(&self) {
        self.ejections.inc();
    }
}

impl InFlight {
    /// Counts the request towards the pod now serving it (replacing an
    /// earlier target's count after a fallback).
    pub fn hold_target(&mut self, guard: Option<CountGuard>) {
        self.target = guard;
        self.prefill = None;
    }

    /// Counts the request's prompt tokens still to prefill on the pod now
    /// serving it (after [`InFlight::hold_target`]).
    pub fn hold_prefill(&mut self, guard: Option<AmountGuard>) {
        self.prefill = guard;
    }

    /// The response's first byte came back: its prompt is prefilled.
    pub fn first_byte(&mut self) {
        self.prefill = None;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn kept_series_count_in_the_exposition() {
        let m = Metrics::new();
        assert!(!m.encode().contains("kvmesh_request_bytes_total{"));
        m.clients.bytes_in(Route::Completions, 5);
        m.clients.bytes_in(Route::Completions, 7);
        m.requests.done(Route::Completions, 200);
        m.requests.done(Route::Completions, 200);
        m.requests.done(Route::Completions, 404);
        m.upstream.latency(Route::ChatCompletions, 0.001);
        let text = m.encode();
        assert!(
            text.contains(r#"kvmesh_request_bytes_total{route="completions"} 12"#),
            "{text}"
        );
        assert!(text.contains(r#"kvmesh_requests_total{route="completions",status="200"} 2"#));
        assert!(text.contains(r#"kvmesh_requests_total{route="completions",status="404"} 1"#));
        assert!(
            text.contains(r#"kvmesh_upstream_latency_seconds_count{route="chat_completions"} 1"#)
        );
        // Only the series used appear, as with plain family lookups.
        assert!(!text.contains(r#"route="embeddings""#));
    }
}
