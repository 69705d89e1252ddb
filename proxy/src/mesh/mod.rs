//! The mesh: sidecars that find each other, share what they know, and route
//! as one (docs/mesh.md).
//!
//! * [`Mesh`] is this sidecar's side of the state stream: the local state
//!   (announce, load, in-flight per target, the local pod's KV blocks in a
//!   [`mirror::Mirror`], recent approximate decisions) and the subscribers it
//!   is served to. Every delta gets the next sequence number and is queued to
//!   every subscriber with `try_send`; a subscriber whose bounded queue is full
//!   is dropped (it reconnects and resyncs), so the sender's memory is bounded.
//! * [`server`] serves the stream on the mesh port (h2c).
//! * [`discovery`] finds peers (static list, DNS, file) and owns one
//!   [`subscriber`] task per peer, which applies the peer's stream to the
//!   [`crate::fleet::Fleet`] and the prefix index.
//! * [`wire`] is the framing.
//!
//! [`run`] is the one task the sidecar spawns; everything below it is owned
//! by it and stops on shutdown.

pub use crate::upstream::mesh as client;
pub mod discovery;
pub mod metrics;
pub mod mirror;
pub mod server;
pub mod subscriber;
pub mod wire;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;

use crate::prefix::LocalKvUpdate;
use crate::shutdown::Shutdown;
use metrics::MeshMetrics;
use mirror::Mirror;
use prometheus_client::registry::Registry;
use wire::{Announce, LoadMsg, Msg};

/// Recent approximate decisions kept for snapshots.
const RECENT_DECISIONS: usize = 4096;
/// Most block keys one published decision carries.
const MAX_DECISION_KEYS: usize = 1024;

/// This sidecar's side of the state stream (see the module docs).
pub struct Mesh {
    announce: Announce,
    hub: Mutex<Hub>,
    queue: usize,
    max_subscribers: usize,
    /// The local KV updates, taken by [`run`] (subscribed at construction so
    /// no batch applied after start is missed).
    local_kv: Mutex<Option<broadcast::Receiver<LocalKvUpdate>>>,
    /// Whether the mesh port is configured (else nothing is published).
    enabled: bool,
    /// Mutual TLS on the mesh port and the subscriptions (`mesh.tls`).
    tls: Option<crate::tls::MeshTls>,
    /// With `mesh.tls`: forwarded requests go over it, to peers' mesh ports.
    client: Option<client::MeshClient>,
    /// Each followed peer's mesh port.
    routes: client::MeshRoutes,
    /// Every followed address's stream state, refreshed by discovery.
    peers: Mutex<Vec<crate::stat::PeerEntry>>,
    /// Whether any peer source is configured (`mesh.peers`, `dns`, `file`),
    /// and whether discovery has listed the peers once.
    follows: bool,
    discovered: std::sync::atomic::AtomicBool,
    /// Readiness waits for the peers' first snapshots until this instant.
    ready_by: std::time::Instant,
    /// Peers, the state stream, forwarding.
    pub metrics: MeshMetrics,
}

struct Hub {
    /// Sequence number of the last delta.
    seq: u64,
    subs: Vec<Sub>,
    mirror: Mirror,
    decisions: VecDeque<(String, Vec<u64>)>,
    last_load: Option<LoadMsg>,
    last_in_flight: Vec<(String, u32)>,
    /// The local engine's LoRA adapters as last published: the snapshot's
    /// `Hello` carries them, and a change goes out as `Adapters`.
    adapters: Vec<String>,
    /// Shutting down: streams have ended and no new one starts.
    closed: bool,
}

/// One subscriber's queue, and the frames outside the sequence it asked for.
struct Sub {
    tx: mpsc::Sender<Bytes>,
    takes: Takes,
}

/// The frames outside the sequence a subscriber asked for (by request
/// header, see [`server`]): a sidecar that predates one ends its stream on it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Takes {
    /// `Stats`: the pod's counters, for `kvmesh stat`.
    pub stats: bool,
    /// `Adapters`: the engine's LoRA adapters as they change.
    pub adapters: bool,
    /// `Prefill`: the prompt tokens sent per pod still to prefill.
    pub prefill: bool,
}

/// Which subscribers a frame goes to.
#[derive(Clone, Copy)]
enum Audience {
    All,
    Stats,
    Adapters,
    Prefill,
}

impl Audience {
    /// Whether a subscriber that asked for `takes` is among this audience.
    fn includes(self, takes: Takes) -> bool {
        match self {
            Audience::All => true,
            Audience::Stats => takes.stats,
            Audience::Adapters => takes.adapters,
            Audience::Prefill => takes.prefill,
        }
    }
}

/// A new subscriber's stream: the snapshot frames, then its queue.
pub struct Subscription {
    pub snapshot: Vec<Bytes>,
    pub rx: mpsc::Receiver<Bytes>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("id", &self.announce.id)
            .field("enabled", &self.enabled)
            .finish()
    }
}

impl Mesh {
    /// The mesh state of a sidecar whose pod is `fleet`'s local pod.
    /// `mesh_addr`: the bound mesh port (`None`: the mesh is off).
    pub fn new(
        config: &crate::config::Config,
        fleet: &crate::fleet::Fleet,
        prefix: &crate::prefix::PrefixState,
        mesh_addr: Option<SocketAddr>,
        tls: Option<crate::tls::MeshTls>,
        registry: &mut Registry,
    ) -> Self {
        let m = &config.mesh;
        let metrics = MeshMetrics::register(registry);
        // The state stream is the mesh backend's; with Valkey the mesh port
        // only serves forwarded requests.
        let enabled =
            mesh_addr.is_some() && config.index.backend == crate::config::index::Backend::Mesh;
        let p = &config.pod;
        Self {
            announce: Announce {
                id: fleet.local_id().to_owned(),
                mesh_addr: mesh_addr.map(|a| a.to_string()).unwrap_or_default(),
                role: p.role,
                models: p.models.clone(),
                lora_adapters: p.lora_adapters.clone(),
                labels: p
                    .labels
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                instance: rand::random(),
                kv_agent: p
                    .node_ip
                    .map(|ip| SocketAddr::new(ip, config.pd.kvagent_port).to_string())
                    .unwrap_or_default(),
            },
            hub: Mutex::new(Hub {
                seq: 0,
                subs: Vec::new(),
                mirror: Mirror::new(config.prefix.index_max_blocks_per_pod),
                decisions: VecDeque::new(),
                last_load: None,
                last_in_flight: Vec::new(),
                adapters: p.lora_adapters.clone(),
                closed: false,
            }),
            queue: m.subscriber_queue,
            max_subscribers: m.max_subscribers,
            local_kv: Mutex::new(enabled.then(|| prefix.subscribe_local())),
            enabled,
            client: tls.clone().map(|shared| {
                let tls_failed = metrics.tls_failures("connect");
                client::MeshClient::new(shared, config.timeouts.connect.get(), tls_failed)
            }),
            tls,
            routes: client::MeshRoutes::default(),
            peers: Mutex::new(Vec::new()),
            follows: !m.peers.is_empty() || m.dns.is_some() || m.file.is_some(),
            discovered: std::sync::atomic::AtomicBool::new(false),
            ready_by: std::time::Instant::now() + m.connect_timeout.get() * 2,
            metrics,
        }
    }

    /// Whether the mesh lets this sidecar take traffic: it has every
    /// followed peer's first snapshot, so it routes among the whole fleet
    /// (a new pod of a P/D fleet that knew no decode pod yet would refuse
    /// its first requests). A peer still connecting after twice
    /// `mesh.connect_timeout` is not waited for (it may be gone); without a
    /// peer source there is nothing to wait for. The reason when not.
    pub fn ready(&self) -> Result<(), String> {
        if !self.follows || std::time::Instant::now() >= self.ready_by {
            return Ok(());
        }
        if !self.discovered.load(std::sync::atomic::Ordering::Acquire) {
            return Err("mesh discovery has not listed the peers yet".to_owned());
        }
        match self.peers.lock().iter().find(|p| p.state == "connecting") {
            Some(p) => Err(format!(
                "waiting for the first snapshot of the mesh peer at {}",
                p.mesh_addr
            )),
            None => Ok(()),
        }
    }

    /// The mesh's mutual TLS, when `mesh.tls` is set.
    pub fn tls(&self) -> Option<&crate::tls::MeshTls> {
        self.tls.as_ref()
    }

    /// The client that forwards over the mesh's mutual TLS, when `mesh.tls` is set.
    pub fn tls_client(&self) -> Option<&client::MeshClient> {
        self.client.as_ref()
    }

    /// Where each followed peer's mesh port is.
    pub fn routes(&self) -> &client::MeshRoutes {
        &self.routes
    }

    /// This pod's identity, as announced.
    pub fn local_id(&self) -> &str {
        &self.announce.id
    }

    /// The bound mesh port (`None`: the mesh is off).
    pub fn mesh_addr(&self) -> Option<SocketAddr> {
        self.announce.mesh_addr.parse().ok()
    }

    /// Every followed address's stream state, as discovery last saw it.
    pub fn peers(&self) -> Vec<crate::stat::PeerEntry> {
        self.peers.lock().clone()
    }

    /// Replaces the peers' stream states (the discovery loop's view).
    pub fn set_peers(&self, peers: Vec<crate::stat::PeerEntry>) {
        *self.peers.lock() = peers;
        self.discovered
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Subscribers served now.
    pub fn subscribers(&self) -> usize {
        self.hub.lock().subs.len()
    }

    /// Sequence number of the last delta published.
    pub fn seq(&self) -> u64 {
        self.hub.lock().seq
    }

    /// Publishes an approximate routing decision: `pod` was sent `keys`.
    pub fn decision(&self, pod: &str, keys: &[u64]) {
        if !self.enabled || keys.is_empty() {
            return;
        }
        let keys = keys[..keys.len().min(MAX_DECISION_KEYS)].to_vec();
        let mut hub = self.hub.lock();
        if hub.decisions.len() >= RECENT_DECISIONS {
            hub.decisions.pop_front();
        }
        hub.decisions.push_back((pod.to_owned(), keys.clone()));
        hub.publish(
            &self.metrics,
            &Msg::Decision {
                pod: pod.to_owned(),
                keys,
            },
        );
    }

    /// Registers a subscriber: the snapshot as of now and a queue of every
    /// later delta, consistent because both are taken under the hub lock.
    /// `None` when [`crate::config::Mesh::max_subscribers`] are served, or
    /// when the sidecar is shutting down. `takes`: the frames outside the
    /// sequence it also takes (see [`Hub::publish_aside`]).
    pub fn subscribe(&self, takes: Takes) -> Option<Subscription> {
        let metrics = &self.metrics;
        let mut hub = self.hub.lock();
        if hub.closed {
            return None;
        }
        hub.subs.retain(|s| !s.tx.is_closed());
        if hub.subs.len() >= self.max_subscribers {
            metrics.dropped("over_limit");
            return None;
        }
        let seq = hub.seq;
        let hello = Announce {
            lora_adapters: hub.adapters.clone(),
            ..self.announce.clone()
        };
        let mut snapshot = vec![wire::encode(seq, &Msg::Hello(hello))];
        if let Some(l) = hub.last_load {
            snapshot.push(wire::encode(seq, &Msg::Load(l)));
        }
        snapshot.push(wire::encode(
            seq,
            &Msg::InFlight(hub.last_in_flight.clone()),
        ));
        for (model, batch) in hub.mirror.snapshot() {
            snapshot.push(wire::encode(
                seq,
                &Msg::Kv {
                    model: model.to_string(),
                    batch,
                },
            ));
        }
        for (pod, keys) in &hub.decisions {
            snapshot.push(wire::encode(
                seq,
                &Msg::Decision {
                    pod: pod.clone(),
                    keys: keys.clone(),
                },
            ));
        }
        snapshot.push(wire::encode(seq, &Msg::SnapshotEnd));
        let (tx, rx) = mpsc::channel(self.queue);
        hub.subs.push(Sub { tx, takes });
        metrics.subscribers(hub.subs.len());
        Some(Subscription { snapshot, rx })
    }

    fn local_kv(&self, update: LocalKvUpdate) {
        let metrics = &self.metrics;
        let mut hub = self.hub.lock();
        match update {
            LocalKvUpdate::Batch { model, batch, .. } => {
                hub.mirror.apply(&model, &batch);
                hub.publish(
                    metrics,
                    &Msg::Kv {
                        model: model.to_string(),
                        batch: (*batch).clone(),
                    },
                );
            }
            LocalKvUpdate::Cleared => self.cleared(&mut hub),
        }
    }

    fn cleared(&self, hub: &mut Hub) {
        hub.mirror.clear();
        let batch = kvmesh_filters::prefix::kvevents::EventBatch {
            ts: 0.0,
            events: vec![kvmesh_filters::prefix::kvevents::KvEvent::AllBlocksCleared],
            dp_rank: None,
            unknown_events: 0,
        };
        hub.publish(
            &self.metrics,
            &Msg::Kv {
                model: String::new(),
                batch,
            },
        );
    }

    /// Publishes the local load and in-flight counts (also the heartbeat).
    fn tick(&self, shared: &Tasks) {
        let now = Instant::now();
        let fleet = &shared.fleet;
        let local = fleet
            .snapshot(now)
            .into_iter()
            .find(|p| p.info.id == fleet.local_id());
        let load = local.as_ref().map(|p| LoadMsg {
            load: p.load,
            age_ms: p.load_age_ms.unwrap_or(u64::MAX),
            healthy: p.healthy,
        });
        let mut in_flight: Vec<(String, u32)> = fleet.published_in_flight().into_iter().collect();
        in_flight.sort_unstable();
        let adapters = local.map(|p| p.info.lora_adapters);
        let mut hub = self.hub.lock();
        if let Some(a) = adapters.filter(|a| *a != hub.adapters) {
            hub.adapters.clone_from(&a);
            hub.publish_aside(&self.metrics, Audience::Adapters, || Msg::Adapters(a));
        }
        if let Some(l) = load {
            hub.last_load = Some(l);
            hub.publish(&self.metrics, &Msg::Load(l));
        }
        hub.last_in_flight = in_flight.clone();
        hub.publish(&self.metrics, &Msg::InFlight(in_flight));
        hub.publish_aside(&self.metrics, Audience::Prefill, || {
            let mut prefill: Vec<(String, u64)> = fleet.published_prefill().into_iter().collect();
            prefill.sort_unstable();
            Msg::Prefill(prefill)
        });
        let scraped = fleet.stats().remove(fleet.local_id()).unwrap_or_default();
        let stats =
            crate::stat::local_stats(scraped, self.metrics.served_total(), shared.pd.totals());
        hub.publish_aside(&self.metrics, Audience::Stats, || Msg::Stats(stats));
    }
}

impl Hub {
    /// Queues one delta to every subscriber; a full queue drops its subscriber.
    fn publish(&mut self, metrics: &MeshMetrics, msg: &Msg) {
        self.seq += 1;
        if self.subs.is_empty() {
            return;
        }
        let frame = wire::encode(self.seq, msg);
        self.send(metrics, &frame, Audience::All);
    }

    /// Queues `msg()` to the subscribers of `to`, built only when there are
    /// some. Outside the sequence: the frame carries the last delta's number
    /// and takes none, so the other subscribers see no gap.
    fn publish_aside(&mut self, metrics: &MeshMetrics, to: Audience, msg: impl FnOnce() -> Msg) {
        if self.subs.iter().any(|s| to.includes(s.takes)) {
            let frame = wire::encode(self.seq, &msg());
            self.send(metrics, &frame, to);
        }
    }

    /// Queues `frame` to every subscriber of `to`; a full queue drops its
    /// subscriber.
    fn send(&mut self, metrics: &MeshMetrics, frame: &Bytes, to: Audience) {
        let before = self.subs.len();
        let mut slow = 0;
        let mut sent = 0u64;
        self.subs.retain(|s| {
            let takes = to.includes(s.takes);
            if !takes {
                return true;
            }
            match s.tx.try_send(frame.clone()) {
                Ok(()) => {
                    sent += 1;
                    true
                }
                Err(mpsc::error::TrySendError::Full(_)) => {
                    slow += 1;
                    false
                }
                Err(mpsc::error::TrySendError::Closed(_)) => false,
            }
        });
        for _ in 0..slow {
            metrics.dropped("slow");
        }
        metrics.frames_out(sent);
        if self.subs.len() != before {
            metrics.subscribers(self.subs.len());
        }
    }
}

/// What the mesh's tasks read and write: the mesh itself, the fleet and
/// prefix index its subscribers fill, the config, the request counters its
/// port's connections count in, and P/D's totals for the stats it publishes.
#[derive(Clone)]
pub struct Tasks {
    pub config: Arc<crate::config::Config>,
    pub mesh: Arc<Mesh>,
    pub fleet: Arc<crate::fleet::Fleet>,
    pub prefix: Arc<crate::prefix::PrefixState>,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub pd: Arc<crate::pd::metrics::PdMetrics>,
}

/// The mesh task: binds nothing itself (the listener is passed in), serves
/// the stream, publishes local state and runs discovery. Returns on shutdown.
pub async fn run<H: crate::server::Handler>(
    shared: Tasks,
    listener: TcpListener,
    forwarded: H,
    shutdown: Shutdown,
) {
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(server::serve(
        shared.clone(),
        listener,
        forwarded,
        shutdown.clone(),
    ));
    tasks.spawn(discovery::run(shared.clone(), shutdown.clone()));
    tasks.spawn(publish(shared, shutdown.clone()));
    while tasks.join_next().await.is_some() {}
}

/// Forwards local KV updates to subscribers and publishes the load on a tick.
async fn publish(shared: Tasks, shutdown: Shutdown) {
    let mesh = shared.mesh.clone();
    let mut kv = mesh.local_kv.lock().take();
    let mut tick = tokio::time::interval(shared.config.mesh.load_interval.get());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.triggered() => {
                // Ends every subscriber's stream (and refuses new ones), so
                // mesh connections can close.
                let mut hub = mesh.hub.lock();
                hub.closed = true;
                hub.subs.clear();
                return;
            }
            _ = tick.tick() => mesh.tick(&shared),
            u = crate::prefix::recv_local(&mut kv) => match u {
                Ok(update) => mesh.local_kv(update),
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    // Batches were lost: the mirror cannot be trusted, so the
                    // peers forget this pod's blocks and relearn them live.
                    tracing::warn!(lost = n, "mesh: local KV updates lagged; peers told to clear this pod");
                    let mut hub = mesh.hub.lock();
                    mesh.cleared(&mut hub);
                }
                Err(broadcast::error::RecvError::Closed) => kv = None,
            },
        }
    }
}

/// Binds the mesh listener of `config.mesh.listen`, if any.
pub async fn bind(config: &crate::config::Config) -> std::io::Result<Option<TcpListener>> {
    match config.mesh.listen {
        Some(addr) => TcpListener::bind(addr).await.map(Some),
        None => Ok(None),
    }
}

/// The address a listener is bound to, for logs and handles.
pub fn local_addr(l: &Option<TcpListener>) -> Option<SocketAddr> {
    l.as_ref().and_then(|l| l.local_addr().ok())
}
