//! Start-up, readiness, the admin port, and graceful shutdown.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use kvmesh_proxy::Sidecar;
use kvmesh_tests::client::{self, admin_get, next_chunk, post_json, send};
use kvmesh_tests::fake_upstream::FakeUpstream;
use kvmesh_tests::sidecar::{refused_addr, start, start_for, test_config, wait_ready};

#[tokio::test]
async fn graceful_shutdown_finishes_an_in_flight_stream() {
    let (tx, engine) = FakeUpstream::scripted_stream().await;
    let proxy = start_for(engine.addr()).await;
    let addr = proxy.addr();
    let resp = send(
        &client::http1(),
        post_json(addr, "/v1/completions", r#"{"prompt":"p","stream":true}"#),
    )
    .await;
    let mut body = resp.into_body();
    assert!(tx.send("data: 1\n\n").await);
    assert_eq!(next_chunk(&mut body).await.unwrap(), "data: 1\n\n");

    let stopping = tokio::spawn(proxy.shutdown());
    // The listener closes first: wait (bounded) until new connections are refused.
    let mut refused = false;
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(addr).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        refused,
        "the client port still accepts after shutdown began"
    );
    assert!(
        !stopping.is_finished(),
        "shutdown did not wait for the stream"
    );

    // The in-flight stream still runs to its end.
    assert!(tx.send("data: 2\n\n").await);
    assert_eq!(next_chunk(&mut body).await.unwrap(), "data: 2\n\n");
    assert!(tx.send("data: [DONE]\n\n").await);
    tx.finish();
    assert_eq!(next_chunk(&mut body).await.unwrap(), "data: [DONE]\n\n");
    assert_eq!(next_chunk(&mut body).await, None);
    tokio::time::timeout(Duration::from_secs(5), stopping)
        .await
        .expect("shutdown completes once the stream ended")
        .unwrap();
}

#[tokio::test]
async fn ready_follows_the_engine_health() {
    let down = start_for(refused_addr().await).await;
    let r = admin_get(down.admin_addr(), "/ready").await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["ready"], false);
    assert_eq!(admin_get(down.admin_addr(), "/health").await.status, 200);
    down.shutdown().await;

    let engine = kvmesh_tests::fake_vllm::start().await;
    let up = start_for(engine.addr()).await;
    wait_ready(&up).await;
    assert_eq!(
        admin_get(up.admin_addr(), "/ready").await.json()["ready"],
        true
    );
    up.shutdown().await;
}

#[tokio::test]
async fn metrics_and_config_on_the_admin_port() {
    let engine = kvmesh_tests::fake_vllm::start().await;
    let proxy = start_for(engine.addr()).await;
    let c = client::http1();
    let stream = r#"{"model":"tiny-llama","prompt":"p","stream":true,"max_tokens":3}"#;
    let r = client::whole(send(&c, post_json(proxy.addr(), "/v1/completions", stream)).await).await;
    assert_eq!(r.status, 200);
    let r = client::fetch(&c, post_json(proxy.addr(), "/v1/completions", "{bad")).await;
    assert_eq!(r.status, 400);

    let m = admin_get(proxy.admin_addr(), "/metrics").await;
    assert_eq!(m.status, 200);
    let text = m.text();
    for want in [
        "kvmesh_requests_total{route=\"completions\",status=\"200\"} 1",
        "kvmesh_requests_total{route=\"completions\",status=\"400\"} 1",
        "kvmesh_requests_in_flight ",
        "kvmesh_time_to_first_token_seconds_count{route=\"completions\"} 1",
        "kvmesh_upstream_latency_seconds_count{route=\"completions\"} 1",
        "kvmesh_inter_token_latency_seconds_count{route=\"completions\"}",
        "kvmesh_response_bytes_total{route=\"completions\"}",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }

    let cfg = admin_get(proxy.admin_addr(), "/config").await.json();
    assert_eq!(cfg["engine"]["url"], format!("http://{}", engine.addr()));
    assert_eq!(cfg["timeouts"]["shutdown_drain"], "10s");
    assert_eq!(cfg["limits"]["max_body_bytes"], 32 * 1024 * 1024);
    proxy.shutdown().await;
}

/// Client connections accepted per serving thread, from the admin port's
/// `kvmesh_client_connections_total{thread="N"}`, in thread order.
async fn connections_by_thread(admin: std::net::SocketAddr) -> Vec<u64> {
    let text = admin_get(admin, "/metrics").await.text();
    let mut seen: Vec<(u16, u64)> = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("kvmesh_client_connections_total{thread=\"")?;
            let (thread, count) = rest.split_once("\"} ")?;
            Some((thread.parse().ok()?, count.trim().parse().ok()?))
        })
        .collect();
    seen.sort_unstable();
    seen.into_iter().map(|(_, n)| n).collect()
}

/// `clients` completions at once, each on a connection of its own; every
/// status that came back.
async fn completions_at_once(addr: std::net::SocketAddr, clients: usize) -> Vec<u16> {
    let body = r#"{"model":"tiny-llama","prompt":"p","max_tokens":2}"#;
    let calls = (0..clients).map(|_| async move {
        client::fetch(&client::http1(), post_json(addr, "/v1/completions", body))
            .await
            .status
            .as_u16()
    });
    futures_util::future::join_all(calls).await
}

/// `runtime.worker_threads: 3` as the binary binds it (`Sidecar::bind`): the
/// three threads each hold a socket on the client port, the kernel spreads
/// connections over them, each serves completions through its own engine
/// pool, and shutdown drains every thread.
#[tokio::test]
async fn three_serving_threads_share_the_client_port() {
    let engine = kvmesh_tests::fake_vllm::start().await;
    let mut config = test_config(engine.addr());
    config.runtime.worker_threads = 3;
    let proxy = Sidecar::bind(config).await.expect("sidecar starts");
    wait_ready(&proxy).await;
    assert_eq!(connections_by_thread(proxy.admin_addr()).await, [0, 0, 0]);

    let statuses = completions_at_once(proxy.addr(), 60).await;
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    let per_thread = connections_by_thread(proxy.admin_addr()).await;
    assert_eq!(per_thread.iter().sum::<u64>(), 60, "{per_thread:?}");
    // By a hash of each client's port: one thread left out of 60 is 3 in 10^10.
    assert!(per_thread.iter().all(|&n| n > 0), "{per_thread:?}");

    tokio::time::timeout(Duration::from_secs(15), proxy.shutdown())
        .await
        .expect("every serving thread drains and stops");
}

/// A client listener the caller bound without `SO_REUSEPORT` (as the tests
/// and the demo do): the serving threads share that one socket and still
/// serve every connection.
#[tokio::test]
async fn serving_threads_share_a_listener_bound_by_the_caller() {
    let engine = kvmesh_tests::fake_vllm::start().await;
    let mut config = test_config(engine.addr());
    config.runtime.worker_threads = 2;
    let proxy = start(config).await;
    wait_ready(&proxy).await;

    let statuses = completions_at_once(proxy.addr(), 20).await;
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    let per_thread = connections_by_thread(proxy.admin_addr()).await;
    assert_eq!(per_thread.len(), 2, "{per_thread:?}");
    assert_eq!(per_thread.iter().sum::<u64>(), 20, "{per_thread:?}");
    tokio::time::timeout(Duration::from_secs(15), proxy.shutdown())
        .await
        .expect("every serving thread drains and stops");
}

/// The sidecar's `/ready` answer: status and reason.
async fn readiness(h: &kvmesh_proxy::SidecarHandle) -> (u16, String) {
    let r = admin_get(h.admin_addr(), "/ready").await;
    let reason = r.json()["reason"].as_str().unwrap_or_default().to_owned();
    (r.status.as_u16(), reason)
}

#[tokio::test]
async fn ready_waits_for_the_mesh_peers_first_snapshot_but_not_for_a_dead_peer() {
    let engine = kvmesh_tests::fake_vllm::start().await;
    let mut pc = test_config(engine.addr());
    pc.mesh.listen = Some("127.0.0.1:0".parse().unwrap());
    let peer = start(pc).await;
    wait_ready(&peer).await;
    let peer_mesh = peer.mesh_addr().unwrap().to_string();
    let peer_id = peer.fleet().local_id().to_owned();

    // Following the live peer only: once ready, it already routes among it.
    let mut c = test_config(engine.addr());
    c.mesh.listen = Some("127.0.0.1:0".parse().unwrap());
    c.mesh.peers = vec![peer_mesh.clone()];
    let one = start(c).await;
    wait_ready(&one).await;
    let now = tokio::time::Instant::now();
    assert!(
        one.fleet()
            .snapshot(now)
            .iter()
            .any(|p| p.info.id == peer_id),
        "ready before the peer's snapshot"
    );
    one.shutdown().await;

    // A dead address too: not ready while it is tried (the mesh says why),
    // ready once twice connect_timeout has passed without it.
    let mut c = test_config(engine.addr());
    c.mesh.listen = Some("127.0.0.1:0".parse().unwrap());
    c.mesh.peers = vec![peer_mesh, refused_addr().await.to_string()];
    c.mesh.connect_timeout = kvmesh_proxy::config::Duration::from_millis(1500);
    let s = start(c).await;
    let mut saw_mesh_reason = false;
    for _ in 0..40 {
        let (status, reason) = readiness(&s).await;
        assert_ne!(status, 200, "ready while a peer was still connecting");
        if reason.contains("mesh") {
            saw_mesh_reason = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(saw_mesh_reason, "/ready never named the mesh");
    wait_ready(&s).await;
    s.shutdown().await;
    peer.shutdown().await;
}
