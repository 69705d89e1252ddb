//! The accounting stage: everything a request changes in the sidecar's
//! shared books, in one place. The execute stage calls it as it goes:
//!
//! | when | what |
//! |---|---|
//! | [`predict`]: a target is taken up (a split too) | blocks predicted on its pods (precise mode) |
//! | [`rank_taken`]: the same, when it runs on the local engine with data parallelism | the pick counted on the schedule stage's rank, the blocks predicted (or recorded, approximate mode) on it |
//! | [`track`]: a whole request is about to be sent to a target | the request counted in flight on its pod across the mesh (until its body ends; a fallback moves the count), its uncached prompt tokens as waiting to be prefilled there (until its first byte), and as forwarded to that pod when it goes to a peer sidecar |
//! | [`served`]: a response head came back | the pod's call counted as served (outlier ejection), where it ran (mesh counters), the approximate index and the mesh publish of the decision |
//! | [`failed`]: a target failed before any byte | the call counted as failed (outlier ejection) |
//!
//! Predictions and in-flight counts start before the response head, not
//! after it: a request arriving meanwhile must see them, or a burst would
//! all go to the same pod.

use std::net::SocketAddr;

use tokio::time::Instant;

use crate::fleet::Fleet;
use crate::mesh::Mesh;
use crate::metrics::OutlierMetrics;
use crate::prefix::PrefixState;
use crate::request::{Leg, RequestCtx, Served, Target, Upstream};

/// The books the accounting stage keeps, borrowed for one request (built by
/// `path::handles::accounting`): nothing cloned, no reference count touched.
#[derive(Clone, Copy)]
pub struct Accounting<'a> {
    /// In-flight counts, outlier calls, pod ids.
    pub fleet: &'a Fleet,
    /// Predicted blocks; the approximate index.
    pub prefix: &'a PrefixState,
    /// Outlier ejections.
    pub outliers: &'a OutlierMetrics,
    /// Where approximate decisions are published; the mesh counters.
    pub mesh: &'a Mesh,
}

/// A response head came back from `upstream`.
pub(crate) fn served(a: Accounting<'_>, ctx: &RequestCtx, upstream: &Upstream) {
    a.fleet.call_served(&upstream.pod(a.fleet), Instant::now());
    let peer = match upstream {
        Upstream::Peer(addr) => Some(*addr),
        _ => None,
    };
    ran_on(a, ctx, peer);
}

/// `upstream` failed before any byte: counts towards its pod's ejection.
pub(crate) fn failed(a: Accounting<'_>, upstream: &Upstream) {
    let pod = upstream.pod(a.fleet);
    if let Some(period) = a.fleet.call_failed(&pod, Instant::now()) {
        a.outliers.ejected();
        tracing::warn!(%pod, ?period, "pod ejected after consecutive failed calls");
    }
}

/// The pod id of where a response came from, for the access line.
pub(crate) fn served_pod(fleet: &Fleet, s: Served) -> String {
    match s {
        Served::LocalEngine => fleet.local_id().to_owned(),
        Served::Peer(addr) => fleet.peer_id(addr).unwrap_or_else(|| addr.to_string()),
    }
}

/// Counts the request towards the pod `target` runs on (its decode pod when
/// disaggregated), for as long as the response lasts. Called by the execute
/// stage for each target it tries, so a fallback moves the count.
pub(crate) fn track(a: Accounting<'_>, ctx: &mut RequestCtx, target: &Target) {
    if ctx.already_routed && *target == Target::LocalEngine {
        // Forwarded here by a peer, which publishes it to the mesh itself,
        // and counts its prompt tokens.
        if let Some(in_flight) = ctx.in_flight.as_mut() {
            in_flight.hold_target(a.fleet.begin_received());
        }
        return;
    }
    let pod = pod_of(a.fleet, target);
    if let (Target::Peer { .. }, Some(id), Some(_)) = (target, &pod, &ctx.view) {
        // Counted when sent, not when answered: a request lost with its
        // peer (a partition, a crash) was still forwarded there.
        a.mesh.metrics.forwarded(id);
    }
    let guard = pod.as_ref().and_then(|id| a.fleet.begin(id));
    let prefill = match (target, &pod) {
        // A split's prompt is computed on its prefill pod, which counts
        // them while the prefill leg runs (`pd::twoleg`, `pd::sglang`); its
        // decode pod computes none.
        (Target::Disaggregated { .. }, _) | (_, None) => None,
        (_, Some(id)) => a.fleet.begin_priced_prefill(id, &ctx.uncached_tokens),
    };
    if let Some(in_flight) = ctx.in_flight.as_mut() {
        in_flight.hold_target(guard);
        in_flight.hold_prefill(prefill);
    }
}

/// Precise mode: the pods `target` sends this request's prompt to will hold
/// its blocks (both legs of a split: prefill computes them, decode receives
/// them), until their engines' KV events say so. A request a peer already
/// routed was predicted there.
pub(crate) fn predict(a: Accounting<'_>, ctx: &RequestCtx, target: &Target) {
    if ctx.already_routed || ctx.block_keys.is_empty() {
        return;
    }
    if let Target::Disaggregated { prefill, .. } = target {
        if let Some(id) = leg_id(a.fleet, prefill) {
            a.prefix.predict(&id, ctx);
        }
    }
    if let Some(id) = pod_of(a.fleet, target) {
        a.prefix.predict(&id, ctx);
    }
}

/// Data parallelism: `target` runs (a leg of) the request on the local
/// engine, so on the rank the schedule stage chose. The pick weighs on the
/// rank until the next scrape, and the rank will hold the request's blocks.
/// Unlike [`predict`], a request a peer routed here counts too: only this
/// sidecar knows its engine's ranks.
pub(crate) fn rank_taken(a: Accounting<'_>, ctx: &RequestCtx, target: &Target) {
    let Some(rank) = ctx.dp_rank else {
        return;
    };
    let local = match target {
        Target::LocalEngine => true,
        Target::Peer { .. } => false,
        Target::Disaggregated { prefill, decode } => {
            *prefill == Leg::LocalEngine || *decode == Leg::LocalEngine
        }
    };
    if !local {
        return;
    }
    a.fleet.ranks().picked(rank);
    let name = crate::prefix::rank_pod(a.prefix.local_pod().1, rank);
    a.prefix.predict(&name, ctx);
    a.prefix.record(&name, ctx);
}

fn pod_of(fleet: &Fleet, target: &Target) -> Option<String> {
    match target {
        Target::LocalEngine => leg_id(fleet, &Leg::LocalEngine),
        Target::Peer { sidecar_addr } => fleet.peer_id(*sidecar_addr),
        Target::Disaggregated { decode, .. } => leg_id(fleet, decode),
    }
}

fn leg_id(fleet: &Fleet, leg: &Leg) -> Option<String> {
    match leg {
        Leg::LocalEngine => Some(fleet.local_id().to_owned()),
        Leg::Peer { sidecar_addr } => fleet.peer_id(*sidecar_addr),
        // An engine outside the mesh: no pod of the fleet.
        Leg::Direct(_) => None,
    }
}

/// Where the request ran, as the mesh counts it (`None`: the local
/// engine); in approximate mode the decision is recorded in the local index
/// and published to the peers.
fn ran_on(a: Accounting<'_>, ctx: &RequestCtx, peer: Option<SocketAddr>) {
    if ctx.view.is_none() {
        return;
    }
    let m = &a.mesh.metrics;
    let pod = match peer {
        None if ctx.already_routed => {
            m.request("received");
            return;
        }
        None => {
            m.request("local");
            a.fleet.local_id().to_owned()
        }
        Some(addr) => {
            m.request("forwarded");
            let Some(id) = a.fleet.peer_id(addr) else {
                return;
            };
            id
        }
    };
    if a.prefix.mode() == crate::prefix::Mode::Approximate && !ctx.block_keys.is_empty() {
        a.prefix.record(&pod, ctx);
        a.mesh.decision(&pod, &ctx.block_keys);
    }
}
