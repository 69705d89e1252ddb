//! Accepting connections: TCP (TLS optional), a bounded number of
//! connections, and graceful shutdown: stop accepting, let each connection
//! finish its in-flight requests up to the drain deadline, then cut the rest.
//! Every connection task is owned by the [`JoinSet`] of its listener.
//!
//! Plain TCP connections speak HTTP/1.1 through kvmesh's own codec
//! (`h1.rs`), unless they open with the HTTP/2 preface; HTTP/2 by prior
//! knowledge and everything over TLS (HTTP/1.1 or HTTP/2 by ALPN) go to
//! hyper-util's auto server ([`serve_conn`]).
//!
//! Slow clients are bounded: a connection whose first request has not begun
//! within `timeouts.request_head` is closed (every later head has the same
//! deadline; an oversize head is answered 431), and each cut is counted in
//! `kvmesh_client_connections_rejected_total`.

mod h1;

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;

use crate::body::{IncomingBody, ResponseBody};
use crate::metrics::{Listener, Metrics, RejectReason};
use crate::shutdown::Shutdown;

/// Answers requests of one listener.
pub trait Handler: Clone + Send + Sync + 'static {
    fn handle(
        self,
        req: Request<IncomingBody>,
    ) -> impl Future<Output = Response<ResponseBody>> + Send + 'static;
}

/// How a listener serves.
#[derive(Clone)]
pub struct ServeOpts {
    /// For logs: `client` or `admin`.
    pub name: &'static str,
    pub tls: Option<TlsAcceptor>,
    pub tls_handshake: Duration,
    /// Concurrent connections: a permit per connection, shared by every
    /// thread accepting on this listener; further accepts wait for one.
    pub slots: Arc<Semaphore>,
    pub drain: Duration,
    /// How long a request head may take (`timeouts.request_head`).
    pub request_head: Duration,
    /// Which serving thread accepts (`runtime.worker_threads`; 0 is the first).
    pub thread: u16,
    /// Where accepted connections and cut clients are counted (`None`: not
    /// counted, the admin port).
    pub metrics: Option<Arc<Metrics>>,
}

/// Accepts until `shutdown`, then drains. Returns when every connection is gone.
pub async fn serve<H: Handler>(
    listener: TcpListener,
    handler: H,
    opts: ServeOpts,
    shutdown: Shutdown,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // The timer bounds how long a client may take to send its request head.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(opts.request_head);
    builder.http2().timer(TokioTimer::new());
    let slots = opts.slots.clone();
    let accepted = opts
        .metrics
        .as_ref()
        .map(|m| m.clients.connections(opts.thread));
    let mut conns = JoinSet::new();
    loop {
        // Reap finished connections so the set stays as small as the live ones.
        while conns.try_join_next().is_some() {}
        let permit = tokio::select! {
            _ = shutdown.triggered() => break,
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break, // the semaphore is never closed; stop rather than spin
            },
        };
        let (tcp, peer) = tokio::select! {
            _ = shutdown.triggered() => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(listener = opts.name, error = %e, "accept failed");
                    tokio::select! {
                        _ = shutdown.triggered() => break,
                        _ = tokio::time::sleep(Duration::from_millis(50)) => continue,
                    }
                }
            },
        };
        if let Some(c) = &accepted {
            c.inc();
        }
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "set_nodelay failed");
        }
        let builder = builder.clone();
        let handler = handler.clone();
        let shutdown = shutdown.clone();
        let tls = opts.tls.clone();
        let handshake = opts.tls_handshake;
        let name = opts.name;
        let limits = ConnLimits {
            request_head: opts.request_head,
            rejected: opts.metrics.clone(),
        };
        conns.spawn(async move {
            let _permit = permit;
            match tls {
                None => h1::serve(tcp, handler, &shutdown, &limits, &builder).await,
                Some(acceptor) => match tokio::time::timeout(handshake, acceptor.accept(tcp)).await
                {
                    Ok(Ok(tls)) => serve_conn(&builder, tls, handler, &shutdown, &limits).await,
                    Ok(Err(e)) => {
                        limits.reject(RejectReason::TlsHandshake);
                        tracing::debug!(listener = name, %peer, error = %e, "TLS handshake failed")
                    }
                    Err(_) => {
                        limits.reject(RejectReason::TlsHandshake);
                        tracing::debug!(listener = name, %peer, "TLS handshake timed out")
                    }
                },
            }
        });
    }
    drop(listener);
    tracing::info!(
        listener = opts.name,
        connections = conns.len(),
        "stopped accepting; draining"
    );
    let drained = tokio::time::timeout(opts.drain, async {
        while conns.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            listener = opts.name,
            cut = conns.len(),
            "drain deadline passed; closing the rest"
        );
        conns.shutdown().await;
    }
}

/// The per-connection bounds on slow clients, and where cuts are counted.
struct ConnLimits {
    request_head: Duration,
    rejected: Option<Arc<Metrics>>,
}

impl ConnLimits {
    fn reject(&self, reason: RejectReason) {
        if let Some(m) = &self.rejected {
            m.clients.rejected(Listener::Client, reason);
        }
    }
}

/// How the first wait on a connection ended.
enum First<R> {
    Ended(R),
    Shutdown,
    HeadDeadline,
}

async fn serve_conn<I, H>(
    builder: &auto::Builder<TokioExecutor>,
    io: I,
    handler: H,
    shutdown: &Shutdown,
    limits: &ConnLimits,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Handler,
{
    // Set when the first request head is complete. Until then nothing but
    // the head deadline bounds the connection: hyper's own HTTP/1.1 header
    // timeout does not cover the protocol sniffing of the auto builder nor
    // an HTTP/2 preface, and a client may send nothing at all.
    let started = Arc::new(AtomicBool::new(false));
    let seen = started.clone();
    let service = service_fn(move |req: Request<hyper::body::Incoming>| {
        seen.store(true, Ordering::Relaxed);
        // Boxed: hyper moves the service's future into its dispatcher, and
        // this wrapper holds the handler's; the request path's is about
        // 5.7 KB, a memcpy of its whole state per request where moving a box
        // moves a pointer. Paced requests (one at a time, caches cold) cost a
        // few percent less CPU for it (docs/bench-tool.md, "Paced: user
        // time, not syscalls").
        let fut = Box::pin(handler.clone().handle(req.map(IncomingBody::Hyper)));
        async move { Ok::<_, Infallible>(fut.await) }
    });
    let conn = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    // Biased, the connection first: its end wins over a shutdown that
    // raced it, and no branch order is drawn on every wake-up.
    let first = tokio::select! {
        biased;
        r = conn.as_mut() => First::Ended(r),
        _ = shutdown.triggered() => First::Shutdown,
        _ = tokio::time::sleep(limits.request_head) => First::HeadDeadline,
    };
    let first = match first {
        First::HeadDeadline if !started.load(Ordering::Relaxed) => {
            limits.reject(RejectReason::HeaderTimeout);
            tracing::debug!("no request head within timeouts.request_head; closing");
            return; // dropping the connection closes the socket
        }
        First::HeadDeadline => tokio::select! {
            biased;
            r = conn.as_mut() => First::Ended(r),
            _ = shutdown.triggered() => First::Shutdown,
        },
        other => other,
    };
    let result = match first {
        First::Ended(r) => r,
        // Finish in-flight requests (h1: the current one; h2: GOAWAY, then
        // the open streams); the listener's drain deadline bounds this.
        _ => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        if let Some(h) = e.downcast_ref::<hyper::Error>() {
            // A header timeout after the first request is also how an idle
            // keep-alive connection ends: only a first head is counted.
            if h.is_timeout() && !started.load(Ordering::Relaxed) {
                limits.reject(RejectReason::HeaderTimeout);
            } else if h.is_parse_too_large() {
                limits.reject(RejectReason::HeaderTooLarge);
            }
        }
        tracing::debug!(error = %e, "connection ended with an error");
    }
}
