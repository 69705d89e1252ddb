//! Routing: where each inference request runs. Holds the active scheduler
//! (`kvmesh_filters::sched::Scheduler`, compiled from `filters.yaml` or the
//! built-in default), replaces it when the file changes on disk
//! ([`reload`]), and turns one request into a [`Plan`]: the fleet's pods as
//! endpoint views, the request as the scheduler's request view
//! ([`request`]), one scheduling cycle, and the decision mapped to targets
//! ([`plan`]). `POST /debug/route` and `GET /debug/fleet` (`crate::admin`)
//! explain it on the admin port.
//!
//! A request another sidecar already routed here (`x-kvmesh-routed`) always
//! runs locally, so routing never loops; so do non-inference calls.

pub mod metrics;
pub mod pd_threshold;
pub mod plan;
pub mod producers;
pub mod rank;
pub mod reload;
pub mod request;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

use kvmesh_filters::sched::{
    ConfigError, Decision, DecisionTrace, FilterConfig, Route, ScheduleError, Scheduler, TraceLevel,
};
use opentelemetry::KeyValue;
use parking_lot::RwLock;
use prometheus_client::registry::Registry;
use tokio::time::Instant;

use crate::config::Config;
use crate::error::ProxyError;
use crate::fleet::{Fleet, PodInfo};
use crate::otel::Stage;
use crate::prefix::PrefixState;
use crate::request::{Plan, RequestCtx};
use metrics::RoutingMetrics;
pub use producers::PrefixSettings;

/// Block size assumed until the engine reports its own (vLLM's default).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

/// What planning one request reads besides the filter config: the fleet's
/// pods, the prefix index and its block size, the local models. Borrowed per request (`path::handles::routing_inputs`).
#[derive(Clone, Copy)]
pub struct Inputs<'a> {
    /// The local pod's models (the first names a model-less request).
    pub pod: &'a crate::config::Pod,
    pub fleet: &'a Fleet,
    pub prefix: &'a PrefixState,
    /// The local engine's KV block size from its metrics (0: not yet known).
    pub engine_block_size: &'a AtomicU32,
}

/// A filter config that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum FiltersError {
    #[error("{file}: cannot read: {source}")]
    Read {
        file: String,
        #[source]
        source: std::io::Error,
    },
    /// `file:line:col: field: message`.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// A compiled filter config and where it came from.
pub struct Active {
    pub scheduler: Scheduler,
    /// The file it was read from, or `<builtin>`.
    pub origin: String,
    /// What its prefix producers set ([`producers`]).
    pub prefix: PrefixSettings,
    /// `flowControl`, when its feature gate is on (`crate::flow`).
    pub flow: Option<kvmesh_filters::sched::config::flow::FlowControl>,
}

impl Active {
    /// Logs what the config sets that this sidecar does not read.
    fn log_notes(&self) {
        for note in &self.prefix.notes {
            tracing::warn!(file = %self.origin, "{note}");
        }
    }
}

/// The routing state every request shares.
pub struct Routing {
    active: RwLock<Arc<Active>>,
    /// The watched file (`scheduling.filters`), if any.
    file: Option<PathBuf>,
    /// Origin of the millisecond clock stateful plugins see.
    epoch: Instant,
    /// The active config's `maxPrefixBlocksToMatch`, read by every request's
    /// prefix stage without taking the lock.
    approx_max_blocks: AtomicUsize,
    /// Decisions, reloads, failed engine scrapes.
    pub metrics: RoutingMetrics,
}

/// Reads and compiles a filter config file.
pub fn load_filters(path: &Path) -> Result<Active, FiltersError> {
    load_filters_with(path, None)
}

/// Reads a filter config file and compiles it with the P/D threshold override.
pub fn load_filters_with(path: &Path, pd_threshold: Option<u32>) -> Result<Active, FiltersError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| FiltersError::Read {
        file: file.clone(),
        source,
    })?;
    compile(&pd_threshold::apply(
        FilterConfig::from_yaml(&text, &file)?,
        pd_threshold,
    )?)
}

/// Compiles a filter config already in memory.
pub fn compile(cfg: &FilterConfig) -> Result<Active, FiltersError> {
    Ok(Active {
        scheduler: Scheduler::new(cfg)?,
        origin: cfg.file().to_owned(),
        prefix: PrefixSettings::of(cfg),
        flow: cfg.flow_control.clone(),
    })
}

/// Who the local pod is, from config. Its identity is the address peers and
/// clients reach its sidecar on: today the client listener's bound address
/// (the mesh's `advertise` setting replaces it here).
pub fn local_pod(config: &Config, client_addr: std::net::SocketAddr) -> PodInfo {
    let p = &config.pod;
    PodInfo {
        id: config
            .mesh
            .advertise
            .clone()
            .unwrap_or_else(|| client_addr.to_string()),
        sidecar_addr: None,
        role: p.role,
        models: p.models.clone(),
        lora_adapters: p.lora_adapters.clone(),
        labels: p.labels.clone(),
    }
}

impl std::fmt::Debug for Routing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routing")
            .field("active", &self.active().origin)
            .field("file", &self.file)
            .finish()
    }
}

impl Routing {
    /// The filter config of `config.scheduling.filters`, or the built-in default.
    /// Its families are registered in `registry`.
    pub fn from_config(config: &Config, registry: &mut Registry) -> Result<Self, FiltersError> {
        let file = config.scheduling.filters.clone();
        let active = match &file {
            Some(path) => load_filters_with(path, config.pd.min_uncached_tokens)?,
            None => compile(&pd_threshold::apply(
                FilterConfig::builtin_default(),
                config.pd.min_uncached_tokens,
            )?)?,
        };
        active.log_notes();
        Ok(Self {
            approx_max_blocks: AtomicUsize::new(active.prefix.approx_max_blocks),
            active: RwLock::new(Arc::new(active)),
            file,
            epoch: Instant::now(),
            metrics: RoutingMetrics::register(registry),
        })
    }

    /// The scheduler in use now; a reload does not disturb a cycle holding it.
    pub fn active(&self) -> Arc<Active> {
        self.active.read().clone()
    }

    /// Makes `cfg` the active filter config (the demo compares policies this
    /// way; file reloads go through the same swap).
    pub fn install(&self, cfg: &FilterConfig) -> Result<(), FiltersError> {
        self.swap(compile(cfg)?);
        Ok(())
    }

    fn swap(&self, active: Active) {
        active.log_notes();
        // Under the lock, so two swaps at once leave the window of the config
        // that won.
        let mut slot = self.active.write();
        self.approx_max_blocks
            .store(active.prefix.approx_max_blocks, Ordering::Relaxed);
        *slot = Arc::new(active);
    }

    /// Most leading text blocks of a prompt the approximate index reads
    /// (`maxPrefixBlocksToMatch` of the active config).
    pub fn approx_max_blocks(&self) -> usize {
        self.approx_max_blocks.load(Ordering::Relaxed)
    }

    /// The watched filter file, if any.
    pub fn file(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    /// Milliseconds since this sidecar started, for plugins that age state.
    pub fn now_ms(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.epoch).as_millis()).unwrap_or(u64::MAX)
    }

    /// The plan for one request: the scheduler's decision as targets.
    /// `span`: the schedule stage's span; a recording one gets the chosen
    /// pods, the top scores and the reason ([`record`]).
    pub fn plan(&self, h: Inputs<'_>, ctx: &RequestCtx, span: &Stage) -> Result<Plan, ProxyError> {
        let m = &self.metrics;
        if let Some(prefiller) = &ctx.epp_prefiller {
            let plan = Plan::epp(prefiller.clone());
            m.decision(plan.decision(), plan.reason);
            return Ok(plan);
        }
        if ctx.already_routed {
            m.decision("local", "routed_by_peer");
            return Ok(Plan::local("routed_by_peer"));
        }
        let Some(view) = &ctx.view else {
            m.decision("local", "passthrough");
            return Ok(Plan::local("passthrough"));
        };
        let started = std::time::Instant::now();
        let now = Instant::now();
        let (req, endpoints) = request::build(h, ctx, view, now);
        // The debug line below prints the handler's reason, which a summary
        // trace has; the full trace (every plugin and endpoint name) costs
        // more than the decision on a small fleet, so it is built only when
        // the trace-level line that prints it is enabled. `/debug/route`
        // asks the scheduler for the full trace itself.
        let level = if tracing::enabled!(tracing::Level::TRACE) || span.recording() {
            TraceLevel::Full
        } else {
            TraceLevel::Summary
        };
        let active = self.active();
        let decision = active.scheduler.schedule_with(
            &req,
            &endpoints,
            self.now_ms(now),
            rand::random(),
            level,
        );
        m.scheduling_latency(started.elapsed().as_secs_f64());
        match decision {
            Ok(Decision { route, trace }) => {
                let mut plan = plan::from_route(h.fleet, &route, &req, &endpoints);
                if let (Some(flow), Some(plan)) = (&active.flow, plan.as_mut()) {
                    plan.pool = crate::flow::pool(flow, &route, &req.model, &endpoints);
                }
                tracing::debug!(
                    request_id = ctx.id(),
                    decision = plan.as_ref().map_or("error", Plan::decision),
                    route = ?route,
                    reason = %trace.reason,
                    "scheduled"
                );
                tracing::trace!(request_id = ctx.id(), trace = ?trace, "decision trace");
                if span.recording() {
                    record(span, &route, &trace);
                }
                match plan {
                    Some(plan) => {
                        m.decision(plan.decision(), plan.reason);
                        Ok(plan)
                    }
                    None => {
                        m.decision("error", "pod_gone");
                        Err(ProxyError::Internal(format!(
                            "the scheduler chose {:?}, which left the fleet",
                            route.primary().id
                        )))
                    }
                }
            }
            Err(e) => {
                let err = no_endpoint_error(&req.model, &endpoints, e);
                let reason = match &err {
                    ProxyError::ModelNotFound { .. } => "model_not_found",
                    _ => "no_endpoint",
                };
                m.decision("error", reason);
                Err(err)
            }
        }
    }
}

/// A scheduling failure as the client's error: an unknown model is 404
/// (nothing in the mesh serves it), anything else names the filter.
pub fn no_endpoint_error(
    model: &str,
    endpoints: &[kvmesh_filters::sched::EndpointView],
    e: ScheduleError,
) -> ProxyError {
    let served = endpoints.iter().any(|ep| {
        (ep.models.is_empty() && ep.lora_adapters.is_empty())
            || ep.models.iter().any(|m| m == model)
            || ep.lora_adapters.iter().any(|a| a == model)
    });
    if !served {
        let mut known: Vec<&str> = endpoints
            .iter()
            .flat_map(|ep| ep.models.iter().chain(&ep.lora_adapters))
            .map(String::as_str)
            .collect();
        known.sort_unstable();
        known.dedup();
        known.truncate(16);
        return ProxyError::ModelNotFound {
            model: model.to_owned(),
            known: known.join(", "),
        };
    }
    match e {
        ScheduleError::NoEndpoint {
            model,
            filter,
            profile,
        } => ProxyError::NoEndpoint {
            model,
            filter,
            profile,
        },
        other => ProxyError::Internal(other.to_string()),
    }
}

/// How many candidates of each profile the schedule span lists.
const TOP_SCORES: usize = 3;

/// The schedule span's attributes: the chosen pods, the handler's reason, and
/// each profile's best candidates by weighted total (`profile: pod=0.83 ...`).
fn record(span: &Stage, route: &Route, trace: &DecisionTrace) {
    span.set(KeyValue::new(
        "kvmesh.schedule.pod",
        route.primary().id.clone(),
    ));
    if let Some(p) = route.prefill() {
        span.set(KeyValue::new("kvmesh.schedule.prefill_pod", p.id.clone()));
    }
    span.set(KeyValue::new("kvmesh.schedule.why", trace.reason.clone()));
    let mut scores = String::new();
    for p in &trace.profiles {
        let mut ranked: Vec<(&String, f64)> =
            p.candidates.iter().zip(p.totals.iter().copied()).collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
        if !scores.is_empty() {
            scores.push_str("; ");
        }
        scores.push_str(&p.profile);
        scores.push(':');
        for (id, total) in ranked.into_iter().take(TOP_SCORES) {
            scores.push_str(&format!(" {id}={total:.3}"));
        }
    }
    span.set(KeyValue::new("kvmesh.schedule.top_scores", scores));
}
