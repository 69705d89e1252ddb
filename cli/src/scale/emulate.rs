//! The emulated fleets `kvmesh bench scale` puts a real sidecar in front of.
//!
//! * [`ValkeyFleet`]: N pods, each one the Valkey writer a sidecar runs
//!   ([`kvmesh_proxy::valkey::Writer`]) on a connection of its own, as each
//!   sidecar has, over its pod's entry of one shared prefix index, fed KV events the way a sidecar's KV-event feed feeds it
//!   (`PrefixIndex::apply_touching`, then the writer), renewing its lease on
//!   the sidecar's schedule; and a fast fake engine on the pod's own loopback
//!   address, which serves what the sidecar under test forwards there.
//! * [`MeshFleet`]: N real sidecars in this process with the mesh on and no
//!   peers of their own, fed KV events through `PrefixState::ingest_local`
//!   (the KV-event feed's path), publishing their state streams to the
//!   sidecar under test, which follows them all.
//!
//! Both hold the same blocks per pod: the prefixes of a few prompt groups
//! (which the requests under test share) and filler chains up to a fixed
//! number of blocks, churned at a fixed rate per pod.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use kvmesh_filters::prefix::index::{PodId, PrefixIndex, Touched};
use kvmesh_filters::prefix::kvevents::{BlockRemoved, BlockStored, EventBatch, KvEvent};
use kvmesh_filters::prefix::tokenize::{Builtin, Tokenizer};
use kvmesh_filters::sched::view::Role;
use kvmesh_loadgen::fake::{FastEngine, FastEngineConfig};
use kvmesh_proxy::config::index::Valkey as ValkeyConfig;
use kvmesh_proxy::valkey::metrics::IndexMetrics;
use kvmesh_proxy::valkey::{PodRecord, Store, Writer};
use kvmesh_proxy::{Shutdown, SidecarHandle};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

/// The model every pod serves and every request names.
pub const MODEL: &str = "bench-model";
/// Tokens per KV block.
pub const BLOCK: usize = 16;
/// Words of a group's shared prefix (about one token each): 48 blocks.
const PREFIX_WORDS: usize = 48 * BLOCK;

/// The prompt of user `user` in group `group`: the group's prefix, then a
/// question of its own (starting with a newline, so the prefix's tokens are
/// a prefix of the prompt's).
pub fn prompt(group: usize, user: usize) -> String {
    format!("{}\nquestion {user} of group {group}", group_prefix(group))
}

fn group_prefix(group: usize) -> String {
    (0..PREFIX_WORDS)
        .map(|k| format!("g{group}w{k}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The token ids of a group's prefix, as the sidecar under test tokenizes
/// the prompt (the builtin tokenizer, BOS first).
pub fn prefix_tokens(group: usize) -> Result<Vec<u32>> {
    let mut t = Builtin
        .encode(&group_prefix(group), true)
        .context("tokenizing a group prefix")?;
    t.truncate(t.len() / BLOCK * BLOCK);
    Ok(t)
}

/// How the pods' blocks are laid out and churned.
#[derive(Debug, Clone)]
pub struct Blocks {
    /// Prompt groups; pod `k` holds the prefix of groups `k mod groups`
    /// (and so each group is held by about pods / groups pods).
    pub groups: usize,
    /// Blocks each pod holds (its group's prefix and filler).
    pub per_pod: usize,
    /// Filler blocks each pod stores (and as many it removes) per second
    /// while the load runs.
    pub churn_per_pod: f64,
}

/// Generates one pod's events: its group's prefix, filler, churn.
struct PodEvents {
    next_hash: u64,
    /// Engine hashes of live filler blocks, oldest first.
    filler: std::collections::VecDeque<u64>,
    next_token: u32,
}

impl PodEvents {
    fn new(pod: usize) -> Self {
        Self {
            next_hash: (pod as u64) << 32,
            filler: Default::default(),
            next_token: 20_000,
        }
    }

    /// A batch storing a whole group prefix as one chain.
    fn prefix(&mut self, tokens: &[u32]) -> EventBatch {
        let n = tokens.len() / BLOCK;
        let hashes: Vec<u64> = (0..n).map(|_| self.hash()).collect();
        stored(hashes, None, tokens.to_vec())
    }

    /// A batch storing one filler block (a chain of its own).
    fn filler(&mut self) -> EventBatch {
        let h = self.hash();
        self.filler.push_back(h);
        let t0 = self.next_token;
        self.next_token = self.next_token.wrapping_add(BLOCK as u32);
        let tokens: Vec<u32> = (0..BLOCK as u32)
            .map(|i| t0.wrapping_add(i) % 31_000 + 16)
            .collect();
        stored(vec![h], None, tokens)
    }

    /// A batch removing the oldest filler block.
    fn evict(&mut self) -> Option<EventBatch> {
        let h = self.filler.pop_front()?;
        Some(EventBatch {
            events: vec![KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![h],
                ..Default::default()
            })],
            ..Default::default()
        })
    }

    fn hash(&mut self) -> u64 {
        self.next_hash += 1;
        self.next_hash
    }
}

fn stored(hashes: Vec<u64>, parent: Option<u64>, token_ids: Vec<u32>) -> EventBatch {
    EventBatch {
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids,
            block_size: BLOCK as u32,
            ..Default::default()
        })],
        ..Default::default()
    }
}

/// The batches that fill pod `k` to `blocks.per_pod`.
fn seed(k: usize, ev: &mut PodEvents, blocks: &Blocks, prefixes: &[Vec<u32>]) -> Vec<EventBatch> {
    let mut out = Vec::new();
    let mut held = 0;
    let group = k % blocks.groups;
    if let Some(p) = prefixes.get(group) {
        held += p.len() / BLOCK;
        out.push(ev.prefix(p));
    }
    while held < blocks.per_pod {
        out.push(ev.filler());
        held += 1;
    }
    out
}

/// Pod `k`'s loopback address: 127.1.x.y, never the sidecar under test's.
fn pod_ip(k: usize) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(127, 1, (k / 250) as u8, (k % 250 + 1) as u8)
}

/// What one emulated Valkey pod's task takes.
enum ToPod {
    Batch(EventBatch, Vec<Touched>),
    /// Flush everything now and say when done (seeding).
    Drain(tokio::sync::oneshot::Sender<()>),
}

/// See the module docs.
pub struct ValkeyFleet {
    /// A router's connection, for lookups; every pod writes on its own.
    /// (One connection shared by all pods would reach Valkey as one client's
    /// long pipelines, which it runs back to back while a lookup waits: a
    /// queue no fleet of separate sidecars makes.)
    pub store: Arc<Store>,
    pub index: Arc<PrefixIndex>,
    pub metrics: Arc<IndexMetrics>,
    pods: Vec<(PodId, String, PodEvents, mpsc::Sender<ToPod>)>,
    engines: Vec<FastEngine>,
    tasks: JoinSet<()>,
    shutdown: Shutdown,
}

impl ValkeyFleet {
    /// `n` pods writing to the Valkey of `cfg`, seeded with `blocks`;
    /// `engines`: each pod also serves requests forwarded to it (a fake
    /// engine on its own loopback address), else its address is never bound.
    pub async fn start(
        n: usize,
        cfg: &ValkeyConfig,
        blocks: &Blocks,
        engines: bool,
    ) -> Result<Self> {
        let mut fleet = Self::connect(n, cfg, engines).await?;
        fleet.seed(blocks).await?;
        Ok(fleet)
    }

    /// The pods connected, each with its writer and (with `engines`) its
    /// fake engine, holding no block yet: what Valkey holds for the
    /// connections alone, before [`Self::seed`].
    pub async fn connect(n: usize, cfg: &ValkeyConfig, engines: bool) -> Result<Self> {
        let shutdown = Shutdown::new();
        let mut tasks = JoinSet::new();
        let connect = |tasks: &mut JoinSet<()>| {
            let store = Arc::new(Store::new(cfg.clone()));
            tasks.spawn(store.clone().run(shutdown.clone()));
            store
        };
        let store = connect(&mut tasks);
        let stores: Vec<Arc<Store>> = (0..n).map(|_| connect(&mut tasks)).collect();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        for s in std::iter::once(&store).chain(&stores) {
            while !s.is_up() {
                anyhow::ensure!(
                    tokio::time::Instant::now() < deadline,
                    "no connection to valkey at {:?}",
                    cfg.urls
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        let index = Arc::new(PrefixIndex::default());
        let metrics = Arc::new(IndexMetrics::default());
        let mut pods = Vec::with_capacity(n);
        let mut fake = Vec::new();
        for (k, store) in stores.iter().enumerate() {
            let id = if engines {
                let engine =
                    FastEngine::bind(&format!("{}:0", pod_ip(k)), FastEngineConfig::default())
                        .await
                        .with_context(|| format!("fake engine on {}", pod_ip(k)))?;
                let id = engine.addr().to_string();
                fake.push(engine);
                id
            } else {
                format!("{}:8000", pod_ip(k))
            };
            let pod = index.pod(&id).context("index full")?;
            let rec = record(&id, k);
            let writer = Writer::new(
                store.clone(),
                index.clone(),
                pod,
                &id,
                vec![MODEL.into()],
                Box::new(move || rec.clone()),
            );
            let (tx, rx) = mpsc::channel(256);
            tasks.spawn(drive(
                writer,
                rx,
                cfg.clone(),
                metrics.clone(),
                shutdown.clone(),
            ));
            pods.push((pod, id, PodEvents::new(k), tx));
        }
        Ok(Self {
            store,
            index,
            metrics,
            pods,
            engines: fake,
            tasks,
            shutdown,
        })
    }

    /// Stores each pod's blocks (its group's prefix and filler) and waits
    /// until every writer has written them.
    pub async fn seed(&mut self, blocks: &Blocks) -> Result<()> {
        let prefixes: Vec<Vec<u32>> = (0..blocks.groups)
            .map(prefix_tokens)
            .collect::<Result<_>>()?;
        for k in 0..self.pods.len() {
            let batches = {
                let (_, _, ev, _) = &mut self.pods[k];
                seed(k, ev, blocks, &prefixes)
            };
            for b in batches {
                self.apply(k, b).await;
            }
        }
        self.drain().await;
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.pods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    /// The id of pod `k`.
    pub fn id(&self, k: usize) -> &str {
        &self.pods[k].1
    }

    /// Applies `b` to pod `k`'s index entry and hands it to its writer.
    async fn apply(&mut self, k: usize, b: EventBatch) {
        let (pod, _, _, tx) = &self.pods[k];
        let mut touched = Vec::new();
        self.index.apply_touching(*pod, MODEL, &b, &mut touched);
        let _ = tx.send(ToPod::Batch(b, touched)).await;
    }

    /// One churn step of pod `k`: a filler block stored, the oldest removed.
    pub async fn churn(&mut self, k: usize) {
        let (stored, removed) = {
            let ev = &mut self.pods[k].2;
            (ev.filler(), ev.evict())
        };
        self.apply(k, stored).await;
        if let Some(r) = removed {
            self.apply(k, r).await;
        }
    }

    /// Stores a fresh one-block chain on pod `k`; returns its block key
    /// (the freshness probe looks it up until pod `k` is seen holding it).
    pub async fn probe(&mut self, k: usize, salt: u64) -> u64 {
        let tokens: Vec<u32> = (0..BLOCK as u64)
            .map(|i| ((salt * 131 + i) % 30_000 + 16) as u32)
            .collect();
        let keys = self.index.request_keys(MODEL, None, &tokens, BLOCK);
        let b = {
            let ev = &mut self.pods[k].2;
            let h = ev.hash();
            stored(vec![h], None, tokens)
        };
        self.apply(k, b).await;
        keys[0]
    }

    /// Waits until every writer has written what it was given.
    pub async fn drain(&self) {
        let mut waits = Vec::new();
        for (_, _, _, tx) in &self.pods {
            let (done, wait) = tokio::sync::oneshot::channel();
            if tx.send(ToPod::Drain(done)).await.is_ok() {
                waits.push(wait);
            }
        }
        for w in waits {
            let _ = w.await;
        }
    }

    pub async fn stop(mut self) {
        self.shutdown.trigger();
        self.pods.clear();
        while self.tasks.join_next().await.is_some() {}
        for e in self.engines.drain(..) {
            e.shutdown().await;
        }
    }
}

fn record(id: &str, k: usize) -> PodRecord {
    PodRecord {
        id: id.to_owned(),
        mesh: String::new(),
        kv_agent: String::new(),
        role: Role::Both,
        models: vec![MODEL.into()],
        adapters: vec![],
        labels: Default::default(),
        waiting: (k % 3) as u32,
        running: 4 + (k % 5) as u32,
        kv: 0.5,
        block_size: BLOCK as u32,
        blocks: 4096,
        healthy: true,
        in_flight: (k % 7) as u32,
        load_age_ms: 0,
        ttl_ms: 0,
        work: None,
    }
}

/// One emulated pod's writer, on the schedule a sidecar's writer keeps:
/// batches as they come, a flush `flush_interval` after a change, a
/// renewal every `lease_interval`.
async fn drive(
    mut w: Writer,
    mut rx: mpsc::Receiver<ToPod>,
    cfg: ValkeyConfig,
    m: Arc<IndexMetrics>,
    shutdown: Shutdown,
) {
    let m = &*m;
    let model: Arc<str> = Arc::from(MODEL);
    let mut lease = kvmesh_proxy::valkey::writer::lease_timer(cfg.lease_interval.get());
    let mut flush_at: Option<tokio::time::Instant> = None;
    let mut drains: Vec<tokio::sync::oneshot::Sender<()>> = Vec::new();
    loop {
        tokio::select! {
            _ = shutdown.triggered() => {
                w.leave().await;
                return;
            }
            msg = rx.recv() => match msg {
                Some(ToPod::Batch(b, touched)) => w.batch(m, &model, &b, &touched),
                Some(ToPod::Drain(done)) => drains.push(done),
                None => return,
            },
            _ = lease.tick() => { let _ = w.renew(m).await; }
            _ = sleep_until(flush_at) => {
                let _ = w.flush(m).await;
                flush_at = None;
            }
        }
        if flush_at.is_none() && w.has_work() {
            flush_at = Some(tokio::time::Instant::now() + cfg.flush_interval.get());
        }
        if !drains.is_empty() && w.is_registered() && !w.has_work() {
            for d in drains.drain(..) {
                let _ = d.send(());
            }
        } else if !drains.is_empty() && flush_at.is_none() {
            flush_at = Some(tokio::time::Instant::now() + cfg.flush_interval.get());
        }
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// See the module docs.
pub struct MeshFleet {
    sidecars: Vec<SidecarHandle>,
    events: Vec<PodEvents>,
    engine: FastEngine,
    seq: u64,
}

impl MeshFleet {
    /// `n` sidecars in this process, mesh on, no peers, seeded with `blocks`.
    pub async fn start(n: usize, blocks: &Blocks) -> Result<Self> {
        let engine = FastEngine::bind("127.0.0.1:0", FastEngineConfig::default()).await?;
        let prefixes: Vec<Vec<u32>> = (0..blocks.groups)
            .map(prefix_tokens)
            .collect::<Result<_>>()?;
        let mut sidecars = Vec::with_capacity(n);
        for k in 0..n {
            let mut c = kvmesh_proxy::Config::default();
            c.listeners.client = SocketAddr::new(pod_ip(k).into(), 0);
            c.listeners.admin = SocketAddr::new(pod_ip(k).into(), 0);
            c.engine.url = kvmesh_proxy::config::EngineUrl::parse(&engine.url())
                .map_err(anyhow::Error::msg)?;
            c.pod.models = vec![MODEL.into()];
            c.prefix.tokenizer = kvmesh_proxy::config::TokenizerChoice::Builtin;
            c.mesh.listen = Some(SocketAddr::new(pod_ip(k).into(), 0));
            c.logging.level = "error".into();
            sidecars.push(
                kvmesh_proxy::Sidecar::bind(c)
                    .await
                    .context("emulated mesh sidecar")?,
            );
        }
        let mut fleet = Self {
            sidecars,
            events: (0..n).map(PodEvents::new).collect(),
            engine,
            seq: 0,
        };
        for k in 0..n {
            for b in seed(k, &mut fleet.events[k], blocks, &prefixes) {
                fleet.apply(k, &b);
            }
        }
        Ok(fleet)
    }

    pub fn len(&self) -> usize {
        self.sidecars.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sidecars.is_empty()
    }

    /// Every emulated sidecar's mesh address, for the peers file.
    pub fn mesh_addrs(&self) -> Vec<SocketAddr> {
        self.sidecars.iter().filter_map(|s| s.mesh_addr()).collect()
    }

    pub fn id(&self, k: usize) -> String {
        self.sidecars[k].fleet().local_id().to_owned()
    }

    fn apply(&mut self, k: usize, b: &EventBatch) {
        self.seq += 1;
        self.sidecars[k]
            .prefix()
            .ingest_local(self.seq, Arc::from(MODEL), b);
    }

    /// One churn step of pod `k`, as [`ValkeyFleet::churn`].
    pub fn churn(&mut self, k: usize) {
        let stored = self.events[k].filler();
        let removed = self.events[k].evict();
        self.apply(k, &stored);
        if let Some(r) = removed {
            self.apply(k, &r);
        }
    }

    /// Stores a fresh one-block chain on pod `k`: the probe's prompt tokens.
    pub fn probe(&mut self, k: usize, salt: u64) -> Vec<u32> {
        let tokens: Vec<u32> = (0..BLOCK as u64)
            .map(|i| ((salt * 131 + i) % 30_000 + 16) as u32)
            .collect();
        let h = self.events[k].hash();
        self.apply(k, &stored(vec![h], None, tokens.clone()));
        tokens
    }

    pub async fn stop(self) {
        for s in self.sidecars {
            s.shutdown().await;
        }
        self.engine.shutdown().await;
    }
}
