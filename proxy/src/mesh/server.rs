//! The mesh port: HTTP/2 by prior knowledge (h2c), or over mutual TLS with
//! `mesh.tls` (a peer without a certificate from the mesh CA gets nothing;
//! the handshake is bounded by `timeouts.tls_handshake`). `GET /mesh/v1/stream`
//! answers `200` with a never-ending body: the snapshot frames, then the
//! subscriber's queue of deltas ([`super::Mesh::subscribe`]). The body ends
//! when the sender drops the subscriber (slow) or shuts down; the subscriber
//! then reconnects and resyncs. With `mesh.tls` every other request is one a
//! peer forwarded ([`super::client`]) and goes down the request path as on
//! the client port; without it, anything else is `404`. A connection whose
//! first request has not arrived within `timeouts.request_head` is closed
//! and counted (`kvmesh_client_connections_rejected_total{listener="mesh"}`).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Either;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::Tasks;
use crate::metrics::{Listener, RejectReason};
use crate::server::Handler;
use crate::shutdown::Shutdown;

/// The stream's path on the mesh port.
pub const STREAM_PATH: &str = "/mesh/v1/stream";
/// Content type of the stream.
pub const CONTENT_TYPE: &str = "application/x-kvmesh-stream";
/// A subscriber with `mesh.follow: same-models` names its models here (a JSON
/// array); a sidecar serving none of them answers `409` at once rather than
/// build a snapshot the subscriber would drop at its hello.
pub const FOLLOW_MODELS: &str = "x-kvmesh-follow-models";
/// A subscriber that takes `Stats` frames (kind 7, out of sequence) sends
/// this header; older sidecars do not, and get none.
pub const TAKES_STATS: &str = "x-kvmesh-stats";
/// A subscriber that takes `Adapters` frames (kind 8, out of sequence) sends
/// this header; older sidecars do not, and learn a peer's adapters from its
/// `Hello` alone.
pub const TAKES_ADAPTERS: &str = "x-kvmesh-adapters";
/// A subscriber that takes `Prefill` frames (kind 9, out of sequence) sends
/// this header; older sidecars do not, and count only their own requests'
/// prompt tokens.
pub const TAKES_PREFILL: &str = "x-kvmesh-prefill";
/// Most mesh connections served at once (peers plus a margin).
const MAX_CONNECTIONS: usize = 8192;

/// A response body of whole frames.
pub enum StreamBody {
    Frames {
        snapshot: VecDeque<Bytes>,
        rx: mpsc::Receiver<Bytes>,
    },
    Empty,
}

impl Body for StreamBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Self::Empty => Poll::Ready(None),
            Self::Frames { snapshot, rx } => {
                if let Some(b) = snapshot.pop_front() {
                    return Poll::Ready(Some(Ok(Frame::data(b))));
                }
                rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Self::Empty)
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// Serves the mesh port until shutdown; with `mesh.tls`, a request a peer
/// forwarded goes to `forwarded` (the request path, which the sidecar passes
/// in: the mesh does not know the stages).
pub async fn serve<H: Handler>(
    shared: Tasks,
    listener: TcpListener,
    forwarded: H,
    shutdown: Shutdown,
) {
    let mut conns = JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let (tcp, _) = tokio::select! {
            _ = shutdown.triggered() => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "mesh: accept failed");
                    tokio::select! {
                        _ = shutdown.triggered() => break,
                        _ = tokio::time::sleep(Duration::from_millis(50)) => continue,
                    }
                }
            },
        };
        if conns.len() >= MAX_CONNECTIONS {
            continue; // dropped: the peer retries with backoff
        }
        let _ = tcp.set_nodelay(true);
        let shared = shared.clone();
        let shutdown = shutdown.clone();
        let forwarded = forwarded.clone();
        conns.spawn(async move {
            let Some(tls) = shared.mesh.tls() else {
                return serve_conn(shared.clone(), tcp, forwarded, &shutdown).await;
            };
            let handshake = shared.config.timeouts.tls_handshake.get();
            match tokio::time::timeout(handshake, tls.acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => serve_conn(shared.clone(), stream, forwarded, &shutdown).await,
                Ok(Err(e)) => {
                    shared.mesh.metrics.tls_failure("accept");
                    tracing::info!(error = %e, "mesh: TLS handshake with a subscriber failed");
                }
                Err(_) => {
                    shared.mesh.metrics.tls_failure("accept");
                    tracing::info!("mesh: TLS handshake with a subscriber timed out");
                }
            }
        });
    }
    // Each connection finishes on its own deadline (serve_conn); the set is
    // not aborted, so forwarded requests do drain.
    drop(listener);
    while conns.join_next().await.is_some() {}
}

/// Serves one connection (TCP or TLS) until it ends or shutdown. On
/// shutdown, streams end (the hub drops its subscribers) and forwarded
/// requests get `timeouts.shutdown_drain` to finish.
async fn serve_conn<I, H>(shared: Tasks, io: I, forwarded: H, shutdown: &Shutdown)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Handler,
{
    let drain = if shared.mesh.tls().is_some() {
        shared.config.timeouts.shutdown_drain.get()
    } else {
        Duration::from_secs(1)
    };
    let app_limit = shared.config.limits.max_connections;
    let (metrics, head) = (
        shared.metrics.clone(),
        shared.config.timeouts.request_head.get(),
    );
    // Set at the first request: until then only the head deadline bounds a
    // connection (a preface trickled or never sent), and h2 keep-alive
    // pings do not start before the handshake.
    let started = Arc::new(AtomicBool::new(false));
    let seen = started.clone();
    let svc = service_fn(move |req: Request<Incoming>| {
        seen.store(true, Ordering::Relaxed);
        // The state stream is answered at once; with `mesh.tls`, anything
        // else is a request a peer forwarded, for the request path.
        let next = if req.uri().path() == STREAM_PATH || shared.mesh.tls().is_none() {
            Ok(handle(&shared, &req))
        } else {
            Err(forwarded.clone())
        };
        async move {
            Ok::<_, Infallible>(match next {
                Ok(stream) => stream.map(Either::Left),
                Err(path) => path
                    .handle(req.map(crate::body::IncomingBody::Hyper))
                    .await
                    .map(Either::Right),
            })
        }
    });
    // One connection carries every request a peer forwards here: no
    // stream cap below the client port's connection limit.
    let streams = u32::try_from(app_limit).unwrap_or(u32::MAX);
    let mut b = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    b.timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(10)))
        .keep_alive_timeout(Duration::from_secs(20))
        .max_concurrent_streams(streams)
        .adaptive_window(true);
    let conn = b.serve_connection(TokioIo::new(io), svc);
    tokio::pin!(conn);
    let deadline = tokio::time::sleep(head);
    tokio::pin!(deadline);
    let mut head_pending = true;
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = shutdown.triggered() => break,
            _ = deadline.as_mut(), if head_pending => {
                if !started.load(Ordering::Relaxed) {
                    metrics.clients.rejected(Listener::Mesh, RejectReason::HeaderTimeout);
                    tracing::debug!("mesh: no request within timeouts.request_head; closing");
                    return; // dropping the connection closes the socket
                }
                head_pending = false;
            }
        }
    }
    conn.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(drain, conn).await;
}

fn handle(shared: &Tasks, req: &Request<Incoming>) -> Response<StreamBody> {
    if req.uri().path() != STREAM_PATH || req.method() != http::Method::GET {
        return status(StatusCode::NOT_FOUND);
    }
    let theirs: Option<Vec<String>> = req
        .headers()
        .get(FOLLOW_MODELS)
        .and_then(|v| serde_json::from_slice(v.as_bytes()).ok());
    if let Some(theirs) = theirs {
        let ours = &shared.config.pod.models;
        if !crate::config::mesh::Follow::SameModels.follows(&theirs, ours) {
            shared.mesh.metrics.dropped("other_models");
            return status(StatusCode::CONFLICT);
        }
    }
    let h = req.headers();
    let takes = super::Takes {
        stats: h.contains_key(TAKES_STATS),
        adapters: h.contains_key(TAKES_ADAPTERS),
        prefill: h.contains_key(TAKES_PREFILL),
    };
    match shared.mesh.subscribe(takes) {
        Some(sub) => {
            let mut r = Response::new(StreamBody::Frames {
                snapshot: sub.snapshot.into(),
                rx: sub.rx,
            });
            if let Ok(v) = http::HeaderValue::from_str(CONTENT_TYPE) {
                r.headers_mut().insert(http::header::CONTENT_TYPE, v);
            }
            r
        }
        None => status(StatusCode::SERVICE_UNAVAILABLE),
    }
}

fn status(s: StatusCode) -> Response<StreamBody> {
    let mut r = Response::new(StreamBody::Empty);
    *r.status_mut() = s;
    r
}
