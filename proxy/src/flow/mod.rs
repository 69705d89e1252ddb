//! Flow control: while every pod that could run a request is saturated, the
//! sidecar holds it, and sends it to the first pod that has room, first
//! come first served (llm-d's flow control, with its utilization
//! detector's thresholds; `featureGates: [flowControl]` in the filter
//! config, `kvmesh_filters::sched::config::flow`).
//!
//! Why hold rather than send: a request sent to a saturated pod waits in
//! that engine's queue, committed to it. Held in the sidecar it goes to
//! whichever pod frees first, so one queue drains on every pod (a shared
//! queue rather than one per pod), and a pod that just started takes the
//! backlog rather than only what arrives after it.
//!
//! - [`pool`]: whether the pool a plan's first leg runs in is saturated,
//!   judged when the plan is made (`crate::routing`).
//! - [`Gate`]: one line per model and pool role. A request joins it when its
//!   pool is saturated or others already wait; the line's head checks for
//!   room every [`RECHECK`] and is scheduled again once there is
//!   (`crate::path::admit`). Held requests count in the fleet per pool
//!   ([`crate::fleet::held`]), for the mesh and the autoscaling hook.
//!
//! Flow control adds no failure: a request past `maxRequests`, or held
//! `defaultRequestTTL`, is sent as it would be without it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_filters::sched::config::flow::FlowControl;
use kvmesh_filters::sched::{EndpointView, LoadSnapshot, Role, Route};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use crate::fleet::{Fleet, InFlightGuard};
use crate::request::Pool;

/// How often the head of a line looks for room while its pool is saturated.
pub const RECHECK: Duration = Duration::from_millis(5);

/// Whether a pod is saturated: `queue_depth_threshold` requests queue there
/// (its engine's `waiting`, or the mesh's requests in flight to it less its
/// engine's `running`, whichever is larger: the mesh's count is fresher
/// than a scrape), or its KV cache is `kv_cache_util_threshold` full, or
/// the mesh has sent it `prefill_tokens_threshold` prompt tokens still to
/// prefill.
pub fn saturated(cfg: &FlowControl, l: &LoadSnapshot) -> bool {
    let queued = l.waiting.max(l.in_flight.saturating_sub(l.running));
    queued >= cfg.queue_depth_threshold
        || l.kv_usage >= cfg.kv_cache_util_threshold
        || (cfg.prefill_tokens_threshold > 0 && l.prefill_tokens >= cfg.prefill_tokens_threshold)
}

/// The pool `route`'s first leg (its prefill pod when split) runs in: the
/// healthy pods of that pod's role serving `model`; saturated when every
/// one of them is. `None` when the chosen pod is not among `endpoints`.
pub fn pool(
    cfg: &FlowControl,
    route: &Route,
    model: &str,
    endpoints: &[EndpointView],
) -> Option<Pool> {
    let first = route.prefill().unwrap_or_else(|| route.primary());
    let role = endpoints.iter().find(|e| e.id == first.id)?.role;
    Some(Pool {
        role,
        saturated: pool_saturated(cfg, role, model, endpoints),
    })
}

/// Whether every healthy pod of `role` serving `model` is saturated (none
/// at all: not saturated, so nothing waits for a pool that is not there).
pub fn pool_saturated(
    cfg: &FlowControl,
    role: Role,
    model: &str,
    endpoints: &[EndpointView],
) -> bool {
    let mut members = endpoints
        .iter()
        .filter(|e| e.healthy && e.role == role && serves(e, model))
        .peekable();
    members.peek().is_some() && members.all(|e| saturated(cfg, &e.load))
}

/// An endpoint serves `model` when it lists it as a model or an adapter, or
/// lists neither (the model filter's default).
fn serves(e: &EndpointView, model: &str) -> bool {
    (e.models.is_empty() && e.lora_adapters.is_empty())
        || e.models.iter().any(|m| m == model)
        || e.lora_adapters.iter().any(|a| a == model)
}

/// Requests held by this sidecar, in one line per model and pool role.
pub struct Gate {
    /// By model and pool name: only requests that were scheduled join, so
    /// the models are those the fleet serves.
    lines: parking_lot::Mutex<HashMap<(String, &'static str), Arc<Line>>>,
    /// Held now, over every line (`maxRequests` bounds it).
    held: std::sync::atomic::AtomicU32,
    pub metrics: FlowMetrics,
}

/// One line: its head holds `turn`.
#[derive(Default)]
pub struct Line {
    turn: tokio::sync::Mutex<()>,
    /// Requests in the line (the head included).
    waiting: std::sync::atomic::AtomicU32,
}

/// A request's place in a line, for as long as it is held: it counts in
/// the line, the gate and the fleet's held requests until dropped.
pub struct Ticket<'a> {
    gate: &'a Gate,
    line: Arc<Line>,
    pool: &'static str,
    _held: InFlightGuard,
    since: std::time::Instant,
}

impl Gate {
    pub fn new(registry: &mut Registry) -> Self {
        Self {
            lines: parking_lot::Mutex::new(HashMap::new()),
            held: std::sync::atomic::AtomicU32::new(0),
            metrics: FlowMetrics::register(registry),
        }
    }

    /// Whether requests wait in `model`'s line for `role`'s pool: a newcomer
    /// queues behind them even when its pool has room.
    pub fn has_line(&self, model: &str, role: Role) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.lines
            .lock()
            .get(&(model.to_owned(), pool_name(role)))
            .is_some_and(|l| l.waiting.load(Relaxed) > 0)
    }

    /// Joins the line of `model` and `role`'s pool; `None` when `max`
    /// requests are held already (the request is then sent at once).
    pub fn join(&self, fleet: &Fleet, model: &str, role: Role, max: u32) -> Option<Ticket<'_>> {
        use std::sync::atomic::Ordering::Relaxed;
        let pool = pool_name(role);
        let admitted = self
            .held
            .fetch_update(Relaxed, Relaxed, |n| (n < max).then_some(n + 1));
        if admitted.is_err() {
            self.metrics.sent(pool, Sent::Full, Duration::ZERO);
            return None;
        }
        let line = self
            .lines
            .lock()
            .entry((model.to_owned(), pool))
            .or_default()
            .clone();
        line.waiting.fetch_add(1, Relaxed);
        self.metrics.held.get_or_create(&PoolLabels { pool }).inc();
        Some(Ticket {
            gate: self,
            line,
            pool,
            _held: fleet.begin_held(role),
            since: std::time::Instant::now(),
        })
    }
}

impl Ticket<'_> {
    /// Waits for this request's turn at the head of its line.
    pub async fn turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.line.turn.lock().await
    }

    /// Leaves the line, counting why the request was sent.
    pub fn sent(self, why: Sent) {
        self.gate.metrics.sent(self.pool, why, self.since.elapsed());
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.line.waiting.fetch_sub(1, Relaxed);
        self.gate.held.fetch_sub(1, Relaxed);
        self.gate
            .metrics
            .held
            .get_or_create(&PoolLabels { pool: self.pool })
            .dec();
    }
}

/// Why a held request was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    /// A pod of its pool had room.
    Room,
    /// It was held `defaultRequestTTL`.
    Ttl,
    /// `maxRequests` were held already: it was never held.
    Full,
}

impl Sent {
    fn label(self) -> &'static str {
        match self {
            Sent::Room => "room",
            Sent::Ttl => "ttl",
            Sent::Full => "full",
        }
    }
}

/// A pool's name as the metrics and the autoscaling hook write it.
pub fn pool_name(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Both => "aggregated",
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PoolLabels {
    pool: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct SentLabels {
    pool: &'static str,
    reason: &'static str,
}

/// `kvmesh_flow_control_*`.
pub struct FlowMetrics {
    held: Family<PoolLabels, Gauge>,
    sent: Family<SentLabels, Counter>,
    wait: Histogram,
}

impl FlowMetrics {
    fn register(r: &mut Registry) -> Self {
        let m = Self {
            held: Family::default(),
            sent: Family::default(),
            // 1 ms .. ~65 s, doubling.
            wait: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
        };
        r.register(
            "flow_control_queue_size",
            "Requests this sidecar holds now because every pod of their pool is saturated, by pool",
            m.held.clone(),
        );
        r.register(
            "flow_control_sent",
            "Requests flow control sent on, by pool and why (room: a pod had room; ttl: held defaultRequestTTL; full: maxRequests were held, never held)",
            m.sent.clone(),
        );
        r.register_with_unit(
            "flow_control_wait",
            "Time a request was held by flow control",
            Unit::Seconds,
            m.wait.clone(),
        );
        m
    }

    fn sent(&self, pool: &'static str, why: Sent, waited: Duration) {
        self.sent
            .get_or_create(&SentLabels {
                pool,
                reason: why.label(),
            })
            .inc();
        if why != Sent::Full {
            self.wait.observe(waited.as_secs_f64());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kvmesh_filters::sched::Choice;

    fn ep(id: &str, role: Role, load: LoadSnapshot) -> EndpointView {
        EndpointView {
            id: id.to_owned(),
            address: id.to_owned(),
            role,
            models: vec!["m".to_owned()],
            load,
            healthy: true,
            ..EndpointView::default()
        }
    }

    fn queued(n: u32) -> LoadSnapshot {
        LoadSnapshot {
            in_flight: n + 1,
            running: 1,
            ..LoadSnapshot::default()
        }
    }

    #[test]
    fn a_pod_is_saturated_by_its_queue_its_kv_or_its_pending_prefill() {
        let cfg = FlowControl {
            prefill_tokens_threshold: 8192,
            ..FlowControl::default()
        };
        assert!(!saturated(&cfg, &LoadSnapshot::default()));
        assert!(!saturated(&cfg, &queued(4)));
        assert!(saturated(&cfg, &queued(5)), "the mesh's count queues 5");
        let engine = LoadSnapshot {
            waiting: 5,
            ..LoadSnapshot::default()
        };
        assert!(saturated(&cfg, &engine), "the engine's queue of 5");
        let kv = LoadSnapshot {
            kv_usage: 0.8,
            ..LoadSnapshot::default()
        };
        assert!(saturated(&cfg, &kv));
        let prefill = LoadSnapshot {
            prefill_tokens: 8192,
            ..LoadSnapshot::default()
        };
        assert!(saturated(&cfg, &prefill));
        let off = FlowControl::default();
        assert!(
            !saturated(&off, &prefill),
            "0 turns the token threshold off"
        );
    }

    #[test]
    fn the_pool_is_the_first_legs_role_and_saturated_only_when_every_pod_is() {
        let cfg = FlowControl::default();
        let eps = vec![
            ep("p1", Role::Prefill, queued(9)),
            ep("p2", Role::Prefill, queued(2)),
            ep("d1", Role::Decode, queued(9)),
        ];
        let choice = |id: &str| Choice {
            id: id.to_owned(),
            index: eps.iter().position(|e| e.id == id).unwrap(),
            fallbacks: vec![],
        };
        let split = Route::Disaggregated {
            prefill: choice("p1"),
            decode: choice("d1"),
        };
        let p = pool(&cfg, &split, "m", &eps).unwrap();
        assert_eq!(p.role, Role::Prefill);
        assert!(!p.saturated, "p2 has room");
        let whole = Route::Aggregated {
            target: choice("d1"),
        };
        let p = pool(&cfg, &whole, "m", &eps).unwrap();
        assert_eq!((p.role, p.saturated), (Role::Decode, true));
        // A pod serving another model, or unhealthy, is not in the pool.
        let mut eps = eps;
        eps[1].models = vec!["other".to_owned()];
        assert!(pool(&cfg, &split, "m", &eps).unwrap().saturated);
        eps[1].models = vec!["m".to_owned()];
        eps[1].healthy = false;
        assert!(pool(&cfg, &split, "m", &eps).unwrap().saturated);
        // No pod of the role at all: nothing to wait for.
        assert!(!pool_saturated(&cfg, Role::Both, "m", &eps));
    }
}
