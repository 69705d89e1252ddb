//! Pods leaving while requests are routed (issue 41's closed loop, which
//! lost requests as pools shrank):
//!
//! - A sidecar that is shutting down still routes the requests it took just
//!   before: its fleet keeps the peers it knew. Here A's filters keep only B
//!   (as a P/D prefill pod's decode profile keeps only decode pods), and A
//!   takes a request as its shutdown begins: it must forward it to B, not
//!   answer 503 "removed the last candidates" because it forgot B when its
//!   mesh stopped.
//! - A peer that drained (its listener closed) leaves the others' fleets at
//!   its first refused reconnect, not `mesh.stale_after` later, even while
//!   the peers file still lists it.
//! - When most of the fleet is gone at once (a scale-down from 19 pods to 2)
//!   and a sidecar still lists the leavers, a request tries every pod that
//!   refuses before it gives up: refusals do not use up
//!   `migration.max_migrations`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use kvmesh_engine_sim::SimHandle;
use kvmesh_filters::sched::Role;
use kvmesh_proxy::fleet::{EngineLoad, PodInfo};
use kvmesh_tests::client::{fetch, http1, post_json};
use kvmesh_tests::mesh::{kv_sim, mesh_config, start_on, write_peers};
use kvmesh_tests::route::{
    config, eventually, filters_yaml, labels_of, metric, only_pod, sim, MODEL,
};
use kvmesh_tests::sidecar::{refused_addr, start};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A short completion of `prompt` sent to the sidecar at `addr` is answered 200.
async fn completes(addr: std::net::SocketAddr, prompt: &str) {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    let r = fetch(
        &http1(),
        post_json(addr, "/v1/completions", &body.to_string()),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
}

/// The completions `engine` received.
fn completions_served(engine: &SimHandle) -> usize {
    engine
        .received_requests()
        .into_iter()
        .filter(|r| r.path == "/v1/completions")
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_draining_sidecar_routes_the_requests_it_took_to_the_peers_it_knew() {
    let peers = tempfile::NamedTempFile::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (ea, eb) = (kv_sim().await, kv_sim().await);
    let mut ca = mesh_config(&ea, peers.path());
    ca.pod.labels.insert("pod".into(), "a".into());
    ca.scheduling.filters = Some(only_pod(dir.path(), "b"));
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
    assert_eq!(completions_served(&eb), 1, "B's engine served it");
    a.shutdown().await;
    b.shutdown().await;
    ea.shutdown().await;
    eb.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drained_peer_leaves_the_fleet_at_its_first_refused_reconnect() {
    let peers = tempfile::NamedTempFile::new().unwrap();
    let (ea, eb) = (kv_sim().await, kv_sim().await);
    // A would keep a peer it cannot reach for a minute: only the refusal
    // can make it leave within the wait below.
    let mut ca = mesh_config(&ea, peers.path());
    ca.mesh.stale_after = kvmesh_proxy::config::Duration::from_secs(60);
    let cb = mesh_config(&eb, peers.path());
    let (a, b) = (start_on(ca, None).await, start_on(cb, None).await);
    // The peers file lists B throughout, as DNS or a ConfigMap still does
    // for a few seconds after a pod is deleted.
    write_peers(
        peers.path(),
        &[a.mesh_addr().unwrap(), b.mesh_addr().unwrap()],
    );
    let b_id = b.fleet().local_id().to_owned();
    let knows_b = |a: &kvmesh_proxy::SidecarHandle| {
        let now = tokio::time::Instant::now();
        a.fleet().snapshot(now).iter().any(|p| p.info.id == b_id)
    };
    eventually("A knows B", || async { knows_b(&a).then_some(()) }).await;

    b.shutdown().await;
    eventually("A forgot B, which refuses connections", || async {
        (!knows_b(&a)).then_some(())
    })
    .await;
    // A serves on: nothing goes to the port that refuses.
    for i in 0..5 {
        completes(a.addr(), &format!("after the drain {i}")).await;
    }
    assert_eq!(
        metric(&a, "kvmesh_fallbacks_total").await.unwrap_or(0.0),
        0.0
    );
    a.shutdown().await;
    ea.shutdown().await;
    eb.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_tries_every_refusing_pod_before_it_fails() {
    // A's own engine is down (no last resort at home), and its filters keep
    // the pool's pods: eight that refuse connections (gone, but still
    // listed) and one that serves, ranked last by its queue.
    let dir = tempfile::tempdir().unwrap();
    let filters = dir.path().join("filters.yaml");
    let pool = "  - type: label-selector-filter\n    parameters:\n      matchLabels: {pool: serve}\n  - type: queue-scorer\n";
    std::fs::write(&filters, filters_yaml(pool)).unwrap();
    let mut ca = kvmesh_tests::sidecar::test_config(refused_addr().await);
    ca.scheduling.filters = Some(filters);
    // One pod past the plan: without the refusals being free, the request
    // would fail after the plan's four targets and one more.
    ca.migration.max_migrations = 1;
    let a = start(ca).await;
    let ez = sim().await;
    let z = start(config(&ez, &[], None)).await;
    let now = tokio::time::Instant::now();
    let pod = |id: String, addr| PodInfo {
        id,
        sidecar_addr: Some(addr),
        role: Role::Both,
        models: vec![MODEL.to_owned()],
        lora_adapters: vec![],
        labels: labels_of(&[("pool", "serve")]),
    };
    for i in 0..8 {
        let id = format!("gone-{i}");
        a.fleet()
            .upsert_peer(pod(id.clone(), refused_addr().await))
            .unwrap();
        a.fleet().set_load(&id, EngineLoad::default(), now);
    }
    let busy = EngineLoad {
        running: 8,
        waiting: 8,
        ..EngineLoad::default()
    };
    a.fleet()
        .upsert_peer(pod("zz-serving".into(), z.addr()))
        .unwrap();
    a.fleet().set_load("zz-serving", busy, now);

    completes(a.addr(), "most of the fleet just left").await;
    assert_eq!(
        completions_served(&ez),
        1,
        "the one pod that serves took it"
    );
    assert_eq!(metric(&a, "kvmesh_fallbacks_total").await, Some(8.0));
    a.shutdown().await;
    z.shutdown().await;
    ez.shutdown().await;
}
