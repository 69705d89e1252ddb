//! `kvmesh bench scale`: one real sidecar (the `kvmesh-proxy` binary) in
//! front of an emulated fleet of N pods, on the full mesh and on Valkey,
//! side by side: its CPU idle and under load, its resident memory, the
//! routing decision's latency with the index lookup, and how soon a block a
//! pod stored is visible to a router. Then what one Valkey core ingests and
//! answers, and from it how many primaries a 1000-pod fleet needs.
//!
//! The emulated pods ([`emulate`]) run the code a sidecar runs for its own
//! pod: on Valkey, the writer; on the mesh, real sidecars publishing their
//! state streams. Each holds `blocks_per_pod` blocks and churns
//! `churn_per_pod` a second (one stored, one removed) while the load runs;
//! the sidecar under test routes `rate` requests a second of shared-prefix
//! prompts whose prefixes the pods hold. docs/benchmarks.md holds a full
//! run; docs/mesh.md reads it.

pub mod emulate;
mod ingest;
pub mod report;
pub mod sut;
pub mod tags;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use kvmesh_loadgen::client::{Client, ClientConfig};
use kvmesh_loadgen::fake::{FastEngine, FastEngineConfig};
use kvmesh_loadgen::overhead::procs::cpu_of;
use kvmesh_loadgen::valkey::ValkeyServer;
use kvmesh_proxy::config::index::Valkey as ValkeyConfig;
use kvmesh_proxy::valkey::Lookup;
use serde::Serialize;

use emulate::{Blocks, MeshFleet, ValkeyFleet, MODEL};
pub use report::ScaleReport;
use sut::{Backend, Sut};

/// What one run measures.
#[derive(Debug, Clone)]
pub struct ScaleOpts {
    /// Fleet sizes.
    pub pods: Vec<usize>,
    /// The largest fleet the mesh is run at (past it the mesh does not fit
    /// this machine: every emulated peer is a whole sidecar).
    pub mesh_max: usize,
    /// Rounds per point; the report gives medians with min-max ranges.
    pub rounds: usize,
    pub idle: Duration,
    pub load: Duration,
    /// Requests per second the sidecar under test routes during the load.
    pub rate: f64,
    pub blocks: Blocks,
    /// Seconds of the Valkey ingest and lookup saturation runs.
    pub saturate: Duration,
    /// The `kvmesh-proxy` binary (default: beside this one, then PATH).
    pub proxy: Option<PathBuf>,
    pub work_dir: PathBuf,
}

impl ScaleOpts {
    /// The full run, or `quick`: one round and shorter phases (under 10
    /// minutes on 2 cores).
    pub fn new(quick: bool, work_dir: PathBuf) -> Self {
        Self {
            pods: vec![32, 128, 512, 1000],
            mesh_max: if quick { 128 } else { 512 },
            rounds: if quick { 1 } else { 3 },
            idle: Duration::from_secs(if quick { 4 } else { 10 }),
            load: Duration::from_secs(if quick { 6 } else { 15 }),
            rate: 40.0,
            blocks: Blocks {
                groups: 32,
                per_pod: if quick { 256 } else { 512 },
                churn_per_pod: 10.0,
            },
            saturate: Duration::from_secs(if quick { 4 } else { 10 }),
            proxy: None,
            work_dir,
        }
    }
}

/// One point's measurement.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Sample {
    pub idle_cpu_ms_per_s: f64,
    pub load_cpu_ms_per_s: f64,
    pub rss_mb: f64,
    pub decision_p50_ms: Option<f64>,
    pub decision_p99_ms: Option<f64>,
    pub freshness_p50_ms: Option<f64>,
    pub freshness_p99_ms: Option<f64>,
    pub requests: usize,
    pub failed: usize,
    /// Share of the requests the sidecar under test sent to another pod.
    pub forwarded_share: f64,
    /// Valkey: bytes of memory per (block, pod) entry.
    pub valkey_bytes_per_block: Option<f64>,
    /// Valkey: CPU microseconds per block change written during the load.
    pub valkey_cpu_us_per_block: Option<f64>,
    /// Valkey: emulated pods that registered again during the point (a lease
    /// lapsed because the emulator fell behind; 0 when the point is clean).
    pub reregistrations: Option<u64>,
    /// The emulator's own CPU during the load, ms per s (past ~900 on its one
    /// CPU it is the bottleneck, not what is measured).
    pub emulator_cpu_ms_per_s: f64,
}

/// The CPUs the emulated fleet runs on, and those left to what is
/// measured (the sidecar under test and Valkey): on a machine of two or more
/// CPUs the emulator, which stands for hundreds of machines, keeps to the
/// first and leaves the rest alone, as the other machines would.
#[derive(Debug, Clone, Copy)]
pub struct Cpus {
    pub emulator: usize,
    pub measured: Option<usize>,
}

impl Cpus {
    fn split() -> Cpus {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        Cpus {
            emulator: 0,
            measured: (n >= 2).then_some(1),
        }
    }
}

/// Pins every thread of process `pid` (0: this one) to CPU `cpu`; threads
/// it starts later inherit it. Best effort: a failure leaves it unpinned.
pub fn pin(pid: u32, cpu: usize) {
    let dir = if pid == 0 {
        "/proc/self/task".to_owned()
    } else {
        format!("/proc/{pid}/task")
    };
    let Ok(tasks) = std::fs::read_dir(dir) else {
        return;
    };
    for t in tasks.flatten() {
        let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes
        // within it; sched_setaffinity reads size_of::<cpu_set_t>() bytes.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
}

/// Runs every point and the saturation measurements.
pub async fn run(opts: &ScaleOpts) -> Result<ScaleReport> {
    std::fs::create_dir_all(&opts.work_dir)?;
    let cpus = Cpus::split();
    if cpus.measured.is_some() {
        pin(0, cpus.emulator);
    }
    let binary = sut::proxy_binary(opts.proxy.as_deref())?;
    let mut report = ScaleReport::new(opts);
    report.load_average.push(load_average());
    for round in 0..opts.rounds {
        for &n in &opts.pods {
            // Rounds alternate which mode goes first, so neither always
            // runs on a machine the other just warmed.
            let mut modes = vec!["valkey"];
            if n <= opts.mesh_max {
                modes.push("mesh");
            }
            if round % 2 == 1 {
                modes.reverse();
            }
            for mode in modes {
                eprintln!(
                    "scale: round {} of {}, {mode}, {n} pods",
                    round + 1,
                    opts.rounds
                );
                let s = match mode {
                    "mesh" => mesh_point(opts, &binary, n, round, cpus).await,
                    _ => valkey_point(opts, &binary, n, round, cpus).await,
                }
                .with_context(|| format!("{mode} at {n} pods"))?;
                eprintln!(
                    "scale:   idle {:.1} ms/s, load {:.1} ms/s, rss {:.1} MB, decision p99 {:?} ms, freshness p99 {:?} ms, failed {}",
                    s.idle_cpu_ms_per_s, s.load_cpu_ms_per_s, s.rss_mb, s.decision_p99_ms, s.freshness_p99_ms, s.failed
                );
                report.add(mode, n, s);
            }
        }
    }
    report.hash_tags = tags::measure()?;
    eprintln!("scale: valkey saturation");
    report.saturation = Some(ingest::saturate(opts, cpus).await?);
    report.load_average.push(load_average());
    report.finish();
    Ok(report)
}

fn valkey_config(urls: Vec<String>) -> ValkeyConfig {
    ValkeyConfig {
        urls,
        ..ValkeyConfig::default()
    }
}

async fn valkey_point(
    opts: &ScaleOpts,
    binary: &std::path::Path,
    n: usize,
    round: usize,
    cpus: Cpus,
) -> Result<Sample> {
    let server = ValkeyServer::start().await?;
    if let Some(c) = cpus.measured {
        pin(server.pid(), c);
    }
    let cfg = valkey_config(vec![server.url()]);
    // Memory per block: the seeding alone, every connection already open.
    let mut fleet = ValkeyFleet::connect(n, &cfg, true).await?;
    let before = server.info_memory_used().await?;
    fleet.seed(&opts.blocks).await?;
    let used = server.info_memory_used().await?;
    let engine = FastEngine::bind("127.0.0.1:0", FastEngineConfig::default()).await?;
    let name = format!("valkey-{n}-r{round}");
    let sut = Sut::start(
        binary,
        &opts.work_dir,
        &name,
        &engine.url(),
        &Backend::Valkey {
            urls: cfg.urls.clone(),
        },
        cpus.measured,
    )
    .await?;
    wait_for(
        Duration::from_secs(30),
        "the sidecar under test registered in valkey",
        || async {
            let v = sut.admin_json("/debug/index", None).await.ok()?;
            v["writer"]["registered"].as_bool().filter(|r| *r)
        },
    )
    .await?;
    let lookup = Lookup::new(fleet.store.clone());
    let valkey_cpu = || server.cpu_seconds().unwrap_or(0.0);
    let written = |f: &ValkeyFleet| f.metrics.blocks_written() as f64;
    let registered = fleet.metrics.registrations_total();
    let mut s = idle_phase(opts, &sut).await?;
    let (cpu0, w0) = (valkey_cpu(), written(&fleet));
    let load = load_phase(
        opts,
        &sut,
        n,
        Probe::Valkey {
            fleet: &mut fleet,
            lookup: &lookup,
            metrics: &kvmesh_proxy::valkey::metrics::IndexMetrics::default(),
        },
    )
    .await?;
    let (cpu1, w1) = (valkey_cpu(), written(&fleet));
    s.merge_load(load);
    let entries = (n * opts.blocks.per_pod) as f64;
    s.valkey_bytes_per_block = Some(used.saturating_sub(before) as f64 / entries.max(1.0));
    if w1 > w0 {
        s.valkey_cpu_us_per_block = Some((cpu1 - cpu0) * 1e6 / (w1 - w0));
    }
    s.reregistrations = Some(fleet.metrics.registrations_total() - registered);
    sut.stop().await;
    engine.shutdown().await;
    fleet.stop().await;
    drop(server);
    Ok(s)
}

async fn mesh_point(
    opts: &ScaleOpts,
    binary: &std::path::Path,
    n: usize,
    round: usize,
    cpus: Cpus,
) -> Result<Sample> {
    let mut fleet = MeshFleet::start(n, &opts.blocks).await?;
    let peers = opts.work_dir.join(format!("peers-{n}.txt"));
    let text: String = fleet
        .mesh_addrs()
        .iter()
        .map(|a| format!("{a}\n"))
        .collect();
    std::fs::write(&peers, text)?;
    let engine = FastEngine::bind("127.0.0.1:0", FastEngineConfig::default()).await?;
    let name = format!("mesh-{n}-r{round}");
    let sut = Sut::start(
        binary,
        &opts.work_dir,
        &name,
        &engine.url(),
        &Backend::Mesh { peers_file: peers },
        cpus.measured,
    )
    .await?;
    let want = n as f64;
    wait_for(
        Duration::from_secs(120),
        "the sidecar under test in sync with every peer",
        || async {
            let m = sut.metrics().await.ok()?;
            let fresh = sut::series(&m, "kvmesh_mesh_peers{state=\"fresh\"}")?;
            (fresh >= want).then_some(())
        },
    )
    .await?;
    let mut s = idle_phase(opts, &sut).await?;
    let load = load_phase(opts, &sut, n, Probe::Mesh { fleet: &mut fleet }).await?;
    s.merge_load(load);
    sut.stop().await;
    engine.shutdown().await;
    fleet.stop().await;
    Ok(s)
}

/// Waits (bounded) for `probe` to say yes.
async fn wait_for<F, Fut, T>(deadline: Duration, what: &str, mut probe: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let end = Instant::now() + deadline;
    loop {
        if let Some(v) = probe().await {
            return Ok(v);
        }
        anyhow::ensure!(Instant::now() < end, "{what}: not within {deadline:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Two seconds to settle, then CPU over the idle window and RSS after it.
async fn idle_phase(opts: &ScaleOpts, sut: &Sut) -> Result<Sample> {
    tokio::time::sleep(Duration::from_secs(2)).await;
    let c0 = sut.cpu_seconds()?;
    tokio::time::sleep(opts.idle).await;
    let c1 = sut.cpu_seconds()?;
    Ok(Sample {
        idle_cpu_ms_per_s: (c1 - c0) * 1e3 / opts.idle.as_secs_f64(),
        rss_mb: sut.rss_mb()?,
        ..Sample::default()
    })
}

/// What the load phase's freshness probes read.
enum Probe<'a> {
    Valkey {
        fleet: &'a mut ValkeyFleet,
        lookup: &'a Lookup,
        metrics: &'a kvmesh_proxy::valkey::metrics::IndexMetrics,
    },
    Mesh {
        fleet: &'a mut MeshFleet,
    },
}

/// The load phase's own figures.
struct Load {
    cpu_ms_per_s: f64,
    emulator_cpu_ms_per_s: f64,
    decision: (Option<f64>, Option<f64>),
    freshness: Vec<f64>,
    requests: usize,
    failed: usize,
    forwarded_share: f64,
}

impl Sample {
    fn merge_load(&mut self, l: Load) {
        self.load_cpu_ms_per_s = l.cpu_ms_per_s;
        self.emulator_cpu_ms_per_s = l.emulator_cpu_ms_per_s;
        (self.decision_p50_ms, self.decision_p99_ms) = l.decision;
        self.freshness_p50_ms = report::percentile(&l.freshness, 0.5);
        self.freshness_p99_ms = report::percentile(&l.freshness, 0.99);
        self.requests = l.requests;
        self.failed = l.failed;
        self.forwarded_share = l.forwarded_share;
    }
}

/// Longest a freshness probe waits; a probe past it counts as this long.
const FRESHNESS_CAP: Duration = Duration::from_secs(2);
/// Freshness probes per second.
const PROBES_PER_S: f64 = 10.0;

/// The load: churn on every pod, requests to the sidecar under test, and
/// freshness probes, all for `opts.load`.
async fn load_phase(opts: &ScaleOpts, sut: &Sut, n: usize, mut probe: Probe<'_>) -> Result<Load> {
    const DECISION: &str = "kvmesh_routing_decision_latency_seconds";
    let m0 = sut.metrics().await?;
    let c0 = sut.cpu_seconds()?;
    let e0 = cpu_of(std::process::id()).unwrap_or(0.0);
    let sender = tokio::spawn(send_requests(
        sut.addr,
        opts.rate,
        opts.load,
        opts.blocks.groups,
    ));
    let started = Instant::now();
    let churn_every =
        Duration::from_secs_f64(1.0 / (opts.blocks.churn_per_pod * n as f64).max(1e-9));
    let mut next_churn = started;
    let mut next_probe = started;
    let mut pod = 0usize;
    let mut salt = 0u64;
    let mut freshness = Vec::new();
    // The probes wait beside the churn, never in its way: a fleet's block
    // changes do not pause while somebody watches for one of them (a churn
    // that paused for each probe caught up in bursts of hundreds of writes,
    // which the lookups then queued behind).
    let mut watches = FuturesUnordered::new();
    while started.elapsed() < opts.load {
        let now = Instant::now();
        // Churn the pods in turn, catching up in bursts if behind.
        let mut burst = 0;
        while next_churn <= now && burst < 2000 {
            match &mut probe {
                Probe::Valkey { fleet, .. } => fleet.churn(pod % n).await,
                Probe::Mesh { fleet } => fleet.churn(pod % n),
            }
            pod += 1;
            burst += 1;
            next_churn += churn_every;
        }
        if next_probe <= now {
            next_probe += Duration::from_secs_f64(1.0 / PROBES_PER_S);
            salt += 1;
            let k = (salt as usize * 7919) % n;
            watches.push(plant(&mut probe, sut, k, salt).await);
        }
        let tick = tokio::time::sleep(Duration::from_millis(2));
        tokio::pin!(tick);
        loop {
            tokio::select! {
                _ = &mut tick => break,
                Some(ms) = watches.next(), if !watches.is_empty() => freshness.push(ms),
            }
        }
    }
    while let Some(ms) = watches.next().await {
        freshness.push(ms);
    }
    let (requests, failed) = sender.await.context("request sender")?;
    let c1 = sut.cpu_seconds()?;
    let e1 = cpu_of(std::process::id()).unwrap_or(0.0);
    let m1 = sut.metrics().await?;
    let (b0, b1) = (sut::buckets(&m0, DECISION), sut::buckets(&m1, DECISION));
    let to_ms = |v: Option<f64>| v.map(|s| s * 1e3);
    let fwd =
        |m: &str| sut::series(m, "kvmesh_mesh_requests_total{served=\"forwarded\"}").unwrap_or(0.0);
    let secs = started.elapsed().as_secs_f64();
    Ok(Load {
        cpu_ms_per_s: (c1 - c0) * 1e3 / secs,
        emulator_cpu_ms_per_s: (e1 - e0) * 1e3 / secs,
        decision: (
            to_ms(sut::quantile(&b0, &b1, 0.5)),
            to_ms(sut::quantile(&b0, &b1, 0.99)),
        ),
        freshness,
        requests,
        failed,
        forwarded_share: (fwd(&m1) - fwd(&m0)) / requests.max(1) as f64,
    })
}

/// Stores a fresh block on pod `k`; the future returned waits until a
/// router sees it there (on Valkey, a lookup; on the mesh, the sidecar under
/// test's index, its `/debug/route` view of the block) and gives the
/// milliseconds since it was stored, at most [`FRESHNESS_CAP`].
async fn plant<'a>(
    probe: &mut Probe<'a>,
    sut: &'a Sut,
    k: usize,
    salt: u64,
) -> Pin<Box<dyn Future<Output = f64> + 'a>> {
    let started = Instant::now();
    let seen: Pin<Box<dyn Future<Output = ()> + 'a>> = match probe {
        Probe::Valkey {
            fleet,
            lookup,
            metrics,
        } => {
            let key = fleet.probe(k, salt).await;
            let id = fleet.id(k).to_owned();
            let (lookup, metrics) = (*lookup, *metrics);
            Box::pin(async move {
                loop {
                    if let Ok(found) = lookup.find(metrics, MODEL, &[key]).await {
                        if found
                            .candidates
                            .iter()
                            .any(|c| c.depth >= 1 && c.record.id == id)
                        {
                            return;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
        }
        Probe::Mesh { fleet } => {
            let tokens = fleet.probe(k, salt);
            let id = fleet.id(k);
            let body =
                serde_json::json!({"model": MODEL, "prompt": tokens, "max_tokens": 1}).to_string();
            Box::pin(async move {
                loop {
                    if let Ok(v) = sut.admin_json("/debug/route", Some(body.clone())).await {
                        let held = v["endpoints"].as_array().is_some_and(|eps| {
                            eps.iter().any(|e| {
                                e["id"] == id.as_str()
                                    && e["prefix"]["matched_blocks"].as_u64().unwrap_or(0) >= 1
                            })
                        });
                        if held {
                            return;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
        }
    };
    Box::pin(async move {
        match tokio::time::timeout(FRESHNESS_CAP, seen).await {
            Ok(()) => started.elapsed().as_secs_f64() * 1e3,
            Err(_) => FRESHNESS_CAP.as_secs_f64() * 1e3,
        }
    })
}

/// An open loop of `rate` requests a second for `dur`: shared-prefix prompts
/// of `groups` groups. Returns (sent, not 200).
async fn send_requests(
    addr: std::net::SocketAddr,
    rate: f64,
    dur: Duration,
    groups: usize,
) -> (usize, usize) {
    let client = Arc::new(Client::new(ClientConfig {
        request_timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    }));
    let Ok(uri) = format!("http://{addr}/v1/completions").parse::<http::Uri>() else {
        return (0, 0);
    };
    let mut tasks = tokio::task::JoinSet::new();
    let started = Instant::now();
    let every = Duration::from_secs_f64(1.0 / rate.max(0.1));
    let mut i = 0usize;
    while started.elapsed() < dur {
        let body = serde_json::json!({
            "model": MODEL,
            "prompt": emulate::prompt((i * 7) % groups, i),
            "max_tokens": 4,
        })
        .to_string();
        let (client, uri) = (client.clone(), uri.clone());
        tasks.spawn(
            async move { client.send(uri, Bytes::from(body), false).await.status == Some(200) },
        );
        i += 1;
        tokio::time::sleep_until((started + every * i as u32).into()).await;
    }
    let mut failed = 0;
    while let Some(ok) = tasks.join_next().await {
        if !matches!(ok, Ok(true)) {
            failed += 1;
        }
    }
    (i, failed)
}

/// The 1, 5 and 15 minute load averages.
pub fn load_average() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut it = text
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(f64::NAN));
    [
        it.next().unwrap_or(f64::NAN),
        it.next().unwrap_or(f64::NAN),
        it.next().unwrap_or(f64::NAN),
    ]
}
