//! The keep-alive pool to the local engine over HTTP/1.1: the connection
//! nearly every request uses, so it is kept lean. The pool holds only idle
//! connections, newest last; a request takes the newest one that is ready
//! (or dials a new one), and gives it back when the response body has been
//! read to its end and dropped ([`ReplyBody`]).
//!
//! A connection has no task of its own: the request that holds it drives it
//! (writes the request, reads the head, then the body as the body is read),
//! from the task that serves the client. An exchange then wakes one task, the
//! client's, instead of two that hand the request and each frame to each other
//! through channels (on a multi-threaded runtime that hand-over often also
//! wakes a second worker thread). Idle connections are looked at, without a
//! task, when they are next taken and by the reaper: one the engine closed
//! (its keep-alive timeout) is dropped then. Other upstreams (peers, llm-d's
//! prefiller, h2c) go through the general client in `mod.rs`.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery};
use http::{header, HeaderValue, Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::body::UpstreamBody;

/// How many times a request whose connection closed before it was written
/// is sent on another one (the engine closed an idle connection just as it
/// was taken: the usual keep-alive race, and safe to retry since nothing was sent).
const UNSENT_RETRIES: usize = 2;

/// A connection given back less than this long ago is taken, on a request's
/// first try, without driving it first to see whether the engine closed it.
/// That look runs hyper's whole dispatcher once (about 800 instructions, a
/// request's 1.3%), and engines close idle connections after seconds (vLLM's
/// and SGLang's uvicorn: 5 s). A connection closed sooner costs one unsent
/// try: hyper reads the close before it writes, and the retry looks first.
const TRUSTED_IDLE: Duration = Duration::from_secs(1);

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

/// One HTTP/1.1 connection: the handle a request is queued on, and hyper's
/// state machine for the socket, which whoever holds the connection polls.
/// 712 bytes (hyper 1.12): boxed, so that handing it between the pool and a
/// response body (which moves a few times on its way to the client) moves a
/// pointer.
struct Conn {
    sender: http1::SendRequest<UpstreamBody>,
    io: http1::Connection<TokioIo<TcpStream>, UpstreamBody>,
    /// `io` finished (closed, or failed): it must not be polled again.
    done: bool,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").field("done", &self.done).finish()
    }
}

impl Conn {
    /// Moves the exchange on: writes what is queued, reads what arrived.
    /// True once the connection is finished. An error needs no handling
    /// here: hyper hands it to the request or body it failed.
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.done {
            self.done = self.io.poll_without_shutdown(cx).is_ready();
        }
        self.done
    }

    /// Drives the connection once without a task to wake (an idle one, or one
    /// given back): it notices a close, and becomes ready for the next
    /// request once its last exchange is wound down.
    fn settle(&mut self) {
        self.drive(&mut Context::from_waker(Waker::noop()));
    }

    fn closed(&self) -> bool {
        self.done || self.sender.is_closed()
    }
}

impl Idle {
    /// Closed by the engine, or idle for `timeout`: never to be used again.
    fn stale(&mut self, timeout: Duration) -> bool {
        self.conn.settle();
        self.conn.closed() || self.since.elapsed() >= timeout
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
    /// The request went out and the exchange failed.
    #[error("{0}")]
    Request(#[source] hyper::Error),
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
    /// takes it) on a pooled connection or a new one, and drives that
    /// connection until the response head is in.
    pub async fn send(
        &self,
        req: Request<UpstreamBody>,
    ) -> Result<Response<ReplyBody>, EngineError> {
        let mut req = self.inner.origin_form(req);
        for attempt in 0..=UNSENT_RETRIES {
            let mut conn = match self.inner.take(attempt == 0) {
                Some(c) => c,
                None => self.inner.connect().await?,
            };
            let mut head = std::pin::pin!(conn.sender.try_send_request(req));
            let sent = std::future::poll_fn(|cx| {
                // Write the request (and read what came back) first; then
                // the head is there if it arrived.
                let finished = conn.drive(cx);
                match head.as_mut().poll(cx) {
                    Poll::Ready(r) => Poll::Ready(Some(r)),
                    // Finished without answering: dropping the connection
                    // below gives the request its error.
                    Poll::Pending if finished => Poll::Ready(None),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
            let (sent, conn) = match sent {
                Some(r) => (r, Some(conn)),
                None => {
                    drop(conn);
                    (head.await, None)
                }
            };
            match sent {
                Ok(resp) => {
                    let pool = Arc::downgrade(&self.inner);
                    return Ok(resp.map(|b| match conn {
                        Some(conn) => ReplyBody::leased(b, Lease { conn, pool }),
                        None => ReplyBody::plain(b),
                    }));
                }
                Err(mut e) => match e.take_message() {
                    Some(unsent) => req = unsent,
                    None => return Err(EngineError::Request(e.into_error())),
                },
            }
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

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        // A panic while holding the lock cannot leave the list inconsistent.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// HTTP/1 wants the origin form (`/path?query`) and a Host header.
    fn origin_form(&self, mut req: Request<UpstreamBody>) -> Request<UpstreamBody> {
        let path = req
            .uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        *req.uri_mut() = Uri::from(path);
        req.headers_mut()
            .entry(header::HOST)
            .or_insert_with(|| self.host.clone());
        req
    }

    /// The newest idle connection that can take a request now. Closed ones
    /// are dropped; one that is open but not ready yet stays for later.
    /// `trust_fresh`: one given back within [`TRUSTED_IDLE`] and ready is
    /// taken as it is.
    fn take(&self, trust_fresh: bool) -> Option<Box<Conn>> {
        let mut idle = self.lock();
        let mut i = idle.len();
        while i > 0 {
            i -= 1;
            let c = &mut idle[i];
            if trust_fresh && c.conn.sender.is_ready() && c.since.elapsed() < TRUSTED_IDLE {
                return Some(idle.swap_remove(i).conn);
            }
            if c.stale(self.idle_timeout) {
                idle.swap_remove(i);
            } else if c.conn.sender.is_ready() {
                return Some(idle.swap_remove(i).conn);
            }
        }
        None
    }

    /// Takes back a connection whose last response was read to its end.
    fn put(&self, mut conn: Box<Conn>) {
        conn.settle();
        if conn.closed() {
            return;
        }
        let mut idle = self.lock();
        if idle.len() < self.max_idle {
            idle.push(Idle {
                conn,
                since: Instant::now(),
            });
        }
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
        let (sender, io) = http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| fail(e.to_string()))?;
        Ok(Box::new(Conn {
            sender,
            io,
            done: false,
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
        p.lock().retain_mut(|c| !c.stale(p.idle_timeout));
    }
}

/// A connection lent to one response. Back to the pool when the body is
/// dropped after its end; closed when it is dropped before (the engine then
/// sees the client go, and stops generating).
#[derive(Debug)]
struct Lease {
    conn: Box<Conn>,
    pool: Weak<Inner>,
}

/// A response body from an upstream. From the engine pool it holds its
/// connection, and reading the body drives it.
#[derive(Debug)]
pub struct ReplyBody {
    inner: Incoming,
    lease: Option<Lease>,
    /// The last frame was read (a chunked body says so only by ending).
    ended: bool,
}

impl ReplyBody {
    /// A body from a client that manages its own connections.
    pub fn plain(inner: Incoming) -> Self {
        Self {
            inner,
            lease: None,
            ended: false,
        }
    }

    fn leased(inner: Incoming, lease: Lease) -> Self {
        Self {
            inner,
            lease: Some(lease),
            ended: false,
        }
    }
}

impl Drop for ReplyBody {
    fn drop(&mut self) {
        let ended = self.ended || self.inner.is_end_stream();
        if let (Some(lease), true) = (self.lease.take(), ended) {
            if let Some(pool) = lease.pool.upgrade() {
                pool.put(lease.conn);
            }
        }
    }
}

impl Body for ReplyBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if let Some(lease) = this.lease.as_mut() {
            // A failed connection hands its error to the body.
            lease.conn.drive(cx);
        }
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            this.ended = true;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures_util::StreamExt;
    use http_body_util::{BodyExt, Full, StreamBody};
    use hyper::service::service_fn;
    use tokio::net::TcpListener;
    use tokio::sync::Semaphore;

    use super::*;

    type TestBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

    /// A fake engine on loopback that counts the connections it accepted and
    /// saw end. `/hold` answers once `gate` gives a permit; `/stream` sends one
    /// chunk and then nothing.
    struct FakeEngine {
        authority: Authority,
        accepted: Arc<AtomicUsize>,
        ended: Arc<AtomicUsize>,
        gate: Arc<Semaphore>,
    }

    async fn fake_engine(keep_alive: bool) -> FakeEngine {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let accepted = Arc::new(AtomicUsize::new(0));
        let ended = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(Semaphore::new(0));
        let (a, e, g) = (accepted.clone(), ended.clone(), gate.clone());
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                let (e, g) = (e.clone(), g.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let g = g.clone();
                        async move {
                            let body: TestBody = match req.uri().path() {
                                "/hold" => {
                                    g.acquire().await.expect("gate").forget();
                                    Full::new(Bytes::from_static(b"held")).boxed()
                                }
                                "/stream" => {
                                    let chunks = futures_util::stream::iter([Ok::<_, Infallible>(
                                        Frame::data(Bytes::from_static(b"first")),
                                    )])
                                    .chain(futures_util::stream::pending());
                                    BodyExt::boxed(StreamBody::new(chunks))
                                }
                                _ => Full::new(Bytes::from_static(b"ok")).boxed(),
                            };
                            Ok::<_, Infallible>(Response::new(body))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .keep_alive(keep_alive)
                        .serve_connection(TokioIo::new(tcp), svc)
                        .await;
                    e.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        FakeEngine {
            authority: Authority::try_from(addr.to_string()).expect("authority"),
            accepted,
            ended,
            gate,
        }
    }

    fn pool(engine: &FakeEngine, max_idle: usize, idle_timeout: Duration) -> EnginePool {
        EnginePool::new(
            engine.authority.clone(),
            Duration::from_secs(5),
            max_idle,
            idle_timeout,
        )
    }

    fn get(engine: &FakeEngine, path: &str) -> Request<UpstreamBody> {
        get_at(&engine.authority, path)
    }

    fn get_at(authority: &Authority, path: &str) -> Request<UpstreamBody> {
        let mut req = Request::new(UpstreamBody::Full(Full::new(Bytes::new())));
        *req.uri_mut() = format!("http://{authority}{path}").parse().expect("uri");
        req
    }

    async fn fetch(pool: &EnginePool, engine: &FakeEngine, path: &str) -> String {
        text(pool.send(get(engine, path)).await.expect("response")).await
    }

    async fn text(resp: Response<ReplyBody>) -> String {
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        String::from_utf8(bytes.to_vec()).expect("utf-8")
    }

    /// Waits (bounded) until `cond` holds.
    async fn until(what: &str, cond: impl Fn() -> bool) {
        for _ in 0..500 {
            if cond() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("timed out waiting until {what}");
    }

    /// `n` requests to `/hold`, each in its own task, once each has its own
    /// connection: their answers come when the engine's gate opens.
    async fn held_requests(
        pool: &Arc<EnginePool>,
        engine: &FakeEngine,
        n: usize,
    ) -> Vec<tokio::task::JoinHandle<String>> {
        let sends = (0..n)
            .map(|_| {
                let (pool, req) = (pool.clone(), get(engine, "/hold"));
                tokio::spawn(async move { text(pool.send(req).await.expect("response")).await })
            })
            .collect();
        until("every held request has its own connection", || {
            engine.accepted.load(Ordering::SeqCst) == n
        })
        .await;
        sends
    }

    #[tokio::test]
    async fn sequential_requests_share_one_connection() {
        let engine = fake_engine(true).await;
        let pool = pool(&engine, 8, Duration::from_secs(60));
        for _ in 0..5 {
            assert_eq!(fetch(&pool, &engine, "/").await, "ok");
            // The body was read and dropped: the connection is back.
            until("the connection is ready again", || {
                pool.inner.lock().iter().any(|c| c.conn.sender.is_ready())
            })
            .await;
        }
        assert_eq!(engine.accepted.load(Ordering::SeqCst), 1);
        assert_eq!(pool.idle(), 1);
    }

    #[tokio::test]
    async fn a_busy_connection_is_not_shared_and_idle_ones_are_capped() {
        let engine = fake_engine(true).await;
        let pool = Arc::new(pool(&engine, 1, Duration::from_secs(60)));
        let sends = held_requests(&pool, &engine, 2).await;
        engine.gate.add_permits(2);
        for s in sends {
            assert_eq!(s.await.expect("task"), "held");
        }
        // max_idle = 1: the second connection back is closed, not kept.
        assert_eq!(pool.idle(), 1);
        until("the engine saw the extra connection close", || {
            engine.ended.load(Ordering::SeqCst) == 1
        })
        .await;
    }

    #[tokio::test]
    async fn an_engine_closing_every_connection_costs_no_request() {
        let engine = fake_engine(false).await;
        let pool = pool(&engine, 8, Duration::from_secs(60));
        for _ in 0..5 {
            assert_eq!(fetch(&pool, &engine, "/").await, "ok");
        }
        assert_eq!(engine.accepted.load(Ordering::SeqCst), 5);
    }

    #[tokio::test]
    async fn a_body_dropped_half_read_closes_its_connection() {
        let engine = fake_engine(true).await;
        let pool = pool(&engine, 8, Duration::from_secs(60));
        let mut body = pool
            .send(get(&engine, "/stream"))
            .await
            .expect("response")
            .into_body();
        let first = body.frame().await.expect("a frame").expect("data");
        assert_eq!(first.into_data().ok(), Some(Bytes::from_static(b"first")));
        drop(body);
        until("the half-read connection is closed", || {
            engine.ended.load(Ordering::SeqCst) == 1
        })
        .await;
        assert_eq!(fetch(&pool, &engine, "/").await, "ok");
        assert_eq!(engine.accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn idle_connections_are_closed_after_the_idle_timeout() {
        let engine = fake_engine(true).await;
        let pool = pool(&engine, 8, Duration::from_millis(200));
        assert_eq!(fetch(&pool, &engine, "/").await, "ok");
        assert_eq!(pool.idle(), 1);
        until("the idle connection is closed", || {
            engine.ended.load(Ordering::SeqCst) == 1
        })
        .await;
        assert_eq!(pool.idle(), 0);
    }

    #[tokio::test]
    async fn dropping_the_pool_closes_its_connections_and_stops_its_reaper() {
        let engine = fake_engine(true).await;
        let metrics = tokio::runtime::Handle::current().metrics();
        // The fake engine's accept loop.
        let before = metrics.num_alive_tasks();
        let pool = pool(&engine, 8, Duration::from_secs(60));
        assert_eq!(fetch(&pool, &engine, "/").await, "ok");
        drop(pool);
        until("the engine saw the idle connection close", || {
            engine.ended.load(Ordering::SeqCst) == 1
        })
        .await;
        until("no task of the pool is left", || {
            metrics.num_alive_tasks() == before
        })
        .await;
    }

    #[tokio::test]
    async fn a_connection_has_no_task_of_its_own() {
        let engine = fake_engine(true).await;
        let metrics = tokio::runtime::Handle::current().metrics();
        let pool = Arc::new(pool(&engine, 8, Duration::from_secs(60)));
        // The fake engine's accept loop and the pool's reaper.
        let before = metrics.num_alive_tasks();
        let held = held_requests(&pool, &engine, 3).await;
        // The three requests' tasks and the engine's three connection
        // tasks; none for the pool's side of the connections.
        assert_eq!(metrics.num_alive_tasks(), before + 6);
        engine.gate.add_permits(3);
        for h in held {
            assert_eq!(h.await.expect("task"), "held");
        }
        assert_eq!(pool.idle(), 3);
    }

    /// An engine that answers one request per connection and then closes it
    /// without saying so (no `Connection: close`): a keep-alive timeout
    /// that fell between two requests. It closes at once, or, with `hold`,
    /// once the notify fires (counting the closes).
    async fn one_shot_engine(
        hold: Option<(Arc<tokio::sync::Notify>, Arc<AtomicUsize>)>,
    ) -> (Authority, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let accepted = Arc::new(AtomicUsize::new(0));
        let a = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut tcp, _)) = listener.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                let hold = hold.clone();
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tcp.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    let _ = tcp.write_all(reply).await;
                    if let Some((close, closed)) = hold {
                        close.notified().await;
                        drop(tcp);
                        closed.fetch_add(1, Ordering::SeqCst);
                    }
                    // Otherwise closed as the task ends.
                });
            }
        });
        (
            Authority::try_from(addr.to_string()).expect("authority"),
            accepted,
        )
    }

    #[tokio::test]
    async fn a_fresh_connection_the_engine_closed_is_retried_on_a_new_one() {
        let close = Arc::new(tokio::sync::Notify::new());
        let closed = Arc::new(AtomicUsize::new(0));
        let (authority, accepted) = one_shot_engine(Some((close.clone(), closed.clone()))).await;
        let pool = EnginePool::new(
            authority.clone(),
            Duration::from_secs(5),
            8,
            Duration::from_secs(60),
        );
        let resp = pool
            .send(get_at(&authority, "/"))
            .await
            .expect("first response");
        assert_eq!(text(resp).await, "ok");
        assert_eq!(pool.idle(), 1);
        // The engine closes the idle connection just after giving it back:
        // well within TRUSTED_IDLE, so the next request takes it unlooked.
        close.notify_one();
        until("the engine closed the connection", || {
            closed.load(Ordering::SeqCst) == 1
        })
        .await;
        let resp = pool
            .send(get_at(&authority, "/"))
            .await
            .expect("a retry on a new connection");
        assert_eq!(text(resp).await, "ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn an_idle_connection_the_engine_closed_costs_no_request() {
        let (authority, accepted) = one_shot_engine(None).await;
        let pool = EnginePool::new(
            authority.clone(),
            Duration::from_secs(5),
            8,
            Duration::from_secs(60),
        );
        for n in 1..=4 {
            let resp = pool
                .send(get_at(&authority, "/"))
                .await
                .expect("a response on a fresh connection");
            assert_eq!(text(resp).await, "ok");
            // Each close is seen when the connection is next looked at, at
            // the latest: a request never goes out on it.
            assert_eq!(accepted.load(Ordering::SeqCst), n);
        }
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error_and_sends_the_host() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let authority = Authority::try_from(listener.local_addr().expect("addr").to_string())
            .expect("authority");
        drop(listener);
        let pool = EnginePool::new(
            authority.clone(),
            Duration::from_secs(5),
            8,
            Duration::from_secs(60),
        );
        let mut req = Request::new(UpstreamBody::Full(Full::new(Bytes::new())));
        *req.uri_mut() = format!("http://{authority}/v1/models")
            .parse()
            .expect("uri");
        let e = pool.send(req).await.expect_err("nothing listens");
        assert!(matches!(e, EngineError::Connect { .. }), "{e}");

        // The origin form and Host header an HTTP/1.1 engine expects.
        let mut req = Request::new(UpstreamBody::Full(Full::new(Bytes::new())));
        *req.uri_mut() = format!("http://{authority}/v1/models?x=1")
            .parse()
            .expect("uri");
        let req = pool.inner.origin_form(req);
        assert_eq!(req.uri().to_string(), "/v1/models?x=1");
        assert_eq!(req.headers()[header::HOST], authority.as_str());
    }
}
