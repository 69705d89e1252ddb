//! Test clients for the proxy: HTTP/1.1, h2c (prior knowledge) and TLS with a
//! test root, each returning the response with its body still streaming so a
//! test can read it frame by frame.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::{CertificateDer, ServerName};

/// Every client wait in the harness is bounded by this.
pub const WAIT: Duration = Duration::from_secs(10);

pub type TestClient = Client<HttpConnector, Full<Bytes>>;

/// A pooled HTTP/1.1 client.
pub fn http1() -> TestClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// A pooled HTTP/2 client speaking h2c by prior knowledge.
pub fn h2c() -> TestClient {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new())
}

/// A request to `addr` with a body; `headers` are added as given.
pub fn request(
    method: &str,
    addr: SocketAddr,
    path: &str,
    body: impl Into<Bytes>,
    headers: &[(&str, &str)],
) -> Request<Full<Bytes>> {
    let mut b = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(body.into())).expect("valid test request")
}

/// A JSON POST.
pub fn post_json(addr: SocketAddr, path: &str, body: &str) -> Request<Full<Bytes>> {
    request(
        "POST",
        addr,
        path,
        body.to_owned(),
        &[("content-type", "application/json")],
    )
}

/// Sends and waits for the response head.
pub async fn send(client: &TestClient, req: Request<Full<Bytes>>) -> Response<Incoming> {
    tokio::time::timeout(WAIT, client.request(req))
        .await
        .expect("response head within the wait")
        .expect("request succeeded at the HTTP level")
}

/// A whole response: status, headers, body.
pub struct Whole {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Whole {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Reads a response to its end.
pub async fn whole(resp: Response<Incoming>) -> Whole {
    let (head, body) = resp.into_parts();
    let body = tokio::time::timeout(WAIT, body.collect())
        .await
        .expect("body within the wait")
        .expect("body read")
        .to_bytes();
    Whole {
        status: head.status,
        headers: head.headers,
        body,
    }
}

/// Sends and reads the whole response.
pub async fn fetch(client: &TestClient, req: Request<Full<Bytes>>) -> Whole {
    whole(send(client, req).await).await
}

/// The next data chunk of a body, or `None` at its end. Panics on a body error.
pub async fn next_chunk(body: &mut Incoming) -> Option<Bytes> {
    loop {
        let frame = tokio::time::timeout(WAIT, body.frame())
            .await
            .expect("a frame within the wait")?
            .expect("body frame");
        if let Ok(data) = frame.into_data() {
            return Some(data);
        }
    }
}

/// A GET to the admin port, read whole.
pub async fn admin_get(admin: SocketAddr, path: &str) -> Whole {
    fetch(&http1(), request("GET", admin, path, Bytes::new(), &[])).await
}

/// Which protocol a TLS client asks for through ALPN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alpn {
    Http1,
    H2,
}

/// One request over TLS (trusting `root`), read whole, plus the negotiated ALPN.
pub async fn tls_fetch(
    addr: SocketAddr,
    root: CertificateDer<'static>,
    alpn: Alpn,
    req: Request<Full<Bytes>>,
) -> (Option<Vec<u8>>, Whole) {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(root).expect("test root is a valid certificate");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = match alpn {
        Alpn::Http1 => vec![b"http/1.1".to_vec()],
        Alpn::H2 => vec![b"h2".to_vec()],
    };
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let name = ServerName::try_from("localhost").expect("server name");
    let tls = tokio::time::timeout(WAIT, connector.connect(name, tcp))
        .await
        .expect("handshake within the wait")
        .expect("TLS handshake");
    let negotiated = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
    let io = TokioIo::new(tls);
    let resp = match alpn {
        Alpn::Http1 => {
            let (mut send, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .expect("h1 handshake");
            tokio::spawn(conn);
            send.send_request(req).await.expect("h1 request")
        }
        Alpn::H2 => {
            let (mut send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                .await
                .expect("h2 handshake");
            tokio::spawn(conn);
            send.send_request(req).await.expect("h2 request")
        }
    };
    (negotiated, whole(resp).await)
}
