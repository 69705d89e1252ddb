//! The P/D side channel's client: one JSON request to another simulated
//! engine's HTTP server, on a fresh connection, under a deadline.
//!
//! A fresh connection per call keeps this free of pools and background tasks:
//! the connection is driven inside the call and closed when it returns. One
//! handoff per disaggregated request makes the connect cost negligible next to
//! the simulated transfer.

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::time::Instant;

/// Largest side-channel reply read.
const MAX_REPLY: usize = 64 * 1024;

/// Why a side-channel call got no usable reply.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SideError {
    #[error("could not connect to {addr}: {reason}")]
    Unreachable { addr: String, reason: String },
    #[error("{addr} did not answer in time")]
    Timeout { addr: String },
    #[error("{addr}: {reason}")]
    Failed { addr: String, reason: String },
}

/// `POST path` with `body` to `host:port`; the reply's status and JSON body
/// (`Null` when it is not JSON). Everything, connecting included, ends by
/// `deadline`.
pub(crate) async fn post_json(
    host: &str,
    port: u16,
    path: &str,
    body: &Value,
    deadline: Instant,
) -> Result<(u16, Value), SideError> {
    call(http::Method::POST, host, port, path, Some(body), deadline).await
}

/// `GET path` from `host:port`, as [`post_json`].
pub(crate) async fn get_json(
    host: &str,
    port: u16,
    path: &str,
    deadline: Instant,
) -> Result<(u16, Value), SideError> {
    call(http::Method::GET, host, port, path, None, deadline).await
}

async fn call(
    method: http::Method,
    host: &str,
    port: u16,
    path: &str,
    body: Option<&Value>,
    deadline: Instant,
) -> Result<(u16, Value), SideError> {
    let addr = authority(host, port);
    let exchange = exchange(method, host, port, &addr, path, body);
    match tokio::time::timeout_at(deadline, exchange).await {
        Ok(r) => r,
        Err(_) => Err(SideError::Timeout { addr }),
    }
}

async fn exchange(
    method: http::Method,
    host: &str,
    port: u16,
    addr: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<(u16, Value), SideError> {
    let failed = |reason: String| SideError::Failed {
        addr: addr.to_string(),
        reason,
    };
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let stream = tokio::net::TcpStream::connect((bare, port))
        .await
        .map_err(|e| SideError::Unreachable {
            addr: addr.to_string(),
            reason: e.to_string(),
        })?;
    let _ = stream.set_nodelay(true);
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| failed(format!("handshake: {e}")))?;
    let bytes = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
    let req = http::Request::builder()
        .method(method)
        .uri(path)
        .header(http::header::HOST, addr)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(bytes))
        .map_err(|e| failed(format!("building the request: {e}")))?;
    // The request owns `send`: once it has the reply, dropping `send` lets
    // the connection future finish, so both end together.
    let call = async move {
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| failed(format!("request: {e}")))?;
        let status = resp.status().as_u16();
        let bytes = Limited::new(resp.into_body(), MAX_REPLY)
            .collect()
            .await
            .map_err(|e| failed(format!("reading the reply: {e}")))?
            .to_bytes();
        Ok((
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ))
    };
    let (reply, _) = tokio::join!(call, conn);
    reply
}

/// `host:port`, with brackets around an IPv6 literal.
fn authority(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authority_brackets_ipv6() {
        assert_eq!(authority("10.0.0.1", 80), "10.0.0.1:80");
        assert_eq!(authority("::1", 80), "[::1]:80");
        assert_eq!(authority("localhost", 5600), "localhost:5600");
    }

    #[tokio::test]
    async fn nothing_listening_is_unreachable() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        let r = post_json("127.0.0.1", port, "/x", &Value::Null, deadline).await;
        assert!(matches!(r, Err(SideError::Unreachable { .. })), "{r:?}");
    }
}
