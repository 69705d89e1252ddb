//! Stage 3, schedule: choose where the request runs, with an ordered list of
//! fallbacks.
//!
//! Today every request goes to the local engine. The scheduling stage replaces
//! [`Scheduler::plan`]'s body: build the `kvmesh_filters::sched` request view
//! from `ctx.view` and `ctx.block_keys`, run the pure scheduler over the
//! endpoint snapshot, and map its picks to [`Target`]s (the local pod to
//! `LocalEngine`, another pod to `Peer`, a prefill/decode pair to
//! `Disaggregated`). A request another sidecar already routed here
//! (`ctx.already_routed`) always runs locally, so routing never loops.

use std::net::SocketAddr;

use super::context::RequestCtx;
use crate::app::App;
use crate::error::ProxyError;

/// Most targets the execute stage tries for one request (the first plus fallbacks).
pub const MAX_ATTEMPTS: usize = 4;

/// Where a request (or one leg of it) runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// This pod's engine.
    LocalEngine,
    /// Another pod: forwarded to its sidecar, marked as already routed.
    Peer { sidecar_addr: SocketAddr },
    /// Prefill on one pod, decode on another, joined by a P/D connector.
    Disaggregated { prefill: Leg, decode: Leg },
}

/// One leg of a disaggregated request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leg {
    LocalEngine,
    Peer { sidecar_addr: SocketAddr },
}

/// The scheduler's answer: a target, what to try next, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub target: Target,
    /// Tried in order when a target refuses the connection before any byte was
    /// sent; at most `MAX_ATTEMPTS - 1` are used.
    pub fallbacks: Vec<Target>,
    /// A short, stable reason for logs and metric labels.
    pub reason: &'static str,
}

/// Chooses targets. Holds whatever state scheduling needs (endpoint snapshots,
/// the filter config); cheap to call from many requests at once.
#[derive(Debug, Default)]
pub struct Scheduler;

impl Scheduler {
    pub fn plan(&self, ctx: &RequestCtx) -> Result<Plan, ProxyError> {
        let reason = if ctx.already_routed {
            "routed-by-peer"
        } else {
            "local-only"
        };
        Ok(Plan {
            target: Target::LocalEngine,
            fallbacks: Vec::new(),
            reason,
        })
    }
}

pub fn schedule(app: &App, ctx: &mut RequestCtx) -> Result<Plan, ProxyError> {
    let plan = app.scheduler.plan(ctx)?;
    ctx.decision = plan.reason;
    Ok(plan)
}
