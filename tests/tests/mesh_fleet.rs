//! The mesh end to end: simulated engines publishing KV events, one sidecar
//! each, the sidecars finding each other through a peers file and sharing
//! their state streams. Requests sent to any sidecar land on the pod that
//! holds their prefix (as when one sidecar routes for all); a restarted
//! sidecar rejoins and resyncs; a stalled peer leaves the scheduling set; a
//! forwarding loop is refused; an unknown model is a clear error; a slow
//! subscriber is dropped, not buffered; `follow: same-models` leaves a peer
//! of another model alone.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvmesh_engine_sim::SimHandle;
use kvmesh_proxy::mesh::wire::{self, Announce, Msg};
use kvmesh_proxy::SidecarHandle;
use kvmesh_tests::client::{fetch, http1, post_json, request};
use kvmesh_tests::mesh::{
    indexes_converged, kv_sim, mesh_config, shared_prefix_body, start_on, write_peers,
};
use kvmesh_tests::route::{eventually, metric, MODEL};
use tokio::net::TcpListener;

struct Mesh {
    engines: Vec<SimHandle>,
    sidecars: Vec<SidecarHandle>,
    peers: tempfile::NamedTempFile,
}

/// `n` pods that found each other, every one knowing every other.
async fn mesh(n: usize) -> Mesh {
    let m = mesh_with(n, |_, _| {}).await;
    m.wait_full().await;
    m
}

/// `n` pods joined through one peers file, pod `i`'s config changed by
/// `adjust(i, config)` first; returns before they have found each other.
async fn mesh_with(n: usize, adjust: impl Fn(usize, &mut kvmesh_proxy::config::Config)) -> Mesh {
    let peers = tempfile::NamedTempFile::new().unwrap();
    let mut engines = Vec::new();
    let mut sidecars = Vec::new();
    for i in 0..n {
        let e = kv_sim().await;
        let mut c = mesh_config(&e, peers.path());
        adjust(i, &mut c);
        sidecars.push(start_on(c, None).await);
        engines.push(e);
    }
    let addrs: Vec<SocketAddr> = sidecars.iter().map(|s| s.mesh_addr().unwrap()).collect();
    write_peers(peers.path(), &addrs);
    Mesh {
        engines,
        sidecars,
        peers,
    }
}

impl Mesh {
    /// Every sidecar knows every pod, with a fresh load.
    async fn wait_full(&self) {
        let n = self.sidecars.len();
        for s in &self.sidecars {
            eventually("every peer known", || async {
                let now = tokio::time::Instant::now();
                let pods = s.fleet().snapshot(now);
                (pods.len() == n && pods.iter().all(|p| p.load_age_ms.is_some_and(|a| a < 1000)))
                    .then_some(())
            })
            .await;
        }
    }

    /// Every sidecar's index holds the same entries (every pod's blocks).
    async fn wait_converged(&self) {
        indexes_converged(&self.sidecars).await;
    }

    /// Sends group 400's first prompt to the first sidecar, every engine
    /// holding its first byte for 2 s; the task ends with its status.
    fn send_held(&self) -> tokio::task::JoinHandle<http::StatusCode> {
        for e in &self.engines {
            e.faults().delay_first_byte(Some(Duration::from_secs(2)));
        }
        let req = post_json(
            self.sidecars[0].addr(),
            "/v1/completions",
            &shared_prefix_body(400, 0),
        );
        tokio::spawn(async move { fetch(&http1(), req).await.status })
    }

    /// Prefix-cache (hits, queries) in tokens, summed over the engines.
    fn engine_hits(&self) -> (u64, u64) {
        self.engines.iter().fold((0, 0), |(h, q), e| {
            let s = e.stats();
            (h + s.prefix_hits, q + s.prefix_queries)
        })
    }

    async fn shutdown(self) {
        for s in self.sidecars {
            s.shutdown().await;
        }
        for e in self.engines {
            e.shutdown().await;
        }
        drop(self.peers);
    }
}

/// The completion calls an engine received (health and metrics polls aside).
fn completions(e: &SimHandle) -> Vec<kvmesh_engine_sim::ReceivedRequest> {
    let mut v = e.received_requests();
    v.retain(|r| r.path == "/v1/completions");
    v
}

async fn complete(addr: SocketAddr, body: &str) {
    let r = fetch(&http1(), post_json(addr, "/v1/completions", body)).await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Round 1 sends each group's first user; once every index has converged,
/// round 2 sends the other users. Returns round 2's engine hit rate.
async fn shared_prefix_round(
    m: &Mesh,
    groups: std::ops::Range<usize>,
    via: impl Fn(usize) -> SocketAddr,
) -> f64 {
    let mut i = 0;
    for g in groups.clone() {
        complete(via(i), &shared_prefix_body(g, 0)).await;
        i += 1;
    }
    m.wait_converged().await;
    let (h0, q0) = m.engine_hits();
    for u in 1..4 {
        for g in groups.clone() {
            complete(via(i), &shared_prefix_body(g, u)).await;
            i += 1;
        }
    }
    let (h1, q1) = m.engine_hits();
    (h1 - h0) as f64 / (q1 - q0).max(1) as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_to_any_sidecar_land_where_their_prefix_is_cached() {
    let m = mesh(4).await;
    let addrs: Vec<SocketAddr> = m.sidecars.iter().map(|s| s.addr()).collect();
    // The mesh: clients spread round-robin over all four sidecars.
    let mesh_rate = shared_prefix_round(&m, 0..8, |i| addrs[i % 4]).await;
    // One router: every request through the first sidecar (fresh groups).
    let single_rate = shared_prefix_round(&m, 100..108, |_| addrs[0]).await;
    eprintln!("engine prefix hit rate: mesh {mesh_rate:.3}, single router {single_rate:.3}");
    assert!(single_rate > 0.8, "single router hit rate {single_rate}");
    assert!(
        mesh_rate > single_rate - 0.05,
        "mesh {mesh_rate} vs single {single_rate}"
    );
    let mut forwarded = 0.0;
    for s in &m.sidecars {
        forwarded += metric(s, "kvmesh_mesh_requests_total{served=\"forwarded\"}")
            .await
            .unwrap_or(0.0);
        let fresh = metric(s, "kvmesh_mesh_peers{state=\"fresh\"}").await;
        assert_eq!(fresh, Some(3.0));
    }
    assert!(forwarded > 0.0, "round-robin clients needed forwarding");
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_sidecar_rejoins_and_resyncs_from_a_snapshot() {
    let mut m = mesh(2).await;
    let a_id = m.sidecars[0].fleet().local_id().to_owned();
    // Served by A's engine itself (marked as already routed).
    let body = shared_prefix_body(7, 0);
    let r = fetch(
        &http1(),
        request(
            "POST",
            m.sidecars[0].addr(),
            "/v1/completions",
            body,
            &[
                ("content-type", "application/json"),
                ("x-kvmesh-routed", "1"),
            ],
        ),
    )
    .await;
    assert_eq!(r.status, 200);
    m.wait_converged().await;
    let b = m.sidecars.pop().unwrap();
    let (b_client, b_mesh) = (b.addr(), b.mesh_addr().unwrap());
    let b_id = b.fleet().local_id().to_owned();
    b.shutdown().await;
    eventually("A drops B", || async {
        (!m.sidecars[0].fleet().contains(&b_id)).then_some(())
    })
    .await;
    // B comes back on the same addresses with nothing in its index.
    let mut cfg = mesh_config(&m.engines[1], m.peers.path());
    cfg.mesh.listen = Some(b_mesh);
    let b = start_on(cfg, Some(TcpListener::bind(b_client).await.unwrap())).await;
    eventually("A knows B again", || async {
        m.sidecars[0].fleet().contains(&b_id).then_some(())
    })
    .await;
    eventually("B knows A", || async {
        b.fleet().contains(&a_id).then_some(())
    })
    .await;
    let a_entries = m.sidecars[0].prefix().index().stats().entries;
    eventually("B resynced A's blocks", || async {
        (b.prefix().index().stats().entries == a_entries).then_some(())
    })
    .await;
    assert!(a_entries > 0);
    assert!(
        metric(&b, "kvmesh_mesh_resyncs_total{reason=\"connect\"}")
            .await
            .unwrap_or(0.0)
            >= 1.0
    );
    m.sidecars.push(b);
    m.shutdown().await;
}

/// A mesh peer that sends its hello and snapshot, then falls silent; its
/// client port counts the connections it gets.
async fn stalled_peer(
    id_listener: &TcpListener,
    subscribers: usize,
) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let mesh = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = mesh.local_addr().unwrap();
    let id = id_listener.local_addr().unwrap().to_string();
    // One connection per subscriber (`subscribers` of them): once dropped,
    // the peer stays unreachable.
    let task = tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        for _ in 0..subscribers {
            let Ok((tcp, _)) = mesh.accept().await else {
                return;
            };
            let id = id.clone();
            conns.spawn(async move {
                let svc = hyper::service::service_fn(move |_req| {
                    let hello = wire::encode(
                        0,
                        &Msg::Hello(Announce {
                            id: id.clone(),
                            mesh_addr: String::new(),
                            role: kvmesh_filters::sched::Role::Both,
                            models: vec![MODEL.to_owned()],
                            lora_adapters: vec![],
                            labels: vec![],
                            instance: 1,
                            kv_agent: String::new(),
                        }),
                    );
                    let end = wire::encode(0, &Msg::SnapshotEnd);
                    let frames = futures_util::stream::iter([hello, end])
                        .map(|b| Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(b)))
                        .chain(futures_util::stream::pending());
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
        drop(mesh);
        while conns.join_next().await.is_some() {}
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_peer_leaves_the_scheduling_set_and_requests_go_elsewhere() {
    let m = mesh(2).await;
    let fake_client = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let fake_id = fake_client.local_addr().unwrap().to_string();
    let (fake_mesh, task) = stalled_peer(&fake_client, 2).await;
    let mut addrs: Vec<SocketAddr> = m.sidecars.iter().map(|s| s.mesh_addr().unwrap()).collect();
    addrs.push(fake_mesh);
    write_peers(m.peers.path(), &addrs);
    let a = &m.sidecars[0];
    eventually("the fake peer joins", || async {
        a.fleet().contains(&fake_id).then_some(())
    })
    .await;
    eventually("the silent peer is dropped", || async {
        (!a.fleet().contains(&fake_id)).then_some(())
    })
    .await;
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    let accept = tokio::spawn(async move {
        while let Ok((_s, _)) = fake_client.accept().await {
            counter.fetch_add(1, Ordering::Relaxed);
        }
    });
    for i in 0..8 {
        complete(a.addr(), &shared_prefix_body(200 + i, 0)).await;
    }
    assert_eq!(
        hits.load(Ordering::Relaxed),
        0,
        "nothing went to the stalled peer"
    );
    assert!(
        metric(a, "kvmesh_mesh_resyncs_total{reason=\"connect\"}")
            .await
            .unwrap_or(0.0)
            >= 1.0
    );
    accept.abort();
    task.abort();
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forwarding_cannot_loop_and_unknown_models_are_clear_errors() {
    let m = mesh(2).await;
    let a = &m.sidecars[0];
    let body = shared_prefix_body(1, 0);
    let hdr = |hops: &'static str| {
        request(
            "POST",
            a.addr(),
            "/v1/completions",
            body.clone(),
            &[
                ("content-type", "application/json"),
                ("x-kvmesh-routed", "1"),
                ("x-kvmesh-hops", hops),
            ],
        )
    };
    let before = completions(&m.engines[0]).len();
    let r = fetch(&http1(), hdr("2")).await;
    assert_eq!(r.status, 508, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "loop_detected");
    assert_eq!(
        completions(&m.engines[0]).len(),
        before,
        "a looping request reaches no engine"
    );
    // One hop is the normal forwarded case: served by this pod's own engine.
    let r = fetch(&http1(), hdr("1")).await;
    assert_eq!(r.status, 200);
    assert_eq!(completions(&m.engines[0]).len(), before + 1);
    let last = completions(&m.engines[0]).pop().unwrap();
    assert_eq!(
        last.header("x-kvmesh-hops"),
        None,
        "mesh headers stop at the engine"
    );
    // A model nothing in the mesh serves.
    let r = fetch(
        &http1(),
        post_json(
            a.addr(),
            "/v1/completions",
            r#"{"model":"nope","prompt":"hi","max_tokens":1}"#,
        ),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    assert!(r.text().contains(MODEL));
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_subscriber_is_dropped_not_buffered() {
    let peers = tempfile::NamedTempFile::new().unwrap();
    let e = kv_sim().await;
    let mut cfg = mesh_config(&e, peers.path());
    cfg.mesh.subscriber_queue = 4;
    cfg.mesh.load_interval = kvmesh_proxy::config::Duration::from_millis(10);
    let s = start_on(cfg, None).await;
    // A subscriber with a small window that never reads its stream.
    let tcp = tokio::net::TcpStream::connect(s.mesh_addr().unwrap())
        .await
        .unwrap();
    let (mut send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(16 * 1024)
        .handshake::<_, Empty<Bytes>>(TokioIo::new(tcp))
        .await
        .unwrap();
    let driver = tokio::spawn(conn);
    let req = http::Request::get(format!("http://{}/mesh/v1/stream", s.mesh_addr().unwrap()))
        .body(Empty::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(s.mesh().subscribers(), 1);
    // KV events of long prompts and the load ticks fill the window, then the queue.
    for i in 0..6 {
        complete(s.addr(), &shared_prefix_body(300 + i, 0)).await;
    }
    eventually("the slow subscriber is dropped", || async {
        (s.mesh().subscribers() == 0).then_some(())
    })
    .await;
    assert!(
        metric(&s, "kvmesh_mesh_subscribers_dropped_total{reason=\"slow\"}")
            .await
            .unwrap_or(0.0)
            >= 1.0
    );
    // What was queued drains, then the stream ends: the subscriber must resync.
    let mut body = resp.into_body();
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(f) = body.frame().await {
            if f.is_err() {
                break;
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the dropped stream ends");
    driver.abort();
    s.shutdown().await;
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dns_discovery_finds_a_peer_and_static_peers_with_names_resolve() {
    let peers = tempfile::NamedTempFile::new().unwrap();
    let (ea, eb, ec) = (kv_sim().await, kv_sim().await, kv_sim().await);
    let a = start_on(mesh_config(&ea, peers.path()), None).await;
    let port = a.mesh_addr().unwrap().port();
    // B finds A through DNS (the name resolves to loopback), C through a
    // static `host:port` with a name.
    let mut cb = mesh_config(&eb, peers.path());
    cb.mesh.file = None;
    cb.mesh.dns = Some(kvmesh_proxy::config::mesh::DnsDiscovery {
        name: "localhost".to_owned(),
        port,
    });
    let b = start_on(cb, None).await;
    let mut cc = mesh_config(&ec, peers.path());
    cc.mesh.file = None;
    cc.mesh.peers = vec![format!("localhost:{port}")];
    let c = start_on(cc, None).await;
    let a_id = a.fleet().local_id().to_owned();
    for s in [&b, &c] {
        eventually("A discovered", || async {
            s.fleet().contains(&a_id).then_some(())
        })
        .await;
    }
    for s in [a, b, c] {
        s.shutdown().await;
    }
    for e in [ea, eb, ec] {
        e.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_flight_requests_are_seen_by_every_sidecar_exactly_once() {
    let m = mesh(2).await;
    // B's engine caches the prompt, so A forwards the next one to B.
    let warm = request(
        "POST",
        m.sidecars[1].addr(),
        "/v1/completions",
        shared_prefix_body(400, 0),
        &[
            ("content-type", "application/json"),
            ("x-kvmesh-routed", "1"),
        ],
    );
    assert_eq!(fetch(&http1(), warm).await.status, 200);
    m.wait_converged().await;
    let held = m.send_held();
    // Every sidecar counts it once: its own guard, or the publisher's report
    // (a forwarded request is published by its forwarder only).
    let total = |s: &SidecarHandle| -> u32 {
        s.fleet()
            .snapshot(tokio::time::Instant::now())
            .iter()
            .map(|p| p.in_flight_local + p.in_flight_mesh)
            .sum()
    };
    for s in &m.sidecars {
        eventually("the request is seen", || async {
            (total(s) == 1).then_some(())
        })
        .await;
    }
    for s in &m.sidecars {
        assert_eq!(total(s), 1, "counted once while it runs");
    }
    // Counted as forwarded to B when sent, before any answer.
    let b_id = m.sidecars[1].fleet().local_id().to_owned();
    let to_b = format!("kvmesh_mesh_forwarded_total{{target=\"{b_id}\"}}");
    assert_eq!(metric(&m.sidecars[0], &to_b).await, Some(1.0));
    assert_eq!(held.await.unwrap(), 200);
    let fwd = metric(
        &m.sidecars[0],
        "kvmesh_mesh_requests_total{served=\"forwarded\"}",
    )
    .await;
    assert_eq!(fwd, Some(1.0), "the held request was forwarded to B");
    for s in &m.sidecars {
        eventually("the request is gone", || async {
            (total(s) == 0).then_some(())
        })
        .await;
    }
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prompt_tokens_to_prefill_are_seen_by_every_sidecar_until_the_first_byte() {
    let m = mesh(2).await;
    // A cold prompt: wherever it goes, all of its tokens are to compute.
    let held = m.send_held();
    // Every sidecar sees the prompt's tokens on one pod: the sender's own
    // guard, or the sender's Prefill report.
    let pending = |s: &SidecarHandle| -> Vec<u64> {
        s.fleet()
            .endpoints(tokio::time::Instant::now(), 16, |_| 0)
            .iter()
            .map(|e| e.load.prefill_tokens)
            .collect()
    };
    let mut seen = Vec::new();
    for s in &m.sidecars {
        let p = eventually("the prompt is seen", || async {
            let p = pending(s);
            (p.iter().filter(|&&t| t > 0).count() == 1).then_some(p)
        })
        .await;
        seen.push(p.iter().sum::<u64>());
    }
    assert!(seen[0] > 100, "the whole prompt is to compute: {seen:?}");
    assert_eq!(seen[0], seen[1], "both sidecars count it once");
    assert_eq!(held.await.unwrap(), 200);
    for s in &m.sidecars {
        eventually("the prompt is done", || async {
            pending(s).iter().all(|&t| t == 0).then_some(())
        })
        .await;
    }
    m.shutdown().await;
}

/// The client addresses (pod ids) of `sidecars`, sorted.
fn client_addrs(sidecars: &[SidecarHandle]) -> Vec<String> {
    let mut v: Vec<String> = sidecars.iter().map(|s| s.addr().to_string()).collect();
    v.sort();
    v
}

/// The pods in a sidecar's fleet, sorted.
fn pod_ids(s: &SidecarHandle) -> Vec<String> {
    let now = tokio::time::Instant::now();
    let mut v: Vec<String> = s
        .fleet()
        .snapshot(now)
        .into_iter()
        .map(|p| p.info.id)
        .collect();
    v.sort();
    v
}

/// `kvmesh_mesh_peers{state}` of one sidecar.
async fn peers_in(s: &SidecarHandle, state: &str) -> Option<f64> {
    metric(s, &format!(r#"kvmesh_mesh_peers{{state="{state}"}}"#)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_follow_same_models_a_peer_serving_other_models_is_not_followed() {
    use kvmesh_proxy::config::mesh::Follow;
    let m = mesh_with(3, |i, c| {
        let model = if i == 2 { "other-model" } else { MODEL };
        c.pod.models = vec![model.to_owned()];
        c.mesh.follow = Follow::SameModels;
    })
    .await;
    let sidecars = &m.sidecars;
    // The two pods of MODEL follow each other; each saw the third pod's hello and left it.
    let pair = client_addrs(&sidecars[..2]);
    for s in &sidecars[..2] {
        eventually(
            "the other pod of the model in sync, the third not followed",
            || async {
                let fresh = peers_in(s, "fresh").await == Some(1.0);
                let other = peers_in(s, "other_models").await == Some(1.0);
                (fresh && other).then_some(())
            },
        )
        .await;
        assert_eq!(pod_ids(s), pair);
    }
    // The third pod follows nobody: both peers serve other models.
    let lone = &sidecars[2];
    eventually("both peers not followed", || async {
        (peers_in(lone, "other_models").await == Some(2.0)).then_some(())
    })
    .await;
    assert_eq!(peers_in(lone, "known").await, Some(0.0));
    assert_eq!(pod_ids(lone), vec![lone.addr().to_string()]);
    // Each pod named its models when it asked, so the third pod turned the pair away before
    // building a snapshot they would have dropped, and served no subscriber.
    let turned_away = r#"kvmesh_mesh_subscribers_dropped_total{reason="other_models"}"#;
    assert!(metric(lone, turned_away).await >= Some(2.0));
    assert_eq!(metric(lone, "kvmesh_mesh_subscribers").await, Some(0.0));
    // Requests for the model route as usual; the other model is unknown here, since the pod that
    // serves it is not followed.
    complete(sidecars[0].addr(), &shared_prefix_body(0, 0)).await;
    let r = fetch(
        &http1(),
        post_json(
            sidecars[0].addr(),
            "/v1/completions",
            r#"{"model":"other-model","prompt":"hi","max_tokens":1}"#,
        ),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_mesh_tls_only_peers_of_the_mesh_ca_join_and_requests_are_forwarded_over_it() {
    use kvmesh_tests::certs::{MeshPki, TestCert};
    let (mesh_ca, other_ca) = (MeshPki::new(), MeshPki::new());
    // Pod 1's client port speaks TLS for its clients, so a forward to it over plain HTTP would
    // fail: requests reach it only through its mesh port.
    let client_cert = TestCert::new();
    let mut m = mesh_with(3, |i, c| {
        let ca = if i == 2 { &other_ca } else { &mesh_ca };
        c.mesh.tls = Some(ca.files(&format!("pod{i}"), "kvmesh-mesh"));
        if i == 1 {
            c.listeners.tls = Some(kvmesh_proxy::config::Tls {
                cert: client_cert.cert_path.clone(),
                key: client_cert.key_path.clone(),
            });
        }
    })
    .await;
    let (sidecars, engines) = (&m.sidecars, &m.engines);
    // The two pods of the mesh CA follow each other over TLS; the third pod's certificate is
    // refused both when it subscribes to them and when they subscribe to it.
    let pair = client_addrs(&sidecars[..2]);
    for s in &sidecars[..2] {
        eventually(
            "in sync with the other pod, the third refused both ways",
            || async {
                let fresh = peers_in(s, "fresh").await == Some(1.0);
                let accept = tls_failures(s, "accept").await >= 1.0;
                let connect = tls_failures(s, "connect").await >= 1.0;
                (fresh && accept && connect).then_some(())
            },
        )
        .await;
        assert_eq!(pod_ids(s), pair);
    }
    // A client that trusts the mesh CA but has no certificate of its own gets no stream.
    let anonymous = stream_without_client_cert(
        sidecars[0].mesh_addr().unwrap(),
        &mesh_ca.files("anon", "kvmesh-mesh").ca,
    )
    .await;
    assert!(anonymous.is_err(), "{anonymous:?}");
    let outsider = &sidecars[2];
    assert_eq!(peers_in(outsider, "fresh").await, Some(0.0));
    assert_eq!(pod_ids(outsider), vec![outsider.addr().to_string()]);
    // The TLS mesh shares KV state: pod 1 runs a prompt (its sidecar told to keep it), and both
    // indexes then hold its blocks ...
    let warm = request(
        "POST",
        sidecars[1].addr(),
        "/v1/completions",
        shared_prefix_body(0, 0),
        &[
            ("content-type", "application/json"),
            ("x-kvmesh-routed", "1"),
        ],
    );
    let (_, r) = kvmesh_tests::client::tls_fetch(
        sidecars[1].addr(),
        client_cert.der.clone(),
        kvmesh_tests::client::Alpn::Http1,
        warm,
    )
    .await;
    assert_eq!(r.status, 200);
    eventually("indexes converged over TLS", || async {
        let e: Vec<usize> = sidecars[..2]
            .iter()
            .map(|s| s.prefix().index().stats().entries)
            .collect();
        (e[0] > 0 && e[0] == e[1]).then_some(())
    })
    .await;
    assert_eq!(outsider.prefix().index().stats().entries, 0);
    // ... so pod 0 forwards the same prompt to pod 1, over the mesh port.
    complete(sidecars[0].addr(), &shared_prefix_body(0, 0)).await;
    let served = |s, how: &'static str| async move {
        let series = format!(r#"kvmesh_mesh_requests_total{{served="{how}"}}"#);
        metric(s, &series).await
    };
    assert_eq!(served(&sidecars[0], "forwarded").await, Some(1.0));
    // (The warm-up, marked as routed, counts as received too.)
    assert_eq!(served(&sidecars[1], "received").await, Some(2.0));
    assert_eq!(completions(&engines[1]).len(), 2);
    assert!(completions(&engines[0]).is_empty());
    // A forwarded request still running when its peer shuts down completes: the mesh port
    // drains instead of cutting it.
    engines[1]
        .faults()
        .delay_first_byte(Some(Duration::from_millis(600)));
    let req = post_json(
        sidecars[0].addr(),
        "/v1/completions",
        &shared_prefix_body(0, 0),
    );
    let held = tokio::spawn(async move { fetch(&http1(), req).await.status });
    eventually("the forwarded request reached pod 1's engine", || async {
        (completions(&m.engines[1]).len() == 3).then_some(())
    })
    .await;
    let pod1 = m.sidecars.remove(1);
    let stopping = tokio::spawn(pod1.shutdown());
    assert_eq!(held.await.unwrap(), 200);
    stopping.await.unwrap();
    m.shutdown().await;
}

/// `kvmesh_mesh_tls_handshake_failures_total{side}` of one sidecar (0 before any).
async fn tls_failures(s: &SidecarHandle, side: &str) -> f64 {
    let series = format!(r#"kvmesh_mesh_tls_handshake_failures_total{{side="{side}"}}"#);
    metric(s, &series).await.unwrap_or(0.0)
}

/// `GET /mesh/v1/stream` over TLS trusting the CA in `ca_pem`, with no client certificate: the
/// response status, or why there was none.
async fn stream_without_client_cert(
    addr: SocketAddr,
    ca_pem: &std::path::Path,
) -> Result<http::StatusCode, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca_pem).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let attempt = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let name = ServerName::try_from("kvmesh-mesh").unwrap();
        let tls = connector
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                .await
                .map_err(|e| format!("h2: {e}"))?;
        tokio::spawn(conn);
        let req = http::Request::get(format!("https://{addr}/mesh/v1/stream"))
            .body(Empty::<Bytes>::new())
            .unwrap();
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| format!("request: {e}"))?;
        Ok(resp.status())
    };
    tokio::time::timeout(Duration::from_secs(5), attempt)
        .await
        .unwrap_or_else(|_| Err("no answer within 5 s".to_owned()))
}
