//! Stage 3, schedule: choose where the request runs, with an ordered list of
//! fallbacks.
//!
//! The work is in [`crate::routing`]: build the `kvmesh_filters::sched`
//! request view from `ctx.view` (and the prefix stage's block keys), run the
//! active scheduler over the fleet's endpoint views, and map its picks to
//! [`Target`]s (the local pod to `LocalEngine`, another pod to `Peer`, a
//! prefill/decode pair to `Disaggregated`). A request whose route came with
//! it is not scheduled: one another sidecar already routed here
//! (`ctx.already_routed`) runs locally, so routing never loops; one an llm-d
//! EPP split (`ctx.epp_prefiller`) runs the split it names. Non-inference
//! calls run locally.

use std::net::SocketAddr;

use http::uri::Authority;

use super::context::RequestCtx;
use crate::app::App;
use crate::error::ProxyError;
use crate::otel::Stage;
use opentelemetry::KeyValue;

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
    Peer {
        sidecar_addr: SocketAddr,
    },
    /// An engine outside the mesh that an llm-d EPP named and
    /// `pd.allowed_prefillers` lists (prefill legs only).
    Direct(Authority),
}

impl Leg {
    /// The whole request on this leg's pod.
    pub fn whole(&self) -> Target {
        match self {
            // An engine outside the mesh is only ever a prefill leg; the
            // decode leg (where a whole request would go) is ours or a peer.
            Self::LocalEngine | Self::Direct(_) => Target::LocalEngine,
            Self::Peer { sidecar_addr } => Target::Peer {
                sidecar_addr: *sidecar_addr,
            },
        }
    }
}

/// The scheduler's answer: a target, what to try next, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub target: Target,
    /// Tried in order when a target refuses the connection before any byte was
    /// sent; at most `MAX_ATTEMPTS - 1` are used.
    pub fallbacks: Vec<Target>,
    /// For a disaggregated target: other prefill pods, best first, tried when
    /// the chosen prefill pod refuses or fails before answering.
    pub prefill_fallbacks: Vec<Leg>,
    /// A short, stable reason for logs and metric labels.
    pub reason: &'static str,
}

impl Plan {
    /// An llm-d EPP's split: prefill on `prefiller`, decode on the local
    /// engine, no fallbacks (the EPP chose both pods).
    pub fn epp(prefiller: Leg) -> Self {
        Self {
            target: Target::Disaggregated {
                prefill: prefiller,
                decode: Leg::LocalEngine,
            },
            fallbacks: Vec::new(),
            prefill_fallbacks: Vec::new(),
            reason: "prefiller_header",
        }
    }

    /// Everything on the local engine, no fallbacks.
    pub fn local(reason: &'static str) -> Self {
        Self {
            target: Target::LocalEngine,
            fallbacks: Vec::new(),
            prefill_fallbacks: Vec::new(),
            reason,
        }
    }

    /// The metric label of where the request goes: `local`, `peer` or `disaggregated`.
    pub fn decision(&self) -> &'static str {
        match self.target {
            Target::LocalEngine => "local",
            Target::Peer { .. } => "peer",
            Target::Disaggregated { .. } => "disaggregated",
        }
    }
}

pub fn schedule(app: &App, ctx: &mut RequestCtx) -> Result<Plan, ProxyError> {
    let span = Stage::of(ctx.trace.as_deref(), "kvmesh.schedule");
    let plan = app.routing.plan(app, ctx, &span);
    if span.recording() {
        match &plan {
            Ok(p) => {
                span.set(KeyValue::new("kvmesh.schedule.decision", p.decision()));
                span.set(KeyValue::new("kvmesh.schedule.reason", p.reason));
                let n = i64::try_from(p.fallbacks.len()).unwrap_or(i64::MAX);
                span.set(KeyValue::new("kvmesh.schedule.fallbacks", n));
            }
            Err(e) => span.fail(e),
        }
    }
    let plan = plan?;
    ctx.route_reason = plan.reason;
    Ok(plan)
}
