use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures_util::StreamExt;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
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
    let mut req = Request::new(UpstreamBody::empty());
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
        // The body was read: the connection is back.
        assert_eq!(pool.idle(), 1);
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
async fn a_connection_the_engine_closed_right_after_its_response_is_not_used() {
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
    // The engine closes the idle connection just after giving it back;
    // the close is seen when the connection is next taken.
    close.notify_one();
    until("the engine closed the connection", || {
        closed.load(Ordering::SeqCst) == 1
    })
    .await;
    let resp = pool
        .send(get_at(&authority, "/"))
        .await
        .expect("a response on a new connection");
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
async fn a_refused_connection_is_a_connect_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let authority =
        Authority::try_from(listener.local_addr().expect("addr").to_string()).expect("authority");
    drop(listener);
    let pool = EnginePool::new(
        authority.clone(),
        Duration::from_secs(5),
        8,
        Duration::from_secs(60),
    );
    let mut req = Request::new(UpstreamBody::empty());
    *req.uri_mut() = format!("http://{authority}/v1/models")
        .parse()
        .expect("uri");
    let e = pool.send(req).await.expect_err("nothing listens");
    assert!(matches!(e, EngineError::Connect { .. }), "{e}");
}

/// What a scripted engine saw of one request: its head and body bytes.
type Seen = Arc<std::sync::Mutex<Vec<Vec<u8>>>>;

/// A raw engine on loopback: on each connection it reads requests (a head,
/// then a body of its `content-length`, or a chunked one up to its last
/// chunk), records each, and answers each with the next of `replies`,
/// closing the connection after a reply that ends in `close`.
async fn scripted_engine(replies: Vec<&'static [u8]>) -> (Authority, Seen, Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen: Seen = Arc::default();
    let accepted = Arc::new(AtomicUsize::new(0));
    let (s, a) = (seen.clone(), accepted.clone());
    tokio::spawn(async move {
        let mut replies = replies.into_iter();
        while let Ok((mut tcp, _)) = listener.accept().await {
            a.fetch_add(1, Ordering::SeqCst);
            let mut buf = Vec::new();
            loop {
                let request = loop {
                    if let Some(n) = request_len(&buf) {
                        break Some(buf.drain(..n).collect::<Vec<u8>>());
                    }
                    let mut chunk = [0u8; 4096];
                    match tcp.read(&mut chunk).await {
                        Ok(0) | Err(_) => break None,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                };
                let Some(request) = request else { break };
                s.lock().expect("seen").push(request);
                let Some(reply) = replies.next() else { return };
                let _ = tcp.write_all(reply).await;
                if reply.ends_with(b"close") {
                    break;
                }
            }
        }
    });
    (
        Authority::try_from(addr.to_string()).expect("authority"),
        seen,
        accepted,
    )
}

/// The length of the first whole request in `buf`, if there is one.
fn request_len(buf: &[u8]) -> Option<usize> {
    let head = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let text = String::from_utf8_lossy(&buf[..head]).to_lowercase();
    if text.contains("transfer-encoding: chunked") {
        let end = buf[head..].windows(5).position(|w| w == b"0\r\n\r\n")?;
        return Some(head + end + 5);
    }
    let len = text
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .map_or(0, |v| v.trim().parse().unwrap_or(0));
    (buf.len() >= head + len).then_some(head + len)
}

fn scripted_pool(authority: &Authority) -> EnginePool {
    EnginePool::new(
        authority.clone(),
        Duration::from_secs(5),
        8,
        Duration::from_secs(60),
    )
}

fn post_at(authority: &Authority, path: &str, body: &'static str) -> Request<UpstreamBody> {
    let mut req = Request::new(UpstreamBody::full(body));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = format!("http://{authority}{path}").parse().expect("uri");
    req.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    req
}

#[tokio::test]
async fn requests_go_out_in_origin_form_with_host_and_length() {
    let (authority, seen, _) = scripted_engine(vec![
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
    ])
    .await;
    let pool = scripted_pool(&authority);
    let mut req = post_at(&authority, "/v1/completions?x=1", r#"{"prompt":"p"}"#);
    // The client's own length is not trusted: the body's is written.
    req.headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from_static("999"));
    assert_eq!(text(pool.send(req).await.expect("response")).await, "ok");
    assert_eq!(
        text(
            pool.send(get_at(&authority, "/v1/models"))
                .await
                .expect("response")
        )
        .await,
        "ok"
    );
    let seen = seen.lock().expect("seen").clone();
    let first = String::from_utf8(seen[0].clone()).expect("utf-8");
    assert!(
        first.starts_with("POST /v1/completions?x=1 HTTP/1.1\r\n"),
        "{first}"
    );
    assert!(
        first.contains(&format!("\r\nhost: {authority}\r\n")),
        "{first}"
    );
    assert!(first.contains("\r\ncontent-length: 14\r\n"), "{first}");
    assert!(!first.contains("999"), "{first}");
    assert!(first.ends_with("\r\n\r\n{\"prompt\":\"p\"}"), "{first}");
    // A GET with no body states no length.
    let second = String::from_utf8(seen[1].clone()).expect("utf-8");
    assert!(
        second.starts_with("GET /v1/models HTTP/1.1\r\n"),
        "{second}"
    );
    assert!(!second.contains("content-length"), "{second}");
    assert_eq!(pool.idle(), 1);
}

#[tokio::test]
async fn chunked_and_interim_responses_are_read_and_the_connection_kept() {
    let (authority, _, accepted) = scripted_engine(vec![
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
    ])
    .await;
    let pool = scripted_pool(&authority);
    let resp = pool
        .send(post_at(&authority, "/", "{}"))
        .await
        .expect("response");
    assert_eq!(resp.status(), 200);
    assert_eq!(text(resp).await, "hello world");
    assert_eq!(
        pool.idle(),
        1,
        "the chunked body ended: the connection is back"
    );
    assert_eq!(
        text(pool.send(get_at(&authority, "/")).await.expect("response")).await,
        ""
    );
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_body_that_runs_until_the_close_spends_its_connection() {
    let (authority, _, accepted) = scripted_engine(vec![
        b"HTTP/1.1 200 OK\r\n\r\nall of it, then close",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
    ])
    .await;
    let pool = scripted_pool(&authority);
    let resp = pool.send(get_at(&authority, "/")).await.expect("response");
    assert_eq!(text(resp).await, "all of it, then close");
    assert_eq!(pool.idle(), 0);
    assert_eq!(
        text(pool.send(get_at(&authority, "/")).await.expect("response")).await,
        "ok"
    );
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_response_to_head_has_no_body_and_keeps_its_connection() {
    let (authority, _, accepted) = scripted_engine(vec![
        b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
    ])
    .await;
    let pool = scripted_pool(&authority);
    let mut req = get_at(&authority, "/v1/models");
    *req.method_mut() = Method::HEAD;
    let resp = pool.send(req).await.expect("response");
    assert_eq!(resp.headers()[header::CONTENT_LENGTH], "1234");
    assert_eq!(text(resp).await, "");
    assert_eq!(
        text(pool.send(get_at(&authority, "/")).await.expect("response")).await,
        "ok"
    );
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_broken_exchange_is_an_error_and_its_connection_is_dropped() {
    let (authority, _, _) = scripted_engine(vec![
        // Cut mid-body.
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort, then close",
        // A head that is not HTTP.
        b"SSH-2.0-OpenSSH\r\n\r\nclose",
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\nclose",
    ])
    .await;
    let pool = scripted_pool(&authority);
    let body = pool
        .send(get_at(&authority, "/"))
        .await
        .expect("a head")
        .into_body();
    let e = body.collect().await.expect_err("cut short");
    assert!(
        e.to_string().contains("closed before the body ended"),
        "{e}"
    );
    let e = pool
        .send(get_at(&authority, "/"))
        .await
        .expect_err("not HTTP");
    assert!(
        matches!(e, EngineError::Request(ExchangeError::Head(_))),
        "{e}"
    );
    let e = pool
        .send(get_at(&authority, "/"))
        .await
        .expect_err("an upgrade");
    assert!(
        matches!(e, EngineError::Request(ExchangeError::Upgrade)),
        "{e}"
    );
    assert_eq!(pool.idle(), 0);
}

#[tokio::test]
async fn a_streamed_request_body_of_unknown_length_goes_out_chunked() {
    let (authority, seen, _) =
        scripted_engine(vec![b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]).await;
    let pool = scripted_pool(&authority);
    // A body whose size nobody knows: hyper's, from a client that streamed it.
    let parts =
        ["{\"prompt\":", "\"streamed\"}"].map(|p| Ok::<_, Infallible>(Frame::data(Bytes::from(p))));
    let incoming = hyper_body(StreamBody::new(futures_util::stream::iter(parts))).await;
    let mut req = Request::new(UpstreamBody::Stream(http_body_util::Limited::new(
        crate::body::IncomingBody::Hyper(incoming),
        1 << 20,
    )));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = format!("http://{authority}/v1/files").parse().expect("uri");
    assert_eq!(text(pool.send(req).await.expect("response")).await, "ok");
    let seen = String::from_utf8(seen.lock().expect("seen")[0].clone()).expect("utf-8");
    assert!(
        seen.contains("\r\ntransfer-encoding: chunked\r\n"),
        "{seen}"
    );
    assert!(!seen.contains("content-length"), "{seen}");
    let body = &seen[seen.find("\r\n\r\n").expect("head") + 4..];
    assert_eq!(body, "a\r\n{\"prompt\":\r\nb\r\n\"streamed\"}\r\n0\r\n\r\n");
}

/// `body` as hyper's `Incoming` of unknown length: sent by a hyper client
/// over a loopback connection and received by a hyper server.
async fn hyper_body<B>(body: B) -> Incoming
where
    B: Body<Data = Bytes, Error = Infallible> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.expect("accept");
        let tx = std::sync::Mutex::new(Some(tx));
        let svc = service_fn(move |req: Request<Incoming>| {
            if let Some(tx) = tx.lock().expect("tx").take() {
                let _ = tx.send(req.into_body());
            }
            async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::new()))) }
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(tcp), svc)
            .await;
    });
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let req = Request::post("/").body(body).expect("request");
    tokio::spawn(async move {
        let _ = sender.send_request(req).await;
    });
    rx.await.expect("the server got the body")
}
