//! Forwarding over the mesh's mutual TLS (`mesh.tls`): requests for a peer go
//! to its mesh port, where its sidecar serves them like any other request
//! (`crate::mesh::server`), instead of to its client port over plain HTTP.
//!
//! One HTTP/2 connection per peer carries every forwarded request to it
//! (streams are multiplexed). It is made on first use under
//! `timeouts.connect` (TCP, then the TLS handshake, then HTTP/2) and made
//! again once it closes; closed ones are dropped whenever a new one is made,
//! so the map holds at most the live connections and one being replaced.
//! Where a peer's mesh port is comes from its stream: the address this
//! sidecar subscribed to ([`MeshRoutes`], one entry per subscriber).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use parking_lot::Mutex;
use tokio::net::TcpStream;

use crate::body::UpstreamBody;
use crate::tls::MeshTls;

/// Why a request could not be forwarded over the mesh.
#[derive(Debug, thiserror::Error)]
pub enum MeshSendError {
    /// The peer cannot have started on the request: the next fallback may
    /// take it. `tls`: the peer's TLS refused this sidecar.
    #[error("mesh connection to {addr}: {reason}")]
    Connect {
        addr: SocketAddr,
        reason: String,
        tls: bool,
    },
    /// The request was handed to the connection and failed there.
    #[error("mesh request to {addr}: {reason}")]
    Request { addr: SocketAddr, reason: String },
}

/// Each followed peer's mesh port, and the KV agent of its node when it
/// announced one, by its sidecar (client) address.
#[derive(Debug, Default)]
pub struct MeshRoutes {
    by_sidecar: Mutex<HashMap<SocketAddr, Route>>,
}

#[derive(Debug, Clone, Copy)]
struct Route {
    mesh: SocketAddr,
    kv_agent: Option<SocketAddr>,
}

impl MeshRoutes {
    /// The peer whose sidecar is `sidecar` streams from `mesh` and announced
    /// `kv_agent` (one entry per mesh port: a peer that came back under
    /// another identity replaces its old one).
    pub fn set(&self, sidecar: SocketAddr, mesh: SocketAddr, kv_agent: Option<SocketAddr>) {
        let mut routes = self.by_sidecar.lock();
        routes.retain(|_, r| r.mesh != mesh);
        routes.insert(sidecar, Route { mesh, kv_agent });
    }

    /// Forgets the routes to the mesh port `mesh` (its subscriber ended).
    pub fn remove_mesh(&self, mesh: SocketAddr) {
        self.by_sidecar.lock().retain(|_, r| r.mesh != mesh);
    }

    pub fn get(&self, sidecar: SocketAddr) -> Option<SocketAddr> {
        self.by_sidecar.lock().get(&sidecar).map(|r| r.mesh)
    }

    /// The KV agent on the node of the peer whose sidecar is `sidecar`, as it
    /// announced it (`None`: unknown peer, or it announced none).
    pub fn kv_agent(&self, sidecar: SocketAddr) -> Option<SocketAddr> {
        self.by_sidecar
            .lock()
            .get(&sidecar)
            .and_then(|r| r.kv_agent)
    }
}

/// See the module docs.
pub struct MeshClient {
    tls: MeshTls,
    connect_timeout: Duration,
    conns: Mutex<HashMap<SocketAddr, SendRequest<UpstreamBody>>>,
    /// Counts a failed TLS handshake (the mesh's `tls_failures{side="connect"}`).
    tls_failed: Box<dyn Fn() + Send + Sync>,
}

impl std::fmt::Debug for MeshClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshClient")
            .field("peers", &self.conns.lock().len())
            .finish_non_exhaustive()
    }
}

impl MeshClient {
    /// `tls_failed` counts each call that fails on a TLS handshake or alert.
    pub fn new(
        tls: MeshTls,
        connect_timeout: Duration,
        tls_failed: impl Fn() + Send + Sync + 'static,
    ) -> Self {
        Self {
            tls,
            connect_timeout,
            conns: Mutex::new(HashMap::new()),
            tls_failed: Box::new(tls_failed),
        }
    }

    /// Sends `req` to the mesh port `addr`; the response head, or why none.
    /// A failure is [`MeshSendError::Connect`] whenever the peer cannot have
    /// started on the request: no connection, a request hyper hands back
    /// unsent (the connection closed first), a stream the peer refused
    /// (`REFUSED_STREAM`), or a TLS alert (with TLS 1.3 a peer that rejects
    /// this sidecar's certificate says so only after the handshake, when the
    /// first request is written).
    pub async fn send(
        &self,
        addr: SocketAddr,
        req: http::Request<UpstreamBody>,
    ) -> Result<http::Response<Incoming>, MeshSendError> {
        let sent = self.try_send(addr, req).await;
        if let Err(MeshSendError::Connect { tls: true, .. }) = &sent {
            (self.tls_failed)();
        }
        sent
    }

    async fn try_send(
        &self,
        addr: SocketAddr,
        req: http::Request<UpstreamBody>,
    ) -> Result<http::Response<Incoming>, MeshSendError> {
        let mut sender = self.sender(addr).await?;
        let unsent = |reason: String, tls: bool| MeshSendError::Connect { addr, reason, tls };
        sender
            .ready()
            .await
            .map_err(|e| unsent(e.to_string(), tls_alert(&e)))?;
        match sender.try_send_request(req).await {
            Ok(resp) => Ok(resp),
            Err(mut e) => {
                let returned = e.take_message().is_some();
                let e = e.into_error();
                let reason = crate::error::error_chain(&e);
                let tls = tls_alert(&e);
                if returned || tls || refused_stream(&e) {
                    Err(unsent(reason, tls))
                } else {
                    Err(MeshSendError::Request { addr, reason })
                }
            }
        }
    }

    /// Drops the connection to the mesh port `addr` (its peer's stream
    /// ended); requests still on it finish.
    pub fn forget(&self, addr: SocketAddr) {
        self.conns.lock().remove(&addr);
    }

    /// The open connection to `addr`, or a new one.
    async fn sender(&self, addr: SocketAddr) -> Result<SendRequest<UpstreamBody>, MeshSendError> {
        if let Some(s) = self.conns.lock().get(&addr) {
            if !s.is_closed() {
                return Ok(s.clone());
            }
        }
        let connect = async {
            let tcp = TcpStream::connect(addr)
                .await
                .map_err(|e| (e.to_string(), false))?;
            let _ = tcp.set_nodelay(true);
            let tls = self
                .tls
                .connect(tcp)
                .await
                .map_err(|e| (format!("TLS handshake: {e}"), true))?;
            let mut b = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
            // Pinged while idle too: a peer lost without a FIN is noticed and
            // its connection closes instead of being reused.
            b.timer(TokioTimer::new())
                .keep_alive_interval(Some(Duration::from_secs(10)))
                .keep_alive_timeout(Duration::from_secs(20))
                .keep_alive_while_idle(true)
                .adaptive_window(true);
            b.handshake::<_, UpstreamBody>(TokioIo::new(tls))
                .await
                .map_err(|e| (format!("HTTP/2 handshake: {e}"), false))
        };
        let (sender, conn) = match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(Ok(x)) => x,
            Ok(Err((reason, tls))) => return Err(MeshSendError::Connect { addr, reason, tls }),
            Err(_) => {
                return Err(MeshSendError::Connect {
                    addr,
                    reason: format!("not connected within {:?}", self.connect_timeout),
                    tls: false,
                })
            }
        };
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%addr, error = %e, "mesh: forwarding connection ended");
            }
        });
        let mut conns = self.conns.lock();
        // Connections that closed since (a peer that went away, noticed by
        // the idle pings) are dropped here.
        conns.retain(|_, s| !s.is_closed());
        conns.insert(addr, sender.clone());
        Ok(sender)
    }
}

/// Whether `e` (or a cause) is a TLS error: the peer's alert, or one of ours.
pub(crate) fn tls_alert(e: &(dyn std::error::Error + 'static)) -> bool {
    causes(e).any(|c| {
        c.downcast_ref::<rustls::Error>().is_some()
            || c.downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some())
    })
}

/// Whether the peer reset the stream with `REFUSED_STREAM` (RFC 9113 8.7:
/// not processed).
fn refused_stream(e: &(dyn std::error::Error + 'static)) -> bool {
    causes(e).any(|c| {
        c.downcast_ref::<h2::Error>()
            .is_some_and(|h| h.reason() == Some(h2::Reason::REFUSED_STREAM))
    })
}

/// `e` and its causes, at most 16 deep.
fn causes<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(e), |c| c.source()).take(16)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], port))
    }

    #[test]
    fn tls_alerts_and_refused_streams_are_told_apart_from_other_failures() {
        let alert = rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRequired);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, alert);
        assert!(tls_alert(&io));
        let plain = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert!(!tls_alert(&plain));
        let refused = h2::Error::from(h2::Reason::REFUSED_STREAM);
        assert!(refused_stream(&refused));
        assert!(!refused_stream(&h2::Error::from(h2::Reason::CANCEL)));
        assert!(!refused_stream(&plain));
    }

    #[test]
    fn routes_keep_one_entry_per_mesh_port() {
        let r = MeshRoutes::default();
        r.set(addr(8000), addr(7000), Some(addr(7600)));
        r.set(addr(8001), addr(7001), None);
        assert_eq!(r.get(addr(8000)), Some(addr(7000)));
        assert_eq!(r.kv_agent(addr(8000)), Some(addr(7600)));
        assert_eq!(r.kv_agent(addr(8001)), None);
        // The peer behind mesh port 7000 came back under another identity.
        r.set(addr(8002), addr(7000), None);
        assert_eq!(r.get(addr(8000)), None);
        assert_eq!(r.kv_agent(addr(8000)), None);
        assert_eq!(r.get(addr(8002)), Some(addr(7000)));
        r.remove_mesh(addr(7001));
        assert_eq!(r.get(addr(8001)), None);
        assert_eq!(r.get(addr(8002)), Some(addr(7000)));
    }
}
