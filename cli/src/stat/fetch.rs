//! Reading `/debug/stat` from an admin port, with errors that say which
//! address failed and how: unreachable, too slow, or not a kvmesh admin port.

use std::time::Duration;

use bytes::Bytes;
use http::{header, Request, StatusCode};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::{Report, FORMAT, PATH};

/// Largest `/debug/stat` document read (a 4096-pod fleet is ~3 MiB).
const MAX_BYTES: usize = 16 << 20;

/// Why the admin port could not answer.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("cannot reach the kvmesh admin port at {addr}: {reason}")]
    Unreachable { addr: String, reason: String },
    #[error("no answer from the admin port at {addr} within {after:?}")]
    Timeout { addr: String, after: Duration },
    #[error("{addr} is not a kvmesh admin port: GET {PATH} {what}")]
    NotKvmesh { addr: String, what: String },
}

/// One `/debug/stat` document from the admin port at `addr` (`HOST:PORT`),
/// everything (resolve, connect, request, body) within `deadline`.
pub async fn fetch(addr: &str, deadline: Duration) -> Result<Report, FetchError> {
    tokio::time::timeout(deadline, fetch_inner(addr))
        .await
        .map_err(|_| FetchError::Timeout {
            addr: addr.to_owned(),
            after: deadline,
        })?
}

async fn fetch_inner(addr: &str) -> Result<Report, FetchError> {
    let unreachable = |reason: String| FetchError::Unreachable {
        addr: addr.to_owned(),
        reason,
    };
    let not_kvmesh = |what: String| FetchError::NotKvmesh {
        addr: addr.to_owned(),
        what,
    };
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    // The connection task ends with this function (the timeout drops it).
    let conn = async move {
        let _ = conn.await;
    };
    let exchange = async {
        let req = Request::get(PATH)
            .header(header::HOST, addr)
            .body(Empty::<Bytes>::new())
            .map_err(|e| unreachable(e.to_string()))?;
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| not_kvmesh(format!("got no HTTP/1.1 answer ({e})")))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), MAX_BYTES)
            .collect()
            .await
            .map_err(|e| unreachable(format!("reading the answer: {e}")))?
            .to_bytes();
        if status != StatusCode::OK {
            return Err(not_kvmesh(format!("answered {status}")));
        }
        let doc: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|_| not_kvmesh("answered something other than JSON".to_owned()))?;
        match doc.get("kvmesh_stat").and_then(serde_json::Value::as_u64) {
            Some(v) if v == u64::from(FORMAT) => {}
            Some(v) => {
                return Err(not_kvmesh(format!(
                    "answered format {v}; this client reads {FORMAT}"
                )))
            }
            None => return Err(not_kvmesh("answered JSON without kvmesh_stat".to_owned())),
        }
        serde_json::from_value(doc).map_err(|e| not_kvmesh(format!("answered a bad document: {e}")))
    };
    // Drive the connection until the answer is in; if it ends first, what it
    // delivered (or the error it left) is still read.
    tokio::pin!(exchange);
    tokio::select! {
        r = &mut exchange => return r,
        () = conn => {}
    }
    exchange.await
}
