//! The Valkey index backend against a real `valkey-server` (never a mock):
//! writers and lookups agree on who holds what, leases fence a pod that
//! stopped renewing, an engine restart fences the old member; sidecars in
//! front of simulated engines route by prefix through Valkey as the mesh
//! does, in approximate mode too (each sidecar's decisions are guesses the
//! others route on, until they expire); and no request fails while Valkey
//! is slow, gone, restarted empty, or failed over to its replica (by hand,
//! or by Sentinel, which the sidecars find the primary through), after
//! which the index is whole again.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_engine_sim::SimHandle;
use kvmesh_filters::prefix::index::{PrefixIndex, Touched};
use kvmesh_filters::prefix::kvevents::{BlockRemoved, BlockStored, EventBatch, KvEvent};
use kvmesh_filters::sched::view::Role;
use kvmesh_loadgen::valkey::{ValkeyCluster, ValkeyReplicaSet, ValkeySentinelSet, ValkeyServer};
use kvmesh_proxy::config::index::{Backend, Valkey as ValkeyConfig, ValkeySentinel};
use kvmesh_proxy::config::{Config, Duration as CfgDuration, TokenizerChoice};
use kvmesh_proxy::valkey::metrics::IndexMetrics;
use kvmesh_proxy::valkey::store::{StoreError, STALL_AFTER};
use kvmesh_proxy::valkey::{Lookup, PodRecord, Store, Writer};
use kvmesh_proxy::{Shutdown, SidecarHandle};
use kvmesh_tests::client::{fetch, http1, request};
use kvmesh_tests::mesh::{kv_sim, mesh_config, shared_prefix_body, start_on};
use kvmesh_tests::route::{eventually, metric};
use kvmesh_tests::sidecar::fast_valkey;

const BS: usize = 16;

/// Short timings, so leases lapse, caches expire and idle pods are
/// forgotten within a test.
fn fast(urls: Vec<String>) -> ValkeyConfig {
    ValkeyConfig {
        block_ttl: CfgDuration::from_secs(60),
        resync_jitter: CfgDuration::from_millis(200),
        forget_after: CfgDuration::from_secs(2),
        ..fast_valkey(urls)
    }
}

async fn connected(cfg: ValkeyConfig, shutdown: &Shutdown) -> Arc<Store> {
    let store = Arc::new(Store::new(cfg));
    tokio::spawn(store.clone().run(shutdown.clone()));
    eventually("connected to valkey", || async {
        store.is_up().then_some(())
    })
    .await;
    store
}

fn record(id: &str) -> PodRecord {
    PodRecord {
        id: id.to_owned(),
        mesh: String::new(),
        kv_agent: String::new(),
        role: Role::Both,
        models: vec!["m".into()],
        adapters: vec![],
        labels: Default::default(),
        waiting: 1,
        running: 2,
        kv: 0.25,
        block_size: BS as u32,
        blocks: 1000,
        healthy: true,
        in_flight: 3,
        load_age_ms: 0,
        ttl_ms: 0,
        work: None,
    }
}

fn tokens(n_blocks: usize, seed: u32) -> Vec<u32> {
    (0..(n_blocks * BS) as u32)
        .map(|i| seed * 100_000 + i)
        .collect()
}

/// A batch storing the first `n` blocks of `toks` as one chain.
fn store_chain(toks: &[u32], n: usize, hash_base: u64) -> EventBatch {
    let stored = BlockStored {
        block_hashes: (0..n as u64).map(|i| hash_base + i).collect(),
        parent_block_hash: None,
        token_ids: toks[..n * BS].to_vec(),
        block_size: BS as u32,
        ..Default::default()
    };
    EventBatch {
        events: vec![KvEvent::BlockStored(stored)],
        ..Default::default()
    }
}

fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch {
        events,
        ..Default::default()
    }
}

/// One emulated pod: its writer over a shared index.
struct Pod {
    writer: Writer,
    pod: kvmesh_filters::prefix::index::PodId,
}

impl Pod {
    fn new(store: &Arc<Store>, index: &Arc<PrefixIndex>, id: &str) -> Self {
        let pod = index.pod(id).unwrap();
        let rec = record(id);
        let writer = Writer::new(
            store.clone(),
            index.clone(),
            pod,
            id,
            vec!["m".into()],
            Box::new(move || rec.clone()),
        );
        Pod { writer, pod }
    }

    async fn apply(&mut self, m: &IndexMetrics, index: &PrefixIndex, b: EventBatch) {
        let mut touched: Vec<Touched> = Vec::new();
        index.apply_touching(self.pod, "m", &b, &mut touched);
        self.writer.batch(m, &Arc::from("m"), &b, &touched);
        self.sync(m).await;
    }

    /// Renews, then flushes until nothing (rewrites included) is pending.
    async fn sync(&mut self, m: &IndexMetrics) {
        self.writer.renew(m).await.unwrap();
        for _ in 0..200 {
            self.writer.flush(m).await.unwrap();
            if self.writer.is_registered()
                && self.writer.pending() == 0
                && self.writer.rewriting() == 0
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("writer did not drain: {:?}", self.writer);
    }
}

/// Depth per pod id in a fresh lookup (past the cache).
async fn depths(lookup: &Lookup, m: &IndexMetrics, keys: &[u64]) -> Vec<(String, u32)> {
    tokio::time::sleep(Duration::from_millis(25)).await;
    let found = lookup.find(m, "m", keys).await.unwrap();
    let mut out: Vec<(String, u32)> = found
        .candidates
        .iter()
        .map(|c| (c.record.id.clone(), c.depth))
        .collect();
    out.sort();
    out
}

#[tokio::test]
async fn writers_and_lookups_agree_on_who_holds_what() {
    let server = ValkeyServer::start().await.unwrap();
    let shutdown = Shutdown::new();
    let store = connected(fast(vec![server.url()]), &shutdown).await;
    let m = &IndexMetrics::default();
    let index = Arc::new(PrefixIndex::default());
    let mut a = Pod::new(&store, &index, "127.0.0.1:10001");
    let mut b = Pod::new(&store, &index, "127.0.0.1:10002");
    let toks = tokens(8, 1);
    let keys = index.request_keys("m", None, &toks, BS);
    a.apply(m, &index, store_chain(&toks, 8, 100)).await;
    b.apply(m, &index, store_chain(&toks, 3, 200)).await;
    let lookup = Lookup::new(store.clone());
    assert_eq!(
        depths(&lookup, m, &keys).await,
        vec![("127.0.0.1:10001".into(), 8), ("127.0.0.1:10002".into(), 3)]
    );
    let found = lookup.find(m, "m", &keys).await.unwrap();
    assert_eq!(found.deepest, 8);
    let rec = &found.candidates[0].record;
    assert_eq!((rec.waiting, rec.running, rec.in_flight), (1, 2, 3));

    // The tail of a's chain evicted: its depth follows.
    let removed = KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![104, 105, 106, 107],
        ..Default::default()
    });
    a.apply(m, &index, batch(vec![removed])).await;
    assert_eq!(
        depths(&lookup, m, &keys).await,
        vec![("127.0.0.1:10001".into(), 4), ("127.0.0.1:10002".into(), 3)]
    );

    // A prompt nobody holds still gets candidates: the ring's homes and a
    // random sample, at depth 0.
    let cold = index.request_keys("m", None, &tokens(4, 9), BS);
    assert_eq!(
        depths(&lookup, m, &cold).await,
        vec![("127.0.0.1:10001".into(), 0), ("127.0.0.1:10002".into(), 0)]
    );

    // b's engine restarts: a new member, the old one fenced at once, and
    // b's new blocks under the new member.
    let old = b.writer.member().to_owned();
    b.apply(m, &index, batch(vec![KvEvent::AllBlocksCleared]))
        .await;
    assert_ne!(b.writer.member(), old);
    b.apply(m, &index, store_chain(&toks, 2, 300)).await;
    assert_eq!(
        depths(&lookup, m, &keys).await,
        vec![("127.0.0.1:10001".into(), 4), ("127.0.0.1:10002".into(), 2)]
    );

    // a stops renewing (its sidecar died): out of every lookup once its
    // lease lapses.
    let mut lapsed = false;
    for _ in 0..200 {
        b.writer.renew(m).await.unwrap();
        if depths(&lookup, m, &keys).await == vec![("127.0.0.1:10002".to_owned(), 2)] {
            lapsed = true;
            break;
        }
    }
    assert!(lapsed, "a's lease never lapsed");
    shutdown.trigger();
}

/// Connects `cfg` and waits for the store to come up, or, with `up` false,
/// for it to have tried and failed (its last error set) while staying down.
async fn tries(cfg: ValkeyConfig, shutdown: &Shutdown, up: bool) -> Arc<Store> {
    let store = Arc::new(Store::new(cfg));
    tokio::spawn(store.clone().run(shutdown.clone()));
    eventually("a connection attempt", || async {
        (store.is_up() || !store.last_error().is_empty()).then_some(())
    })
    .await;
    assert_eq!(store.is_up(), up, "last error: {}", store.last_error());
    store
}

#[tokio::test]
async fn rediss_urls_speak_tls_with_a_private_ca_and_a_client_certificate() {
    use kvmesh_proxy::config::index::ValkeyTls;
    use kvmesh_tests::certs::MeshPki;
    use kvmesh_tests::tls_front::TlsFront;

    let server = ValkeyServer::start().await.unwrap();
    let upstream: SocketAddr = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let pki = MeshPki::new();
    let valkey = pki.files("valkey", "localhost");
    let client = pki.files("sidecar", "kvmesh-sidecar");
    // As `tls-auth-clients yes`: the handshake needs a certificate of the CA.
    let front = TlsFront::start(upstream, &valkey.cert, &valkey.key, Some(&valkey.ca)).await;
    let url = format!("rediss://localhost:{}", front.addr.port());
    let tls = |ca: bool, cert: bool| ValkeyTls {
        ca: ca.then(|| valkey.ca.clone()),
        cert: cert.then(|| client.cert.clone()),
        key: cert.then(|| client.key.clone()),
    };
    let with = |t: Option<ValkeyTls>| ValkeyConfig {
        tls: t,
        ..fast(vec![url.clone()])
    };
    let shutdown = Shutdown::new();

    // The private CA and a client certificate: the index works through TLS.
    let store = tries(with(Some(tls(true, true))), &shutdown, true).await;
    let m = &IndexMetrics::default();
    let index = Arc::new(PrefixIndex::default());
    let mut a = Pod::new(&store, &index, "127.0.0.1:10001");
    let toks = tokens(4, 3);
    let keys = index.request_keys("m", None, &toks, BS);
    a.apply(m, &index, store_chain(&toks, 4, 100)).await;
    let lookup = Lookup::new(store.clone());
    assert_eq!(
        depths(&lookup, m, &keys).await,
        vec![("127.0.0.1:10001".into(), 4)]
    );
    // The bytes did go through the front: the server has the pod's blocks.
    assert!(server
        .info_field("keyspace", "db0")
        .await
        .unwrap()
        .contains("keys="));

    // The system's roots do not know the private CA: never up, and it says why.
    let untrusted = tries(with(None), &shutdown, false).await;
    assert!(
        untrusted
            .last_error()
            .to_lowercase()
            .contains("certificate"),
        "{}",
        untrusted.last_error()
    );
    // The CA but no client certificate: the server refuses the handshake.
    let anonymous = tries(with(Some(tls(true, false))), &shutdown, false).await;
    assert!(!anonymous.is_up());
    shutdown.trigger();
}

#[test]
fn tls_settings_that_cannot_work_are_refused_with_the_field() {
    use kvmesh_proxy::config::index::ValkeyTls;
    let check = |urls: &[&str], tls: Option<ValkeyTls>| {
        let mut c = Config::default();
        c.index.backend = Backend::Valkey;
        c.index.valkey.urls = urls.iter().map(|u| (*u).to_owned()).collect();
        c.index.valkey.tls = tls;
        kvmesh_proxy::config::index::validate(&c)
            .err()
            .map(|(field, _)| field)
    };
    let files = |ca: &str, cert: Option<&str>, key: Option<&str>| ValkeyTls {
        ca: Some(ca.into()),
        cert: cert.map(Into::into),
        key: key.map(Into::into),
    };
    assert_eq!(check(&["rediss://v:6380"], None), None);
    assert_eq!(
        check(&["rediss://a:6380", "redis://b:6379"], None).as_deref(),
        Some("index.valkey.urls")
    );
    assert_eq!(
        check(&["redis://v:6379"], Some(ValkeyTls::default())).as_deref(),
        Some("index.valkey.tls")
    );
    let ca = std::env::current_exe().unwrap();
    let ca = ca.to_str().unwrap();
    assert_eq!(
        check(&["rediss://v:6380"], Some(files(ca, Some(ca), None))).as_deref(),
        Some("index.valkey.tls")
    );
    assert_eq!(
        check(
            &["rediss://v:6380"],
            Some(files("/nonexistent/ca.pem", None, None))
        )
        .as_deref(),
        Some("index.valkey.tls.ca")
    );
    assert_eq!(
        check(&["valkeys://v:6380"], Some(files(ca, None, None))),
        None
    );
}

#[tokio::test]
async fn a_restarted_empty_valkey_is_refilled_by_the_writers_and_a_frozen_one_times_out() {
    let mut server = ValkeyServer::start().await.unwrap();
    let shutdown = Shutdown::new();
    let store = connected(fast(vec![server.url()]), &shutdown).await;
    let m = &IndexMetrics::default();
    let index = Arc::new(PrefixIndex::default());
    let mut a = Pod::new(&store, &index, "127.0.0.1:10001");
    let toks = tokens(6, 2);
    let keys = index.request_keys("m", None, &toks, BS);
    a.apply(m, &index, store_chain(&toks, 6, 100)).await;
    let lookup = Lookup::new(store.clone());
    assert_eq!(
        depths(&lookup, m, &keys).await,
        vec![("127.0.0.1:10001".into(), 6)]
    );

    // Frozen: a lookup gives up at its deadline instead of hanging.
    server.freeze().unwrap();
    let started = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(25)).await;
    assert!(lookup.find(m, "m", &keys).await.is_err());
    assert!(started.elapsed() < Duration::from_secs(2));
    server.thaw().unwrap();

    // Restarted empty: the store reconnects (and reloads its functions),
    // the writer finds its record gone, registers again and rewrites.
    server.restart_empty().await.unwrap();
    let old = a.writer.member().to_owned();
    let mut whole = false;
    for _ in 0..400 {
        let _ = a.writer.renew(m).await;
        let _ = a.writer.flush(m).await;
        tokio::time::sleep(Duration::from_millis(25)).await;
        if let Ok(found) = lookup.find(m, "m", &keys).await {
            if found.candidates.len() == 1 && found.candidates[0].depth == 6 {
                whole = true;
                break;
            }
        }
    }
    assert!(whole, "the index never became whole again");
    assert_ne!(a.writer.member(), old, "a new member after the restart");
    shutdown.trigger();
}

/// A hung server (SIGSTOP: the socket stays open and nothing answers) is
/// cut off: once calls have missed their deadlines for `STALL_AFTER`, the
/// store counts as down and a call fails at once instead of waiting out its
/// deadline; when the server answers again, the store connects again.
#[tokio::test]
async fn a_silent_valkey_is_cut_off_and_connected_again() {
    let server = ValkeyServer::start().await.unwrap();
    let shutdown = Shutdown::new();
    let store = connected(fast(vec![server.url()]), &shutdown).await;
    let m = &IndexMetrics::default();
    let lookup = Lookup::new(store.clone());
    let index = PrefixIndex::default();
    let keys = index.request_keys("m", None, &tokens(4, 3), BS);
    assert!(lookup.find(m, "m", &keys).await.is_ok());
    let before = store.generation();

    server.freeze().unwrap();
    let frozen = std::time::Instant::now();
    let mut cut = false;
    for _ in 0..200 {
        // Misses its deadline (or is answered from the lookup's cache).
        let _ = lookup.find(m, "m", &keys).await;
        if !store.is_up() {
            cut = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(cut, "still up after {:?} of silence", frozen.elapsed());
    assert!(
        frozen.elapsed() >= STALL_AFTER,
        "cut before the silence lasted"
    );
    let started = std::time::Instant::now();
    let down = store
        .call::<String>(&redis::cmd("PING"), Duration::from_secs(5))
        .await;
    assert!(matches!(down, Err(StoreError::Down)), "{down:?}");
    assert!(started.elapsed() < Duration::from_secs(1), "a call waited");

    server.thaw().unwrap();
    eventually("connected again", || async {
        (store.is_up() && store.generation() > before).then_some(())
    })
    .await;
    assert!(lookup.find(m, "m", &keys).await.is_ok());
    shutdown.trigger();
}

/// A sidecar config on the Valkey backend in front of `engine`.
fn valkey_sidecar(engine: &SimHandle, cfg: ValkeyConfig) -> Config {
    let peers = std::env::temp_dir().join("kvmesh-valkey-no-peers");
    let mut c = mesh_config(engine, &peers);
    c.mesh.file = None;
    c.mesh.listen = None;
    c.index.backend = Backend::Valkey;
    c.index.valkey = cfg;
    c
}

struct Fleet {
    engines: Vec<SimHandle>,
    sidecars: Vec<SidecarHandle>,
}

async fn fleet(n: usize, cfg: ValkeyConfig) -> Fleet {
    fleet_of(n, cfg, false).await
}

/// `n` engines, each behind a sidecar on Valkey (`approx`: engines without
/// KV events, sidecars in approximate mode); once every sidecar registered.
async fn fleet_of(n: usize, cfg: ValkeyConfig, approx: bool) -> Fleet {
    let mut engines = Vec::new();
    let mut sidecars = Vec::new();
    for _ in 0..n {
        let (e, config) = if approx {
            let e = kvmesh_tests::route::sim().await;
            let c = approx_sidecar(&e, cfg.clone());
            (e, c)
        } else {
            let e = kv_sim().await;
            let c = valkey_sidecar(&e, cfg.clone());
            (e, c)
        };
        sidecars.push(start_on(config, None).await);
        engines.push(e);
    }
    for s in &sidecars {
        eventually("registered in valkey", || async {
            s.index()?.status().writer.registered.then_some(())
        })
        .await;
    }
    Fleet { engines, sidecars }
}

impl Fleet {
    /// After a failover, once every writer has written: 8 requests of group
    /// 0 through `via` all succeed, and more than half their prompt hits
    /// the engines' caches (the index is whole again).
    async fn index_whole_again(&self, via: SocketAddr) {
        self.written().await;
        let (h0, q0) = self.engine_hits();
        assert_eq!(failures(via, 8, 0).await, 0);
        let (h1, q1) = self.engine_hits();
        let rate = (h1 - h0) as f64 / (q1 - q0).max(1) as f64;
        assert!(rate > 0.5, "prefix hit rate after the failover {rate}");
    }

    fn engine_hits(&self) -> (u64, u64) {
        self.engines.iter().fold((0, 0), |(h, q), e| {
            let s = e.stats();
            (h + s.prefix_hits, q + s.prefix_queries)
        })
    }

    /// Every sidecar's writer has nothing pending.
    async fn written(&self) {
        for s in &self.sidecars {
            eventually("writes drained", || async {
                let w = s.index()?.status().writer;
                (w.registered && w.pending == 0 && w.rewriting == 0).then_some(())
            })
            .await;
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
    }

    async fn shutdown(self) {
        for s in self.sidecars {
            s.shutdown().await;
        }
    }
}

async fn complete(addr: SocketAddr, body: &str) -> u16 {
    let r = fetch(
        &http1(),
        request(
            "POST",
            addr,
            "/v1/completions",
            body.to_owned(),
            &[("content-type", "application/json")],
        ),
    )
    .await;
    r.status.as_u16()
}

/// Sends each group's first request, waits for the index, then three more
/// users per group; the engines' prefix hit rate over the later ones.
async fn shared_prefix_round(
    f: &Fleet,
    groups: std::ops::Range<usize>,
    via: impl Fn(usize) -> SocketAddr,
) -> f64 {
    let mut i = 0;
    for g in groups.clone() {
        assert_eq!(complete(via(i), &shared_prefix_body(g, 0)).await, 200);
        i += 1;
    }
    f.written().await;
    let (h0, q0) = f.engine_hits();
    for u in 1..4 {
        for g in groups.clone() {
            assert_eq!(complete(via(i), &shared_prefix_body(g, u)).await, 200);
            i += 1;
        }
    }
    let (h1, q1) = f.engine_hits();
    (h1 - h0) as f64 / (q1 - q0).max(1) as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sidecars_on_valkey_route_by_prefix_as_the_mesh_does() {
    let server = ValkeyServer::start().await.unwrap();
    let f = fleet(4, fast(vec![server.url()])).await;
    let addrs: Vec<SocketAddr> = f.sidecars.iter().map(|s| s.addr()).collect();
    let spread = shared_prefix_round(&f, 0..8, |i| addrs[i % 4]).await;
    let single = shared_prefix_round(&f, 100..108, |_| addrs[0]).await;
    eprintln!("engine prefix hit rate through valkey: spread {spread:.3}, one sidecar {single:.3}");
    assert!(single > 0.8, "one sidecar's hit rate {single}");
    assert!(
        spread > single - 0.05,
        "spread {spread} vs one sidecar {single}"
    );
    let mut forwarded = 0.0;
    for s in &f.sidecars {
        forwarded += metric(s, r#"kvmesh_mesh_requests_total{served="forwarded"}"#)
            .await
            .unwrap_or(0.0);
        assert!(
            metric(s, r#"kvmesh_index_lookups_total{outcome="ok"}"#)
                .await
                .unwrap_or(0.0)
                > 0.0
        );
        assert_eq!(metric(s, "kvmesh_index_up").await, Some(1.0));
    }
    assert!(forwarded > 0.0, "spread clients needed forwarding");
    f.shutdown().await;
}

/// Sends `n` requests through `via` for groups that pods hold, counting
/// anything but a 200.
async fn failures(via: SocketAddr, n: usize, group0: usize) -> usize {
    let mut bad = 0;
    for i in 0..n {
        if complete(via, &shared_prefix_body(group0 + i % 4, i)).await != 200 {
            bad += 1;
        }
    }
    bad
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_request_fails_while_valkey_is_frozen_gone_or_restarted_empty() {
    let mut server = ValkeyServer::start().await.unwrap();
    let f = fleet(3, fast(vec![server.url()])).await;
    let addrs: Vec<SocketAddr> = f.sidecars.iter().map(|s| s.addr()).collect();
    // Each group's prefix on some pod.
    assert!(shared_prefix_round(&f, 0..4, |i| addrs[i % 3]).await > 0.5);

    server.freeze().unwrap();
    assert_eq!(failures(addrs[0], 12, 0).await, 0, "frozen valkey");
    server.thaw().unwrap();

    server.kill();
    assert_eq!(failures(addrs[1], 12, 0).await, 0, "no valkey");
    for s in &f.sidecars {
        eventually("valkey down is seen", || async {
            (!s.index()?.status().up).then_some(())
        })
        .await;
    }
    let down = metric(
        &f.sidecars[1],
        r#"kvmesh_index_lookups_total{outcome="down"}"#,
    )
    .await;
    assert!(down.unwrap_or(0.0) > 0.0, "lookups while down are counted");

    // Back, empty: every writer finds its record gone, registers again
    // under a new member and rewrites its pod.
    server.restart_empty().await.unwrap();
    for s in &f.sidecars {
        eventually("registered again", || async {
            let again = metric(
                s,
                r#"kvmesh_index_registrations_total{reason="lease_lost"}"#,
            )
            .await?;
            let st = s.index()?.status();
            (again >= 1.0 && st.up && st.writer.registered).then_some(())
        })
        .await;
    }
    f.written().await;
    assert_eq!(failures(addrs[2], 12, 0).await, 0, "after the restart");
    // Whole again: the groups' next users land where their prefix is.
    let (h0, q0) = f.engine_hits();
    assert_eq!(failures(addrs[0], 8, 0).await, 0);
    let (h1, q1) = f.engine_hits();
    let rate = (h1 - h0) as f64 / (q1 - q0).max(1) as f64;
    assert!(rate > 0.5, "prefix hit rate after the rewrite {rate}");
    f.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sidecars_follow_a_failover_to_the_replica() {
    let mut set = ValkeyReplicaSet::start().await.unwrap();
    let urls = set.urls().to_vec();
    let f = fleet(2, fast(urls.clone())).await;
    let addrs: Vec<SocketAddr> = f.sidecars.iter().map(|s| s.addr()).collect();
    assert_eq!(f.sidecars[0].index().unwrap().status().server, urls[0]);
    assert!(shared_prefix_round(&f, 0..4, |i| addrs[i % 2]).await > 0.5);
    set.promote_replica().await.unwrap();
    assert_eq!(failures(addrs[0], 8, 0).await, 0, "during the failover");
    for s in &f.sidecars {
        eventually("on the promoted replica", || async {
            let st = s.index()?.status();
            (st.up && st.server == urls[1] && st.writer.registered).then_some(())
        })
        .await;
    }
    f.index_whole_again(addrs[1]).await;
    f.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sidecars_route_through_a_cluster_of_three_primaries_and_a_pod_that_left_is_out() {
    let cluster = ValkeyCluster::start().await.unwrap();
    let mut cfg = fast(cluster.urls());
    cfg.cluster = true;
    // Three stripes: a model's pods spread over the slots of several primaries.
    cfg.stripes = 3;
    let mut f = fleet(3, cfg).await;
    let addrs: Vec<SocketAddr> = f.sidecars.iter().map(|s| s.addr()).collect();
    let spread = shared_prefix_round(&f, 0..6, |i| addrs[i % 3]).await;
    assert!(spread > 0.75, "hit rate through the cluster {spread}");

    // A pod leaves: within 5 s no lookup names it.
    let gone = f.sidecars.pop().unwrap();
    let gone_id = gone.fleet().local_id().to_owned();
    gone.shutdown().await;
    let started = std::time::Instant::now();
    eventually("the pod that left is out of the lookups", || async {
        let r = fetch(
            &http1(),
            request(
                "POST",
                f.sidecars[0].admin_addr(),
                "/debug/route",
                shared_prefix_body(0, 99),
                &[("content-type", "application/json")],
            ),
        )
        .await;
        let v: serde_json::Value = serde_json::from_slice(&r.body).ok()?;
        let c = v["index"]["candidates"].as_array()?;
        (!c.is_empty() && !c.iter().any(|p| p[0] == gone_id.as_str())).then_some(())
    })
    .await;
    assert!(started.elapsed() < Duration::from_secs(5));
    f.shutdown().await;
}

/// `GET /autoscale` on `admin`, as JSON.
async fn autoscale(admin: SocketAddr) -> serde_json::Value {
    let r = fetch(&http1(), request("GET", admin, "/autoscale", "", &[])).await;
    serde_json::from_slice(&r.body).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_autoscaling_hook_on_valkey_sizes_the_whole_fleet_not_the_pods_one_sidecar_routed_to() {
    let server = ValkeyServer::start().await.unwrap();
    let mut f = fleet(3, fast(vec![server.url()])).await;
    let admin = f.sidecars[0].admin_addr();
    // No request was routed, so the sidecar itself knows only its own pod;
    // the hook still counts all three, with their loads from their records.
    eventually("every pod sized, each with a fresh load", || async {
        let a = autoscale(admin).await;
        let pool = &a["aggregated"];
        (pool["pods"] == 3 && pool["measured"] == 3).then_some(())
    })
    .await;
    assert_eq!(
        f.sidecars[0]
            .fleet()
            .snapshot(tokio::time::Instant::now())
            .len(),
        1
    );
    // The same answer is in its /metrics, for an HPA or KEDA's Prometheus scaler.
    assert_eq!(
        metric(
            &f.sidecars[0],
            r#"kvmesh_autoscale_pods{pool="aggregated"}"#
        )
        .await,
        Some(3.0)
    );
    // A pod that leaves is out once its lease lapses and the view is re-read.
    let gone = f.sidecars.pop().unwrap();
    gone.shutdown().await;
    eventually("the pod that left is no longer sized", || async {
        (autoscale(admin).await["aggregated"]["pods"] == 2).then_some(())
    })
    .await;
    f.shutdown().await;
}

/// `fast`, the primary found through `set`'s sentinels.
fn through_sentinel(set: &ValkeySentinelSet, master: &str) -> ValkeyConfig {
    ValkeyConfig {
        sentinel: Some(ValkeySentinel {
            urls: set.sentinel_urls(),
            master: master.to_owned(),
            ..ValkeySentinel::default()
        }),
        ..fast(Vec::new())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sidecars_find_the_primary_through_sentinel_and_follow_its_failover() {
    let mut set = ValkeySentinelSet::start(1).await.unwrap();
    let shutdown = Shutdown::new();
    // A name the sentinels do not monitor: down, and it says why.
    let unknown = tries(through_sentinel(&set, "nope"), &shutdown, false).await;
    assert!(
        unknown
            .last_error()
            .contains("knows no primary named \"nope\""),
        "{}",
        unknown.last_error()
    );
    shutdown.trigger();

    let f = fleet(2, through_sentinel(&set, ValkeySentinelSet::MASTER)).await;
    let addrs: Vec<SocketAddr> = f.sidecars.iter().map(|s| s.addr()).collect();
    let primary = set.primary().url();
    for s in &f.sidecars {
        assert_eq!(s.index().unwrap().status().server, primary);
    }
    assert!(shared_prefix_round(&f, 0..4, |i| addrs[i % 2]).await > 0.5);

    // The primary dies; requests keep coming while the sentinel notices,
    // promotes the replica and the sidecars follow it. None fails.
    set.kill_primary();
    let killed = std::time::Instant::now();
    let replica = set.replica().url();
    let (mut sent, mut failed) = (0, 0);
    let end = killed + Duration::from_secs(30);
    loop {
        failed += failures(addrs[sent % 2], 2, 0).await;
        sent += 2;
        let followed = f.sidecars.iter().all(|s| {
            let st = s.index().unwrap().status();
            st.up && st.server == replica && st.writer.registered
        });
        if followed {
            break;
        }
        let now: Vec<_> = f
            .sidecars
            .iter()
            .map(|s| s.index().unwrap().status())
            .collect();
        assert!(
            std::time::Instant::now() < end,
            "the sidecars did not follow the sentinel to {replica}: {now:?}"
        );
    }
    eprintln!(
        "sentinel failover: the sidecars on the promoted replica {:?} after the kill, {sent} requests sent meanwhile",
        killed.elapsed()
    );
    assert_eq!(
        failed, 0,
        "{failed} of {sent} requests failed during the failover"
    );
    // The sentinel's own view agrees (the sidecars had no other way to learn
    // the replica: urls is empty).
    set.wait_failover().await.unwrap();
    f.index_whole_again(addrs[1]).await;
    f.shutdown().await;
}

#[tokio::test]
async fn a_sentinel_switch_moves_the_store_while_the_old_primary_still_answers() {
    let set = ValkeySentinelSet::start(1).await.unwrap();
    let shutdown = Shutdown::new();
    let store = connected(through_sentinel(&set, ValkeySentinelSet::MASTER), &shutdown).await;
    assert_eq!(store.server(), set.primary().url());
    let generation = store.generation();
    // Nothing is sent, so no error or READONLY can tell the store: only the
    // sentinels' +switch-master does.
    set.failover().await.unwrap();
    set.wait_failover().await.unwrap();
    let replica = set.replica().url();
    eventually("the store on the new primary", || async {
        (store.is_up() && store.server() == replica).then_some(())
    })
    .await;
    assert!(store.generation() > generation);
    assert!(set.primary().is_running(), "the old primary was not killed");
    shutdown.trigger();
}

/// A sidecar in front of `engine` on the Valkey backend in approximate
/// mode: an engine without KV events, no tokenizer.
fn approx_sidecar(engine: &SimHandle, cfg: ValkeyConfig) -> Config {
    let mut c = kvmesh_tests::route::config(engine, &[], None);
    c.prefix.tokenizer = TokenizerChoice::None;
    c.engine.kv_events = None;
    c.index.backend = Backend::Valkey;
    c.index.valkey = cfg;
    c
}

async fn approx_fleet(n: usize, cfg: ValkeyConfig) -> Fleet {
    fleet_of(n, cfg, true).await
}

impl Fleet {
    /// Sends `body` through sidecar `via`; the index of the engine that ran it.
    async fn served_by(&self, via: usize, body: &str) -> usize {
        let before: Vec<u64> = self
            .engines
            .iter()
            .map(|e| e.stats().prompt_tokens)
            .collect();
        assert_eq!(complete(self.sidecars[via].addr(), body).await, 200);
        let ran: Vec<usize> = (0..self.engines.len())
            .filter(|&i| self.engines[i].stats().prompt_tokens > before[i])
            .collect();
        assert_eq!(ran.len(), 1, "one engine ran it: {ran:?}");
        ran[0]
    }

    /// The depths sidecar `at`'s index lookup gives `body`'s prompt, by pod
    /// id (pods it holds none of left out).
    async fn depths(&self, at: usize, body: &str) -> Vec<(String, u64)> {
        let r = fetch(
            &http1(),
            request(
                "POST",
                self.sidecars[at].admin_addr(),
                "/debug/route",
                body.to_owned(),
                &[("content-type", "application/json")],
            ),
        )
        .await;
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        let mut out: Vec<(String, u64)> = v["index"]["candidates"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| Some((c[0].as_str()?.to_owned(), c[1].as_u64()?)))
            .filter(|(_, depth)| *depth > 0)
            .collect();
        out.sort();
        out
    }

    fn pod_id(&self, i: usize) -> String {
        self.sidecars[i].fleet().local_id().to_owned()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn approximate_sidecars_on_valkey_route_a_prefix_another_sidecar_routed_to_the_same_pod() {
    let server = ValkeyServer::start().await.unwrap();
    let f = approx_fleet(3, fast(vec![server.url()])).await;
    for g in 0..6 {
        let (a, b, c) = (g % 3, (g + 1) % 3, (g + 2) % 3);
        let first = f.served_by(a, &shared_prefix_body(g, 0)).await;
        // b never routed this prompt: it knows where a sent it from Valkey.
        let pod = f.pod_id(first);
        let seen = eventually("a's guess seen by b", || async {
            let d = f.depths(b, &shared_prefix_body(g, 1)).await;
            d.iter().any(|(id, _)| *id == pod).then_some(d)
        })
        .await;
        assert_eq!(seen.len(), 1, "only the pod a chose holds it: {seen:?}");
        assert_eq!(
            f.served_by(b, &shared_prefix_body(g, 1)).await,
            first,
            "group {g} via b"
        );
        assert_eq!(
            f.served_by(c, &shared_prefix_body(g, 2)).await,
            first,
            "group {g} via c"
        );
    }
    for s in &f.sidecars {
        assert!(s.index().unwrap().metrics.guesses_written() > 0);
        assert!(
            metric(s, r#"kvmesh_index_lookups_total{outcome="ok"}"#)
                .await
                .unwrap_or(0.0)
                > 0.0
        );
    }
    f.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_approximate_guess_on_valkey_attracts_until_it_expires() {
    let server = ValkeyServer::start().await.unwrap();
    let cfg = ValkeyConfig {
        approx_ttl: CfgDuration::from_millis(1500),
        ..fast(vec![server.url()])
    };
    let f = approx_fleet(2, cfg).await;
    let first = f.served_by(0, &shared_prefix_body(7, 0)).await;
    let pod = f.pod_id(first);
    let probe = shared_prefix_body(7, 1);
    eventually("the guess seen by the other sidecar", || async {
        (f.depths(1, &probe).await.iter().any(|(id, _)| *id == pod)).then_some(())
    })
    .await;
    // Nobody sends the prompt again: the guess lapses, and no pod holds it
    // for the sidecar that never routed it (nor in Valkey).
    eventually("the guess expired", || async {
        f.depths(1, &probe).await.is_empty().then_some(())
    })
    .await;
    let left: Vec<String> = server.query(redis::cmd("KEYS").arg("*:a:*")).await.unwrap();
    assert!(left.is_empty(), "guess keys left after their ttl: {left:?}");
    f.shutdown().await;
}
