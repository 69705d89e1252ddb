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
//!
//! With `index.backend: valkey`, the decision is made among the pods one
//! index lookup names ([`crate::valkey::Valkey::candidates`]), done here
//! first; a lookup that fails routes among the pods the sidecar knows.

use crate::error::ProxyError;
use crate::otel::Stage;
use crate::request::{Plan, RequestCtx};
use crate::routing::{Inputs, Routing};
use opentelemetry::KeyValue;

/// What the schedule stage reads: the active scheduler, and the fleet, the
/// prefix index, the local models and the counters it plans with.
#[derive(Clone, Copy)]
pub struct Schedule<'a> {
    pub routing: &'a Routing,
    pub inputs: Inputs<'a>,
    /// The Valkey index, with `index.backend: valkey`.
    pub index: Option<&'a crate::valkey::Valkey>,
    /// Where peers' mesh ports and KV agents are, learned from lookups.
    pub routes: &'a crate::upstream::mesh::MeshRoutes,
}

pub async fn schedule(h: Schedule<'_>, ctx: &mut RequestCtx) -> Result<Plan, ProxyError> {
    let started = std::time::Instant::now();
    let span = Stage::of(ctx.trace.as_deref(), "kvmesh.schedule");
    let routed = ctx.already_routed || ctx.epp_prefiller.is_some();
    if let (Some(index), Some(view), false) = (h.index, &ctx.view, routed) {
        let i = h.inputs;
        let model = i.prefix.request_model(view.model.as_deref());
        ctx.candidates = index
            .candidates(i.fleet, h.routes, model, &ctx.block_keys)
            .await;
        if span.recording() {
            let n = ctx.candidates.as_ref().map_or(-1, |c| c.len() as i64);
            span.set(KeyValue::new("kvmesh.schedule.index_candidates", n));
        }
    }
    let plan = h.routing.plan(h.inputs, ctx, &span);
    if ctx.view.is_some() && !routed {
        h.routing
            .metrics
            .decision_latency(started.elapsed().as_secs_f64());
    }
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
    let mut plan = plan?;
    ctx.route_reason = plan.reason;
    ctx.uncached_tokens = std::mem::take(&mut plan.uncached_tokens);
    // Every plan may end on the local engine (its last resort); a run there
    // goes to this rank.
    ctx.dp_rank = crate::routing::rank::choose(h.inputs, ctx);
    Ok(plan)
}
