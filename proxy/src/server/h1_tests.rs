//! The own HTTP/1.1 server against raw clients: what goes over the wire.

use std::sync::atomic::{AtomicUsize, Ordering};

use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::*;

/// Echoes `METHOD path body` (`/echo`), holds until the client goes
/// (`/hold`, counting how many held futures were dropped), or answers with
/// a declared length (`/sized`).
#[derive(Clone, Default)]
struct Echo {
    dropped: Arc<AtomicUsize>,
}

struct CountDrop(Arc<AtomicUsize>);

impl Drop for CountDrop {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

impl Handler for Echo {
    async fn handle(self, req: Request<IncomingBody>) -> Response<ResponseBody> {
        let (head, body) = req.into_parts();
        match head.uri.path() {
            "/hold" => {
                let _guard = CountDrop(self.dropped.clone());
                std::future::pending::<()>().await;
                Response::new(ResponseBody::empty())
            }
            "/sized" => {
                let mut r = Response::new(ResponseBody::full("hello"));
                r.headers_mut()
                    .insert(CONTENT_LENGTH, http::HeaderValue::from_static("5"));
                r
            }
            path => {
                let body = match body.collect().await {
                    Ok(b) => String::from_utf8_lossy(&b.to_bytes()).into_owned(),
                    Err(e) => format!("error: {e}"),
                };
                Response::new(ResponseBody::full(format!("{} {path} {body}", head.method)))
            }
        }
    }
}

/// A server of `handler` on loopback, one `serve` per connection, with
/// `head` as the request head deadline.
async fn server(
    handler: Echo,
    head: Duration,
) -> (std::net::SocketAddr, Arc<crate::metrics::Metrics>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let metrics = Arc::new(crate::metrics::Metrics::new());
    let m = metrics.clone();
    tokio::spawn(async move {
        let shutdown = Shutdown::new();
        let h2 = auto::Builder::new(TokioExecutor::new());
        while let Ok((tcp, _)) = listener.accept().await {
            let (handler, shutdown, h2, m) =
                (handler.clone(), shutdown.clone(), h2.clone(), m.clone());
            tokio::spawn(async move {
                let limits = ConnLimits {
                    request_head: head,
                    rejected: Some(m),
                };
                serve(tcp, handler, &shutdown, &limits, &h2).await;
            });
        }
    });
    (addr, metrics)
}

/// Sends `wire`, then reads until the server closes (bounded).
async fn exchange(addr: std::net::SocketAddr, wire: &[u8]) -> String {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(wire).await.unwrap();
    read_to_close(&mut tcp).await
}

async fn read_to_close(tcp: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(20), tcp.read_to_end(&mut got)).await;
    assert!(
        r.is_ok(),
        "the server did not close: {}",
        String::from_utf8_lossy(&got)
    );
    String::from_utf8_lossy(&got).into_owned()
}

/// Reads one response with a `content-length` from a connection left open.
async fn read_response(tcp: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let len = text[..end]
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .map_or(0, |v| v.parse::<usize>().unwrap());
            if got.len() >= end + 4 + len {
                return text;
            }
        }
        let n = tokio::time::timeout(Duration::from_secs(20), tcp.read(&mut buf))
            .await
            .expect("a response in time")
            .unwrap();
        assert!(n > 0, "closed early: {text}");
        got.extend_from_slice(&buf[..n]);
    }
}

fn body_of(response: &str) -> &str {
    response.split_once("\r\n\r\n").map_or("", |(_, b)| b)
}

#[tokio::test]
async fn keep_alive_and_pipelined_requests_share_one_connection() {
    let (addr, _) = server(Echo::default(), Duration::from_secs(10)).await;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\none")
        .await
        .unwrap();
    let first = read_response(&mut tcp).await;
    assert!(first.starts_with("HTTP/1.1 200 OK\r\n"), "{first}");
    assert!(first.contains("\r\ndate: "), "{first}");
    assert_eq!(body_of(&first), "POST /echo one");
    // Two at once: answered in order on the same connection.
    tcp.write_all(b"GET /a HTTP/1.1\r\n\r\nPOST /b HTTP/1.1\r\ncontent-length: 1\r\n\r\n2")
        .await
        .unwrap();
    let a = read_response(&mut tcp).await;
    assert_eq!(body_of(&a), "GET /a ");
    let b = read_response(&mut tcp).await;
    assert_eq!(body_of(&b), "POST /b 2");
    // Connection: close ends it after the answer.
    tcp.write_all(b"GET /c HTTP/1.1\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let c = read_to_close(&mut tcp).await;
    assert!(c.contains("\r\nconnection: close\r\n"), "{c}");
    assert_eq!(body_of(&c), "GET /c ");
}

#[tokio::test]
async fn bodies_that_come_later_chunked_or_after_100_continue_are_read_whole() {
    let (addr, _) = server(Echo::default(), Duration::from_secs(10)).await;
    // Chunked, in pieces.
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"POST /chunked HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n4\r\nwiki")
        .await
        .unwrap();
    tcp.write_all(b"\r\n5;ext=1\r\npedia\r\n0\r\nx-trailer: t\r\n\r\n")
        .await
        .unwrap();
    let r = read_response(&mut tcp).await;
    assert_eq!(body_of(&r), "POST /chunked wikipedia");
    // The connection is still good after a chunked body.
    tcp.write_all(b"GET /again HTTP/1.1\r\n\r\n").await.unwrap();
    assert_eq!(body_of(&read_response(&mut tcp).await), "GET /again ");
    // Expect: 100-continue: the body is sent only after the 100.
    tcp.write_all(b"POST /late HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 4\r\n\r\n")
        .await
        .unwrap();
    let mut interim = [0u8; 25];
    tokio::time::timeout(Duration::from_secs(20), tcp.read_exact(&mut interim))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    tcp.write_all(b"body").await.unwrap();
    assert_eq!(body_of(&read_response(&mut tcp).await), "POST /late body");
}

#[tokio::test]
async fn head_and_http_1_0_get_what_their_protocol_says() {
    let (addr, _) = server(Echo::default(), Duration::from_secs(10)).await;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"HEAD /sized HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.ends_with(b"\r\n\r\n") {
        let n = tcp.read(&mut buf).await.unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains("\r\ncontent-length: 5\r\n"), "{text}");
    // No body followed: the next answer starts right after the head.
    tcp.write_all(b"GET /next HTTP/1.1\r\n\r\n").await.unwrap();
    let next = read_response(&mut tcp).await;
    assert!(next.starts_with("HTTP/1.1 200"), "{next}");
    // HTTP/1.0 without keep-alive: answered, then closed.
    let r = exchange(addr, b"GET /old HTTP/1.0\r\n\r\n").await;
    assert!(r.contains("\r\nconnection: close\r\n"), "{r}");
    assert_eq!(body_of(&r), "GET /old ");
}

#[tokio::test]
async fn bad_heads_are_answered_and_closed() {
    let (addr, metrics) = server(Echo::default(), Duration::from_secs(10)).await;
    let r = exchange(addr, b"GET / HTTP/1.1\r\nbad header\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{r}");
    let r = exchange(
        addr,
        b"POST / HTTP/1.1\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 400 "), "{r}");
    let r = exchange(addr, b"POST / HTTP/1.1\r\ntransfer-encoding: gzip\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 501 "), "{r}");
    let mut big = b"GET / HTTP/1.1\r\nx: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', crate::h1::head::MAX_HEAD_BYTES));
    let r = exchange(addr, &big).await;
    assert!(r.starts_with("HTTP/1.1 431 "), "{r}");
    let text = metrics.encode();
    assert!(
        text.contains(r#"kvmesh_client_connections_rejected_total{listener="client",reason="header_too_large"} 1"#),
        "{text}"
    );
}

#[tokio::test]
async fn a_client_that_leaves_drops_its_request() {
    let echo = Echo::default();
    let (addr, _) = server(echo.clone(), Duration::from_secs(10)).await;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET /hold HTTP/1.1\r\n\r\n").await.unwrap();
    // Wait (bounded) until the server is inside the handler, by a second
    // request on another connection answered after it.
    let r = exchange(addr, b"GET /probe HTTP/1.1\r\nconnection: close\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    drop(tcp);
    for _ in 0..500 {
        if echo.dropped.load(Ordering::SeqCst) == 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the held request was not dropped when its client left");
}

#[tokio::test]
async fn a_silent_client_is_cut_at_the_head_deadline_and_counted() {
    let (addr, metrics) = server(Echo::default(), Duration::from_millis(200)).await;
    // Half a head, never finished.
    let r = exchange(addr, b"GET / HTTP/1.1\r\nx-slow: ").await;
    assert_eq!(r, "");
    let text = metrics.encode();
    assert!(
        text.contains(r#"kvmesh_client_connections_rejected_total{listener="client",reason="header_timeout"} 1"#),
        "{text}"
    );
}

#[tokio::test]
async fn the_http2_preface_is_served_by_hyper() {
    let (addr, _) = server(Echo::default(), Duration::from_secs(10)).await;
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = Request::post("http://x/h2")
        .body(http_body_util::Full::new(Bytes::from("over h2")))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.version(), Version::HTTP_2);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"POST /h2 over h2");
}
