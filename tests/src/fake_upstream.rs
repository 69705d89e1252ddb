//! An in-process fake upstream (an engine or a peer sidecar) for tests, built
//! with a builder: routes map a path to a function from the recorded request to
//! a scripted [`Reply`]. Listens on `127.0.0.1:0`, speaks HTTP/1.1 and h2c,
//! records every request, and stops when dropped.
//!
//! Streams are driven by the test through a [`StreamTx`]: each `send` becomes
//! one body chunk on the wire, so a test can check that a chunk reached the
//! client before the next one exists, and `body_dropped` tells it when the
//! proxy went away (cancelled the upstream request).

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// A request as the fake saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: Method,
    /// Path and query.
    pub path: String,
    pub version: http::Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

type RouteFn = Arc<dyn Fn(&Seen) -> Reply + Send + Sync>;

/// What the fake answers.
#[derive(Clone)]
pub enum Reply {
    /// A whole response.
    Full {
        status: StatusCode,
        headers: Vec<(HeaderName, HeaderValue)>,
        body: Bytes,
    },
    /// A response head, then the chunks a [`StreamTx`] sends (one request only).
    Stream {
        status: StatusCode,
        headers: Vec<(HeaderName, HeaderValue)>,
        source: Arc<Mutex<Option<ChannelBody>>>,
    },
    /// Never answers: the response head never comes.
    Hang,
}

/// The test's end of a scripted stream.
pub struct StreamTx {
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
    dropped: watch::Receiver<bool>,
}

/// The fake's end: a body fed by a channel that reports when it is dropped.
pub struct ChannelBody {
    rx: mpsc::Receiver<Result<Bytes, std::io::Error>>,
    dropped: watch::Sender<bool>,
}

/// Builds a [`FakeUpstream`].
#[derive(Default)]
pub struct FakeUpstreamBuilder {
    routes: HashMap<String, RouteFn>,
}

/// A running fake; stops when dropped.
pub struct FakeUpstream {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: JoinHandle<()>,
}

impl Reply {
    pub fn json(status: u16, body: impl Into<Bytes>) -> Self {
        Self::Full {
            status: StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            headers: vec![(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body: body.into(),
        }
    }

    pub fn text(status: u16, body: impl Into<Bytes>) -> Self {
        Self::Full {
            status: StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            headers: vec![(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain"),
            )],
            body: body.into(),
        }
    }

    /// An SSE stream driven by the returned [`StreamTx`].
    pub fn sse() -> (StreamTx, Self) {
        Self::stream("text/event-stream; charset=utf-8")
    }

    /// A streamed body of any content type, driven by the returned [`StreamTx`].
    pub fn stream(content_type: &'static str) -> (StreamTx, Self) {
        let (tx, rx) = mpsc::channel(64);
        let (dropped_tx, dropped_rx) = watch::channel(false);
        let body = ChannelBody {
            rx,
            dropped: dropped_tx,
        };
        let reply = Self::Stream {
            status: StatusCode::OK,
            headers: vec![(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static(content_type),
            )],
            source: Arc::new(Mutex::new(Some(body))),
        };
        (
            StreamTx {
                tx,
                dropped: dropped_rx,
            },
            reply,
        )
    }

    /// An SSE stream of ready-made chunks, each sent as its own frame.
    pub fn sse_chunks(chunks: Vec<Bytes>) -> Self {
        let (tx, reply) = Self::sse();
        for c in chunks {
            // The channel holds 64 chunks; fakes send fewer.
            let _ = tx.tx.try_send(Ok(c));
        }
        reply
    }

    /// Adds a response header.
    pub fn header(mut self, name: &'static str, value: &'static str) -> Self {
        let h = (
            HeaderName::from_static(name),
            HeaderValue::from_static(value),
        );
        match &mut self {
            Self::Full { headers, .. } | Self::Stream { headers, .. } => headers.push(h),
            Self::Hang => {}
        }
        self
    }
}

impl StreamTx {
    /// Sends one chunk; false when the body is gone.
    pub async fn send(&self, chunk: impl Into<Bytes>) -> bool {
        self.tx.send(Ok(chunk.into())).await.is_ok()
    }

    /// Makes the body fail, as an engine that dies mid-response: the fake's
    /// connection is cut without the terminating chunk.
    pub async fn fail(self) {
        let _ = self
            .tx
            .send(Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "engine died",
            )))
            .await;
    }

    /// Ends the body cleanly.
    pub fn finish(self) {}

    /// Waits up to `within` for the fake's response body to be dropped (the
    /// proxy closed the upstream request). Sends `probe` chunks meanwhile,
    /// since a server notices a closed peer only when it writes.
    pub async fn body_dropped(&mut self, within: Duration, probe: &'static [u8]) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if *self.dropped.borrow() {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            let _ = self.tx.try_send(Ok(Bytes::from_static(probe)));
            let _ = tokio::time::timeout(Duration::from_millis(20), self.dropped.changed()).await;
        }
    }
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.rx.poll_recv(cx).map(|o| o.map(|r| r.map(Frame::data)))
    }
}

impl Drop for ChannelBody {
    fn drop(&mut self) {
        self.dropped.send_replace(true);
    }
}

impl FakeUpstreamBuilder {
    /// Answers requests for `path` (exact match, query ignored).
    pub fn route(mut self, path: &str, f: impl Fn(&Seen) -> Reply + Send + Sync + 'static) -> Self {
        self.routes.insert(path.to_owned(), Arc::new(f));
        self
    }

    pub async fn start(self) -> FakeUpstream {
        let listener = match TcpListener::bind("127.0.0.1:0").await {
            Ok(l) => l,
            Err(e) => panic!("fake upstream cannot bind 127.0.0.1:0: {e}"),
        };
        let addr = match listener.local_addr() {
            Ok(a) => a,
            Err(e) => panic!("fake upstream address: {e}"),
        };
        let seen = Arc::new(Mutex::new(Vec::new()));
        let routes = Arc::new(self.routes);
        let task = tokio::spawn(accept_loop(listener, routes, seen.clone()));
        FakeUpstream { addr, seen, task }
    }
}

impl FakeUpstream {
    pub fn builder() -> FakeUpstreamBuilder {
        FakeUpstreamBuilder::default()
    }

    /// An engine whose first `/v1/completions` answer is an SSE stream the
    /// test writes through the returned sender; later calls hang.
    pub async fn scripted_stream() -> (StreamTx, FakeUpstream) {
        let (tx, reply) = Reply::sse();
        let slot = Mutex::new(Some(reply));
        let engine = FakeUpstream::builder()
            .route("/v1/completions", move |_| {
                slot.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take()
                    .unwrap_or(Reply::Hang)
            })
            .start()
            .await;
        (tx, engine)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every request received so far, in arrival order.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// The requests a sidecar forwarded for a client: they carry `X-Request-Id`,
    /// while the sidecar's own probes and scrapes (`/health`, `/metrics`) do not.
    pub fn calls(&self) -> Vec<Seen> {
        self.seen()
            .into_iter()
            .filter(|s| s.headers.contains_key("x-request-id"))
            .collect()
    }
}

impl Drop for FakeUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    routes: Arc<HashMap<String, RouteFn>>,
    seen: Arc<Mutex<Vec<Seen>>>,
) {
    // Connection tasks live in this set, so aborting the loop stops them all.
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let routes = routes.clone();
        let seen = seen.clone();
        conns.spawn(async move {
            let svc = service_fn(move |req| answer(req, routes.clone(), seen.clone()));
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tcp), svc)
                .await;
        });
        while conns.try_join_next().is_some() {}
    }
}

type FakeBody = http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>;

async fn answer(
    req: Request<Incoming>,
    routes: Arc<HashMap<String, RouteFn>>,
    seen: Arc<Mutex<Vec<Seen>>>,
) -> Result<Response<FakeBody>, Infallible> {
    let (head, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let s = Seen {
        method: head.method,
        path: head
            .uri
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_default(),
        version: head.version,
        headers: head.headers,
        body,
    };
    let reply = match routes.get(head.uri.path()) {
        Some(f) => f(&s),
        None => Reply::text(404, "no such route in the fake"),
    };
    if let Ok(mut v) = seen.lock() {
        v.push(s);
    }
    let (status, headers, body): (_, _, FakeBody) = match reply {
        Reply::Full {
            status,
            headers,
            body,
        } => (
            status,
            headers,
            http_body_util::Full::new(body)
                .map_err(|never| match never {})
                .boxed_unsync(),
        ),
        Reply::Stream {
            status,
            headers,
            source,
        } => {
            let taken = source.lock().ok().and_then(|mut s| s.take());
            match taken {
                Some(b) => (status, headers, b.boxed_unsync()),
                None => (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    Vec::new(),
                    http_body_util::Full::new(Bytes::from_static(b"stream already used"))
                        .map_err(|never| match never {})
                        .boxed_unsync(),
                ),
            }
        }
        Reply::Hang => std::future::pending().await,
    };
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    for (k, v) in headers {
        resp.headers_mut().append(k, v);
    }
    Ok(resp)
}
