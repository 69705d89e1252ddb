//! The keep-alive pool to the local engine over HTTP/1.1, spoken with
//! kvmesh's own codec (`crate::h1`): the connection nearly every request
//! uses, so it is kept lean. The pool holds only idle connections, newest
//! last; a request takes the newest one that is still good (or dials a new
//! one), writes its head and body, reads the response head, and lends the
//! connection to the response body, which gives it back once read to its
//! end ([`ReplyBody`]). A response whose body came in with its head (a
//! small answer) gives it back at once.
//!
//! A connection has no task of its own: the request that holds it writes
//! and reads it from the task that serves the client, so an exchange wakes
//! one task and hands nothing between tasks. An idle connection is looked
//! at when it is next taken and by the reaper, through the socket's
//! readiness (no system call while nothing arrived): one the engine closed
//! (its keep-alive timeout, uvicorn's 5 s) or wrote to unasked is dropped.
//! Other upstreams (peers, llm-d's prefiller, h2c) go through the general
//! client in `mod.rs`.

use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::uri::Authority;
use http::{header, HeaderValue, Method, Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::body::{BoxError, UpstreamBody, Whole};
use crate::h1::encode;
use crate::h1::io::ReadSize;
use crate::h1::{self, BodyError, Decoded, Decoder, Framing, HeadError, ResponseHead};

/// How many times a request whose connection failed before any of it was
/// written is sent on another one (the engine closed an idle connection
/// just as it was taken: the usual keep-alive race, and safe to retry since
/// nothing was sent).
const UNSENT_RETRIES: usize = 2;
/// Most room made in a connection's buffer for a body of known length.
const READ_AHEAD: u64 = 256 * 1024;

/// Idle keep-alive connections to one engine.
pub struct EnginePool {
    inner: Arc<Inner>,
    /// The task closing connections past the idle timeout; stops with the pool.
    reaper: tokio::task::AbortHandle,
}

impl Drop for EnginePool {
    fn drop(&mut self) {
        self.reaper.abort();
    }
}

struct Inner {
    authority: Authority,
    host: HeaderValue,
    connect_timeout: Duration,
    max_idle: usize,
    idle_timeout: Duration,
    idle: Mutex<Vec<Idle>>,
}

struct Idle {
    conn: Box<Conn>,
    since: Instant,
}

/// One HTTP/1.1 connection with its buffers; boxed, so that handing it
/// between the pool and a response body moves a pointer.
struct Conn {
    io: TcpStream,
    /// Read from the engine and not yet used.
    buf: BytesMut,
    reads: ReadSize,
    /// The request head being written.
    out: Vec<u8>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("buffered", &self.buf.len())
            .finish()
    }
}

/// Why a request got no response head.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// No connection: nothing was sent, another target may take the request.
    #[error("connect to {authority}: {reason}")]
    Connect {
        authority: Authority,
        reason: String,
    },
    /// The request went out, or part of it, and the exchange failed.
    #[error("{0}")]
    Request(#[source] ExchangeError),
}

/// How an exchange with the engine failed after it began.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("writing the request: {0}")]
    Write(#[source] std::io::Error),
    #[error("reading the request body to send it: {0}")]
    RequestBody(#[source] BoxError),
    #[error("reading the response: {0}")]
    Read(#[source] std::io::Error),
    #[error("the connection closed before a response head")]
    ClosedBeforeHead,
    #[error("the response head: {0}")]
    Head(#[source] HeadError),
    #[error("the response body: {0}")]
    Body(#[source] BodyError),
    #[error("the engine switched protocols (101), which a proxied request cannot follow")]
    Upgrade,
}

impl EnginePool {
    /// A pool for `authority` (`host:port`, port 80 when absent). Must be made
    /// inside the runtime: it starts the task that closes idle connections.
    pub fn new(
        authority: Authority,
        connect_timeout: Duration,
        max_idle: usize,
        idle_timeout: Duration,
    ) -> Self {
        let host = HeaderValue::from_str(authority.as_str())
            .unwrap_or_else(|_| HeaderValue::from_static("localhost"));
        let inner = Arc::new(Inner {
            authority,
            host,
            connect_timeout,
            max_idle,
            idle_timeout,
            idle: Mutex::new(Vec::new()),
        });
        let reaper = tokio::spawn(reap(Arc::downgrade(&inner))).abort_handle();
        Self { inner, reaper }
    }

    /// Sends `req` (an absolute URI towards this engine, as the general client
    /// takes it; it goes out in origin form with a Host header) on a pooled
    /// connection or a new one, and reads until the response head is in.
    pub async fn send(
        &self,
        req: Request<UpstreamBody>,
    ) -> Result<Response<ReplyBody>, EngineError> {
        let (mut parts, mut body) = req.into_parts();
        let target = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        parts
            .headers
            .entry(header::HOST)
            .or_insert_with(|| self.inner.host.clone());
        let framing = request_framing(&parts.method, &body);
        for _ in 0..=UNSENT_RETRIES {
            let (mut conn, reused) = match self.inner.take() {
                Some(c) => (c, true),
                None => (self.inner.connect().await?, false),
            };
            conn.out.clear();
            encode::request_head(
                &mut conn.out,
                &parts.method,
                &target,
                &parts.headers,
                framing,
            );
            match conn.write_request(&mut body, framing).await {
                Ok(()) => {}
                // Closed under us before it took a byte: nothing was sent.
                Err(Sent::Nothing(_)) if reused => continue,
                Err(Sent::Nothing(e) | Sent::Part(e)) => return Err(EngineError::Request(e)),
            }
            let head = conn
                .read_head(&parts.method)
                .await
                .map_err(EngineError::Request)?;
            return Ok(self.inner.response(conn, head));
        }
        Err(EngineError::Connect {
            authority: self.inner.authority.clone(),
            reason: format!(
                "the connection closed before the request was written, {} times",
                UNSENT_RETRIES + 1
            ),
        })
    }

    /// Idle connections now (tests and debugging).
    pub fn idle(&self) -> usize {
        self.inner.lock().len()
    }
}

/// How a request body is framed on the wire: its length when known (none
/// for an empty body of a method that carries none, as hyper did),
/// chunked otherwise.
fn request_framing(method: &Method, body: &UpstreamBody) -> Framing {
    let len = match body {
        UpstreamBody::Full(b) => Some(b.len()),
        UpstreamBody::Stream(s) if s.is_end_stream() => Some(0),
        UpstreamBody::Stream(s) => s.size_hint().exact(),
    };
    match len {
        Some(0) if !matches!(*method, Method::POST | Method::PUT | Method::PATCH) => Framing::Empty,
        Some(n) => Framing::Length(n),
        None => Framing::Chunked,
    }
}

/// How far a failed write got.
enum Sent {
    Nothing(ExchangeError),
    Part(ExchangeError),
}

impl Conn {
    /// Writes the head in `out`, then the body: a whole one in the same
    /// system call, a streamed one frame by frame.
    async fn write_request(
        &mut self,
        body: &mut UpstreamBody,
        framing: Framing,
    ) -> Result<(), Sent> {
        let mut written = 0;
        let failed = |e, written| {
            let e = ExchangeError::Write(e);
            if written == 0 {
                Sent::Nothing(e)
            } else {
                Sent::Part(e)
            }
        };
        let stream = match body {
            UpstreamBody::Full(b) => {
                let data = b.bytes().map_or(&[][..], |b| &b[..]);
                return h1::io::write_counted(&self.io, &mut [&self.out, data], &mut written)
                    .await
                    .map_err(|e| failed(e, written));
            }
            UpstreamBody::Stream(s) => s,
        };
        h1::io::write_counted(&self.io, &mut [&self.out], &mut written)
            .await
            .map_err(|e| failed(e, written))?;
        let mut sent: u64 = 0;
        let mut size = Vec::with_capacity(20);
        loop {
            let frame = std::future::poll_fn(|cx| Pin::new(&mut *stream).poll_frame(cx)).await;
            let data = match frame {
                None => break,
                Some(Err(e)) => return Err(Sent::Part(ExchangeError::RequestBody(e))),
                Some(Ok(f)) => match f.into_data() {
                    Ok(d) if !d.is_empty() => d,
                    _ => continue,
                },
            };
            sent += data.len() as u64;
            let parts: &mut [&[u8]] = match framing {
                Framing::Length(n) if sent > n => {
                    let e = std::io::Error::other("the request body is longer than its length");
                    return Err(failed(e, written));
                }
                Framing::Chunked => {
                    size.clear();
                    encode::chunk_size(&mut size, data.len());
                    &mut [&size, &data, b"\r\n"]
                }
                _ => &mut [&data],
            };
            h1::io::write_counted(&self.io, parts, &mut written)
                .await
                .map_err(|e| failed(e, written))?;
        }
        match framing {
            Framing::Chunked => {
                h1::io::write_counted(&self.io, &mut [encode::LAST_CHUNK], &mut written)
                    .await
                    .map_err(|e| failed(e, written))
            }
            Framing::Length(n) if sent < n => {
                let e = std::io::Error::other("the request body is shorter than its length");
                Err(failed(e, written))
            }
            _ => Ok(()),
        }
    }

    /// Reads until a final response head is in (interim 1xx heads skipped).
    async fn read_head(&mut self, method: &Method) -> Result<ResponseHead, ExchangeError> {
        loop {
            if !self.buf.is_empty() {
                match h1::head::parse_response(&mut self.buf, method) {
                    Ok(Some(h)) if h.parts.status == http::StatusCode::SWITCHING_PROTOCOLS => {
                        return Err(ExchangeError::Upgrade)
                    }
                    Ok(Some(h)) if h.parts.status.is_informational() => continue,
                    Ok(Some(h)) => return Ok(h),
                    Ok(None) => {}
                    Err(e) => return Err(ExchangeError::Head(e)),
                }
            }
            match h1::io::read(&self.io, &mut self.buf, &mut self.reads).await {
                Ok(0) => return Err(ExchangeError::ClosedBeforeHead),
                Ok(_) => {}
                Err(e) => return Err(ExchangeError::Read(e)),
            }
        }
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        // A panic while holding the lock cannot leave the list inconsistent.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The newest idle connection that is still good; the broken or
    /// expired ones met on the way are dropped.
    fn take(&self) -> Option<Box<Conn>> {
        let mut idle = self.lock();
        while let Some(c) = idle.pop() {
            if !c.stale(self.idle_timeout) {
                return Some(c.conn);
            }
        }
        None
    }

    /// Takes back a connection whose last response was read to its end.
    fn put(&self, conn: Box<Conn>) {
        let mut idle = self.lock();
        if idle.len() < self.max_idle {
            idle.push(Idle {
                conn,
                since: Instant::now(),
            });
        }
    }

    /// The response for `head`: its body lends the connection, or, when
    /// the body came in whole with the head, is that buffer, and the
    /// connection is back in the pool already.
    fn response(self: &Arc<Self>, mut conn: Box<Conn>, head: ResponseHead) -> Response<ReplyBody> {
        let whole = match head.framing {
            Framing::Empty => Some(Bytes::new()),
            // `n` is at most `buf.len()`, a usize.
            Framing::Length(n) if conn.buf.len() as u64 >= n => {
                Some(conn.buf.split_to(n as usize).freeze())
            }
            _ => None,
        };
        let body = match whole {
            Some(data) => {
                if head.keep_alive && conn.buf.is_empty() {
                    self.put(conn);
                }
                ReplyBody::Full(Whole::new(data))
            }
            None => ReplyBody::Engine(EngineBody {
                decoder: Decoder::new(head.framing),
                lease: Some(Lease {
                    conn,
                    pool: Arc::downgrade(self),
                    keep_alive: head.keep_alive,
                }),
            }),
        };
        Response::from_parts(head.parts, body)
    }

    async fn connect(&self) -> Result<Box<Conn>, EngineError> {
        let fail = |reason: String| EngineError::Connect {
            authority: self.authority.clone(),
            reason,
        };
        let tcp = tokio::time::timeout(self.connect_timeout, self.dial())
            .await
            .map_err(|_| fail(format!("no connection within {:?}", self.connect_timeout)))?
            .map_err(|e| fail(e.to_string()))?;
        // Without it every small write waits for the peer's delayed ACK.
        tcp.set_nodelay(true).map_err(|e| fail(e.to_string()))?;
        Ok(Box::new(Conn {
            io: tcp,
            buf: BytesMut::new(),
            reads: ReadSize::default(),
            out: Vec::with_capacity(1024),
        }))
    }

    /// The first address of the engine's host that accepts (tokio resolves
    /// the name and tries each address in turn).
    async fn dial(&self) -> std::io::Result<TcpStream> {
        let port = self.authority.port_u16().unwrap_or(80);
        // An IPv6 literal keeps its brackets in the authority.
        let host = self.authority.host();
        let host = host.trim_start_matches('[').trim_end_matches(']');
        TcpStream::connect((host, port)).await
    }
}

impl Idle {
    /// Closed by the engine, written to unasked, or idle for `timeout`.
    fn stale(&self, timeout: Duration) -> bool {
        self.since.elapsed() >= timeout || h1::io::idle_is_broken(&self.conn.io)
    }
}

/// Closes connections idle longer than the idle timeout or closed by the
/// engine, until the pool is gone (dropping the pool aborts it; the weak
/// reference is the backstop).
async fn reap(pool: Weak<Inner>) {
    let every = match pool.upgrade() {
        Some(p) => (p.idle_timeout / 2).max(Duration::from_millis(100)),
        None => return,
    };
    loop {
        tokio::time::sleep(every).await;
        let Some(p) = pool.upgrade() else { return };
        p.lock().retain(|c| !c.stale(p.idle_timeout));
    }
}

/// A connection lent to one response body.
#[derive(Debug)]
struct Lease {
    conn: Box<Conn>,
    pool: Weak<Inner>,
    /// The response lets the connection carry another request.
    keep_alive: bool,
}

/// A response body from an upstream.
#[derive(Debug)]
pub enum ReplyBody {
    /// Whole: it came in with its head (the connection is back in the pool).
    Full(Whole),
    /// Still arriving on a connection of the engine pool.
    Engine(EngineBody),
    /// From hyper's clients (peers, the prefiller, h2c).
    Hyper(Incoming),
}

/// A response body being read from the engine connection it holds: reading
/// it drives the connection; read to its end, the connection goes back to
/// the pool; dropped before (the client left), the connection is closed and
/// the engine sees the request go, and stops generating.
#[derive(Debug)]
pub struct EngineBody {
    decoder: Decoder,
    /// `None` once the body ended or failed.
    lease: Option<Lease>,
}

impl ReplyBody {
    /// A body from a client that manages its own connections.
    pub fn plain(inner: Incoming) -> Self {
        Self::Hyper(inner)
    }
}

impl EngineBody {
    /// The body ended: the connection goes back if it may carry another
    /// request and nothing past the body arrived on it.
    fn finish(&mut self) {
        if let Some(lease) = self.lease.take() {
            if lease.keep_alive && lease.conn.buf.is_empty() {
                if let Some(pool) = lease.pool.upgrade() {
                    pool.put(lease.conn);
                }
            }
        }
    }

    fn fail(&mut self, e: ExchangeError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.lease = None;
        Poll::Ready(Some(Err(Box::new(e))))
    }

    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            let Some(lease) = self.lease.as_mut() else {
                return Poll::Ready(None);
            };
            let conn = &mut *lease.conn;
            match self.decoder.decode(&mut conn.buf) {
                Ok(Decoded::Data(d)) => {
                    if self.decoder.is_done() {
                        self.finish();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(d))));
                }
                Ok(Decoded::End) => {
                    self.finish();
                    return Poll::Ready(None);
                }
                Ok(Decoded::More) => {}
                Err(e) => return self.fail(ExchangeError::Body(e)),
            }
            // Room for what is left of a known length, so that one read
            // can take what has arrived (bounded: a frame at a time).
            if let Some(left) = self.decoder.length_left() {
                conn.buf.reserve(left.min(READ_AHEAD) as usize);
            }
            match h1::io::poll_read(&conn.io, &mut conn.buf, &mut conn.reads, cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0)) => match self.decoder.at_eof() {
                    // A body that runs until the close: its connection is spent.
                    Ok(()) => {
                        self.lease = None;
                        return Poll::Ready(None);
                    }
                    Err(e) => return self.fail(ExchangeError::Body(e)),
                },
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => return self.fail(ExchangeError::Read(e)),
            }
        }
    }
}

impl Body for ReplyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            Self::Full(b) => Pin::new(b).poll_frame(cx),
            Self::Engine(b) => b.poll_frame(cx),
            Self::Hyper(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Full(b) => b.is_end_stream(),
            Self::Engine(b) => b.lease.is_none() || b.decoder.is_done(),
            Self::Hyper(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full(b) => b.size_hint(),
            Self::Engine(b) => b.decoder.size_hint(),
            Self::Hyper(b) => b.size_hint(),
        }
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
