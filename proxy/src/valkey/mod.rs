//! The Valkey index backend (`index.backend: valkey`, docs/mesh.md): the
//! fleet's prefix index and load in a shared Valkey instead of in every
//! sidecar, for fleets past the full mesh.
//!
//! * [`writer`]: each sidecar writes only its own pod: the blocks its
//!   engine's KV events stored and removed, and its record (who it is, load,
//!   in-flight) under a lease.
//! * [`lookup`]: a routing decision asks once which pods hold the request's
//!   prefix and how loaded they and a few others are ([`Valkey::candidates`]);
//!   the answer becomes fleet entries and the decision's candidate set.
//! * [`guesses`]: in approximate mode (`prefix.tokenizer: none`, no KV
//!   events), each routing decision's text block keys, written as guesses
//!   for the pod it chose, which expire; lookups then read those.
//! * [`liveness`]: a peer with calls in flight whose record stops being
//!   renewed without being removed (a host gone, not a drain) is cut off,
//!   so those calls go elsewhere at once.
//! * [`store`]: the connection (single server, primary and replicas, found
//!   through Sentinel or not, or a cluster), reconnects and failover;
//!   `functions.lua` the server side.
//! * When Valkey is slow or away, a lookup fails within its deadline and the
//!   request is routed on what the sidecar knows: its own pod, the pods of
//!   recent lookups with their last loads, and its recent decisions. Nothing
//!   fails because of it; `kvmesh_index_lookups_total{outcome}` and
//!   `/debug/index` say so.
//!
//! [`run`] owns the tasks; they stop on shutdown.

pub mod guesses;
pub mod keys;
pub mod liveness;
pub mod lookup;
pub mod metrics;
pub mod record;
mod sentinel;
pub mod store;
pub mod writer;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::broadcast;
use tokio::time::Instant;

use crate::config::Config;
use crate::fleet::{Fleet, PodSnapshot};
use crate::prefix::LocalKvUpdate;
use prometheus_client::registry::Registry;

use crate::prefix::PrefixState;
use crate::shutdown::Shutdown;
pub use lookup::{Candidate, Found, Lookup};
use metrics::IndexMetrics;
pub use record::PodRecord;
pub use store::{Store, StoreError};
pub use writer::Writer;

/// This sidecar's side of the Valkey index: the connection, the lookups,
/// and what the writer last reported (for `/debug/index`).
#[derive(Debug)]
pub struct Valkey {
    store: Arc<Store>,
    lookup: Lookup,
    /// Approximate mode: lookups read routing decisions' guesses, and the
    /// sidecar writes its own ([`guesses`]).
    approx: bool,
    /// Approximate mode: the member each pod of a recent lookup is
    /// registered as (pod id to member), whom its guesses are written for.
    members: Mutex<HashMap<String, String>>,
    status: Mutex<WriterStatus>,
    /// Where the peers of recent lookups have their records, to cut off
    /// those that stop renewing them ([`liveness`]).
    liveness: liveness::Liveness,
    /// The whole fleet of the local pod's models, as last read, and when.
    fleet_view: tokio::sync::Mutex<Option<(Instant, Arc<Vec<PodSnapshot>>)>>,
    /// Lookups, writes, registrations, the connection.
    pub metrics: IndexMetrics,
}

/// The writer's state, as `/debug/index` shows it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct WriterStatus {
    pub member: String,
    pub registered: bool,
    pub pending: usize,
    pub rewriting: usize,
    pub last_error: Option<String>,
}

/// `/debug/index`: where the index is and how it is doing.
#[derive(Debug, Clone, Serialize)]
pub struct IndexStatus {
    pub backend: &'static str,
    pub up: bool,
    pub server: String,
    /// Why the last attempt to connect failed ("" while connected).
    pub error: String,
    pub writer: WriterStatus,
}

impl Valkey {
    /// The index of `config.index.valkey`, its metrics registered in `registry`.
    pub fn new(config: &Config, registry: &mut Registry) -> Self {
        let store = Arc::new(Store::new(config.index.valkey.clone()));
        let approx = crate::prefix::mode_of(config) == crate::prefix::Mode::Approximate;
        Self {
            lookup: match approx {
                true => Lookup::approximate(store.clone()),
                false => Lookup::new(store.clone()),
            },
            approx,
            members: Mutex::new(HashMap::new()),
            store,
            status: Mutex::new(WriterStatus::default()),
            liveness: liveness::Liveness::default(),
            fleet_view: tokio::sync::Mutex::new(None),
            metrics: IndexMetrics::register(registry),
        }
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    pub fn status(&self) -> IndexStatus {
        IndexStatus {
            backend: "valkey",
            up: self.store.is_up(),
            server: self.store.server(),
            error: self.store.last_error(),
            writer: self.status.lock().clone(),
        }
    }

    /// The schedule stage's lookup: the pods a decision for this request is
    /// made among, with the leading blocks each holds. Each pod the answer
    /// names becomes (or refreshes) a fleet entry, with its load and
    /// in-flight count, so that it can be scored and forwarded to. `None`
    /// when the lookup failed: the decision is then made among every pod the
    /// fleet knows, on their last loads.
    pub async fn candidates(
        &self,
        fleet: &Fleet,
        routes: &crate::upstream::mesh::MeshRoutes,
        model: &str,
        keys: &[u64],
    ) -> Option<Vec<(String, u32)>> {
        let found = self.lookup.find(&self.metrics, model, keys).await.ok()?;
        if self.approx {
            self.learn_members(&found.candidates);
        }
        let now = Instant::now();
        let cfg = self.store.config();
        let mut out = Vec::with_capacity(found.candidates.len());
        for c in &found.candidates {
            let r = &c.record;
            if r.id != fleet.local_id() {
                let Some(info) = r.info() else { continue };
                // Cut off as this member: its record is the stale one.
                if !self.liveness.named(
                    &cfg.key_prefix,
                    cfg.stripes,
                    model,
                    &r.id,
                    &c.member,
                    cfg.lease_ttl.get(),
                ) {
                    continue;
                }
                let sidecar = info.sidecar_addr;
                let at = now
                    .checked_sub(Duration::from_millis(c.age_ms.min(3_600_000)))
                    .unwrap_or(now);
                if fleet
                    .upsert_reported(info, r.load(), at, r.healthy, r.in_flight)
                    .is_err()
                {
                    continue;
                }
                if let (Some(sidecar), Ok(mesh)) = (sidecar, r.mesh.parse()) {
                    routes.set(sidecar, mesh, r.kv_agent.parse().ok());
                }
            }
            out.push((r.id.clone(), c.depth));
        }
        Some(out)
    }
}

/// Most pods whose member an approximate-mode sidecar remembers; past it the
/// map starts over from the next lookups.
const MAX_MEMBERS: usize = 1 << 16;

impl Valkey {
    fn learn_members(&self, candidates: &[Candidate]) {
        let mut members = self.members.lock();
        for c in candidates {
            if members.get(&c.record.id) != Some(&c.member) {
                if members.len() >= MAX_MEMBERS {
                    members.clear();
                }
                members.insert(c.record.id.clone(), c.member.clone());
            }
        }
    }

    /// The member pod `pod` is registered as, if a lookup named it (the
    /// local pod `local`: the writer's, once registered).
    pub fn member_of(&self, pod: &str, local: &str) -> Option<String> {
        if pod == local {
            let s = self.status.lock();
            return s.registered.then(|| s.member.clone());
        }
        self.members.lock().get(pod).cloned()
    }

    /// Forgets `member`, whose record is gone (a lookup names the pod's
    /// new one).
    pub fn forget_member(&self, member: &str) {
        self.members.lock().retain(|_, m| m != member);
    }
}

impl Valkey {
    /// Every pod registered for the local pod's models, as the autoscaling
    /// hook sizes pools from: the pods' records (load, health, in-flight),
    /// the local pod from `fleet` (its own, fresher). A sidecar on Valkey
    /// otherwise knows only the pods of its recent lookups. One call per
    /// model and stripe, reused for a lease (`lease_ttl`, 3 s): a pod that
    /// left stays in the view that long anyway, and the hook's callers (KEDA,
    /// an HPA's metrics, Prometheus) poll every 15-30 s, any sidecar of them.
    pub async fn fleet_view(
        &self,
        config: &Config,
        fleet: &Fleet,
    ) -> Result<Arc<Vec<PodSnapshot>>, StoreError> {
        let mut cached = self.fleet_view.lock().await;
        if let Some((at, view)) = cached.as_ref() {
            if at.elapsed() < self.store.config().lease_ttl.get() {
                return Ok(view.clone());
            }
        }
        let cfg = self.store.config();
        let deadline = cfg.lookup_deadline.get().max(Duration::from_millis(500));
        let asks = config.pod.models.iter().flat_map(|model| {
            (0..cfg.stripes).map(move |stripe| {
                let tag = keys::Tag::new(&cfg.key_prefix, model, stripe);
                async move {
                    self.store
                        .fcall::<redis::Value, _>(
                            "kvmesh_members",
                            &[tag.records()],
                            Vec::<String>::new(),
                            deadline,
                        )
                        .await
                }
            })
        });
        let now = Instant::now();
        let local = fleet.local_id();
        let mut pods: std::collections::BTreeMap<String, PodSnapshot> = fleet
            .snapshot(now)
            .into_iter()
            .filter(|p| p.info.id == local)
            .map(|p| (p.info.id.clone(), p))
            .collect();
        for reply in futures_util::future::join_all(asks).await {
            for (record, pttl) in lookup::parse_members(reply?)? {
                let Some(info) = record.info() else { continue };
                if pods.contains_key(&info.id) {
                    continue;
                }
                pods.insert(
                    info.id.clone(),
                    PodSnapshot {
                        info,
                        load: record.load(),
                        load_age_ms: Some(record.age_ms(pttl)),
                        healthy: record.healthy,
                        in_flight_local: 0,
                        in_flight_mesh: record.in_flight,
                        held: Default::default(),
                        ejected_ms: None,
                        ejections: 0,
                    },
                );
            }
        }
        let view = Arc::new(pods.into_values().collect::<Vec<_>>());
        *cached = Some((Instant::now(), view.clone()));
        Ok(view)
    }
}

/// What the index tasks use.
pub struct Tasks {
    pub valkey: Arc<Valkey>,
    pub config: Arc<Config>,
    pub fleet: Arc<Fleet>,
    pub prefix: Arc<PrefixState>,
    /// The local pod's applied KV batches (subscribed before the feed starts).
    pub local_kv: broadcast::Receiver<LocalKvUpdate>,
    /// The mesh port, announced for forwarding over mutual TLS.
    pub mesh_addr: Option<std::net::SocketAddr>,
}

/// The index tasks: the connection, the local pod's writer, in approximate
/// mode the writer of its routing decisions' guesses, forgetting pods no
/// lookup named for `forget_after`, and cutting off the pods with calls in
/// flight whose records stopped being renewed ([`liveness`]). Returns on
/// shutdown.
pub async fn run(t: Tasks, shutdown: Shutdown) {
    let store = t.valkey.store.clone();
    let conn = tokio::spawn(store.clone().run(shutdown.clone()));
    let guesses = t.valkey.approx.then(|| {
        tokio::spawn(guesses::run(
            t.valkey.clone(),
            t.fleet.local_id().to_owned(),
            t.prefix.subscribe_decisions(),
            shutdown.clone(),
        ))
    });
    let forget = tokio::spawn(forget(
        t.valkey.clone(),
        t.fleet.clone(),
        t.prefix.clone(),
        t.config.clone(),
        shutdown.clone(),
    ));
    let watch = tokio::spawn(watch(
        t.valkey.clone(),
        t.fleet.clone(),
        t.prefix.clone(),
        shutdown.clone(),
    ));
    write(t, shutdown).await;
    let _ = conn.await;
    let _ = forget.await;
    let _ = watch.await;
    if let Some(g) = guesses {
        let _ = g.await;
    }
}

/// The local pod's writer loop: applies local updates as they come, writes
/// every `flush_interval`, renews every `lease_interval`.
async fn write(t: Tasks, shutdown: Shutdown) {
    let cfg = t.config.index.valkey.clone();
    let (pod, name) = t.prefix.local_pod();
    let mut namespaces = t.config.pod.models.clone();
    namespaces.extend(t.config.pod.lora_adapters.iter().cloned());
    let mut writer = Writer::new(
        t.valkey.store.clone(),
        t.prefix.index().clone(),
        pod,
        name,
        namespaces,
        record_fn(&t),
    );
    let m = &t.valkey.metrics;
    let mut rx = Some(t.local_kv);
    let every = cfg.flush_interval.get();
    // Armed only while something waits, so an idle pod's writer sleeps
    // between renewals.
    let mut flush_at: Option<Instant> = None;
    let mut lease = writer::lease_timer(cfg.lease_interval.get());
    let mut error: Option<String> = None;
    loop {
        tokio::select! {
            _ = shutdown.triggered() => {
                writer.leave().await;
                return;
            }
            u = crate::prefix::recv_local(&mut rx) => match u {
                Ok(LocalKvUpdate::Batch { model, batch, touched, .. }) => {
                    writer.batch(m, &model, &batch, &touched);
                }
                Ok(LocalKvUpdate::Cleared) => writer.cleared(m),
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    tracing::warn!(lost = n, "valkey: local KV updates lagged; rewriting the pod");
                    writer.lagged(m);
                }
                // The feed ended: only the lease from here on.
                Err(broadcast::error::RecvError::Closed) => rx = None,
            },
            _ = sleep_until(flush_at) => {
                error = writer.flush(m).await.err().map(|e| e.to_string());
                flush_at = None;
            }
            _ = lease.tick() => {
                m.up(t.valkey.store.is_up());
                error = writer.renew(m).await.err().map(|e| e.to_string());
            }
        }
        if flush_at.is_none() && writer.has_work() {
            flush_at = Some(Instant::now() + every);
        }
        *t.valkey.status.lock() = WriterStatus {
            member: writer.member().to_owned(),
            registered: writer.is_registered(),
            pending: writer.pending(),
            rewriting: writer.rewriting(),
            last_error: error.clone(),
        };
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The local pod's record, built at each renewal.
fn record_fn(t: &Tasks) -> writer::RecordFn {
    let fleet = t.fleet.clone();
    let config = t.config.clone();
    let mesh = t.mesh_addr.map(|a| a.to_string()).unwrap_or_default();
    Box::new(move || {
        let p = &config.pod;
        let me = fleet.local_snapshot(Instant::now());
        PodRecord {
            id: fleet.local_id().to_owned(),
            mesh: mesh.clone(),
            kv_agent: p
                .node_ip
                .map(|ip| std::net::SocketAddr::new(ip, config.pd.kvagent_port).to_string())
                .unwrap_or_default(),
            role: p.role,
            models: p.models.clone(),
            // The live set (static, then those the engine loaded at run time).
            adapters: me.info.lora_adapters.clone(),
            labels: p.labels.clone(),
            waiting: me.load.waiting,
            running: me.load.running,
            kv: me.load.kv_usage,
            block_size: me.load.block_size,
            blocks: me.load.num_blocks,
            healthy: me.healthy,
            in_flight: me.in_flight_local,
            load_age_ms: me.load_age_ms.unwrap_or(0),
            ttl_ms: 0,
            work: me.load.work.map(|w| {
                [
                    w.finished,
                    w.prompt_tokens,
                    w.cached_tokens,
                    w.generation_tokens,
                ]
            }),
        }
    })
}

/// Forgets pods no lookup named for `forget_after` (fleet entries and their
/// predictions), so the fleet holds the pods this sidecar routes among, not
/// every pod there is. They may only be idle: they are not cut off (a pod
/// gone without leaving is, by [`watch`], while calls wait on it).
async fn forget(
    valkey: Arc<Valkey>,
    fleet: Arc<Fleet>,
    prefix: Arc<PrefixState>,
    config: Arc<Config>,
    shutdown: Shutdown,
) {
    let after = config.index.valkey.forget_after.get();
    let mut tick = tokio::time::interval((after / 4).max(Duration::from_millis(100)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.triggered() => return,
            _ = tick.tick() => {
                for id in fleet.peers_older_than(Instant::now(), after) {
                    fleet.remove_peer(&id);
                    prefix.remove_pod(&id);
                    valkey.liveness.forget(&id);
                }
            }
        }
    }
}

/// Every quarter lease, cuts off the peers with calls in flight whose
/// records stopped being renewed without being removed ([`liveness`]).
async fn watch(
    valkey: Arc<Valkey>,
    fleet: Arc<Fleet>,
    prefix: Arc<PrefixState>,
    shutdown: Shutdown,
) {
    let cfg = valkey.store.config().clone();
    let stale = liveness::Liveness::stale_after(cfg.lease_ttl.get(), cfg.lease_interval.get());
    let mut tick = tokio::time::interval((cfg.lease_ttl.get() / 4).max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.triggered() => return,
            _ = tick.tick() => {
                liveness::check(&valkey.liveness, &valkey.store, &fleet, &prefix, stale).await;
            }
        }
    }
}
