//! A sidecar that is shutting down still routes the requests it took just
//! before: its fleet keeps the peers it knew. Here A's filters keep only B
//! (as a P/D prefill pod's decode profile keeps only decode pods), and A
//! takes a request as its shutdown begins: it must forward it to B, not
//! answer 503 "removed the last candidates" because it forgot B when its
//! mesh stopped (issue 41's closed loop lost requests so as pools shrank).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use kvmesh_tests::mesh::{kv_sim, mesh_config, start_on, write_peers};
use kvmesh_tests::route::{eventually, filters_yaml, metric, MODEL};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_draining_sidecar_routes_the_requests_it_took_to_the_peers_it_knew() {
    let peers = tempfile::NamedTempFile::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let filters = dir.path().join("filters.yaml");
    let only_b = "  - type: label-selector-filter\n    parameters:\n      matchLabels: {pod: b}\n  - type: queue-scorer\n";
    std::fs::write(&filters, filters_yaml(only_b)).unwrap();
    let (ea, eb) = (kv_sim().await, kv_sim().await);
    let mut ca = mesh_config(&ea, peers.path());
    ca.pod.labels.insert("pod".into(), "a".into());
    ca.scheduling.filters = Some(filters);
    let mut cb = mesh_config(&eb, peers.path());
    cb.pod.labels.insert("pod".into(), "b".into());
    let (a, b) = (start_on(ca, None).await, start_on(cb, None).await);
    write_peers(
        peers.path(),
        &[a.mesh_addr().unwrap(), b.mesh_addr().unwrap()],
    );
    let b_id = b.fleet().local_id().to_owned();
    eventually("A knows B with a fresh load", || async {
        let now = tokio::time::Instant::now();
        a.fleet()
            .snapshot(now)
            .iter()
            .any(|p| p.info.id == b_id && p.load_age_ms.is_some_and(|ms| ms < 1000))
            .then_some(())
    })
    .await;
    eventually("B serves A's subscription", || async {
        (b.mesh().subscribers() == 1).then_some(())
    })
    .await;

    // The request has begun (its head is in, its body is not) when A's
    // shutdown starts: A reads it to the end and serves it.
    let body =
        format!(r#"{{"model":"{MODEL}","prompt":"hello there, how are you","max_tokens":4}}"#);
    let (first, rest) = body.split_at(10);
    let mut tcp = TcpStream::connect(a.addr()).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{first}",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    eventually("A has the request in hand", || async {
        (metric(&a, "kvmesh_requests_in_flight").await == Some(1.0)).then_some(())
    })
    .await;
    a.shutdown_handle().trigger();
    // A's mesh has stopped: its subscription to B is gone.
    eventually("A's mesh stopped", || async {
        (b.mesh().subscribers() == 0).then_some(())
    })
    .await;
    tcp.write_all(rest.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut answer))
        .await
        .expect("A answers and closes")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let served = eb
        .received_requests()
        .into_iter()
        .filter(|r| r.path == "/v1/completions")
        .count();
    assert_eq!(served, 1, "B's engine served it");
    a.shutdown().await;
    b.shutdown().await;
    ea.shutdown().await;
    eb.shutdown().await;
}
