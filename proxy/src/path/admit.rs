//! Stage 3b, admit: flow control (`crate::flow`). With
//! `featureGates: [flowControl]`, a request whose pool is saturated, or
//! whose line already holds others, waits in its line; the line's head
//! looks for room every [`RECHECK`], and once a pod of its pool has room it
//! is scheduled again, on the loads of now, and sent. Without the gate, or
//! for a request that was not scheduled (passthrough, routed by a peer),
//! the plan goes on as it is.
//!
//! A request held `defaultRequestTTL`, or one that finds `maxRequests`
//! held, is sent as it would be without flow control. A client that leaves
//! while held drops its request's future, and with it its place in line.

use tokio::time::Instant;

use crate::error::ProxyError;
use crate::flow::{Gate, Sent, RECHECK};
use crate::request::{Plan, RequestCtx};

use super::schedule::{self, Schedule};

/// What the admit stage reads: the schedule stage's handle (to schedule a
/// held request again) and the lines.
#[derive(Clone, Copy)]
pub struct Admit<'a> {
    pub schedule: Schedule<'a>,
    pub gate: &'a Gate,
}

pub async fn admit(h: Admit<'_>, ctx: &mut RequestCtx, plan: Plan) -> Result<Plan, ProxyError> {
    // A plan has a pool only when flow control was on as it was made.
    let (Some(pool), Some(view)) = (plan.pool, ctx.view.as_ref()) else {
        return Ok(plan);
    };
    let Some(flow) = h.schedule.routing.active().flow.clone() else {
        return Ok(plan);
    };
    let i = h.schedule.inputs;
    let model = i.prefix.request_model(view.model.as_deref()).to_owned();
    if !pool.saturated && !h.gate.has_line(&model, pool.role) {
        return Ok(plan);
    }
    let Some(ticket) = h.gate.join(i.fleet, &model, pool.role, flow.max_requests) else {
        return Ok(plan);
    };
    let deadline = Instant::now() + flow.request_ttl;
    // First come, first served: the line's head looks for room, the rest
    // wait their turn (or their deadline).
    let turn = tokio::time::timeout_at(deadline, ticket.turn()).await;
    let why = loop {
        let endpoints = i
            .fleet
            .endpoints_where(Instant::now(), |p| p.role == pool.role);
        if !crate::flow::pool_saturated(&flow, pool.role, &model, &endpoints) {
            break Sent::Room;
        }
        if Instant::now() >= deadline {
            break Sent::Ttl;
        }
        tokio::time::sleep_until(deadline.min(Instant::now() + RECHECK)).await;
    };
    // Scheduled again on the loads of now. The execute stage counts it in
    // flight at its pod before it first yields, so the next in line, which
    // looks once the turn is handed on, sees it there (but for the few
    // microseconds another thread may take to look first).
    let plan = schedule::schedule(h.schedule, ctx).await;
    drop(turn);
    ticket.sent(why);
    plan
}
