//! `kvmesh-proxy run` as a user starts it, on its default single thread and
//! on several (`--worker-threads`): the built binary serves a completion end
//! to end either way, and the effective config says which it runs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The answer of the fake engine, which also echoes the prompt it was sent.
const ANSWER: &str = "fake-engine-answer";

/// An engine on loopback answering every request with a completion that
/// carries the request body.
async fn fake_engine() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let svc = service_fn(|req: Request<Incoming>| async move {
                    let sent = req.into_body().collect().await.unwrap().to_bytes();
                    let body = format!(
                        "{{\"id\":\"{ANSWER}\",\"object\":\"text_completion\",\"choices\":[],\"echo\":{}}}",
                        serde_json::to_string(&String::from_utf8_lossy(&sent)).unwrap()
                    );
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    addr
}

/// A port the OS had free a moment ago.
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// The sidecar process, killed when the test ends however it ends.
struct Sidecar(Child);

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One HTTP/1.1 exchange on a fresh connection: the status and the body.
async fn exchange(port: u16, head: &str, body: &str) -> Option<(u16, String)> {
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    let req = format!(
        "{head}\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(req.as_bytes()).await.ok()?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut raw))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n")?.1.to_owned();
    Some((status, body))
}

/// Threads of `pid` whose name is `name`.
fn threads_named(pid: u32, name: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim() == name)
        .count()
}

#[tokio::test]
async fn the_binary_serves_on_one_thread_and_on_several() {
    let engine = fake_engine().await;
    for threads in [None, Some(3)] {
        let (listen, admin) = (free_port(), free_port());
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvmesh-proxy"));
        cmd.arg("run")
            .args(["--listen", &format!("127.0.0.1:{listen}")])
            .args(["--admin", &format!("127.0.0.1:{admin}")])
            .args(["--engine", &format!("http://{engine}")])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(n) = threads {
            cmd.args(["--worker-threads", &n.to_string()]);
        }
        let sidecar = Sidecar(cmd.spawn().expect("start kvmesh-proxy"));

        let mut ready = false;
        for _ in 0..500 {
            if let Some((200, _)) = exchange(admin, "GET /ready HTTP/1.1", "").await {
                ready = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(ready, "{threads:?}: the sidecar never became ready");

        // Several completions, so that pooled engine connections are reused.
        for i in 0..3 {
            let prompt = format!("{{\"model\":\"m\",\"prompt\":\"request {i}\",\"max_tokens\":2}}");
            let (status, body) = exchange(listen, "POST /v1/completions HTTP/1.1", &prompt)
                .await
                .expect("an answer");
            assert_eq!(status, 200, "{threads:?}: {body}");
            assert!(body.contains(ANSWER), "{threads:?}: {body}");
            assert!(
                body.contains(&format!("request {i}")),
                "{threads:?}: {body}"
            );
        }

        let (_, config) = exchange(admin, "GET /config HTTP/1.1", "")
            .await
            .expect("config");
        let config: serde_json::Value = serde_json::from_str(&config).expect("JSON config");
        let want = threads.unwrap_or(1);
        assert_eq!(config["runtime"]["worker_threads"], want, "{config}");
        // The first thread is the process's own; each added one is named.
        for n in 1..want {
            let name = format!("kvmesh-worker-{n}");
            assert_eq!(threads_named(sidecar.0.id(), &name), 1, "{name}");
        }
        assert_eq!(
            threads_named(sidecar.0.id(), &format!("kvmesh-worker-{want}")),
            0
        );
    }
}
