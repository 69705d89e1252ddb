//! Stage 4, execute: send the request to the plan's target and relay the
//! response. A target that refuses the connection (nothing was sent), whose
//! connection breaks before a response head, an engine that answers 500, 502,
//! 503 or 504 before any byte, or a peer sidecar that answers with the
//! `x-kvmesh-unserved` mark (its own engine did one of these) hands the
//! request to the next fallback, and after the plan's targets the local
//! engine, once, as a last resort (`last_resort_is_local`), then, for the
//! client's inference requests, other pods the fleet knows, up to
//! `migration.max_migrations` (`elsewhere`; a pod tried after a refusal is
//! not counted, since nothing reached the refusing one); when none serves it, the last
//! 5xx answer is relayed. Any later failure (a body that breaks, a deadline) is final,
//! because the upstream may be working on it. A disaggregated target whose
//! decode pod fails before any byte (refuses, or answers 5xx) has its decode
//! leg sent again with the same `kv_transfer_params` to the next decode pod
//! while the prefill pod's lease holds (`crate::pd`); after that, the next
//! fallback serves the request whole (the prefill pod frees the blocks it
//! held for that decode when its lease expires).

use std::sync::atomic::AtomicBool;

use http::{HeaderValue, Response};
use http_body_util::Limited;
use tokio::time::Instant;

use crate::body::{ResponseBody, UpstreamBody};
use crate::config::Limits;
use crate::error::{ProxyError, UpstreamName};
use crate::fleet::Fleet;
use crate::headers::UNSERVED;
use crate::otel::Hop;
use crate::pd::metrics::PdMetrics;
use crate::request::migrate::{KvResend, Migration, RerouteSource, Start};
use crate::request::{
    leg_upstream, relay, send, ClientBody, ClientRequest, Leg, Plan, RequestCtx, Served, Target,
    Upstream, Upstreams, FORWARD, MAX_ATTEMPTS,
};
use crate::upstream::ReplyBody;

use super::account::Accounting;

/// What the execute stage reads, borrowed for one request (`path::handles::execute`):
/// the upstream calls (pools, fleet view, deadlines, counters), the books
/// it keeps as it goes, and whether the local engine is up (the last
/// resort).
#[derive(Clone, Copy)]
pub struct Execute<'a> {
    pub up: Upstreams<'a>,
    pub books: Accounting<'a>,
    /// P/D's counters, for a split.
    pub pd: &'a PdMetrics,
    /// Set by the readiness probe once the local engine answers.
    pub engine_ready: &'a AtomicBool,
    /// Whether and how far a stream may migrate.
    pub migration: &'a crate::config::Migration,
    /// Gives a stream its way to another pod; `None` for a continuation
    /// itself (the first stream's relay migrates it again).
    pub reroute: Option<&'a dyn RerouteSource>,
}

pub async fn execute(
    h: Execute<'_>,
    ctx: &mut RequestCtx,
    plan: Plan,
    mut req: ClientRequest,
) -> Result<Response<ResponseBody>, ProxyError> {
    crate::request::hops::check_arrival(&req.head.headers)?;
    if let Some(t) = ctx.trace.as_mut() {
        t.begin_execute();
    }
    let mut prefill_fallbacks = plan.prefill_fallbacks;
    let mut targets: std::collections::VecDeque<Target> = std::iter::once(plan.target)
        .chain(plan.fallbacks)
        .take(MAX_ATTEMPTS)
        .collect();
    // Every target tried, in order.
    let mut attempted: Vec<Target> = Vec::new();
    // Pods tried past the plan (`elsewhere`) that may have started work.
    let mut retried = 0;
    // Whether the last target tried refused the connection: nothing reached
    // it, so the next pod past the plan is not counted in `retried`.
    let mut refused = false;
    let mut last = None;
    let mut last_reply: Option<(Upstream, Unserved)> = None;
    // Decode pods that failed before any byte: not tried again whole.
    let mut refused_decodes: Vec<Served> = Vec::new();
    loop {
        let target = match targets.pop_front() {
            Some(t) => t,
            // Every target of the plan failed before any byte: the local
            // engine is the last resort, once, then another pod.
            None if last_resort_is_local(h, ctx, &attempted) => Target::LocalEngine,
            None => match elsewhere(h, ctx, &req, &attempted, &mut retried, refused) {
                Some(t) => t,
                None => break,
            },
        };
        attempted.push(target.clone());
        if refused_decodes.contains(&served_on(&target)) {
            continue;
        }
        refused = false;
        super::account::predict(h.books, ctx, &target);
        super::account::rank_taken(h.books, ctx, &target);
        if matches!(target, Target::Disaggregated { .. }) {
            // A split counts at its decode pod from the start, while its
            // prefill leg runs (which counts at the prefill pod).
            super::account::track(h.books, ctx, &target);
        }
        let upstream = match target {
            Target::LocalEngine => Upstream::Engine,
            Target::Peer { sidecar_addr } => Upstream::Peer(sidecar_addr),
            Target::Disaggregated { prefill, decode } => {
                ctx.attempts += 1;
                let prefill_fallbacks = std::mem::take(&mut prefill_fallbacks);
                let mut access = ctx.access.take();
                if let Some(a) = access.as_mut() {
                    a.legs(
                        leg_pod(h.books.fleet, &prefill),
                        leg_pod(h.books.fleet, &decode),
                    );
                }
                let mut pd = crate::pd::PdPlan::scheduled(prefill, prefill_fallbacks, decode);
                // A decode leg that fails before any byte goes again to the
                // pod a migrating stream would go on on.
                let model = ctx.view.as_ref().and_then(|v| v.model.clone());
                let left: Vec<Target> = targets.iter().cloned().collect();
                let next_decode = |failed: &[Upstream]| {
                    let avoid: Vec<Served> = failed.iter().map(Upstream::served).collect();
                    let next = super::migrate::pick(h, model.as_deref(), &avoid, &left)?;
                    Some(super::migrate::upstream_of(next))
                };
                let split = crate::pd::Pd {
                    up: h.up,
                    metrics: h.pd,
                    fleet: h.books.fleet,
                    lease: h.migration.pd_kv_lease.get(),
                    max_resends: h.migration.max_migrations,
                    next_decode: &next_decode,
                };
                let run = Box::pin(crate::pd::execute(split, ctx, &mut pd, &req));
                let r = crate::access::pd_scope(access.as_deref_mut(), run).await;
                ctx.access = access;
                for failed in pd.failed_decodes() {
                    super::account::failed(h.books, failed);
                    refused_decodes.push(failed.served());
                }
                let decode = pd.decode();
                let decode_name = decode.name(h.up.engine_url);
                match r {
                    Ok(resp) => {
                        let all = tried_and_left(&attempted, &targets);
                        let serving = whole_on(decode);
                        if !pd.failed_decodes().is_empty() {
                            // The re-sent decode leg counts at its pod now.
                            super::account::track(h.books, ctx, &serving);
                        }
                        let stream = Serving {
                            targets: all,
                            serving: &serving,
                            upstream: decode_name,
                            kv_resend: pd.kv_resend(),
                        };
                        return Ok(migrating(h, ctx, &req, stream, resp));
                    }
                    Err(e) if failed_before_any_byte(&e, pd.failed_decodes(), h.up.engine_url) => {
                        tracing::warn!(request_id = ctx.id(), error = %e, "the decode pod failed before any byte; trying the next fallback whole");
                        last = Some(e);
                        continue;
                    }
                    other => return other,
                }
            }
        };
        // A streamed body can be sent once; after a refusal it is still unread,
        // but only a buffered body may go to a second target.
        let tried = last.is_some() || last_reply.is_some();
        if tried && matches!(req.body, ClientBody::Streaming(_)) {
            break;
        }
        ctx.attempts += 1;
        super::account::track(h.books, ctx, &target);
        match forward(h.up, ctx, upstream.clone(), &mut req).await {
            Ok(Forwarded::Served(resp)) => {
                super::account::served(h.books, ctx, &upstream);
                ctx.served_by = Some(upstream.served());
                let all = tried_and_left(&attempted, &targets);
                let name = upstream.name(h.up.engine_url);
                let stream = Serving {
                    targets: all,
                    serving: &target,
                    upstream: name,
                    kv_resend: None,
                };
                return Ok(migrating(h, ctx, &req, stream, resp));
            }
            Ok(Forwarded::Unserved(reply)) => {
                super::account::failed(h.books, &upstream);
                h.up.metrics.fallback();
                tracing::debug!(request_id = ctx.id(), status = %reply.resp.status(), "target answered 5xx before any byte; trying the next fallback");
                last_reply = Some((upstream, reply));
            }
            Err(e) if crate::error::next_target_may_serve(&e) => {
                super::account::failed(h.books, &upstream);
                h.up.metrics.fallback();
                tracing::debug!(request_id = ctx.id(), error = %e, "target refused; trying the next fallback");
                refused = matches!(e, ProxyError::Connect { .. });
                last = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    // Every target failed before any byte. The last 5xx answer, if one came,
    // says more than a refusal; a request a peer routed here carries the mark
    // that lets that peer try its own next fallback.
    if let Some((upstream, reply)) = last_reply {
        let Unserved {
            mut resp,
            name,
            hop,
        } = reply;
        if ctx.already_routed {
            resp.headers_mut()
                .insert(UNSERVED, HeaderValue::from_static("1"));
        }
        ctx.served_by = Some(upstream.served());
        return Ok(relay(&h.up, ctx, name, resp, hop));
    }
    Err(last.unwrap_or_else(|| ProxyError::Internal("the plan had no target".to_owned())))
}

/// The plan's targets: those tried, then those left.
fn tried_and_left(tried: &[Target], left: &std::collections::VecDeque<Target>) -> Vec<Target> {
    tried.iter().chain(left.iter()).cloned().collect()
}

/// Who serves a stream that may migrate ([`migrating`]).
struct Serving<'a> {
    /// The plan's targets: those tried, then those left.
    targets: Vec<Target>,
    /// The target serving it, and its name.
    serving: &'a Target,
    upstream: UpstreamName,
    /// A P/D stream's decode leg, to send again as it was if its pod fails
    /// before any token.
    kv_resend: Option<KvResend>,
}

/// `resp`, a stream `stream.serving` began, able to go on on another pod if that
/// one fails mid-way (`crate::request::migrate`): the client's own streamed
/// completions, chat completions and responses, answered `200` with an
/// event stream, with migration on. Anything else is returned as it is.
fn migrating(
    h: Execute<'_>,
    ctx: &RequestCtx,
    req: &ClientRequest,
    stream: Serving<'_>,
    resp: Response<ResponseBody>,
) -> Response<ResponseBody> {
    let (Some(source), Some(view), ClientBody::Buffered(body)) = (h.reroute, &ctx.view, &req.body)
    else {
        return resp;
    };
    let sse = resp
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let route_ok = matches!(
        ctx.route,
        crate::metrics::Route::Completions
            | crate::metrics::Route::ChatCompletions
            | crate::metrics::Route::Responses
    );
    if !h.migration.enabled()
        || ctx.already_routed
        || !view.stream
        || !route_ok
        || !sse
        || resp.status() != http::StatusCode::OK
    {
        return resp;
    }
    let Serving {
        targets,
        serving,
        upstream,
        kv_resend,
    } = stream;
    let serving = served_on(serving);
    let start = Start {
        route: ctx.route,
        model: view.model.clone(),
        body: body.clone(),
        method: req.head.method.clone(),
        uri: req.head.uri.clone(),
        headers: req.head.headers.clone(),
        request_id: ctx.request_id.clone(),
        started: ctx.started,
        targets,
        serving,
        upstream,
        attempts: ctx.attempts,
        max_migrations: h.migration.max_migrations,
        // Past the overall deadline the request is over, wherever it goes.
        deadline: h.migration.deadline.get().min(h.up.timeouts.overall.get()),
        kv_resend,
    };
    let m = Migration::new(start, source.reroute(), std::sync::Arc::clone(h.up.metrics));
    resp.map(|b| b.with_migration(Box::new(m)))
}

/// How one attempt ended, short of an error.
enum Forwarded {
    /// A response to relay.
    Served(Response<ResponseBody>),
    /// A 5xx head before any byte (the engine's own, or a peer's marked
    /// [`UNSERVED`]): the next fallback may serve the request; kept to
    /// answer with when none does.
    Unserved(Unserved),
}

struct Unserved {
    resp: Response<ReplyBody>,
    name: UpstreamName,
    hop: Hop,
}

/// Engine statuses a fallback may do better than: a server error, overload
/// or a gateway's failure, all answered before any byte of a completion.
fn unserved_status(status: http::StatusCode) -> bool {
    matches!(status.as_u16(), 500 | 502 | 503 | 504)
}

/// Whether the local engine should be tried after every target of the plan
/// failed before any byte: the plan's pods can leave the fleet between the
/// scheduling and the attempt (a peer drained or restarted meanwhile), and a
/// plan made from a sparse view (a sidecar that just started) may name few.
/// Only when the local engine was not tried already, can take the
/// request (not a prefill-only pod, serving its model, ready, not ejected),
/// and the request was not routed here (it runs locally anyway).
fn last_resort_is_local(h: Execute<'_>, ctx: &RequestCtx, targets: &[Target]) -> bool {
    let local = |t: &Target| match t {
        Target::LocalEngine => true,
        Target::Disaggregated { decode, .. } => *decode == Leg::LocalEngine,
        Target::Peer { .. } => false,
    };
    let pod = &h.up.pod;
    let model_served = match ctx.view.as_ref().and_then(|v| v.model.as_deref()) {
        Some(m) => pod.models.is_empty() || pod.models.iter().any(|s| s == m),
        None => true,
    };
    !ctx.already_routed
        && ctx.view.is_some()
        && !targets.iter().any(local)
        && pod.role != kvmesh_filters::sched::Role::Prefill
        && model_served
        && h.engine_ready.load(std::sync::atomic::Ordering::Acquire)
        && !h
            .books
            .fleet
            .ejected(h.books.fleet.local_id(), Instant::now())
}

/// After the plan and the last resort failed before any byte: another pod
/// the fleet knows (as a migrating stream would go on, `path/migrate.rs`)
/// takes the client's inference request whole, up to
/// `migration.max_migrations` of them. A pod tried after one that refused
/// the connection is not counted (`after_refusal`): nothing reached that
/// one, so no work is done twice, and each pod is tried once, so the fleet
/// bounds the search (a scale-down that takes most pods at once leaves a
/// sidecar with many that refuse until the mesh forgets them). A request a
/// peer routed here is not (its sidecar tries its own next target), nor one
/// whose body was streamed (it is gone), nor any with migration off.
fn elsewhere(
    h: Execute<'_>,
    ctx: &RequestCtx,
    req: &ClientRequest,
    tried: &[Target],
    retried: &mut u8,
    after_refusal: bool,
) -> Option<Target> {
    let view = ctx.view.as_ref()?;
    h.reroute?;
    let spent = !after_refusal && *retried >= h.migration.max_migrations;
    if ctx.already_routed
        || !matches!(req.body, ClientBody::Buffered(_))
        || !h.migration.enabled()
        || spent
    {
        return None;
    }
    let avoid: Vec<Served> = tried.iter().map(served_on).collect();
    let next = super::migrate::pick(h, view.model.as_deref(), &avoid, &[])?;
    if !after_refusal {
        *retried += 1;
    }
    tracing::info!(
        request_id = ctx.id(),
        ?next,
        "every planned target failed before any byte; retrying on another pod"
    );
    Some(match next {
        Served::LocalEngine => Target::LocalEngine,
        Served::Peer(sidecar_addr) => Target::Peer { sidecar_addr },
    })
}

/// The pod a target serves a whole request on (a split: its decode pod).
fn served_on(t: &Target) -> Served {
    match t {
        Target::LocalEngine => Served::LocalEngine,
        Target::Peer { sidecar_addr } => Served::Peer(*sidecar_addr),
        Target::Disaggregated { decode, .. } => match decode.whole() {
            Target::Peer { sidecar_addr } => Served::Peer(sidecar_addr),
            _ => Served::LocalEngine,
        },
    }
}

/// Whether `e` is the last of the `failed` decode pods failing before any
/// byte reached the client, so that another pod may serve the request (a
/// refusal, a connection broken before the head, a decode leg's 5xx).
fn failed_before_any_byte(
    e: &ProxyError,
    failed: &[Upstream],
    engine_url: &crate::config::EngineUrl,
) -> bool {
    let Some(upstream) = failed.last().map(|u| u.name(engine_url)) else {
        return false;
    };
    crate::error::next_target_may_serve(e)
        && matches!(e, ProxyError::Connect { upstream: u, .. } | ProxyError::UpstreamFailed { upstream: u, .. } if *u == upstream)
}

/// The whole request on `u`'s pod.
fn whole_on(u: &Upstream) -> Target {
    match u {
        Upstream::Peer(sidecar_addr) => Target::Peer {
            sidecar_addr: *sidecar_addr,
        },
        Upstream::Engine | Upstream::Direct(_) => Target::LocalEngine,
    }
}

/// The pod a P/D leg goes to, for the access line.
fn leg_pod(fleet: &Fleet, leg: &Leg) -> String {
    leg_upstream(leg).pod(fleet)
}

/// One attempt: request head rewritten for the hop, body as the client sent it.
async fn forward(
    up: Upstreams<'_>,
    ctx: &RequestCtx,
    upstream: Upstream,
    req: &mut ClientRequest,
) -> Result<Forwarded, ProxyError> {
    let body = client_body(up.limits, req)?;
    let (mut resp, name, hop) =
        send(&up, ctx, &upstream, &req.head, body, FORWARD, ctx.attempts).await?;
    let unserved = match upstream {
        // The peer did not serve it and sent nothing: its engine refused or
        // failed before any byte, as if that engine were ours.
        Upstream::Peer(_) => resp.headers_mut().remove(UNSERVED).is_some(),
        Upstream::Engine | Upstream::Direct(_) => unserved_status(resp.status()),
    };
    if unserved {
        return Ok(Forwarded::Unserved(Unserved { resp, name, hop }));
    }
    Ok(Forwarded::Served(relay(&up, ctx, name, resp, hop)))
}

/// The client's body for one attempt: buffered bodies can be sent again.
fn client_body(limits: &Limits, req: &mut ClientRequest) -> Result<UpstreamBody, ProxyError> {
    Ok(match &mut req.body {
        ClientBody::Buffered(b) => UpstreamBody::full(b.clone()),
        ClientBody::Streaming(b) => {
            let incoming = b
                .take()
                .ok_or_else(|| ProxyError::Internal("streamed body sent twice".to_owned()))?;
            let limit = usize::try_from(limits.max_body_bytes.0).unwrap_or(usize::MAX);
            UpstreamBody::Stream(Limited::new(incoming, limit))
        }
    })
}
