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
}

pub fn schedule(h: Schedule<'_>, ctx: &mut RequestCtx) -> Result<Plan, ProxyError> {
    let span = Stage::of(ctx.trace.as_deref(), "kvmesh.schedule");
    let plan = h.routing.plan(h.inputs, ctx, &span);
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
