//! Where a migrating stream goes on (`crate::request::migrate`): the pod a
//! continuation is sent to, and the call. The relay of a stream whose
//! upstream failed after bytes reached the client asks here, through the
//! owned handle `handles::Rerouter`, long after the execute stage returned.
//!
//! The next pod is the first that has not failed this request, is not
//! ejected, and can decode its model, in this order: the plan's targets
//! (the scheduler's ranking when the request arrived), then the other pods
//! the fleet knows, least loaded first, then the local engine. The
//! continuation's prompt holds the whole output so far, so any such pod
//! can serve it; most of its prefix is cached only on the pod that failed.
//!
//! A continuation whose output went by text is counted first by the next
//! pod's `/tokenize` ([`count_on`]): the engine's own, through its sidecar
//! for a peer (which passes the path through to it).

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method};
use http_body_util::{BodyExt, Limited};
use kvmesh_filters::sched::Role;
use serde::Deserialize;
use tokio::time::Instant;

use crate::body::{streamed, Counted, Streamed, UpstreamBody};
use crate::error::{ProxyError, UpstreamName};
use crate::metrics::Route;
use crate::otel::Hop;
use crate::prefix::tokenize::MAX_TOKENIZE_RESPONSE;
use crate::request::migrate::{Count, Job};
use crate::request::{send_traced, RequestCtx, Served, Target, Upstream};

use super::execute::Execute;

/// [`pick`], with the name errors give the pod.
pub fn pick_named(
    h: Execute<'_>,
    model: Option<&str>,
    avoid: &[Served],
    targets: &[Target],
) -> Option<(Served, UpstreamName)> {
    let s = pick(h, model, avoid, targets)?;
    Some((s, upstream_of(s).name(h.up.engine_url)))
}

/// The call to the pod `s`.
pub(super) fn upstream_of(s: Served) -> Upstream {
    match s {
        Served::LocalEngine => Upstream::Engine,
        Served::Peer(a) => Upstream::Peer(a),
    }
}

/// The pod to continue on, if any is left (see the module docs).
pub fn pick(
    h: Execute<'_>,
    model: Option<&str>,
    avoid: &[Served],
    targets: &[Target],
) -> Option<Served> {
    let now = Instant::now();
    let fleet = h.books.fleet;
    let serves = |models: &[String]| {
        model.is_none_or(|m| models.is_empty() || models.iter().any(|s| s == m))
    };
    let local_ok = || {
        let local = fleet.local_snapshot(now);
        h.up.pod.role != Role::Prefill
            && serves(&h.up.pod.models)
            && h.engine_ready.load(std::sync::atomic::Ordering::Acquire)
            && local.ejected_ms.is_none()
    };
    let usable = |s: &Served| {
        !avoid.contains(s)
            && match s {
                Served::LocalEngine => local_ok(),
                Served::Peer(a) => fleet.peer_id(*a).is_some_and(|id| !fleet.ejected(&id, now)),
            }
    };
    let planned = targets.iter().map(|t| match t {
        Target::LocalEngine => Served::LocalEngine,
        Target::Peer { sidecar_addr } => Served::Peer(*sidecar_addr),
        Target::Disaggregated { decode, .. } => match decode.whole() {
            Target::Peer { sidecar_addr } => Served::Peer(sidecar_addr),
            _ => Served::LocalEngine,
        },
    });
    if let Some(s) = planned.into_iter().find(|s| usable(s)) {
        return Some(s);
    }
    let mut others: Vec<_> = fleet
        .snapshot(now)
        .into_iter()
        .filter(|p| p.healthy && p.ejected_ms.is_none() && p.info.role != Role::Prefill)
        .filter(|p| serves(&p.info.models))
        .filter_map(|p| {
            let load = p.in_flight_local + p.in_flight_mesh;
            Some((load, Served::Peer(p.info.sidecar_addr?)))
        })
        .filter(|(_, s)| !avoid.contains(s))
        .collect();
    others.sort_by_key(|(load, _)| *load);
    if let Some((_, s)) = others.first() {
        return Some(*s);
    }
    usable(&Served::LocalEngine).then_some(Served::LocalEngine)
}

/// Sends a continuation to `to`; anything but a `200` answer is an error.
/// The pod's outlier books count the call as any other, and its body
/// counts towards the pod's requests in flight until it ends.
pub async fn send_to(
    h: Execute<'_>,
    to: Served,
    job: Job,
) -> Result<(Streamed, UpstreamName), ProxyError> {
    let mut ctx = RequestCtx::continuation(job.request_id, job.route, job.started);
    ctx.attempts = job.attempt;
    let upstream = upstream_of(to);
    let (mut head, ()) = http::Request::new(()).into_parts();
    head.method = job.method;
    head.uri = job.uri;
    head.headers = job.headers;
    let body = UpstreamBody::full(job.body);
    let sent = send_traced(&h.up, &ctx, &upstream, &head, body, job.hop).await;
    match sent {
        Ok((resp, name, hop)) if resp.status() == http::StatusCode::OK => {
            super::account::served(h.books, &ctx, &upstream);
            let count = h.books.fleet.begin(&upstream.pod(h.books.fleet));
            let body = Counted::new(streamed(resp.into_body()), count, hop);
            Ok((streamed(body), name))
        }
        Ok((resp, name, _hop)) => {
            super::account::failed(h.books, &upstream);
            Err(ProxyError::UpstreamFailed {
                upstream: name,
                reason: format!("the continuation was answered {}", resp.status()),
            })
        }
        Err(e) => {
            super::account::failed(h.books, &upstream);
            Err(e)
        }
    }
}

/// How long the two `/tokenize` calls of a count may take together; past
/// it the continuation goes with the stream's own count.
const COUNT_DEADLINE: Duration = Duration::from_secs(2);

/// The tokens `to`'s `/tokenize` counts in the first probe less those in
/// the second (`crate::request::migrate::Count`), or why there is none:
/// either call failed or was refused, or the pair took past
/// [`COUNT_DEADLINE`]. The calls are not the request's: a failure here marks
/// nothing against the pod. Both carry the count's span as their parent,
/// and it records the outcome.
pub async fn count_on(h: Execute<'_>, to: Served, count: Count) -> Result<u64, &'static str> {
    let ctx = RequestCtx::continuation(count.request_id, Route::Other, count.started);
    let upstream = upstream_of(to);
    // The client's headers (its credentials, for an engine or a gateway
    // that asks for them), as the continuation carries them.
    let mut head = http::Request::new(()).into_parts().0;
    head.method = Method::POST;
    head.uri = http::Uri::from_static("/tokenize");
    head.headers = count.headers;
    head.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    count.hop.inject(&mut head.headers);
    let one = |body: Bytes| tokenized(h, &ctx, &upstream, &head, body);
    let [with, without] = count.probes;
    let pair = async { tokio::join!(one(with), one(without)) };
    let counted = match tokio::time::timeout(COUNT_DEADLINE, pair).await {
        Ok((Ok(with), Ok(without))) => with
            .checked_sub(without)
            .ok_or("the output counted fewer than no tokens"),
        Ok((Err(e), _) | (_, Err(e))) => Err(e),
        Err(_) => Err("past the count's deadline"),
    };
    match counted {
        Ok(n) => count.hop.counted(n),
        Err(why) => count.hop.fail(&why),
    }
    counted
}

/// vLLM's `/tokenize` answer: `count`, beside the ids.
#[derive(Deserialize)]
struct Tokenized {
    count: u64,
}

/// One `/tokenize` call's `count`, or why there is none. `head` carries
/// the count's span already (the call makes none of its own).
async fn tokenized(
    h: Execute<'_>,
    ctx: &RequestCtx,
    upstream: &Upstream,
    head: &http::request::Parts,
    body: Bytes,
) -> Result<u64, &'static str> {
    let body = UpstreamBody::full(body);
    let (resp, _, _) = send_traced(&h.up, ctx, upstream, head, body, Hop::off())
        .await
        .map_err(|_| "a /tokenize call failed")?;
    if !resp.status().is_success() {
        return Err("a /tokenize call was refused");
    }
    let bytes = Limited::new(resp.into_body(), MAX_TOKENIZE_RESPONSE)
        .collect()
        .await
        .map_err(|_| "a /tokenize answer was cut or too large")?
        .to_bytes();
    serde_json::from_slice::<Tokenized>(&bytes)
        .map(|t| t.count)
        .map_err(|_| "a /tokenize answer had no count")
}
