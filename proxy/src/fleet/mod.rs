//! The fleet: every pod this sidecar can send work to, as it knows them now.
//!
//! One entry per pod, keyed by the pod's identity (its sidecar's advertised
//! client address, `host:port`). The local pod is always present; peers are
//! added and removed by the mesh. Each entry holds what the scheduler needs:
//! who the pod is (role, models, adapters, labels), its engine's last load
//! report and how old it is, and the requests in flight towards it, counted
//! by this sidecar (exactly, with guards) and by every peer (as they publish).
//!
//! The schedule stage turns the fleet into `kvmesh_filters` endpoint views with
//! [`Fleet::endpoints`]; nothing here does I/O.

pub mod adapters;
pub mod held;
mod load;
pub mod outlier;
pub mod ranks;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use kvmesh_filters::sched::view::{EndpointView, LoadSnapshot, PrefixMatch, Role};
use parking_lot::RwLock;
use serde::Serialize;
use tokio::time::Instant;

pub use held::HeldCounts;
pub use load::{
    parse_engine_metrics, parse_lora_info, parse_rank_loads, EngineLoad, EngineWork, LoraInfo,
    PromptSpread,
};

/// Most pods one sidecar tracks (local included); further peers are refused.
pub const MAX_PODS: usize = 4096;

/// Who a pod is: what it announces about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PodInfo {
    /// The pod's identity: its sidecar's advertised client address.
    pub id: String,
    /// Where to forward requests for this pod; `None` for the local pod.
    pub sidecar_addr: Option<SocketAddr>,
    pub role: Role,
    pub models: Vec<String>,
    pub lora_adapters: Vec<String>,
    pub labels: BTreeMap<String, String>,
}

/// One pod as the fleet sees it, for admin output.
#[derive(Debug, Clone, Serialize)]
pub struct PodSnapshot {
    pub info: PodInfo,
    pub load: EngineLoad,
    /// Milliseconds since the load was last reported (`None`: never).
    pub load_age_ms: Option<u64>,
    pub healthy: bool,
    pub in_flight_local: u32,
    /// Requests other sidecars have in flight to it: the mesh's published
    /// counts, or (on Valkey) the pod's own count from its record.
    pub in_flight_mesh: u32,
    /// Requests its sidecar holds per pool (flow control).
    pub held: HeldCounts,
    /// Milliseconds left of this pod's outlier ejection (`None`: not ejected).
    pub ejected_ms: Option<u64>,
    /// Times this sidecar ejected the pod (recently; see [`outlier`]).
    pub ejections: u32,
}

struct PodState {
    info: PodInfo,
    load: EngineLoad,
    load_at: Option<Instant>,
    healthy: bool,
    /// Requests this sidecar has outstanding to the pod (guards count them).
    in_flight: Arc<AtomicU32>,
    /// Of their prompt tokens, those not yet prefilled (guards count them,
    /// until the first token).
    prefill: Arc<AtomicU64>,
    /// The pod's cumulative counters, for `kvmesh stat`.
    stats: crate::stat::PodStats,
    /// When the entry was made.
    added_at: Instant,
    /// The pod's own in-flight count, as its Valkey record reported it.
    reported_in_flight: u32,
    /// Cancelled when the pod is cut off ([`Fleet::cut_off_peer`]).
    lost: tokio_util::sync::CancellationToken,
}

/// Every pod this sidecar can route to.
pub struct Fleet {
    local_id: String,
    pods: RwLock<BTreeMap<String, PodState>>,
    /// In-flight counts published by peers: reporter -> (target -> count).
    remote_in_flight: RwLock<HashMap<String, HashMap<String, u32>>>,
    /// Prompt tokens to prefill published by peers: reporter -> (target -> tokens).
    remote_prefill: RwLock<HashMap<String, HashMap<String, u64>>>,
    /// Of the local pod's in-flight requests, those a peer forwarded here
    /// (the forwarder already publishes them; see [`Fleet::published_in_flight`]).
    received: Arc<AtomicU32>,
    /// The local engine's data-parallel ranks ([`ranks`]).
    ranks: ranks::Ranks,
    /// Pods ejected for failing calls ([`outlier`]).
    outliers: outlier::Outliers,
    /// Requests this sidecar holds per pool (flow control; [`held`]).
    held: held::Held,
    /// The sidecar addresses of peers that left discovery lately, and when
    /// ([`DEPARTED_GRACE`]).
    departed: parking_lot::Mutex<std::collections::VecDeque<(SocketAddr, Instant)>>,
}

/// How long a peer that left discovery may still be forwarded to: a pod
/// leaves the peer list (its endpoints) when its deletion starts, then
/// drains, so a request scheduled to it a moment before still finds its
/// sidecar serving. Past this its address is no longer trusted.
pub const DEPARTED_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// Departed addresses kept at most (a fleet-wide restart at once).
const MAX_DEPARTED: usize = 1024;

/// Counts one request in flight towards a pod until dropped.
pub type InFlightGuard = crate::metrics::CountGuard;

/// Counts a request's prompt tokens to prefill on a pod until dropped.
pub type AmountGuard = crate::metrics::AmountGuard;

/// What peers publish about the requests they sent, summed per target pod.
struct MeshLoad {
    in_flight: HashMap<String, u32>,
    prefill: HashMap<String, u64>,
}

/// Why a pod could not be added.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FleetError {
    #[error("the fleet already tracks {MAX_PODS} pods")]
    Full,
    #[error("pod {0} is this sidecar's own identity")]
    Local(String),
}

impl Fleet {
    /// A fleet holding only the local pod.
    pub fn new(local: PodInfo) -> Self {
        let local_id = local.id.clone();
        let mut pods = BTreeMap::new();
        pods.insert(local_id.clone(), PodState::new(local));
        Self {
            local_id,
            pods: RwLock::new(pods),
            remote_in_flight: RwLock::new(HashMap::new()),
            remote_prefill: RwLock::new(HashMap::new()),
            received: Arc::new(AtomicU32::new(0)),
            ranks: ranks::Ranks::default(),
            outliers: outlier::Outliers::default(),
            held: held::Held::default(),
            departed: parking_lot::Mutex::new(std::collections::VecDeque::new()),
        }
    }

    /// The local engine's data-parallel ranks (empty without).
    pub fn ranks(&self) -> &ranks::Ranks {
        &self.ranks
    }

    pub fn local_id(&self) -> &str {
        &self.local_id
    }

    /// Adds a peer or refreshes what it announced; its load and health stay.
    pub fn upsert_peer(&self, info: PodInfo) -> Result<(), FleetError> {
        self.upsert_with(info, |_| {})
    }

    /// A peer as its Valkey record describes it: who it is, its load as of
    /// `at`, its health and its own in-flight count, under one lock (a
    /// lookup refreshes every candidate on every decision).
    pub fn upsert_reported(
        &self,
        info: PodInfo,
        load: EngineLoad,
        at: Instant,
        healthy: bool,
        in_flight: u32,
    ) -> Result<(), FleetError> {
        self.upsert_with(info, |s| {
            s.load = load;
            s.load_at = Some(at);
            s.healthy = healthy;
            s.reported_in_flight = in_flight;
        })
    }

    fn upsert_with(&self, info: PodInfo, f: impl FnOnce(&mut PodState)) -> Result<(), FleetError> {
        if info.id == self.local_id {
            return Err(FleetError::Local(info.id));
        }
        let mut pods = self.pods.write();
        if let Some(state) = pods.get_mut(&info.id) {
            state.info = info;
            f(state);
            return Ok(());
        }
        if pods.len() >= MAX_PODS {
            return Err(FleetError::Full);
        }
        let mut state = PodState::new(info);
        f(&mut state);
        pods.insert(state.info.id.clone(), state);
        Ok(())
    }

    /// Forgets a peer that left (the local pod stays); returns whether it
    /// was known. It may drain: calls in flight to it go on, and for
    /// [`DEPARTED_GRACE`] it may still be forwarded to.
    pub fn remove_peer(&self, id: &str) -> bool {
        let Some(gone) = self.remove(id) else {
            return false;
        };
        if let Some(addr) = gone.info.sidecar_addr {
            let mut d = self.departed.lock();
            if d.len() >= MAX_DEPARTED {
                d.pop_front();
            }
            d.push_back((addr, Instant::now()));
        }
        true
    }

    /// Forgets a peer declared unreachable (its mesh stream silent past
    /// `mesh.stale_after`: a partition, a host gone without closing its
    /// connections); returns whether it was known. Unlike a peer that
    /// left, it is not forwarded to again until it is back, and the calls
    /// still waiting for its response head fail now ([`Fleet::lost_signal`]),
    /// so that their requests go to a pod that answers instead of waiting
    /// out `timeouts.first_byte`. A call whose response began is left to the
    /// stream deadlines (a stream migrates after `stream_idle`).
    pub fn cut_off_peer(&self, id: &str) -> bool {
        let Some(gone) = self.remove(id) else {
            return false;
        };
        gone.lost.cancel();
        if let Some(addr) = gone.info.sidecar_addr {
            // It may have left once before and come back within the grace.
            self.departed.lock().retain(|(a, _)| *a != addr);
        }
        true
    }

    fn remove(&self, id: &str) -> Option<PodState> {
        if id == self.local_id {
            return None;
        }
        self.remote_in_flight.write().remove(id);
        self.remote_prefill.write().remove(id);
        self.outliers.forget(id);
        self.pods.write().remove(id)
    }

    /// A token cancelled when the peer whose sidecar is at `addr` is cut off
    /// ([`Fleet::cut_off_peer`]); `None` when no peer in the fleet is there
    /// (a peer that left and drains: nothing cuts its calls short).
    pub fn lost_signal(&self, addr: SocketAddr) -> Option<tokio_util::sync::CancellationToken> {
        self.pods
            .read()
            .values()
            .find(|s| s.info.sidecar_addr == Some(addr))
            .map(|s| s.lost.clone())
    }

    /// Records a pod's engine load, as scraped (local) or published (peers).
    pub fn set_load(&self, id: &str, load: EngineLoad, now: Instant) {
        if let Some(state) = self.pods.write().get_mut(id) {
            state.load = load;
            state.load_at = Some(now);
        }
    }

    /// Replaces the LoRA adapters a pod's engine has loaded (the local
    /// engine's as its sidecar learns them, a peer's as it publishes them);
    /// returns whether they changed.
    pub fn set_lora_adapters(&self, id: &str, adapters: Vec<String>) -> bool {
        match self.pods.write().get_mut(id) {
            Some(state) if state.info.lora_adapters != adapters => {
                state.info.lora_adapters = adapters;
                true
            }
            _ => false,
        }
    }

    pub fn set_healthy(&self, id: &str, healthy: bool) {
        if let Some(state) = self.pods.write().get_mut(id) {
            state.healthy = healthy;
        }
    }

    /// Changes a pod's cumulative counters (scraped locally, published by peers).
    pub fn update_stats(&self, id: &str, f: impl FnOnce(&mut crate::stat::PodStats)) {
        if let Some(state) = self.pods.write().get_mut(id) {
            f(&mut state.stats);
        }
    }

    /// Every pod's cumulative counters, by pod id.
    pub fn stats(&self) -> BTreeMap<String, crate::stat::PodStats> {
        self.pods
            .read()
            .iter()
            .map(|(id, s)| (id.clone(), s.stats))
            .collect()
    }

    /// Replaces what `reporter` last published about its in-flight requests.
    pub fn set_remote_in_flight(&self, reporter: &str, counts: HashMap<String, u32>) {
        if reporter == self.local_id || !self.pods.read().contains_key(reporter) {
            return;
        }
        self.remote_in_flight
            .write()
            .insert(reporter.to_owned(), counts);
    }

    /// Replaces what `reporter` last published about the prompt tokens it
    /// sent that wait to be prefilled.
    pub fn set_remote_prefill(&self, reporter: &str, tokens: HashMap<String, u64>) {
        if reporter == self.local_id || !self.pods.read().contains_key(reporter) {
            return;
        }
        self.remote_prefill
            .write()
            .insert(reporter.to_owned(), tokens);
    }

    /// Counts `tokens` of a request's prompt as waiting to be prefilled on
    /// `id` until the guard drops: at the request's first token (`None`:
    /// unknown pod, or nothing to prefill).
    pub fn begin_prefill(&self, id: &str, tokens: u64) -> Option<AmountGuard> {
        if tokens == 0 {
            return None;
        }
        let pods = self.pods.read();
        let counter = pods.get(id)?.prefill.clone();
        Some(AmountGuard::new(counter, tokens))
    }

    /// [`Fleet::begin_prefill`] for the tokens the scheduler priced at
    /// `id`, out of `priced` (pod, uncached tokens): a request's prompt
    /// counts where it is computed, wherever the plan placed that. A pod
    /// it did not price (an llm-d prefiller named by the gateway) counts
    /// none.
    pub fn begin_priced_prefill(&self, id: &str, priced: &[(String, u64)]) -> Option<AmountGuard> {
        let (_, tokens) = priced.iter().find(|(pod, _)| pod == id)?;
        self.begin_prefill(id, *tokens)
    }

    /// What this sidecar publishes to its peers: the prompt tokens it sent
    /// that wait to be prefilled, per target. Requests peers forwarded here
    /// are not among them (their forwarders count and publish them).
    pub fn published_prefill(&self) -> HashMap<String, u64> {
        self.pods
            .read()
            .iter()
            .map(|(id, s)| (id.clone(), s.prefill.load(Ordering::Relaxed)))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// Counts a request towards `id` until the guard drops (`None`: unknown pod).
    pub fn begin(&self, id: &str) -> Option<InFlightGuard> {
        let pods = self.pods.read();
        let counter = pods.get(id)?.in_flight.clone();
        counter.fetch_add(1, Ordering::Relaxed);
        Some(InFlightGuard::new(counter))
    }

    /// Counts a request a peer forwarded here (already routed) towards the
    /// local pod until the guard drops.
    pub fn begin_received(&self) -> Option<InFlightGuard> {
        let g = self.begin(&self.local_id)?;
        self.received.fetch_add(1, Ordering::Relaxed);
        Some(g.and(self.received.clone()))
    }

    /// What this sidecar publishes to its peers: its in-flight counts per
    /// target, less the requests peers forwarded here (their forwarders
    /// publish those), so no request is counted twice across the mesh; and
    /// the requests it holds per pool, under [`held::target`].
    pub fn published_in_flight(&self) -> HashMap<String, u32> {
        let received = self.received.load(Ordering::Relaxed);
        let mut counts = self.local_in_flight();
        if let Some(n) = counts.get_mut(&self.local_id) {
            *n = n.saturating_sub(received);
        }
        counts.retain(|_, n| *n > 0);
        counts.extend(self.held.published());
        counts
    }

    /// Counts a request this sidecar holds for the pool of `role` (flow
    /// control) until the guard drops.
    pub fn begin_held(&self, role: Role) -> InFlightGuard {
        self.held.begin(role)
    }

    /// This sidecar's own in-flight counts per target, for publishing to peers.
    pub fn local_in_flight(&self) -> HashMap<String, u32> {
        self.pods
            .read()
            .iter()
            .map(|(id, s)| (id.clone(), s.in_flight.load(Ordering::Relaxed)))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// Where requests for `id` go: `None` for the local engine or an unknown pod.
    pub fn sidecar_addr(&self, id: &str) -> Option<SocketAddr> {
        self.pods.read().get(id).and_then(|s| s.info.sidecar_addr)
    }

    pub fn contains(&self, id: &str) -> bool {
        self.pods.read().contains_key(id)
    }

    /// Whether `addr` is a known peer's sidecar, or one that left discovery
    /// within [`DEPARTED_GRACE`] (it drains): only those may be forwarded to.
    pub fn is_peer_addr(&self, addr: SocketAddr) -> bool {
        self.is_peer_addr_at(addr, Instant::now())
    }

    fn is_peer_addr_at(&self, addr: SocketAddr, now: Instant) -> bool {
        if self
            .pods
            .read()
            .values()
            .any(|s| s.info.sidecar_addr == Some(addr))
        {
            return true;
        }
        let mut d = self.departed.lock();
        while d
            .front()
            .is_some_and(|(_, at)| now.saturating_duration_since(*at) > DEPARTED_GRACE)
        {
            d.pop_front();
        }
        d.iter().any(|(a, _)| *a == addr)
    }

    /// The sidecar addresses of the peers at `ip` (at most two: enough to
    /// tell one from several).
    pub fn peer_addrs_at(&self, ip: std::net::IpAddr) -> Vec<SocketAddr> {
        self.pods
            .read()
            .values()
            .filter_map(|s| s.info.sidecar_addr)
            .filter(|a| a.ip() == ip)
            .take(2)
            .collect()
    }

    /// The identity of the peer whose sidecar listens on `addr`.
    pub fn peer_id(&self, addr: SocketAddr) -> Option<String> {
        self.pods
            .read()
            .iter()
            .find(|(_, s)| s.info.sidecar_addr == Some(addr))
            .map(|(id, _)| id.clone())
    }

    /// The pods as scheduler endpoint views, with `matched_blocks(pod id)` as
    /// each pod's prefix match for the request at hand.
    pub fn endpoints(
        &self,
        now: Instant,
        block_size: u32,
        matched_blocks: impl Fn(&str) -> u32,
    ) -> Vec<EndpointView> {
        self.views(now, block_size, &matched_blocks, |_| true)
    }

    /// [`Fleet::endpoints`] of the local pod and the pods named in `ids`
    /// (the candidates of an index lookup), found by id: the cost follows
    /// the candidates, not the fleet.
    pub fn endpoints_of<'a>(
        &self,
        now: Instant,
        block_size: u32,
        matched_blocks: impl Fn(&str) -> u32,
        ids: impl IntoIterator<Item = &'a str>,
    ) -> Vec<EndpointView> {
        let mesh = self.mesh_load();
        let pods = self.pods.read();
        let mut picked: Vec<(&String, &PodState)> = ids
            .into_iter()
            .filter(|id| *id != self.local_id)
            .filter_map(|id| pods.get_key_value(id))
            .collect();
        picked.extend(pods.get_key_value(&self.local_id));
        // In id order, as `endpoints` lists them, once each.
        picked.sort_unstable_by(|a, b| a.0.cmp(b.0));
        picked.dedup_by(|a, b| a.0 == b.0);
        picked
            .into_iter()
            .map(|(id, s)| self.view(id, s, &mesh, now, block_size, &matched_blocks))
            .collect()
    }

    /// [`Fleet::endpoints`] of the pods `keep` picks by what they announced,
    /// with no prefix match: flow control reads one pool's loads this way,
    /// every few milliseconds while the pool is saturated, and builds no
    /// view of the pods of other pools.
    pub fn endpoints_where(
        &self,
        now: Instant,
        keep: impl Fn(&PodInfo) -> bool,
    ) -> Vec<EndpointView> {
        self.views(now, 0, &|_| 0, keep)
    }

    /// The views of the pods `keep` picks, in id order.
    fn views(
        &self,
        now: Instant,
        block_size: u32,
        matched_blocks: &impl Fn(&str) -> u32,
        keep: impl Fn(&PodInfo) -> bool,
    ) -> Vec<EndpointView> {
        let mesh = self.mesh_load();
        self.pods
            .read()
            .iter()
            .filter(|(_, s)| keep(&s.info))
            .map(|(id, s)| self.view(id, s, &mesh, now, block_size, matched_blocks))
            .collect()
    }

    fn view(
        &self,
        id: &str,
        s: &PodState,
        mesh: &MeshLoad,
        now: Instant,
        block_size: u32,
        matched_blocks: &impl Fn(&str) -> u32,
    ) -> EndpointView {
        let local = s.in_flight.load(Ordering::Relaxed);
        let others = s.others_in_flight(id, &mesh.in_flight);
        let prefill = s.prefill.load(Ordering::Relaxed);
        let others_prefill = mesh.prefill.get(id).copied().unwrap_or(0);
        let load_block_size = if s.load.block_size > 0 {
            s.load.block_size
        } else {
            block_size
        };
        EndpointView {
            id: id.to_owned(),
            address: s
                .info
                .sidecar_addr
                .map_or_else(|| id.to_owned(), |a| a.to_string()),
            role: s.info.role,
            models: s.info.models.clone(),
            lora_adapters: s.info.lora_adapters.clone(),
            labels: s.info.labels.clone(),
            load: LoadSnapshot {
                waiting: s.load.waiting,
                running: s.load.running,
                in_flight: local.saturating_add(others),
                kv_usage: s.load.kv_usage,
                block_size: load_block_size,
                num_blocks: s.load.num_blocks,
                prefill_tokens: prefill.saturating_add(others_prefill),
            },
            prefix: PrefixMatch {
                matched_blocks: matched_blocks(id),
                block_size: load_block_size,
            },
            // An ejected pod is skipped like an unhealthy one.
            healthy: s.healthy && self.outliers.ejected_for(id, now).is_none(),
            staleness_ms: s.load_age_ms(now).unwrap_or(u64::MAX),
        }
    }

    /// The local pod, as [`Fleet::snapshot`] shows it.
    pub fn local_snapshot(&self, now: Instant) -> PodSnapshot {
        let mesh = self.mesh_in_flight();
        let pods = self.pods.read();
        let Some(s) = pods.get(&self.local_id) else {
            // The local pod is never removed; a fleet without it reads empty.
            return PodSnapshot {
                info: PodInfo {
                    id: self.local_id.clone(),
                    sidecar_addr: None,
                    role: Role::default(),
                    models: Vec::new(),
                    lora_adapters: Vec::new(),
                    labels: BTreeMap::new(),
                },
                load: EngineLoad::default(),
                load_age_ms: None,
                healthy: false,
                in_flight_local: 0,
                in_flight_mesh: 0,
                held: HeldCounts::default(),
                ejected_ms: None,
                ejections: 0,
            };
        };
        self.pod_snapshot(&self.local_id, s, &mesh, now)
    }

    /// Peers whose load was last refreshed `age` or longer ago (never:
    /// counted from when they were added), for the Valkey backend to forget.
    pub fn peers_older_than(&self, now: Instant, age: std::time::Duration) -> Vec<String> {
        self.pods
            .read()
            .iter()
            .filter(|(id, _)| **id != self.local_id)
            .filter(|(_, s)| now.saturating_duration_since(s.load_at.unwrap_or(s.added_at)) >= age)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Every pod, for the admin port.
    pub fn snapshot(&self, now: Instant) -> Vec<PodSnapshot> {
        let mesh = self.mesh_in_flight();
        self.pods
            .read()
            .iter()
            .map(|(id, s)| self.pod_snapshot(id, s, &mesh, now))
            .collect()
    }

    fn pod_snapshot(
        &self,
        id: &str,
        s: &PodState,
        mesh: &HashMap<String, u32>,
        now: Instant,
    ) -> PodSnapshot {
        PodSnapshot {
            info: s.info.clone(),
            load: s.load,
            load_age_ms: s.load_age_ms(now),
            healthy: s.healthy,
            in_flight_local: s.in_flight.load(Ordering::Relaxed),
            in_flight_mesh: s.others_in_flight(id, mesh),
            held: self.held_by(id),
            ejected_ms: self
                .outliers
                .ejected_for(id, now)
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            ejections: self.outliers.ejections(id),
        }
    }

    /// Records a failed call to pod `id` (see [`outlier`]); returns how long
    /// it was ejected for when this failure ejected it.
    pub fn call_failed(&self, id: &str, now: Instant) -> Option<std::time::Duration> {
        let pods = self.pods.read().len();
        match self.outliers.failure(id, pods, now) {
            outlier::Verdict::Ejected(d) => Some(d),
            outlier::Verdict::Counted => None,
        }
    }

    /// Records a call pod `id` served.
    pub fn call_served(&self, id: &str, now: Instant) {
        self.outliers.success(id, now);
    }

    /// Whether pod `id` is ejected now.
    pub fn ejected(&self, id: &str, now: Instant) -> bool {
        self.outliers.ejected_for(id, now).is_some()
    }

    /// Pods ejected now.
    pub fn ejected_count(&self, now: Instant) -> usize {
        self.outliers.ejected_count(now)
    }

    /// Peers' published in-flight counts and prompt tokens to prefill,
    /// summed per target.
    fn mesh_load(&self) -> MeshLoad {
        MeshLoad {
            in_flight: self.mesh_in_flight(),
            // Unlike request counts, the local pod's tokens count too: a
            // request a peer forwarded here is counted by that peer only.
            prefill: sum_reports(&self.remote_prefill.read(), None, u64::saturating_add),
        }
    }

    /// The requests pod `id`'s sidecar holds per pool: this sidecar's own,
    /// or what that peer last published.
    fn held_by(&self, id: &str) -> HeldCounts {
        if id == self.local_id {
            return self.held.counts();
        }
        self.remote_in_flight
            .read()
            .get(id)
            .map(HeldCounts::from_report)
            .unwrap_or_default()
    }

    /// Peers' published in-flight counts, summed per target. The local
    /// pod's own count is exact (requests forwarded here are counted on
    /// arrival); peers' reports of it would count them twice.
    fn mesh_in_flight(&self) -> HashMap<String, u32> {
        let local = Some(self.local_id.as_str());
        sum_reports(&self.remote_in_flight.read(), local, u32::saturating_add)
    }
}

/// Peers' reports (reporter -> target -> amount) summed per target with
/// `add`, leaving out the target `skip`.
fn sum_reports<N: Copy + Default>(
    reports: &HashMap<String, HashMap<String, N>>,
    skip: Option<&str>,
    add: fn(N, N) -> N,
) -> HashMap<String, N> {
    let mut sum: HashMap<String, N> = HashMap::new();
    for (target, n) in reports.values().flatten() {
        if Some(target.as_str()) != skip {
            let slot = sum.entry(target.clone()).or_default();
            *slot = add(*slot, *n);
        }
    }
    sum
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("local_id", &self.local_id)
            .field("pods", &self.pods.read().len())
            .finish()
    }
}

impl PodState {
    fn new(info: PodInfo) -> Self {
        Self {
            info,
            load: EngineLoad::default(),
            load_at: None,
            healthy: true,
            in_flight: Arc::new(AtomicU32::new(0)),
            prefill: Arc::new(AtomicU64::new(0)),
            stats: crate::stat::PodStats::default(),
            added_at: Instant::now(),
            reported_in_flight: 0,
            lost: tokio_util::sync::CancellationToken::new(),
        }
    }

    /// Requests in flight to this pod from other sidecars: the mesh's
    /// published counts, or the pod's own count from its Valkey record,
    /// whichever is larger (one of them is 0 on either backend).
    fn others_in_flight(&self, id: &str, mesh: &HashMap<String, u32>) -> u32 {
        mesh.get(id)
            .copied()
            .unwrap_or(0)
            .max(self.reported_in_flight)
    }

    fn load_age_ms(&self, now: Instant) -> Option<u64> {
        self.load_at.map(|at| {
            u64::try_from(now.saturating_duration_since(at).as_millis()).unwrap_or(u64::MAX)
        })
    }
}

impl crate::request::Peers for Fleet {
    fn local_id(&self) -> &str {
        Fleet::local_id(self)
    }

    fn peer_id(&self, addr: SocketAddr) -> Option<String> {
        Fleet::peer_id(self, addr)
    }

    fn is_peer_addr(&self, addr: SocketAddr) -> bool {
        Fleet::is_peer_addr(self, addr)
    }

    fn lost_signal(&self, addr: SocketAddr) -> Option<tokio_util::sync::CancellationToken> {
        Fleet::lost_signal(self, addr)
    }
}

#[cfg(test)]
mod tests;
