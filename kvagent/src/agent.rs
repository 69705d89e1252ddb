//! The agent: shared state, start-up and shutdown, and the local operations (register, reserve,
//! wait, free, status). Sending lives in `transfer`, the peer side in `peer`.
//!
//! All bookkeeping sits behind one short-held lock ([`State`]); no lock is held across an await
//! or a bulk copy. Waiters sleep on one `Notify` that fires whenever a lease changes state.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Serialize;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{AgentConfig, SocketConfig};
use crate::error::{Error, ErrorCode, Result};
use crate::metrics::Metrics;
use crate::peer::link::PeerLink;
use crate::peer::proto::Ctrl;
use crate::planner::Caps;
use crate::regions::{LeaseState, Region, Registry};
use crate::shm::Mapping;
use crate::types::{BlockLayout, TransferId};

/// A transfer being received from a peer session.
pub(crate) struct Incoming {
    pub region: u64,
    pub tid: TransferId,
    pub map: Arc<Mapping>,
    pub layout: BlockLayout,
    pub blocks: Vec<u32>,
    pub expected: u64,
    pub received: u64,
    pub writers: u32,
    pub aborted: bool,
    pub started: Instant,
    /// The receiving queue pair of an RDMA transfer; dropping it (destroying the QP) stops any
    /// further WRITE into the landing blocks, so it goes before the blocks are released.
    pub rdma: Option<crate::rdma::Endpoint>,
}

/// Bookkeeping under the agent's lock.
pub(crate) struct State {
    pub reg: Registry,
    /// Keyed by (session, seq).
    pub incoming: HashMap<(u64, u64), Incoming>,
    /// Control writers of incoming sessions.
    pub sessions: HashMap<u64, mpsc::Sender<Ctrl>>,
}

/// The listeners an agent serves.
#[derive(Debug)]
pub struct Listeners {
    /// The local API socket.
    pub local: UnixListener,
    /// The agent-to-agent port.
    pub peer: TcpListener,
    /// The admin (metrics) port, if any.
    pub admin: Option<TcpListener>,
}

/// One region as `status` reports it.
#[derive(Debug, Clone, Serialize)]
pub struct RegionStatus {
    /// Id.
    pub id: u64,
    /// Name.
    pub name: String,
    /// Layout.
    pub layout: BlockLayout,
    /// Free blocks.
    pub free_blocks: u32,
}

/// What `status` reports.
#[derive(Debug, Clone, Serialize)]
pub struct AgentStatus {
    /// Agent id.
    pub agent_id: String,
    /// Address peers use.
    pub address: String,
    /// Capabilities.
    pub caps: Vec<&'static str>,
    /// Regions.
    pub regions: Vec<RegionStatus>,
    /// Leases held.
    pub leases: usize,
    /// Transfers being received.
    pub incoming: usize,
}

/// The running agent.
pub struct Agent {
    pub(crate) cfg: AgentConfig,
    pub(crate) state: Mutex<State>,
    pub(crate) notify: Notify,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) peers: tokio::sync::Mutex<HashMap<String, Arc<PeerLink>>>,
    pub(crate) stop: CancellationToken,
    pub(crate) tasks: TaskTracker,
    pub(crate) caps: Caps,
    pub(crate) address: String,
    /// The RDMA device, when one opened at start (see `rdma`).
    pub(crate) rdma: Option<Arc<crate::rdma::RdmaEngine>>,
    /// Device buffers of GPU regions (see `gpu`).
    pub(crate) gpu: crate::gpu::GpuRegions,
    ids: AtomicU64,
}

/// Handle to a started agent; dropping it does not stop the agent, [`AgentHandle::shutdown`] does.
pub struct AgentHandle {
    /// The agent.
    pub agent: Arc<Agent>,
    /// Bound peer address.
    pub peer_addr: SocketAddr,
    /// Bound admin address.
    pub admin_addr: Option<SocketAddr>,
}

impl AgentHandle {
    /// Stop every task and wait for them.
    pub async fn shutdown(self) {
        self.agent.stop.cancel();
        self.agent.tasks.close();
        self.agent.tasks.wait().await;
    }
}

/// Bind the local socket with the permissions of `cfg` (0600, or 0660 with a group).
pub fn bind_local(cfg: &SocketConfig) -> Result<UnixListener> {
    if cfg.path.exists() {
        std::fs::remove_file(&cfg.path)?;
    }
    let listener = UnixListener::bind(&cfg.path)?;
    let mode = if cfg.group.is_some() { 0o660 } else { 0o600 };
    std::fs::set_permissions(&cfg.path, std::fs::Permissions::from_mode(mode))?;
    if let Some(gid) = cfg.group {
        std::os::unix::fs::chown(&cfg.path, None, Some(gid))?;
    }
    Ok(listener)
}

/// Open the RDMA device when configured; on any failure log why and run without (TCP only).
fn open_rdma(cfg: &crate::rdma::RdmaConfig) -> Option<Arc<crate::rdma::RdmaEngine>> {
    if !cfg.enabled {
        tracing::info!("RDMA off (--rdma off)");
        return None;
    }
    match crate::rdma::RdmaEngine::open(cfg) {
        Ok(engine) => {
            tracing::info!(device = engine.device(), "RDMA on");
            Some(engine)
        }
        Err(e) => {
            tracing::info!(reason = %e, "RDMA unavailable; remote transfers use TCP");
            None
        }
    }
}

impl Agent {
    /// Start serving on `listeners`.
    pub fn start(cfg: AgentConfig, listeners: Listeners) -> Result<AgentHandle> {
        cfg.validate()?;
        let peer_addr = listeners.peer.local_addr()?;
        let admin_addr = listeners
            .admin
            .as_ref()
            .map(|l| l.local_addr())
            .transpose()?;
        let address = cfg
            .advertise
            .clone()
            .unwrap_or_else(|| peer_addr.to_string());
        let metrics = Arc::new(Metrics::new());
        let rdma = open_rdma(&cfg.rdma);
        metrics.set_rdma_available(rdma.is_some());
        let cuda_caps = crate::cuda::caps();
        let rdma_caps = match (&rdma, cuda_caps) {
            (None, _) => 0,
            (Some(_), 0) => Caps::RDMA,
            // GPU-direct needs dma-buf support too; a failed registration falls back per transfer.
            (Some(_), _) => Caps::RDMA | Caps::GPU_DIRECT,
        };
        let caps = Caps(Caps::TCP | rdma_caps | cuda_caps);
        let agent = Arc::new(Agent {
            state: Mutex::new(State {
                reg: Registry::new(cfg.limits),
                incoming: HashMap::new(),
                sessions: HashMap::new(),
            }),
            cfg,
            notify: Notify::new(),
            metrics,
            peers: tokio::sync::Mutex::new(HashMap::new()),
            stop: CancellationToken::new(),
            tasks: TaskTracker::new(),
            caps,
            address,
            rdma,
            gpu: crate::gpu::GpuRegions::default(),
            ids: AtomicU64::new(1),
        });
        tracing::info!(agent = %agent.cfg.agent_id, %peer_addr, caps = ?caps.names(), "kvagent started");
        let a = Arc::clone(&agent);
        agent
            .tasks
            .spawn(crate::local::server::serve(a, listeners.local));
        let a = Arc::clone(&agent);
        agent
            .tasks
            .spawn(crate::peer::server::serve(a, listeners.peer));
        let a = Arc::clone(&agent);
        agent.tasks.spawn(reaper(a));
        if let Some(l) = listeners.admin {
            let m = Arc::clone(&agent.metrics);
            agent.tasks.spawn(crate::metrics::serve_admin(
                l,
                m,
                agent.stop.clone(),
                agent.tasks.clone(),
            ));
        }
        Ok(AgentHandle {
            agent,
            peer_addr,
            admin_addr,
        })
    }

    /// A fresh id for connections, sessions and sequences.
    pub(crate) fn next_id(&self) -> u64 {
        self.ids.fetch_add(1, Ordering::Relaxed)
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Clamp a client's deadline.
    pub(crate) fn deadline(&self, ms: Option<u64>) -> Duration {
        ms.map_or(self.cfg.default_deadline, Duration::from_millis)
            .min(self.cfg.max_deadline)
    }

    pub(crate) fn update_usage(&self, st: &State) {
        self.metrics
            .set_usage(st.reg.registered_bytes(), st.reg.lease_count());
    }

    /// Register a client's memfd as a region.
    pub fn register(
        &self,
        owner: u64,
        name: String,
        layout: BlockLayout,
        fd: OwnedFd,
    ) -> Result<Arc<Region>> {
        let len = layout.validate(self.cfg.limits.max_region_bytes)?;
        let map = Arc::new(Mapping::from_client_fd(fd, len)?);
        let mut st = self.state.lock();
        let region = st.reg.register(name, layout, map, owner)?;
        self.update_usage(&st);
        tracing::info!(region = region.id, name = %region.name, ?layout, "region registered");
        Ok(region)
    }

    /// Register GPU memory from a CUDA IPC handle (128 hex digits): the device buffer is opened
    /// (`cuda_unavailable` without CUDA, and the connection keeps serving) and a host shadow of
    /// the same layout is created for the paths through host memory (see `gpu`).
    pub fn register_gpu(
        &self,
        owner: u64,
        name: String,
        layout: BlockLayout,
        device: i32,
        ipc_handle: &str,
    ) -> Result<Arc<Region>> {
        let handle = crate::cuda::IpcHandle::from_hex(ipc_handle)?;
        let len = layout.validate(self.cfg.limits.max_region_bytes)?;
        if device < 0 {
            return Err(Error::BadRequest(
                "device must be a CUDA ordinal (>= 0)".into(),
            ));
        }
        let gpu = Arc::new(crate::cuda::open_ipc(&handle, device, len)?);
        let shadow = Arc::new(Mapping::create(&format!("kvagent-gpu-{name}"), len)?);
        let mut st = self.state.lock();
        let region = st.reg.register(name, layout, shadow, owner)?;
        self.gpu.insert(region.id, gpu);
        self.update_usage(&st);
        tracing::info!(region = region.id, name = %region.name, device, ?layout, "GPU region registered");
        Ok(region)
    }

    /// Unregister a region; its leases end and transfers into it abort.
    pub fn unregister(&self, id: u64) -> Result<()> {
        self.gpu.remove(id);
        let mut st = self.state.lock();
        let keys: Vec<_> = st
            .incoming
            .iter()
            .filter(|(_, i)| i.region == id)
            .map(|(k, _)| *k)
            .collect();
        for k in keys {
            abort_incoming_locked(
                self,
                &mut st,
                k,
                ErrorCode::UnknownRegion,
                "region unregistered",
            );
        }
        for tid in st.reg.unregister(id)? {
            st.reg
                .record_failure(&tid, ErrorCode::UnknownRegion, "region unregistered".into());
        }
        self.update_usage(&st);
        drop(st);
        self.notify.notify_waiters();
        Ok(())
    }

    /// A local connection closed: drop the regions it registered.
    pub(crate) fn drop_owner(&self, owner: u64) {
        let ids = self.state.lock().reg.owned_by(owner);
        for id in ids {
            let _ = self.unregister(id);
        }
    }

    /// Reserve `n` blocks of a region for `tid`.
    pub fn reserve(&self, region: u64, tid: &TransferId, n: u32) -> Result<Vec<u32>> {
        let mut st = self.state.lock();
        let expires = Instant::now() + self.cfg.lease_ttl;
        st.reg.clear_failure(tid);
        let r = st
            .reg
            .reserve(region, tid, n, LeaseState::Reserved, expires);
        self.update_usage(&st);
        r
    }

    /// Wait until `tid`'s blocks have arrived (in `region`, or in any region).
    pub async fn wait(
        &self,
        region: Option<u64>,
        tid: &TransferId,
        deadline: Duration,
    ) -> Result<(u64, Vec<u32>)> {
        let (r, blocks) = self.wait_arrived(region, tid, deadline).await?;
        if let Some(gpu) = self.gpu.get(r) {
            // A GPU client finds its blocks in its own GPU memory.
            let reg = self.state.lock().reg.region(r)?;
            crate::gpu::GpuRegions::upload(gpu, Arc::clone(&reg.map), reg.layout, blocks.clone())
                .await?;
        }
        Ok((r, blocks))
    }

    async fn wait_arrived(
        &self,
        region: Option<u64>,
        tid: &TransferId,
        deadline: Duration,
    ) -> Result<(u64, Vec<u32>)> {
        let until = tokio::time::Instant::now() + deadline;
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = self.state.lock();
                if let Some(r) = region {
                    st.reg.region(r)?;
                }
                let regions: Vec<u64> = match region {
                    Some(r) => vec![r],
                    None => st.reg.owned_by_any(),
                };
                for r in regions {
                    if let Some(l) = st.reg.lease(r, tid) {
                        if l.state == LeaseState::Arrived {
                            return Ok((r, l.blocks.clone()));
                        }
                    }
                }
                if let Some(err) = st.reg.failure(tid) {
                    return Err(err);
                }
            }
            if tokio::time::timeout_at(until, notified).await.is_err() {
                return Err(Error::Timeout(format!(
                    "blocks of {tid} did not arrive in {deadline:?}"
                )));
            }
        }
    }

    /// End `tid`'s lease in `region`.
    pub fn free(&self, region: u64, tid: &TransferId) -> Result<()> {
        let mut st = self.state.lock();
        let key = st
            .incoming
            .iter()
            .find(|(_, i)| i.region == region && &i.tid == tid)
            .map(|(k, _)| *k);
        if let Some(k) = key {
            abort_incoming_locked(self, &mut st, k, ErrorCode::Aborted, "freed by the client");
        } else if !st.reg.release(region, tid) {
            return Err(Error::UnknownTransfer(tid.to_string()));
        }
        self.update_usage(&st);
        Ok(())
    }

    /// A snapshot for the `status` call.
    pub fn status(&self) -> AgentStatus {
        let st = self.state.lock();
        let mut regions: Vec<RegionStatus> = st
            .reg
            .owned_by_any()
            .into_iter()
            .filter_map(|id| st.reg.region(id).ok())
            .map(|r| RegionStatus {
                id: r.id,
                name: r.name.clone(),
                layout: r.layout,
                free_blocks: st.reg.free_blocks(r.id),
            })
            .collect();
        regions.sort_by_key(|r| r.id);
        AgentStatus {
            agent_id: self.cfg.agent_id.clone(),
            address: self.address.clone(),
            caps: self.caps.names(),
            regions,
            leases: st.reg.lease_count(),
            incoming: st.incoming.len(),
        }
    }
}

/// Abort an incoming transfer: tell the sender, remember the cause for the waiter, and free its
/// blocks now or, if a socket read is still writing into them, when the last one finishes.
pub(crate) fn abort_incoming_locked(
    agent: &Agent,
    st: &mut State,
    key: (u64, u64),
    code: ErrorCode,
    why: &str,
) {
    let Some(inc) = st.incoming.get_mut(&key) else {
        return;
    };
    if inc.aborted {
        return;
    }
    inc.aborted = true;
    inc.rdma = None;
    let (region, tid, writers) = (inc.region, inc.tid.clone(), inc.writers);
    tracing::warn!(transfer = %tid, session = key.0, cause = code.as_str(), why, "incoming transfer aborted");
    agent.metrics.failure(code, "receive");
    st.reg.record_failure(&tid, code, why.to_string());
    if writers == 0 {
        st.incoming.remove(&key);
        st.reg.release(region, &tid);
    } else {
        let _ = st
            .reg
            .set_state(region, &tid, LeaseState::Draining, Instant::now());
    }
    if let Some(tx) = st.sessions.get(&key.0) {
        let _ = tx.try_send(Ctrl::Failed {
            seq: key.1,
            code,
            message: why.to_string(),
        });
    }
    agent.update_usage(st);
    agent.notify.notify_waiters();
}

/// Free whatever expired, every 50 ms, until shutdown.
async fn reaper(agent: Arc<Agent>) {
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tokio::select! {
            () = agent.stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = Instant::now();
        let mut st = agent.state.lock();
        for (region, tid, state) in st.reg.expired(now) {
            let key = st
                .incoming
                .iter()
                .find(|(_, i)| i.region == region && i.tid == tid)
                .map(|(k, _)| *k);
            match key {
                Some(k) => abort_incoming_locked(
                    &agent,
                    &mut st,
                    k,
                    ErrorCode::Timeout,
                    "transfer deadline passed",
                ),
                None => {
                    tracing::warn!(transfer = %tid, region, ?state, "lease expired, blocks freed");
                    st.reg.release(region, &tid);
                    let why = format!("lease expired while {state:?}");
                    st.reg.record_failure(&tid, ErrorCode::Timeout, why);
                    agent.metrics.failure(ErrorCode::Timeout, "local");
                    agent.update_usage(&st);
                    agent.notify.notify_waiters();
                }
            }
        }
    }
}
