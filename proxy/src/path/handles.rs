//! The stages' handles, built from [`App`] per request: borrowed references,
//! nothing cloned. The one file of the stages but `mod.rs` that names `App`;
//! each stage sees only its handle.

use crate::app::App;
use crate::request::Upstreams;

use super::account::Accounting;
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

/// The upstream calls, the books, P/D's counters, the engine's readiness.
pub fn execute(app: &App) -> Execute<'_> {
    Execute {
        up: upstreams(app),
        books: accounting(app),
        pd: &app.pd_metrics,
        engine_ready: &app.engine_ready,
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
