//! The stages' handles, built from [`App`] per request: borrowed references,
//! nothing cloned. The one file of the stages but `mod.rs` that names `App`;
//! each stage sees only its handle.

use std::sync::Arc;

use crate::app::App;
use crate::error::UpstreamName;
use crate::request::migrate::{Continuing, Count, Counting, Job, Reroute, RerouteSource};
use crate::request::{Served, Target, Upstreams};

use super::account::Accounting;
use super::admit::Admit;
use super::classify::Classify;
use super::execute::Execute;
use super::observe::Observe;
use super::prefix::Prefix;
use super::schedule::Schedule;

pub fn classify(app: &App) -> Classify<'_> {
    Classify {
        limits: &app.config.limits,
        pd: &app.config.pd,
        timeouts: &app.config.timeouts,
        clients: &app.metrics.clients,
        fleet: &app.fleet,
    }
}

pub fn prefix(app: &App) -> Prefix<'_> {
    Prefix {
        state: &app.prefix,
        compute: compute(app),
    }
}

pub fn schedule(app: &App) -> Schedule<'_> {
    Schedule {
        routing: &app.routing,
        inputs: routing_inputs(app),
        index: app.index.as_deref(),
        routes: app.mesh.routes(),
    }
}

/// The schedule stage's handle and flow control's lines.
pub fn admit(app: &App) -> Admit<'_> {
    Admit {
        schedule: schedule(app),
        gate: &app.flow,
    }
}

/// The upstream calls, the books, P/D's counters, the engine's readiness.
pub fn execute(app: &App) -> Execute<'_> {
    Execute {
        up: upstreams(app),
        books: accounting(app),
        pd: &app.pd_metrics,
        engine_ready: &app.engine_ready,
        migration: &app.config.migration,
        reroute: None,
    }
}

/// The client's request: as [`execute`], and its streams may migrate.
pub fn execute_migrating(app: &Arc<App>) -> Execute<'_> {
    Execute {
        reroute: Some(app),
        ..execute(app)
    }
}

impl RerouteSource for Arc<App> {
    fn reroute(&self) -> Box<dyn Reroute> {
        Box::new(Rerouter(Arc::clone(self)))
    }
}

/// A migrating stream's own handle on the sidecar (`path/migrate.rs`): it
/// builds the execute stage's handle when the stream needs it.
struct Rerouter(Arc<App>);

impl Reroute for Rerouter {
    fn pick(
        &self,
        model: Option<&str>,
        avoid: &[Served],
        targets: &[Target],
    ) -> Option<(Served, UpstreamName)> {
        super::migrate::pick_named(execute(&self.0), model, avoid, targets)
    }

    fn send(&self, to: Served, job: Job) -> Continuing {
        let app = Arc::clone(&self.0);
        Box::pin(async move { super::migrate::send_to(execute(&app), to, job).await })
    }

    fn count(&self, to: Served, count: Count) -> Counting {
        let app = Arc::clone(&self.0);
        Box::pin(async move { super::migrate::count_on(execute(&app), to, count).await })
    }
}

/// What the accounting stage (called by execute as it goes) takes.
pub fn accounting(app: &App) -> Accounting<'_> {
    Accounting {
        fleet: &app.fleet,
        prefix: &app.prefix,
        outliers: &app.metrics.outliers,
        mesh: &app.mesh,
    }
}

pub fn observe(app: &App) -> Observe<'_> {
    Observe {
        requests: &app.metrics.requests,
        fleet: &app.fleet,
    }
}

/// What upstream calls take: pools, the fleet view, deadlines.
pub fn upstreams(app: &App) -> Upstreams<'_> {
    Upstreams {
        engine_url: &app.config.engine.url,
        timeouts: &app.config.timeouts,
        limits: &app.config.limits,
        pd: &app.config.pd,
        pod: &app.config.pod,
        metrics: &app.metrics.upstream,
        client: &app.client,
        engine: app.engine.as_ref(),
        mesh_tls: app.mesh.tls_client(),
        mesh_routes: app.mesh.routes(),
        peers: &*app.fleet,
    }
}

/// What the prefix stage reads besides the prefix state (also `/debug/route`'s).
pub fn compute(app: &App) -> crate::prefix::Compute<'_> {
    crate::prefix::Compute {
        engine_url: &app.config.engine.url,
        client: &app.client,
        engine_block_size: &app.engine_block_size,
        approx_max_blocks: app.routing.approx_max_blocks(),
    }
}

/// What planning one request reads besides the filter config (also
/// `/debug/route`'s).
pub fn routing_inputs(app: &App) -> crate::routing::Inputs<'_> {
    crate::routing::Inputs {
        pod: &app.config.pod,
        fleet: &app.fleet,
        prefix: &app.prefix,
        engine_block_size: &app.engine_block_size,
    }
}
