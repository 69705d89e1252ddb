//! One call upstream and the relay of its response: where a call goes
//! ([`Upstream`]), sending the client's head rewritten for the hop under the
//! first-byte deadline ([`send`]), and relaying the response chunk by chunk
//! under the idle and overall deadlines ([`relay`]). The execute stage and
//! the P/D connectors make every upstream call through here, with the
//! narrow [`Upstreams`] handle (the pools, the fleet view, the deadlines),
//! never the whole `App`.

use std::net::SocketAddr;
use std::sync::Arc;

use http::uri::{Authority, PathAndQuery, Scheme};
use http::{header, HeaderValue, Request, Response, Uri};
use tokio::time::Instant;

use super::context::{RequestCtx, Served};
use super::plan::Leg;
use crate::body::{RelayParams, ResponseBody, UpstreamBody};
use crate::config::{EngineUrl, Limits, Pd as PdConfig, Pod, Timeouts};
use crate::error::{error_chain, ProxyError, UpstreamName};
use crate::headers::{copy_end_to_end, strip_hop_by_hop, REQUEST_ID, ROUTED};
use crate::metrics::UpstreamMetrics;
use crate::otel::Hop;
use crate::upstream::mesh::{MeshClient, MeshRoutes, MeshSendError};
use crate::upstream::{EngineError, EnginePool, ReplyBody, UpstreamClient};

/// What an upstream call needs, borrowed from the sidecar's state for one
/// call: no allocation, no reference count touched.
#[derive(Clone, Copy)]
pub struct Upstreams<'a> {
    /// The local engine's address.
    pub engine_url: &'a EngineUrl,
    pub timeouts: &'a Timeouts,
    /// The largest client body sent on (a streamed one is cut there).
    pub limits: &'a Limits,
    /// The P/D connectors' settings (`crate::pd` reads them).
    pub pd: &'a PdConfig,
    /// The local pod (its node IP, for a P/D leg's KV agent).
    pub pod: &'a Pod,
    /// Upstream latency, fallbacks, and (held by each relayed body) the relay's counts.
    pub metrics: &'a Arc<UpstreamMetrics>,
    /// The general pooled client (peers, llm-d's prefiller, h2c).
    pub client: &'a UpstreamClient,
    /// The local engine's own keep-alive pool; `None` with h2c upstreams.
    pub engine: Option<&'a EnginePool>,
    /// The mesh's mutual TLS to peers' mesh ports (`mesh.tls`), and where they are.
    pub mesh_tls: Option<&'a MeshClient>,
    pub mesh_routes: &'a MeshRoutes,
    /// Which addresses are discovered peers.
    pub peers: &'a dyn super::Peers,
}

/// Where a disaggregated request's leg goes.
pub(crate) fn leg_upstream(leg: &Leg) -> Upstream {
    match leg {
        Leg::LocalEngine => Upstream::Engine,
        Leg::Peer { sidecar_addr } => Upstream::Peer(*sidecar_addr),
        Leg::Direct(a) => Upstream::Direct(a.clone()),
    }
}

/// Where one attempt goes.
#[derive(Debug, Clone)]
pub(crate) enum Upstream {
    /// This pod's engine.
    Engine,
    /// Another pod's sidecar, which runs the request on its engine.
    Peer(SocketAddr),
    /// An engine outside the mesh named by an llm-d EPP (`x-prefiller-host-port`).
    Direct(Authority),
}

impl Upstream {
    pub(crate) fn served(&self) -> Served {
        match self {
            Self::Engine | Self::Direct(_) => Served::LocalEngine,
            Self::Peer(a) => Served::Peer(*a),
        }
    }

    /// The pod id behind this upstream (an llm-d prefiller: its address).
    pub(crate) fn pod(&self, peers: &dyn super::Peers) -> String {
        match self {
            Self::Engine => peers.local_id().to_owned(),
            Self::Peer(a) => peers.peer_id(*a).unwrap_or_else(|| a.to_string()),
            Self::Direct(a) => a.to_string(),
        }
    }

    /// The name errors and logs use.
    pub(crate) fn name(&self, engine_url: &EngineUrl) -> UpstreamName {
        match self {
            Self::Engine => UpstreamName::Engine(engine_url.authority().to_string()),
            Self::Peer(addr) => UpstreamName::Peer(addr.to_string()),
            Self::Direct(a) => UpstreamName::Engine(a.to_string()),
        }
    }

    /// The address to connect to, and the name errors use.
    fn resolve(&self, engine_url: &EngineUrl) -> Result<(Authority, UpstreamName), ProxyError> {
        Ok(match self {
            Self::Engine => {
                let a = engine_url.authority().clone();
                let n = UpstreamName::Engine(a.to_string());
                (a, n)
            }
            Self::Peer(addr) => {
                let a = Authority::try_from(addr.to_string())
                    .map_err(|e| ProxyError::Internal(format!("peer address {addr}: {e}")))?;
                (a, UpstreamName::Peer(addr.to_string()))
            }
            Self::Direct(a) => (a.clone(), UpstreamName::Engine(a.to_string())),
        })
    }
}

/// The span of a whole request sent to one target (`send`'s `leg`).
pub(crate) const FORWARD: &str = "kvmesh.forward";

/// Sends one request (the client's head, rewritten for the hop, with `body`)
/// and waits for the response head under the first-byte deadline. `leg`
/// names the call's span (`FORWARD`, or a P/D leg's), the `attempt`-th of
/// the request; its context goes upstream in `traceparent`, and it is
/// returned with the response, to end when the response does.
pub(crate) async fn send(
    up: &Upstreams<'_>,
    ctx: &RequestCtx,
    upstream: &Upstream,
    head: &http::request::Parts,
    body: UpstreamBody,
    leg: &'static str,
    attempt: u8,
) -> Result<(Response<ReplyBody>, UpstreamName, Hop), ProxyError> {
    let (authority, name) = upstream.resolve(up.engine_url)?;
    let hop = Hop::of(ctx.trace.as_deref(), leg, &name, attempt);
    send_on(up, ctx, upstream, (authority, name), head, body, hop).await
}

/// [`send`], its span (`hop`) made by the caller: a migrating stream's
/// continuation, sent after the request's context is gone.
pub(crate) async fn send_traced(
    up: &Upstreams<'_>,
    ctx: &RequestCtx,
    upstream: &Upstream,
    head: &http::request::Parts,
    body: UpstreamBody,
    hop: Hop,
) -> Result<(Response<ReplyBody>, UpstreamName, Hop), ProxyError> {
    let to = upstream.resolve(up.engine_url)?;
    send_on(up, ctx, upstream, to, head, body, hop).await
}

async fn send_on(
    up: &Upstreams<'_>,
    ctx: &RequestCtx,
    upstream: &Upstream,
    (authority, name): (Authority, UpstreamName),
    head: &http::request::Parts,
    body: UpstreamBody,
    hop: Hop,
) -> Result<(Response<ReplyBody>, UpstreamName, Hop), ProxyError> {
    let r = send_as(up, ctx, upstream, authority, &name, head, body, &hop).await;
    match r {
        Ok(resp) => {
            hop.status(resp.status().as_u16());
            Ok((resp, name, hop))
        }
        Err(e) => {
            hop.fail(&e);
            Err(e)
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn send_as(
    up: &Upstreams<'_>,
    ctx: &RequestCtx,
    upstream: &Upstream,
    authority: Authority,
    name: &UpstreamName,
    head: &http::request::Parts,
    body: UpstreamBody,
    hop: &Hop,
) -> Result<Response<ReplyBody>, ProxyError> {
    // Taken before the request is built, which checks that the peer is
    // still one: a peer cut off in between fails the call at once.
    let lost = match upstream {
        Upstream::Peer(addr) => up.peers.lost_signal(*addr),
        Upstream::Engine | Upstream::Direct(_) => None,
    };
    let mut out = build_request(up, ctx, upstream, authority, head, body)?;
    if let (Upstream::Engine, Some(rank)) = (upstream, ctx.dp_rank) {
        // The schedule stage's choice, replacing a client's.
        out.headers_mut()
            .insert(crate::headers::RANK, HeaderValue::from(rank));
        hop.rank(rank);
    }
    hop.inject(out.headers_mut());
    let timeouts = up.timeouts;
    let overall_left = timeouts.overall.get().saturating_sub(ctx.started.elapsed());
    let head_wait = timeouts.first_byte.get().min(overall_left);
    let sent = Instant::now();
    // Boxed, so that the timeout holds a pointer and not the upstream call's
    // whole state (see `serve_conn` in server.rs).
    let call = Box::pin(unless_lost(
        up,
        name,
        lost,
        request(up, upstream, name, out),
    ));
    let resp = match tokio::time::timeout(head_wait, call).await {
        Err(_) => {
            return Err(ProxyError::FirstByteTimeout {
                upstream: name.clone(),
                after: head_wait,
            })
        }
        Ok(r) => r?,
    };
    up.metrics.latency(ctx.route, sent.elapsed().as_secs_f64());
    Ok(resp)
}

/// The outcome in `kvmesh_migrations_total` of a call cut short because its
/// pod was declared unreachable before the response head.
pub(crate) const RETRIED_UNREACHABLE: &str = "retried_unreachable";

/// `call` to a peer, unless the peer is declared unreachable (`lost`, see
/// `crate::fleet::Fleet::cut_off_peer`) before its response head: then the
/// call is dropped and fails as a connection broken before the head, which
/// the execute stage retries on the next pod. Nothing reached the client,
/// and across a partition the head would come at the heal at best: without
/// this the request would wait out `first_byte` and fail.
async fn unless_lost(
    up: &Upstreams<'_>,
    name: &UpstreamName,
    lost: Option<tokio_util::sync::CancellationToken>,
    call: impl std::future::Future<Output = Result<Response<ReplyBody>, ProxyError>>,
) -> Result<Response<ReplyBody>, ProxyError> {
    let Some(lost) = lost else {
        return call.await;
    };
    tokio::select! {
        biased;
        r = call => r,
        () = lost.cancelled() => {
            up.metrics.migration(RETRIED_UNREACHABLE);
            tracing::info!(upstream = %name, "the pod was declared unreachable before its response head; retrying the request elsewhere");
            Err(ProxyError::UpstreamFailed {
                upstream: name.clone(),
                reason: "declared unreachable before its response head (its mesh stream was silent past mesh.stale_after)".to_owned(),
            })
        }
    }
}

/// Sends `out` over the engine's own pool, the general pooled client, or, to a
/// peer with `mesh.tls`, over the mesh's mutual TLS to its mesh port; a
/// connection error means nothing was sent.
async fn request(
    up: &Upstreams<'_>,
    upstream: &Upstream,
    name: &UpstreamName,
    out: Request<UpstreamBody>,
) -> Result<Response<ReplyBody>, ProxyError> {
    let connect = |reason: String| ProxyError::Connect {
        upstream: name.clone(),
        reason,
    };
    let failed = |reason: String| ProxyError::UpstreamFailed {
        upstream: name.clone(),
        reason,
    };
    match (upstream, up.mesh_tls, up.engine) {
        (Upstream::Engine, _, Some(pool)) => pool.send(out).await.map_err(|e| match e {
            EngineError::Connect { .. } => connect(e.to_string()),
            EngineError::Request(e) => failed(error_chain(&e)),
        }),
        (Upstream::Peer(peer), Some(mesh), _) => {
            let port = up
                .mesh_routes
                .get(*peer)
                .ok_or_else(|| connect("no mesh port known for this peer".to_owned()))?;
            // Boxed, like the P/D calls: the mesh client's future is large
            // and rarely needed, and inlined it would grow every request's
            // future (which is moved on every request).
            // The client counts a failed TLS handshake itself.
            let resp = Box::pin(mesh.send(port, out)).await.map_err(|e| match e {
                MeshSendError::Connect { .. } => connect(e.to_string()),
                MeshSendError::Request { .. } => failed(e.to_string()),
            })?;
            Ok(resp.map(ReplyBody::plain))
        }
        _ => match up.client.request(out).await {
            Ok(resp) => Ok(resp.map(ReplyBody::plain)),
            Err(e) if e.is_connect() => Err(connect(error_chain(&e))),
            Err(e) => Err(failed(error_chain(&e))),
        },
    }
}

/// Relays an upstream response to the client, chunk by chunk, under the idle
/// and overall deadlines; `hop`, the call's span, ends with the body.
pub(crate) fn relay(
    up: &Upstreams<'_>,
    ctx: &RequestCtx,
    name: UpstreamName,
    resp: Response<ReplyBody>,
    hop: Hop,
) -> Response<ResponseBody> {
    let timeouts = up.timeouts;
    let (mut head, incoming) = resp.into_parts();
    strip_hop_by_hop(&mut head.headers);
    let sse = head
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if sse {
        // An error event may be appended, so the length is not ours to promise.
        head.headers.remove(header::CONTENT_LENGTH);
    }
    head.headers.insert(REQUEST_ID, ctx.request_id.clone());
    let body = ResponseBody::relay(
        incoming,
        RelayParams {
            upstream: name,
            route: ctx.route,
            metrics: Arc::clone(up.metrics),
            started: ctx.started,
            stream_idle: timeouts.stream_idle.get(),
            overall: timeouts.overall.get(),
            sse,
            request_id: ctx.id().to_owned(),
        },
    )
    .with_span(hop);
    Response::from_parts(head, body)
}

fn build_request(
    up: &Upstreams<'_>,
    ctx: &RequestCtx,
    upstream: &Upstream,
    authority: Authority,
    head: &http::request::Parts,
    body: UpstreamBody,
) -> Result<Request<UpstreamBody>, ProxyError> {
    let path = head
        .uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    let over_mesh_tls = matches!(upstream, Upstream::Peer(_)) && up.mesh_tls.is_some();
    let uri = Uri::builder()
        .scheme(if over_mesh_tls {
            Scheme::HTTPS
        } else {
            Scheme::HTTP
        })
        .authority(authority)
        .path_and_query(path)
        .build()
        .map_err(|e| ProxyError::Internal(format!("upstream URI: {e}")))?;
    // A body the proxy rewrote (a P/D leg) has its own length: let the client
    // pool compute it from the body rather than send the client's.
    let rewritten = matches!(body, UpstreamBody::Full(_));
    let mut out = Request::new(body);
    *out.method_mut() = head.method.clone();
    *out.uri_mut() = uri;
    let headers = out.headers_mut();
    let to_engine = !matches!(upstream, Upstream::Peer(_));
    // The client's headers but the hop-by-hop ones and, in the same pass:
    // the client's length of a body the pool measures itself; llm-d's P/D
    // headers, which are for this sidecar (the engine never sees them);
    // Host, which the client pool sets from the upstream URI, as a reverse
    // proxy should; the mesh's routing marks, towards an engine.
    copy_end_to_end(&head.headers, headers, |n| {
        (rewritten && n == header::CONTENT_LENGTH)
            || n == crate::headers::PREFILLER
            || n == header::HOST
            || (to_engine && (n == ROUTED || n == crate::headers::HOPS))
    });
    headers.insert(REQUEST_ID, ctx.request_id.clone());
    if let Upstream::Peer(addr) = upstream {
        super::hops::prepare(up.peers, *addr, &head.headers, headers)?;
        headers.insert(ROUTED, HeaderValue::from_static("1"));
    }
    Ok(out)
}
