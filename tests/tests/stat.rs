//! `kvmesh stat` against a small meshed fleet of simulated engines: one
//! row per pod from any sidecar's admin port, with the counters each pod's
//! own sidecar publishes over the mesh (requests/s, prefix hit rate), and the
//! two errors an operator must tell apart: nothing listening, and something
//! that is not a kvmesh admin port.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::Duration;

use kvmesh::stat::command::{format, once, Output};
use kvmesh::stat::fetch::{fetch, FetchError};
use kvmesh::stat::table::render;
use kvmesh_proxy::SidecarHandle;
use kvmesh_tests::client::{fetch as http_fetch, http1, post_json};
use kvmesh_tests::fake_upstream::{FakeUpstream, Reply};
use kvmesh_tests::mesh::{kv_sim, mesh_config, shared_prefix_body, start_on, write_peers};
use kvmesh_tests::route::{eventually, MODEL};
use kvmesh_tests::sidecar::refused_addr;

const DEADLINE: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_row_per_pod_from_any_sidecar_with_counters_from_the_mesh() {
    let peers = tempfile::NamedTempFile::new().unwrap();
    let mut engines = Vec::new();
    let mut sidecars: Vec<SidecarHandle> = Vec::new();
    for _ in 0..3 {
        let e = kv_sim().await;
        sidecars.push(start_on(mesh_config(&e, peers.path()), None).await);
        engines.push(e);
    }
    let addrs: Vec<SocketAddr> = sidecars.iter().map(|s| s.mesh_addr().unwrap()).collect();
    write_peers(peers.path(), &addrs);
    let admin = sidecars[0].admin_addr().to_string();
    eventually("every peer connected", || async {
        let r = fetch(&admin, DEADLINE).await.ok()?;
        (r.pods.len() == 3 && r.pods.iter().filter(|p| p.mesh == "connected").count() == 2)
            .then_some(())
    })
    .await;

    // Requests through the third pod's sidecar, served wherever it routes them
    // (its own engine or a peer's), twice each so the prefix cache hits.
    for round in 0..2 {
        for user in 0..4 {
            let body = shared_prefix_body(user, round);
            let r = http_fetch(
                &http1(),
                post_json(sidecars[2].addr(), "/v1/completions", &body),
            )
            .await;
            assert_eq!(r.status, 200, "{}", r.text());
        }
    }
    // The first sidecar learns the others' counters over the mesh.
    let served = eventually("counters published", || async {
        let r = fetch(&admin, DEADLINE).await.ok()?;
        let total: u64 = r.pods.iter().map(|p| p.stats.requests).sum();
        let queries: u64 = r.pods.iter().map(|p| p.stats.prefix_queries).sum();
        (total == 8 && queries > 0).then_some(r)
    })
    .await;
    assert_eq!(served.local, sidecars[0].fleet().local_id());
    let post = http_fetch(
        &http1(),
        post_json(sidecars[0].admin_addr(), kvmesh_proxy::stat::PATH, "{}"),
    )
    .await;
    assert_eq!(post.status, 405, "{}", post.text());
    assert_eq!(served.kvmesh_stat, kvmesh_proxy::stat::FORMAT);

    // The table a single run prints: one line per pod, every column.
    let t = once(&admin, Duration::from_millis(200), DEADLINE)
        .await
        .unwrap();
    assert_eq!(t.pods.len(), 3, "{t:?}");
    assert_eq!(t.window_s.map(|w| w >= 0.2), Some(true));
    let local = t.pods.iter().filter(|r| r.mesh == "local").count();
    assert_eq!(local, 1);
    for r in &t.pods {
        assert_eq!(r.role, "both");
        assert_eq!(r.models, vec![MODEL.to_owned()]);
        assert!(r.healthy);
        assert!(["local", "connected"].contains(&r.mesh.as_str()), "{r:?}");
        assert!(r.staleness_ms.is_some_and(|ms| ms < 2000), "{r:?}");
        // No traffic in the window: 0 requests/s, not unknown.
        assert_eq!(r.requests_per_s, Some(0.0), "{r:?}");
    }
    let hits: Vec<f64> = t.pods.iter().filter_map(|r| r.hit_rate).collect();
    assert!(
        !hits.is_empty() && hits.iter().all(|h| (0.0..=1.0).contains(h)),
        "{t:?}"
    );
    let text = render(&t);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    for col in [
        "POD", "ROLE", "MODEL", "WAIT/RUN", "KV", "HIT", "REQ/S", "P/D", "P/D FAIL", "MESH", "AGE",
    ] {
        assert!(lines[0].contains(col), "{col}: {text}");
    }
    for pod in &sidecars {
        let id = pod.fleet().local_id();
        assert_eq!(
            lines.iter().filter(|l| l.starts_with(id)).count(),
            1,
            "{id}: {text}"
        );
    }

    // `-o json`: the same rows for scripts.
    let json: serde_json::Value = serde_json::from_str(&format(&t, Output::Json)).unwrap();
    assert_eq!(json["admin"], admin.as_str());
    let rows = json["pods"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    for key in [
        "pod",
        "role",
        "models",
        "healthy",
        "waiting",
        "running",
        "kv_usage",
        "hit_rate",
        "requests_per_s",
        "pd_splits",
        "pd_failures",
        "mesh",
        "staleness_ms",
    ] {
        assert!(rows.iter().all(|r| r.get(key).is_some()), "{key}: {json}");
    }

    // Requests/s over a window with traffic: 4 requests through the local pod's
    // sidecar within the window show as a positive rate somewhere.
    let first = kvmesh::stat::command::sample(&admin, DEADLINE)
        .await
        .unwrap();
    for user in 0..4 {
        let body = shared_prefix_body(user, 7);
        let r = http_fetch(
            &http1(),
            post_json(sidecars[0].addr(), "/v1/completions", &body),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    let second = eventually("the new requests counted", || async {
        let s = kvmesh::stat::command::sample(&admin, DEADLINE).await.ok()?;
        let total: u64 = s.report.pods.iter().map(|p| p.stats.requests).sum();
        (total == 12).then_some(s)
    })
    .await;
    let t = kvmesh::stat::table::table(&admin, Some(&first), &second);
    let rate: f64 = t.pods.iter().filter_map(|r| r.requests_per_s).sum();
    let window = t.window_s.unwrap();
    assert!(
        (rate * window - 4.0).abs() < 1e-6,
        "{rate} req/s over {window} s"
    );

    for s in sidecars {
        s.shutdown().await;
    }
    for e in engines {
        e.shutdown().await;
    }
}

#[tokio::test]
async fn an_unreachable_port_names_the_address() {
    let addr = refused_addr().await.to_string();
    let err = fetch(&addr, DEADLINE).await.unwrap_err();
    assert!(matches!(err, FetchError::Unreachable { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&addr) && msg.contains("cannot reach"), "{msg}");
}

#[tokio::test]
async fn a_plain_http_server_is_not_a_kvmesh_admin_port() {
    // Answers 404 to everything.
    let plain = FakeUpstream::builder().start().await;
    let addr = plain.addr().to_string();
    let err = fetch(&addr, DEADLINE).await.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, FetchError::NotKvmesh { .. }), "{err:?}");
    assert!(
        msg.contains(&addr) && msg.contains("not a kvmesh admin port") && msg.contains("404"),
        "{msg}"
    );

    // 200, but not JSON; and JSON that is not the stat document.
    let html = FakeUpstream::builder()
        .route("/debug/stat", |_| Reply::text(200, "<html>hello</html>"))
        .start()
        .await;
    let err = fetch(&html.addr().to_string(), DEADLINE).await.unwrap_err();
    assert!(err.to_string().contains("other than JSON"), "{err}");
    let other = FakeUpstream::builder()
        .route("/debug/stat", |_| Reply::json(200, r#"{"status":"ok"}"#))
        .start()
        .await;
    let err = fetch(&other.addr().to_string(), DEADLINE)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("without kvmesh_stat"), "{err}");
}

#[tokio::test]
async fn a_silent_port_times_out_naming_the_address() {
    // Accepts the connection and never answers.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let err = fetch(&addr, Duration::from_millis(200)).await.unwrap_err();
    assert!(matches!(err, FetchError::Timeout { .. }), "{err:?}");
    assert!(err.to_string().contains(&addr), "{err}");
    drop(l);
}

/// Reads frames from one raw subscription to `s`'s mesh port until `n`
/// deltas after the snapshot arrived: (kind, seq) of each.
async fn raw_frames(s: &SidecarHandle, takes_stats: bool, n: usize) -> Vec<(u8, u64)> {
    use http_body_util::{BodyExt, Empty};
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use kvmesh_proxy::mesh::{server, wire};
    let addr = s.mesh_addr().unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake::<_, _, Empty<bytes::Bytes>>(
        TokioExecutor::new(),
        TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let driver = tokio::spawn(conn);
    let mut req = http::Request::get(format!("http://{addr}{}", server::STREAM_PATH));
    if takes_stats {
        req = req.header(server::TAKES_STATS, "1");
    }
    let resp = send
        .send_request(req.body(Empty::new()).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let (mut buf, mut frames, mut deltas) = (Vec::new(), Vec::new(), 0);
    while deltas < n {
        let f = tokio::time::timeout(Duration::from_secs(5), body.frame())
            .await
            .expect("a frame within 5 s")
            .unwrap()
            .unwrap();
        buf.extend_from_slice(&f.into_data().unwrap_or_default());
        while let Some(h) = wire::header(&buf).unwrap() {
            let end = wire::HEADER_LEN + h.len as usize;
            if buf.len() < end {
                break;
            }
            let snapshot_done = frames.iter().any(|(k, _)| *k == 2);
            frames.push((h.kind, h.seq));
            if snapshot_done {
                deltas += 1;
            }
            buf.drain(..end);
        }
    }
    driver.abort();
    frames
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_frames_go_only_to_subscribers_that_take_them_and_take_no_sequence() {
    let peers = tempfile::NamedTempFile::new().unwrap();
    let e = kv_sim().await;
    let s = start_on(mesh_config(&e, peers.path()), None).await;
    const STATS: u8 = 7;
    // Side by side: a sidecar that predates Stats gets none, and its deltas'
    // sequence has no gap, while one that takes them gets them.
    let (old, new) = tokio::join!(raw_frames(&s, false, 12), raw_frames(&s, true, 12));
    assert!(!old.iter().any(|(k, _)| *k == STATS), "{old:?}");
    let end = old.iter().position(|(k, _)| *k == 2).unwrap();
    let seqs: Vec<u64> = old[end + 1..].iter().map(|(_, q)| *q).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{old:?}");
    // Stats after the ticks, carrying the last delta's number.
    let at: Vec<usize> = (0..new.len()).filter(|i| new[*i].0 == STATS).collect();
    assert!(!at.is_empty(), "{new:?}");
    for i in at.into_iter().filter(|i| *i > 0) {
        assert_eq!(new[i].1, new[i - 1].1, "{new:?}");
    }
    s.shutdown().await;
    e.shutdown().await;
}
