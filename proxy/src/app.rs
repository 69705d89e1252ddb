//! What every request shares: the effective config, metrics, the upstream
//! connection pool, the fleet and the routing state. The stages' narrow
//! handles are built from it in `path/handles.rs`.

use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::Arc;

use crate::config::Config;
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::routing::Routing;
use crate::upstream::UpstreamClient;

pub struct App {
    pub config: Arc<Config>,
    pub metrics: Arc<Metrics>,
    pub client: UpstreamClient,
    /// The local engine's own keep-alive pool (HTTP/1.1); `None` with h2c upstreams.
    pub engine: Option<crate::upstream::EnginePool>,
    /// The active filter config and how a request becomes a plan.
    pub routing: Arc<Routing>,
    /// Every pod this sidecar can route to, the local one included.
    pub fleet: Arc<Fleet>,
    /// The local engine's KV block size in tokens, from its metrics (0: not yet known).
    pub engine_block_size: Arc<AtomicU32>,
    /// Tokenizer, block keys and the prefix index (precise and approximate).
    pub prefix: Arc<crate::prefix::PrefixState>,
    /// Set by the readiness probe once the local engine answers its health check.
    pub engine_ready: Arc<AtomicBool>,
    /// The mesh: this sidecar's state stream and its subscribers.
    pub mesh: Arc<crate::mesh::Mesh>,
    /// Spans of the request path (`tracing` in proxy.yaml); `None`: off.
    pub tracer: Option<crate::otel::Tracer>,
    /// The Valkey index (`index.backend: valkey`); `None`: the mesh.
    pub index: Option<Arc<crate::valkey::Valkey>>,
    /// P/D's counters (the other subsystems hold their own).
    pub pd_metrics: Arc<crate::pd::metrics::PdMetrics>,
    /// The autoscaling hook: its samples of the fleet and its metrics.
    pub autoscale: Arc<crate::autoscale::Hook>,
    /// Flow control's lines of held requests (`crate::flow`).
    pub flow: Arc<crate::flow::Gate>,
}

impl App {
    /// The same sidecar for another serving thread (`runtime.worker_threads`):
    /// the shared state, with an upstream client and an engine pool of its
    /// own, so that each connection is driven by the runtime that opened it.
    /// Call it inside that thread's runtime (the pool starts its reaper there).
    pub fn for_thread(&self) -> App {
        App {
            config: self.config.clone(),
            metrics: self.metrics.clone(),
            client: crate::upstream::build(&self.config),
            engine: crate::upstream::engine_pool(&self.config),
            routing: self.routing.clone(),
            fleet: self.fleet.clone(),
            engine_block_size: self.engine_block_size.clone(),
            prefix: self.prefix.clone(),
            engine_ready: self.engine_ready.clone(),
            mesh: self.mesh.clone(),
            tracer: self.tracer.clone(),
            index: self.index.clone(),
            pd_metrics: self.pd_metrics.clone(),
            autoscale: self.autoscale.clone(),
            flow: self.flow.clone(),
        }
    }
}
