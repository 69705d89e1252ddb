//! Accepting connections: TCP (TLS optional), HTTP/1.1 and HTTP/2 by prior
//! knowledge or ALPN (hyper-util's auto server), a bounded number of
//! connections, and graceful shutdown: stop accepting, let each connection
//! finish its in-flight requests up to the drain deadline, then cut the rest.
//! Every connection task is owned by the [`JoinSet`] of its listener.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;

use crate::body::ResponseBody;
use crate::shutdown::Shutdown;

/// Answers requests of one listener.
pub trait Handler: Clone + Send + Sync + 'static {
    fn handle(
        self,
        req: Request<Incoming>,
    ) -> impl Future<Output = Response<ResponseBody>> + Send + 'static;
}

/// How a listener serves.
pub struct ServeOpts {
    /// For logs: `client` or `admin`.
    pub name: &'static str,
    pub tls: Option<TlsAcceptor>,
    pub tls_handshake: Duration,
    pub max_connections: usize,
    pub drain: Duration,
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
    builder.http1().timer(TokioTimer::new());
    builder.http2().timer(TokioTimer::new());
    let slots = Arc::new(Semaphore::new(opts.max_connections));
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
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "set_nodelay failed");
        }
        let builder = builder.clone();
        let handler = handler.clone();
        let shutdown = shutdown.clone();
        let tls = opts.tls.clone();
        let handshake = opts.tls_handshake;
        let name = opts.name;
        conns.spawn(async move {
            let _permit = permit;
            match tls {
                None => serve_conn(&builder, tcp, handler, &shutdown).await,
                Some(acceptor) => match tokio::time::timeout(handshake, acceptor.accept(tcp)).await
                {
                    Ok(Ok(tls)) => serve_conn(&builder, tls, handler, &shutdown).await,
                    Ok(Err(e)) => {
                        tracing::debug!(listener = name, %peer, error = %e, "TLS handshake failed")
                    }
                    Err(_) => tracing::debug!(listener = name, %peer, "TLS handshake timed out"),
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

async fn serve_conn<I, H>(
    builder: &auto::Builder<TokioExecutor>,
    io: I,
    handler: H,
    shutdown: &Shutdown,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Handler,
{
    let service = service_fn(move |req| {
        let fut = handler.clone().handle(req);
        async move { Ok::<_, Infallible>(fut.await) }
    });
    let conn = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        _ = shutdown.triggered() => {
            // Finish in-flight requests (h1: the current one; h2: GOAWAY, then
            // the open streams); the listener's drain deadline bounds this.
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}
