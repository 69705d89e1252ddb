//! Slow and oversize clients against the client port and the mesh port: a
//! client that trickles its request head (one byte at a time, never
//! finishing), sends nothing, trickles its body, or sends a head larger than
//! the listener takes is cut within the configured deadline (the test waits
//! for EOF with a generous bound, never timing the cut), counted in
//! `kvmesh_client_connections_rejected_total{listener,reason}`, and a
//! well-behaved client on the same sidecar is served meanwhile.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::Duration;

use kvmesh_proxy::config::Duration as CfgDuration;
use kvmesh_proxy::SidecarHandle;
use kvmesh_tests::client::{self, admin_get, fetch, post_json};
use kvmesh_tests::sidecar::{start, test_config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

/// Far above the configured deadlines below: a slow machine still sees the
/// cut well within it, and a missing bound fails the test.
const EOF_WITHIN: Duration = Duration::from_secs(20);
/// Gap between two trickled bytes.
const TRICKLE_GAP: Duration = Duration::from_millis(20);

/// A sidecar in front of the fake vLLM with short client deadlines and,
/// when `mesh`, a mesh port (no peers).
async fn sidecar(mesh: bool) -> (kvmesh_tests::fake_upstream::FakeUpstream, SidecarHandle) {
    let engine = kvmesh_tests::fake_vllm::start().await;
    let mut c = test_config(engine.addr());
    c.timeouts.request_head = CfgDuration::from_millis(400);
    c.timeouts.request_body = CfgDuration::from_millis(400);
    if mesh {
        c.mesh.listen = Some("127.0.0.1:0".parse().unwrap());
    }
    let proxy = start(c).await;
    kvmesh_tests::sidecar::wait_ready(&proxy).await;
    (engine, proxy)
}

/// Writes `head` at once, then `trickle` one byte per [`TRICKLE_GAP`] until
/// the server closes (a write fails) or the bytes run out, then holds the
/// connection open. Returns the read half.
async fn trickler(
    addr: SocketAddr,
    head: Vec<u8>,
    trickle: Vec<u8>,
) -> (OwnedReadHalf, JoinHandle<()>) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (read, mut write) = stream.into_split();
    let task = tokio::spawn(async move {
        if write.write_all(&head).await.is_err() {
            return;
        }
        for b in trickle {
            if write.write_all(&[b]).await.is_err() {
                return;
            }
            tokio::time::sleep(TRICKLE_GAP).await;
        }
        // Never finish: the connection stays open until the server cuts it.
        std::future::pending::<()>().await;
    });
    (read, task)
}

/// Everything the server sends until it closes; fails if it never does.
async fn read_to_eof(mut read: impl AsyncReadExt + Unpin) -> Vec<u8> {
    let mut got = Vec::new();
    let r = tokio::time::timeout(EOF_WITHIN, async {
        let mut buf = [0u8; 4096];
        loop {
            match read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(
        r.is_ok(),
        "the server kept the connection open past {EOF_WITHIN:?}"
    );
    got
}

/// The rejection counter of one listener and reason.
async fn rejected(proxy: &SidecarHandle, listener: &str, reason: &str) -> u64 {
    let text = admin_get(proxy.admin_addr(), "/metrics").await.text();
    let series = format!(
        r#"kvmesh_client_connections_rejected_total{{listener="{listener}",reason="{reason}"}} "#
    );
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// A completion through the sidecar answers 200.
async fn served(proxy: &SidecarHandle) {
    let r = fetch(
        &client::http1(),
        post_json(
            proxy.addr(),
            "/v1/completions",
            r#"{"model":"m","prompt":"p"}"#,
        ),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Bytes enough to trickle for far longer than [`EOF_WITHIN`].
fn endless_header() -> Vec<u8> {
    b"x-slow: "
        .iter()
        .copied()
        .chain(std::iter::repeat_n(b'a', 5000))
        .collect()
}

#[tokio::test]
async fn trickled_or_missing_request_heads_are_cut_and_counted_on_the_client_port() {
    let (_engine, proxy) = sidecar(false).await;
    let before = rejected(&proxy, "client", "header_timeout").await;
    // HTTP/1.1 headers, one byte at a time, never finished.
    let head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n".to_vec();
    let (slow_h1, t1) = trickler(proxy.addr(), head, endless_header()).await;
    // An HTTP/2 preface, trickled (hyper's HTTP/1.1 timer never sees it).
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    let (slow_h2, t2) = trickler(proxy.addr(), Vec::new(), preface).await;
    // A client that connects and sends nothing.
    let (silent, t3) = trickler(proxy.addr(), Vec::new(), Vec::new()).await;
    // Served meanwhile.
    served(&proxy).await;
    for (read, task) in [(slow_h1, t1), (slow_h2, t2), (silent, t3)] {
        let got = read_to_eof(read).await;
        // Nothing was answered, or at most an error status: never a 200.
        assert!(
            !got.starts_with(b"HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&got)
        );
        task.abort();
    }
    served(&proxy).await;
    assert_eq!(
        rejected(&proxy, "client", "header_timeout").await - before,
        3
    );
    // Keep-alive connections that finished a request are not counted.
    assert_eq!(rejected(&proxy, "client", "body_timeout").await, 0);
}

#[tokio::test]
async fn a_trickled_body_gets_408_and_is_counted() {
    let (engine, proxy) = sidecar(false).await;
    let head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 4000\r\n\r\n".to_vec();
    let body: Vec<u8> = br#"{"model":"m","prompt":""#.iter().copied().chain(std::iter::repeat_n(b'a', 3977)).collect();
    let (read, task) = trickler(proxy.addr(), head, body).await;
    served(&proxy).await;
    let got = read_to_eof(read).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    task.abort();
    assert_eq!(rejected(&proxy, "client", "body_timeout").await, 1);
    // The engine only ever saw the well-behaved client's request.
    let completions = engine
        .seen()
        .iter()
        .filter(|s| s.path == "/v1/completions")
        .count();
    assert_eq!(completions, 1);
}

#[tokio::test]
async fn an_oversize_request_head_gets_431_and_is_counted() {
    let (_engine, proxy) = sidecar(false).await;
    let mut req = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: ".to_vec();
    req.extend(std::iter::repeat_n(b'a', 1 << 20));
    req.extend_from_slice(b"\r\n\r\n");
    let stream = TcpStream::connect(proxy.addr()).await.unwrap();
    let (read, mut write) = stream.into_split();
    // The server may stop reading (and close) before the whole head is sent.
    let writer = tokio::spawn(async move {
        let _ = write.write_all(&req).await;
        std::future::pending::<()>().await;
    });
    let got = read_to_eof(read).await;
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 431"),
        "{text}"
    );
    writer.abort();
    served(&proxy).await;
    assert_eq!(rejected(&proxy, "client", "header_too_large").await, 1);
}

#[tokio::test]
async fn trickled_or_missing_prefaces_are_cut_and_counted_on_the_mesh_port() {
    let (_engine, proxy) = sidecar(true).await;
    let mesh = proxy.mesh_addr().expect("mesh port");
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    let (slow, t1) = trickler(mesh, Vec::new(), preface).await;
    let (silent, t2) = trickler(mesh, Vec::new(), Vec::new()).await;
    served(&proxy).await;
    for (read, task) in [(slow, t1), (silent, t2)] {
        read_to_eof(read).await;
        task.abort();
    }
    assert_eq!(rejected(&proxy, "mesh", "header_timeout").await, 2);
    // A real subscriber still gets the stream.
    let c = client::h2c();
    let req = client::request(
        "GET",
        mesh,
        kvmesh_proxy::mesh::server::STREAM_PATH,
        "",
        &[],
    );
    let resp = client::send(&c, req).await;
    assert_eq!(resp.status(), 200);
}
