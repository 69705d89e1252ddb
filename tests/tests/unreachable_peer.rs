//! A request waiting for its response head on a peer that becomes
//! unreachable (docs/migration.md, "Non-streamed requests"; the long
//! partition in docs/robustness.md): when the fleet cuts the peer off (its
//! mesh stream fell silent past `mesh.stale_after`), the call is dropped and
//! the request goes whole to a pod that answers, instead of waiting out
//! `timeouts.first_byte` and failing with a 504. The peer here is a
//! listener that reads the request and never answers, as a pod across a
//! network partition does. One test cuts it off as the mesh subscriber
//! does on a silent stream; others give it a mesh port whose state
//! stream falls silent, and the subscriber cuts it off, or a record in
//! Valkey that stops being renewed, and the sidecar cuts it off.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvmesh_filters::prefix::index::PrefixIndex;
use kvmesh_filters::sched::Role;
use kvmesh_loadgen::valkey::ValkeyServer;
use kvmesh_proxy::config::index::{Backend, Valkey as ValkeyConfig};
use kvmesh_proxy::config::Duration as CfgDuration;
use kvmesh_proxy::fleet::{EngineLoad, PodInfo};
use kvmesh_proxy::mesh::wire::{self, Announce, LoadMsg, Msg};
use kvmesh_proxy::valkey::metrics::IndexMetrics;
use kvmesh_proxy::valkey::{PodRecord, Store, Writer};
use kvmesh_proxy::Shutdown;
use kvmesh_tests::client::{fetch, http1, post_json};
use kvmesh_tests::mesh::write_peers;
use kvmesh_tests::route::{config, eventually, labels_of, metric, only_pod, sim, MODEL};
use kvmesh_tests::sidecar::{fast_valkey, start, wait_ready};
use serde_json::json;
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

/// Within the test client's wait for a head (`kvmesh_tests::client::WAIT`),
/// so that a request still waiting for x's head fails the test with the
/// sidecar's 504, and much longer than the local engine takes to answer.
const FIRST_BYTE: Duration = Duration::from_secs(8);

/// A "pod" that accepts, reads what comes and never answers; each
/// connection's first bytes are reported on the channel. The task ends with
/// the test's runtime.
async fn silent_pod() -> (SocketAddr, mpsc::Receiver<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let mut told = false;
                // Held open, answering nothing, until the sidecar drops it.
                while let Ok(n) = conn.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    if !told {
                        told = true;
                        let _ = tx.send(()).await;
                    }
                }
            });
        }
    });
    (addr, rx)
}

/// Sends `body` to the sidecar at `to` and waits until x (the silent pod)
/// has read it: the request then waits on x for a head that never comes.
async fn reaches_x(
    to: SocketAddr,
    body: &serde_json::Value,
    heard: &mut mpsc::Receiver<()>,
) -> tokio::task::JoinHandle<kvmesh_tests::client::Whole> {
    let req = post_json(to, "/v1/completions", &body.to_string());
    let client = http1();
    let pending = tokio::spawn(async move { fetch(&client, req).await });
    tokio::time::timeout(Duration::from_secs(10), heard.recv())
        .await
        .expect("the request reached x")
        .expect("x listens");
    pending
}

/// How the mesh port of [`stallable_mesh_port`] stops.
#[derive(Clone, Copy)]
enum Stop {
    /// Its stream (and any new one) stays open and silent, as across a
    /// network partition.
    Silent,
    /// Its stream ends, and new connections are accepted (by the kernel)
    /// and never answered: a host gone, met on the reconnect.
    CloseThenHang,
}

/// The mesh port of pod `id` (labelled `pod: x`): each subscriber gets its
/// hello, the snapshot's end and a load tick every 100 ms, until `stall`
/// is set; then it stops as `stop` says.
async fn stallable_mesh_port(id: String, stall: watch::Receiver<bool>, stop: Stop) -> SocketAddr {
    let mesh = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = mesh.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = mesh.accept().await {
            if matches!(stop, Stop::CloseThenHang) && *stall.borrow() {
                held.push(tcp);
                continue;
            }
            let (id, stall) = (id.clone(), stall.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |_req| {
                    let hello = wire::encode(
                        0,
                        &Msg::Hello(Announce {
                            id: id.clone(),
                            mesh_addr: String::new(),
                            role: Role::Both,
                            models: vec![MODEL.to_owned()],
                            lora_adapters: vec![],
                            labels: vec![("pod".to_owned(), "x".to_owned())],
                            instance: 1,
                            kv_agent: String::new(),
                        }),
                    );
                    let end = wire::encode(0, &Msg::SnapshotEnd);
                    let ticks = futures_util::stream::unfold(
                        (1u64, stall.clone()),
                        move |(seq, stall)| async move {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            if *stall.borrow() {
                                match stop {
                                    // Silent from here on, the connection open.
                                    Stop::Silent => std::future::pending::<()>().await,
                                    Stop::CloseThenHang => return None,
                                }
                            }
                            let load = Msg::Load(LoadMsg {
                                load: EngineLoad::default(),
                                age_ms: 0,
                                healthy: true,
                            });
                            Some((wire::encode(seq, &load), (seq + 1, stall)))
                        },
                    );
                    let first = if *stall.borrow() {
                        Vec::new()
                    } else {
                        vec![hello, end]
                    };
                    let frames = futures_util::stream::iter(first)
                        .chain(ticks)
                        .map(|b| Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(b)));
                    async move {
                        Ok::<_, std::convert::Infallible>(http::Response::new(
                            http_body_util::StreamBody::new(frames),
                        ))
                    }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    addr
}

/// The same, through the mesh: x is a peer found through a peers file whose
/// state stream falls silent while a request waits on it. Past
/// `mesh.stale_after` the subscriber cuts x off, and the request is
/// answered by the local engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_head_goes_elsewhere_when_its_peers_stream_falls_silent() {
    through_the_mesh(Stop::Silent).await;
}

/// The same when x's stream ends and its mesh port then accepts and never
/// answers (a reconnect that times out, not one refused): past
/// `stale_after` x is cut off too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_head_goes_elsewhere_when_its_peers_reconnects_time_out() {
    through_the_mesh(Stop::CloseThenHang).await;
}

async fn through_the_mesh(stop: Stop) {
    let dir = tempfile::tempdir().unwrap();
    let peers = dir.path().join("peers");
    let engine = sim().await;
    let mut c = config(&engine, &[("pod", "a")], Some(&only_pod(dir.path(), "x")));
    c.timeouts.first_byte = CfgDuration::from_secs(FIRST_BYTE.as_secs());
    c.mesh.listen = Some("127.0.0.1:0".parse().unwrap());
    c.mesh.file = Some(peers.clone());
    c.mesh.refresh_interval = CfgDuration::from_millis(100);
    c.mesh.stale_after = CfgDuration::from_millis(1000);
    c.mesh.load_interval = CfgDuration::from_millis(100);
    c.mesh.reconnect_max = CfgDuration::from_millis(200);
    c.mesh.connect_timeout = CfgDuration::from_millis(300);
    let a = start(c).await;
    wait_ready(&a).await;
    let (silent, mut heard) = silent_pod().await;
    let x_id = silent.to_string();
    let (stall, stalled) = watch::channel(false);
    let x_mesh = stallable_mesh_port(x_id.clone(), stalled, stop).await;
    write_peers(&peers, &[x_mesh]);
    eventually("x joins a's fleet", || async {
        a.fleet().contains(&x_id).then_some(())
    })
    .await;

    let body = json!({"model": MODEL, "prompt": "a short answer", "max_tokens": 6});
    let pending = reaches_x(a.addr(), &body, &mut heard).await;
    stall.send(true).unwrap();
    let r = pending.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 6);
    assert!(!a.fleet().contains(&x_id), "x was cut off");
    let counted = metric(
        &a,
        "kvmesh_migrations_total{outcome=\"retried_unreachable\"}",
    )
    .await;
    assert_eq!(counted, Some(1.0));
    a.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test]
async fn a_request_without_a_head_goes_elsewhere_when_its_peer_is_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let filters = only_pod(dir.path(), "x");
    let engine = sim().await;
    let mut c = config(&engine, &[("pod", "a")], Some(&filters));
    c.timeouts.first_byte = CfgDuration::from_secs(FIRST_BYTE.as_secs());
    let a = start(c).await;
    wait_ready(&a).await;
    let (silent, mut heard) = silent_pod().await;
    let x = PodInfo {
        id: silent.to_string(),
        sidecar_addr: Some(silent),
        role: Role::Both,
        models: vec![MODEL.to_owned()],
        lora_adapters: vec![],
        labels: labels_of(&[("pod", "x")]),
    };

    let whole = json!({"model": MODEL, "prompt": "a short answer", "max_tokens": 6});
    let streamed =
        json!({"model": MODEL, "prompt": "a short stream", "max_tokens": 6, "stream": true});
    for (i, body) in [whole, streamed].into_iter().enumerate() {
        // The plan names x alone, which reads the request and never answers.
        a.fleet().upsert_peer(x.clone()).unwrap();
        a.fleet()
            .set_load(&x.id, EngineLoad::default(), tokio::time::Instant::now());
        let pending = reaches_x(a.addr(), &body, &mut heard).await;
        // x's mesh stream fell silent: the mesh cuts it off.
        assert!(a.fleet().cut_off_peer(&x.id));
        let r = pending.await.unwrap();
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        if body["stream"] == true {
            assert!(r.text().contains("data: [DONE]"), "{}", r.text());
        } else {
            assert_eq!(r.json()["usage"]["completion_tokens"], 6);
        }
        // The local engine (the last resort) got it whole.
        let sent: Vec<serde_json::Value> = engine
            .received_requests()
            .into_iter()
            .filter(|r| r.path.starts_with("/v1/"))
            .map(|r| serde_json::from_slice(&r.body).unwrap())
            .collect();
        assert_eq!(sent.len(), i + 1);
        assert_eq!(sent[i], body);
        let counted = metric(
            &a,
            "kvmesh_migrations_total{outcome=\"retried_unreachable\"}",
        )
        .await;
        assert_eq!(counted, Some((i + 1) as f64));
    }
    a.shutdown().await;
    engine.shutdown().await;
}

/// The same on the Valkey backend: x is a pod the sidecar finds through a
/// lookup (its record in Valkey, renewed every `lease_interval`). While a
/// request waits on it, x's writer stops renewing without deregistering,
/// as a host gone does; before the lease lapses the sidecar sees the
/// record unchanged, cuts x off, and the local engine answers. (Without
/// it x is only forgotten, after `forget_after`, and the request waits out
/// `first_byte`: a 504.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_head_goes_elsewhere_when_its_peers_valkey_record_stops_being_renewed()
{
    through_valkey(false).await;
}

/// A pod that deregisters (a drain, a shutdown: its record deleted) is not
/// cut off: the call waiting on it is left to finish, here to
/// `first_byte`, as on the mesh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_on_a_pod_that_deregisters_from_valkey_is_not_cut_off() {
    through_valkey(true).await;
}

async fn through_valkey(deregisters: bool) {
    let server = ValkeyServer::start().await.unwrap();
    let valkey = ValkeyConfig {
        // Longer than the test: x is never merely forgotten here.
        forget_after: CfgDuration::from_secs(30),
        ..fast_valkey(vec![server.url()])
    };
    let dir = tempfile::tempdir().unwrap();
    let engine = sim().await;
    let mut c = config(&engine, &[("pod", "a")], Some(&only_pod(dir.path(), "x")));
    c.timeouts.first_byte = CfgDuration::from_secs(FIRST_BYTE.as_secs());
    c.mesh.file = None;
    c.mesh.listen = None;
    c.index.backend = Backend::Valkey;
    c.index.valkey = valkey.clone();
    let a = start(c).await;
    wait_ready(&a).await;

    // x: a record naming the silent listener, renewed until told to stop.
    let (silent, mut heard) = silent_pod().await;
    let x_id = silent.to_string();
    let shutdown = Shutdown::new();
    let store = Arc::new(Store::new(valkey));
    tokio::spawn(store.clone().run(shutdown.clone()));
    eventually("connected to valkey", || async {
        store.is_up().then_some(())
    })
    .await;
    let index = Arc::new(PrefixIndex::default());
    let record = PodRecord {
        id: x_id.clone(),
        mesh: String::new(),
        kv_agent: String::new(),
        role: Role::Both,
        models: vec![MODEL.to_owned()],
        adapters: vec![],
        labels: labels_of(&[("pod", "x")]),
        waiting: 0,
        running: 0,
        kv: 0.0,
        block_size: 16,
        blocks: 1000,
        healthy: true,
        in_flight: 0,
        load_age_ms: 0,
        ttl_ms: 0,
        work: None,
    };
    let mut writer = Writer::new(
        store.clone(),
        index.clone(),
        index.pod(&x_id).unwrap(),
        &x_id,
        vec![MODEL.to_owned()],
        Box::new(move || record.clone()),
    );
    let m = IndexMetrics::default();
    for _ in 0..200 {
        let _ = writer.renew(&m).await;
        if writer.is_registered() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(writer.is_registered(), "x registered");
    let (stop, mut stopped) = watch::channel(false);
    let renewing = tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_millis(100));
        loop {
            tokio::select! {
                _ = stopped.changed() => return writer,
                _ = every.tick() => { let _ = writer.renew(&m).await; }
            }
        }
    });

    let body = json!({"model": MODEL, "prompt": "a short answer", "max_tokens": 6});
    let pending = reaches_x(a.addr(), &body, &mut heard).await;
    // x's host is gone: no more renewals, and no deregistration; or x
    // deregisters.
    stop.send(true).unwrap();
    let mut writer = renewing.await.unwrap();
    let counted = || async {
        metric(
            &a,
            "kvmesh_migrations_total{outcome=\"retried_unreachable\"}",
        )
        .await
        .unwrap_or(0.0)
    };
    if deregisters {
        writer.leave().await;
        // Three leases: a pod gone without leaving is cut off within one.
        tokio::time::sleep(Duration::from_millis(1800)).await;
        assert!(!pending.is_finished(), "the call still waits on x");
        assert_eq!(counted().await, 0.0);
        let r = pending.await.unwrap();
        assert_eq!(r.status, 504, "{}", r.text());
        assert_eq!(counted().await, 0.0);
    } else {
        let r = pending.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["usage"]["completion_tokens"], 6);
        assert!(!a.fleet().contains(&x_id), "x was cut off");
        assert_eq!(counted().await, 1.0);
    }
    a.shutdown().await;
    engine.shutdown().await;
    shutdown.trigger();
}
