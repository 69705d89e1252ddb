//! Forwarding over the mesh's mutual TLS (`mesh.tls`): requests for a peer go
//! to its mesh port, where its sidecar serves them like any other request
//! ([`super::server`]), instead of to its client port over plain HTTP.
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
    /// Nothing reached the peer: the next fallback may take the request.
    #[error("mesh connection to {addr}: {reason}")]
    Connect { addr: SocketAddr, reason: String },
    /// The request was handed to the connection and failed there.
    #[error("mesh request to {addr}: {reason}")]
    Request { addr: SocketAddr, reason: String },
}

/// Each followed peer's mesh port, by its sidecar (client) address.
#[derive(Debug, Default)]
pub struct MeshRoutes {
    by_sidecar: Mutex<HashMap<SocketAddr, SocketAddr>>,
}

impl MeshRoutes {
    /// The peer whose sidecar is `sidecar` streams from `mesh` (one entry per
    /// mesh port: a peer that came back under another identity replaces its
    /// old one).
    pub fn set(&self, sidecar: SocketAddr, mesh: SocketAddr) {
        let mut routes = self.by_sidecar.lock();
        routes.retain(|_, m| *m != mesh);
        routes.insert(sidecar, mesh);
    }

    /// Forgets the routes to the mesh port `mesh` (its subscriber ended).
    pub fn remove_mesh(&self, mesh: SocketAddr) {
        self.by_sidecar.lock().retain(|_, m| *m != mesh);
    }

    pub fn get(&self, sidecar: SocketAddr) -> Option<SocketAddr> {
        self.by_sidecar.lock().get(&sidecar).copied()
    }
}

/// See the module docs.
pub struct MeshClient {
    tls: MeshTls,
    connect_timeout: Duration,
    conns: Mutex<HashMap<SocketAddr, SendRequest<UpstreamBody>>>,
}

impl std::fmt::Debug for MeshClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshClient")
            .field("peers", &self.conns.lock().len())
            .finish_non_exhaustive()
    }
}

impl MeshClient {
    pub fn new(tls: MeshTls, connect_timeout: Duration) -> Self {
        Self {
            tls,
            connect_timeout,
            conns: Mutex::new(HashMap::new()),
        }
    }

    /// Sends `req` to the mesh port `addr`; the response head, or why none.
    pub async fn send(
        &self,
        addr: SocketAddr,
        req: http::Request<UpstreamBody>,
    ) -> Result<http::Response<Incoming>, MeshSendError> {
        let mut sender = self.sender(addr).await?;
        sender.ready().await.map_err(|e| MeshSendError::Connect {
            addr,
            reason: e.to_string(),
        })?;
        sender
            .send_request(req)
            .await
            .map_err(|e| MeshSendError::Request {
                addr,
                reason: e.to_string(),
            })
    }

    /// The open connection to `addr`, or a new one.
    async fn sender(&self, addr: SocketAddr) -> Result<SendRequest<UpstreamBody>, MeshSendError> {
        if let Some(s) = self.conns.lock().get(&addr) {
            if !s.is_closed() {
                return Ok(s.clone());
            }
        }
        let connect = async {
            let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
            let _ = tcp.set_nodelay(true);
            let tls = self
                .tls
                .connector
                .connect(self.tls.server_name.clone(), tcp)
                .await
                .map_err(|e| format!("TLS handshake: {e}"))?;
            let mut b = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
            b.timer(TokioTimer::new())
                .keep_alive_interval(Some(Duration::from_secs(10)))
                .keep_alive_timeout(Duration::from_secs(20));
            b.handshake::<_, UpstreamBody>(TokioIo::new(tls))
                .await
                .map_err(|e| format!("HTTP/2 handshake: {e}"))
        };
        let (sender, conn) = match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(Ok(x)) => x,
            Ok(Err(reason)) => return Err(MeshSendError::Connect { addr, reason }),
            Err(_) => {
                return Err(MeshSendError::Connect {
                    addr,
                    reason: format!("not connected within {:?}", self.connect_timeout),
                })
            }
        };
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%addr, error = %e, "mesh: forwarding connection ended");
            }
        });
        let mut conns = self.conns.lock();
        // Connections to peers that left are closed by now: drop them here.
        conns.retain(|_, s| !s.is_closed());
        conns.insert(addr, sender.clone());
        Ok(sender)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], port))
    }

    #[test]
    fn routes_keep_one_entry_per_mesh_port() {
        let r = MeshRoutes::default();
        r.set(addr(8000), addr(7000));
        r.set(addr(8001), addr(7001));
        assert_eq!(r.get(addr(8000)), Some(addr(7000)));
        // The peer behind mesh port 7000 came back under another identity.
        r.set(addr(8002), addr(7000));
        assert_eq!(r.get(addr(8000)), None);
        assert_eq!(r.get(addr(8002)), Some(addr(7000)));
        r.remove_mesh(addr(7001));
        assert_eq!(r.get(addr(8001)), None);
        assert_eq!(r.get(addr(8002)), Some(addr(7000)));
    }
}
