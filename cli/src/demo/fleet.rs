//! A local fleet for the demo and the policy-comparison harness: N simulated
//! engines (`kvmesh-engine-sim`, time-scaled, KV events on loopback), each
//! with a kvmesh sidecar started in-process on port-0 listeners, every
//! sidecar running the same [`Policy`].
//!
//! The sidecars find each other through the mesh (each follows the others'
//! mesh ports, listed in a peers file the fleet writes), which carries load,
//! in-flight counts and KV events between them. If the mesh does not connect
//! within a deadline, the fleet introduces them itself: it registers every
//! sidecar as a peer in every other sidecar's [`Fleet`], and a small owned
//! task copies each sidecar's local engine load and in-flight counts to the
//! others ([`Discovery::Direct`]; no KV events cross pods then). Everything
//! started here
//! stops in [`DemoFleet::shutdown`].

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use kvmesh_engine_sim::{Engine, Flavor, KvEventsConfig, LatencyProfile, SimConfig, SimHandle};
use kvmesh_filters::sched::{FilterConfig, Role};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::policy::{Policy, PrefixSource};
use super::DemoError;
use kvmesh_proxy::config::{self, Config, EngineUrl};
use kvmesh_proxy::fleet::{Fleet, PodInfo};
use kvmesh_proxy::{Sidecar, SidecarHandle};

/// How often the fleet copies loads between sidecars (wall time). The
/// sidecars scrape their engines at the same pace.
const SYNC_INTERVAL: Duration = Duration::from_millis(20);

/// Longest wait for the mesh to connect every sidecar to every other one.
const MESH_DEADLINE: Duration = Duration::from_secs(5);

/// Longest wait for a sidecar to report its engine ready.
const READY_DEADLINE: Duration = Duration::from_secs(10);

/// The shape of a fleet: how many engines, how fast, how big their caches.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    /// Engines (and sidecars).
    pub engines: usize,
    /// The model every engine serves and every request names.
    pub model: String,
    /// Simulated seconds per wall second.
    pub time_scale: f64,
    pub profile: LatencyProfile,
    /// The decode pods' profile when their GPUs differ from the others'
    /// (heterogeneous pools); `None`: `profile`.
    pub decode_profile: Option<Box<LatencyProfile>>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks per engine: small enough that placement decides what stays cached.
    pub num_blocks: usize,
    pub max_num_seqs: usize,
    /// Publish KV events (bound on `127.0.0.1`, port from the OS).
    pub kv_events: bool,
    /// Prefill pods of a disaggregated fleet (the first ones); `None` is half.
    pub prefill_pods: Option<usize>,
    /// The engines' family. SGLang engines split P/D through SGLang's
    /// bootstrap protocol (the sidecars' `sglang` connector), vLLM ones
    /// through `kv_transfer_params` (`nixl`).
    pub flavor: Flavor,
    /// The sidecars' index: `None` the mesh, else the Valkey at these URLs
    /// (`index.backend: valkey`).
    pub valkey: Option<Vec<String>>,
}

impl FleetSpec {
    /// `engines` engines with the `large-gpu` profile (a 70B model: prefill
    /// at 0.3 ms per token, so a cache miss on a long prompt shows in TTFT),
    /// 10× faster than real time, 256 blocks of 16 tokens each.
    pub fn demo(engines: usize) -> FleetSpec {
        FleetSpec {
            engines,
            model: "demo-model".to_owned(),
            time_scale: 10.0,
            profile: LatencyProfile::large_gpu(),
            decode_profile: None,
            block_size: 16,
            num_blocks: 256,
            max_num_seqs: 64,
            kv_events: true,
            prefill_pods: None,
            flavor: Flavor::Vllm,
            valkey: None,
        }
    }

    /// The role of engine `i` under `policy`: P/D splits the fleet, the
    /// first `prefill_pods` (default half) prefill, the rest decode.
    pub fn role(&self, policy: Policy, i: usize) -> Role {
        if !policy.disaggregated() {
            Role::Both
        } else if i < self.prefill_pods.unwrap_or(self.engines / 2) {
            Role::Prefill
        } else {
            Role::Decode
        }
    }

    /// The engine configuration of a pod in `role`.
    pub fn sim_config(&self, role: Role) -> SimConfig {
        let capacity = self.block_size * self.num_blocks;
        let profile = match (role, &self.decode_profile) {
            (Role::Decode, Some(p)) => &**p,
            _ => &self.profile,
        };
        let mut c = SimConfig::new(self.model.clone())
            .with_time_scale(self.time_scale)
            .with_profile(profile.clone())
            .with_block_size(self.block_size)
            .with_num_blocks(self.num_blocks)
            .with_max_num_seqs(self.max_num_seqs)
            .with_max_model_len(capacity.min(8192))
            .with_flavor(self.flavor)
            .with_role(match role {
                Role::Both => kvmesh_engine_sim::Role::Both,
                Role::Prefill => kvmesh_engine_sim::Role::Prefill,
                Role::Decode => kvmesh_engine_sim::Role::Decode,
            });
        if self.kv_events {
            // The engine binds both sockets on loopback ports from the OS;
            // the sidecar connects (vLLM's rule for a bound endpoint).
            let mut kv = KvEventsConfig::new("tcp://127.0.0.1:0");
            kv.bind = Some(true);
            kv.replay_endpoint = Some("tcp://127.0.0.1:0".to_owned());
            kv.topic = format!("kv@demo@{}", self.model);
            c = c.with_kv_events(kv);
        }
        c
    }
}

/// One pod: a simulated engine and its sidecar.
#[derive(Debug)]
pub struct DemoPod {
    pub engine: SimHandle,
    pub sidecar: SidecarHandle,
    pub role: Role,
}

impl DemoPod {
    /// The pod's identity (its sidecar's client address).
    pub fn id(&self) -> &str {
        self.sidecar.fleet().local_id()
    }

    /// The sidecar's base URL, where clients send requests.
    pub fn url(&self) -> String {
        format!("http://{}", self.sidecar.addr())
    }
}

/// A running fleet; call [`DemoFleet::shutdown`] to stop it.
#[derive(Debug)]
pub struct DemoFleet {
    pub pods: Vec<DemoPod>,
    pub policy: Policy,
    pub spec: FleetSpec,
    sync: Option<(CancellationToken, JoinHandle<()>)>,
    /// The mesh's peers file (every sidecar's mesh address), removed on shutdown.
    peers_file: Option<PathBuf>,
    /// How the sidecars found each other.
    pub discovery: Discovery,
    /// The Valkey server the sidecars' index lives in, when the caller
    /// started one for the fleet (stopped with it).
    pub valkey_server: Option<Box<kvmesh_loadgen::valkey::ValkeyServer>>,
}

/// How the sidecars of a fleet learned about each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Discovery {
    /// The mesh: each sidecar follows the others' mesh ports (from a peers
    /// file) and receives their load, in-flight counts and KV events.
    Mesh,
    /// The harness registered peers in each fleet and copies loads itself
    /// (the mesh did not connect in time).
    Direct,
    /// Valkey: each sidecar registered its pod there and finds the others
    /// in its lookups (`index.backend: valkey`).
    Valkey,
}

/// Starts `spec.engines` engines and sidecars running `policy`, introduces
/// the sidecars to each other and returns once every sidecar is ready and
/// knows every peer's load.
pub async fn start(spec: &FleetSpec, policy: Policy) -> Result<DemoFleet, DemoError> {
    let filters = policy
        .filter_config()
        .map_err(|e| DemoError::Config(e.to_string()))?;
    start_with(spec, policy, &filters).await
}

/// [`start`] with the sidecars running `filters` instead of the policy's own
/// filter config (the policy still says where prefix matches come from and
/// whether the fleet is split).
pub async fn start_with(
    spec: &FleetSpec,
    policy: Policy,
    filters: &FilterConfig,
) -> Result<DemoFleet, DemoError> {
    if spec.engines == 0 || spec.engines > 64 {
        return Err(DemoError::Config(format!(
            "engines must be in 1..=64, not {}",
            spec.engines
        )));
    }
    let prefill = spec.prefill_pods.unwrap_or(spec.engines / 2);
    if policy.disaggregated() && (prefill == 0 || prefill >= spec.engines) {
        return Err(DemoError::Config(format!(
            "P/D needs at least one prefill and one decode pod, not {prefill} of {}",
            spec.engines
        )));
    }
    let mut fleet = DemoFleet {
        pods: Vec::with_capacity(spec.engines),
        policy,
        spec: spec.clone(),
        sync: None,
        peers_file: Some(peers_file_path()),
        discovery: Discovery::Mesh,
        valkey_server: None,
    };
    // On any failure, stop what already runs before returning the error.
    let started = async {
        let peers_file = fleet.peers_file.clone().unwrap_or_default();
        std::fs::write(&peers_file, b"").map_err(DemoError::Io)?;
        let mut addrs = pod_addrs(spec, policy)?;
        for i in 0..spec.engines {
            let role = spec.role(policy, i);
            let (ip, listener) = addrs.remove(0);
            let engine = Engine::start(spec.sim_config(role), listener).await?;
            let pod = PodNet {
                ip,
                bootstrap_port: engine.addr().port(),
            };
            let sidecar =
                start_sidecar(spec, policy, &engine, role, pod, &peers_file, &|_| {}).await?;
            sidecar
                .routing()
                .install(filters)
                .map_err(|e| DemoError::Config(e.to_string()))?;
            fleet.pods.push(DemoPod {
                engine,
                sidecar,
                role,
            });
        }
        for pod in &fleet.pods {
            wait_ready(pod.sidecar.admin_addr()).await?;
        }
        // The mesh's peers file: every sidecar follows every other one.
        let addrs: String = fleet
            .pods
            .iter()
            .filter_map(|p| p.sidecar.mesh_addr())
            .map(|a| format!("{a}\n"))
            .collect();
        std::fs::write(&peers_file, addrs).map_err(DemoError::Io)?;
        if spec.valkey.is_some() {
            fleet.discovery = Discovery::Valkey;
            return wait_valkey(&fleet.pods).await;
        }
        if !wait_mesh(&fleet.pods).await {
            introduce(&fleet.pods)?;
            fleet.discovery = Discovery::Direct;
        }
        Ok::<(), DemoError>(())
    }
    .await;
    if let Err(e) = started {
        fleet.shutdown().await;
        return Err(e);
    }
    if fleet.discovery != Discovery::Direct {
        return Ok(fleet);
    }
    let fleets: Vec<Arc<Fleet>> = fleet
        .pods
        .iter()
        .map(|p| p.sidecar.fleet().clone())
        .collect();
    sync_once(&fleets);
    let cancel = CancellationToken::new();
    let task = tokio::spawn(sync_loop(fleets, cancel.clone()));
    fleet.sync = Some((cancel, task));
    Ok(fleet)
}

/// The sidecar's config: the engine beside it, the pod's role and model,
/// where prefix matches come from under `policy`, scrapes fast enough for a
/// time-scaled engine, a short drain.
pub fn sidecar_config(
    spec: &FleetSpec,
    policy: Policy,
    engine: &SimHandle,
    role: Role,
) -> Result<Config, DemoError> {
    let mut c = Config::default();
    match (policy.prefix_source(), engine.kv_endpoints()) {
        (PrefixSource::KvEvents, Some(kv)) => {
            c.engine.kv_events = Some(config::KvEvents {
                endpoint: kv.events.clone(),
                replay_endpoint: kv.replay.clone(),
                socket: config::SocketMode::Connect,
                ..config::KvEvents::default()
            });
            // The simulator tokenizes with the builtin tokenizer: the
            // sidecar's block keys then match the engine's blocks exactly.
            c.prefix.tokenizer = config::TokenizerChoice::Builtin;
        }
        _ => c.prefix.tokenizer = config::TokenizerChoice::None,
    }
    c.engine.url = EngineUrl::parse(&engine.base_url()).map_err(DemoError::Config)?;
    c.engine.metrics_interval = config::Duration::from_millis(20);
    c.engine.health_interval = config::Duration::from_millis(100);
    c.pod.role = role;
    c.pod.models = vec![spec.model.clone()];
    c.timeouts.shutdown_drain = config::Duration::from_secs(2);
    Ok(c)
}

/// Where a pod listens: its address, and the port SGLang engines serve
/// bootstrap on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PodNet {
    pub ip: IpAddr,
    pub bootstrap_port: u16,
}

/// Each pod's address and its engine's bound listener. SGLang P/D needs every
/// prefill engine on one bootstrap port (the sidecars' one
/// `pd.sglang_bootstrap_port`, as every pod of a Kubernetes fleet serves
/// 8998), so a split SGLang fleet gives each pod its own loopback address
/// (127.0.0.2, 127.0.0.3, ...) and binds every engine on one port there;
/// every other fleet runs on 127.0.0.1 with ports from the OS.
fn pod_addrs(spec: &FleetSpec, policy: Policy) -> Result<Vec<(IpAddr, TcpListener)>, DemoError> {
    let std_bind = |addr: SocketAddr| {
        std::net::TcpListener::bind(addr).and_then(|l| {
            l.set_nonblocking(true)?;
            TcpListener::from_std(l)
        })
    };
    if !(spec.flavor == Flavor::Sglang && policy.disaggregated()) {
        let local = IpAddr::V4(Ipv4Addr::LOCALHOST);
        return (0..spec.engines)
            .map(|_| {
                Ok((
                    local,
                    std_bind(SocketAddr::new(local, 0)).map_err(DemoError::Io)?,
                ))
            })
            .collect();
    }
    let ips: Vec<IpAddr> = (0..spec.engines)
        .map(|i| IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2 + i as u8)))
        .collect();
    let mut last = None;
    // A port free on the first address may be taken on another: try a few.
    for _ in 0..16 {
        let first = std_bind(SocketAddr::new(ips[0], 0)).map_err(DemoError::Io)?;
        let port = first.local_addr().map_err(DemoError::Io)?.port();
        let mut bound = vec![(ips[0], first)];
        for &ip in &ips[1..] {
            match std_bind(SocketAddr::new(ip, port)) {
                Ok(l) => bound.push((ip, l)),
                Err(e) => {
                    last = Some(e);
                    break;
                }
            }
        }
        if bound.len() == ips.len() {
            return Ok(bound);
        }
    }
    Err(DemoError::Io(last.unwrap_or_else(|| {
        std::io::Error::other("no port free on every pod address")
    })))
}

/// Starts the sidecar of `engine`, its config as [`sidecar_config`] makes
/// it for a fleet meshed through `peers_file`, then changed by `edit`.
pub(crate) async fn start_sidecar(
    spec: &FleetSpec,
    policy: Policy,
    engine: &SimHandle,
    role: Role,
    pod: PodNet,
    peers_file: &Path,
    edit: &(dyn Fn(&mut Config) + Sync),
) -> Result<SidecarHandle, DemoError> {
    let mut c = sidecar_config(spec, policy, engine, role)?;
    if spec.flavor == Flavor::Sglang {
        // The decode engine reaches the prefill pod's address on this port.
        c.pd.connector = config::PdConnector::Sglang;
        c.pd.sglang_bootstrap_port = pod.bootstrap_port;
    }
    match &spec.valkey {
        Some(urls) => {
            c.index.backend = config::index::Backend::Valkey;
            let v = &mut c.index.valkey;
            v.urls = urls.clone();
            // Records (load, in-flight) as fresh as the mesh's load here.
            v.lease_interval = config::Duration::from_millis(20);
            v.lease_ttl = config::Duration::from_millis(1000);
        }
        None => {
            c.mesh.listen = Some(SocketAddr::new(pod.ip, 0));
            c.mesh.file = Some(peers_file.to_path_buf());
            c.mesh.refresh_interval = config::Duration::from_millis(50);
            c.mesh.load_interval = config::Duration::from_millis(20);
        }
    }
    let client = TcpListener::bind(SocketAddr::new(pod.ip, 0))
        .await
        .map_err(DemoError::Io)?;
    let admin = TcpListener::bind(SocketAddr::new(pod.ip, 0))
        .await
        .map_err(DemoError::Io)?;
    c.listeners.client = client.local_addr().map_err(DemoError::Io)?;
    c.listeners.admin = admin.local_addr().map_err(DemoError::Io)?;
    edit(&mut c);
    Sidecar::start(c, client, admin)
        .await
        .map_err(|e| DemoError::Sidecar(e.to_string()))
}

/// A fresh peers-file path in the temp directory.
pub(crate) fn peers_file_path() -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "kvmesh-demo-{}-{}.peers",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Waits (bounded) until every sidecar's fleet holds every other pod with a
/// fresh load, as the mesh reports them; false if it did not happen in time.
async fn wait_mesh(pods: &[DemoPod]) -> bool {
    let deadline = Instant::now() + MESH_DEADLINE;
    while Instant::now() < deadline {
        let now = Instant::now();
        let joined = pods.iter().all(|p| {
            let snap = p.sidecar.fleet().snapshot(now);
            snap.len() == pods.len()
                && snap
                    .iter()
                    .all(|s| s.load_age_ms.is_some_and(|ms| ms < 1000))
        });
        if joined {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// Waits (bounded) until every sidecar has registered its pod in Valkey.
async fn wait_valkey(pods: &[DemoPod]) -> Result<(), DemoError> {
    let deadline = Instant::now() + MESH_DEADLINE;
    while Instant::now() < deadline {
        let registered = pods.iter().all(|p| {
            p.sidecar
                .index()
                .is_some_and(|v| v.status().writer.registered)
        });
        if registered {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(DemoError::Sidecar(
        "the sidecars did not register in valkey in time".to_owned(),
    ))
}

/// Registers every sidecar as a peer of every other one (what `--peers` and
/// the mesh's membership will do).
fn introduce(pods: &[DemoPod]) -> Result<(), DemoError> {
    for a in pods {
        for b in pods {
            if a.id() == b.id() {
                continue;
            }
            let info = PodInfo {
                id: b.id().to_owned(),
                sidecar_addr: Some(b.sidecar.addr()),
                role: b.role,
                models: vec![b.engine.config().model.clone()],
                lora_adapters: Vec::new(),
                labels: Default::default(),
            };
            a.sidecar
                .fleet()
                .upsert_peer(info)
                .map_err(|e| DemoError::Sidecar(e.to_string()))?;
        }
    }
    Ok(())
}

/// Copies each sidecar's local load, in-flight counts and prompt tokens to
/// prefill into every other sidecar's fleet.
fn sync_once(fleets: &[Arc<Fleet>]) {
    let now = Instant::now();
    for src in fleets {
        let id = src.local_id();
        let Some(local) = src.snapshot(now).into_iter().find(|p| p.info.id == id) else {
            continue;
        };
        let in_flight = src.local_in_flight();
        let prefill = src.published_prefill();
        for dst in fleets {
            if dst.local_id() == id {
                continue;
            }
            // The copy is as fresh as the source's scrape.
            let at = local
                .load_age_ms
                .and_then(|ms| now.checked_sub(Duration::from_millis(ms)))
                .unwrap_or(now);
            dst.set_load(id, local.load, at);
            dst.set_healthy(id, local.healthy);
            dst.set_remote_in_flight(id, in_flight.clone());
            dst.set_remote_prefill(id, prefill.clone());
        }
    }
}

async fn sync_loop(fleets: Vec<Arc<Fleet>>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(SYNC_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => sync_once(&fleets),
        }
    }
}

/// Polls the sidecar's `/ready` until its engine answers, within a deadline.
pub(crate) async fn wait_ready(admin: SocketAddr) -> Result<(), DemoError> {
    let client: HyperClient<_, Empty<Bytes>> =
        HyperClient::builder(TokioExecutor::new()).build_http();
    let uri: http::Uri = format!("http://{admin}/ready")
        .parse()
        .map_err(|e| DemoError::Config(format!("admin address {admin}: {e}")))?;
    let deadline = Instant::now() + READY_DEADLINE;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(DemoError::NotReady(admin.to_string()));
        }
        let attempt = tokio::time::timeout(left, client.get(uri.clone())).await;
        if matches!(attempt, Ok(Ok(ref r)) if r.status().is_success()) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20).min(left)).await;
    }
}

impl DemoFleet {
    /// The sidecars' base URLs, in pod order: clients spread over all of them.
    pub fn urls(&self) -> Vec<String> {
        self.pods.iter().map(DemoPod::url).collect()
    }

    /// The engines' prefix-cache counters summed over the fleet:
    /// `(queries, hits)` in tokens, as the engines count them.
    pub fn engine_prefix_counters(&self) -> (u64, u64) {
        self.pods.iter().fold((0, 0), |(q, h), p| {
            let s = p.engine.stats();
            (q + s.prefix_queries, h + s.prefix_hits)
        })
    }

    /// Requests the prefill pods received (zero means P/D never engaged).
    pub fn prefill_requests(&self) -> usize {
        self.pods
            .iter()
            .filter(|p| p.role == Role::Prefill)
            .map(|p| p.engine.received_requests().len())
            .sum()
    }

    /// Stops the load copier, every sidecar (draining), then every engine.
    pub async fn shutdown(mut self) {
        if let Some((cancel, task)) = self.sync.take() {
            cancel.cancel();
            // A panic in the copier is already logged by tokio; nothing to add.
            let _ = task.await;
        }
        let mut engines = Vec::with_capacity(self.pods.len());
        for pod in self.pods.drain(..) {
            pod.sidecar.shutdown().await;
            engines.push(pod.engine);
        }
        for engine in engines {
            engine.shutdown().await;
        }
        if let Some(path) = self.peers_file.take() {
            // Best effort: a leftover file in the temp directory harms nothing.
            let _ = std::fs::remove_file(path);
        }
    }
}
