//! The verbs layer (feature `rdma`): a device context and protection domain per agent, memory
//! regions cached per agent region, and one RC queue pair with its own completion queue per
//! transfer ([`Endpoint`]), driven through [`QpStateMachine`] and [`Completions`].
//!
//! A queue pair per transfer costs a few verbs calls (microseconds to a millisecond) against
//! transfers of megabytes; pooling connected pairs per peer is the next step once measured on
//! hardware. All calls here block (posting and polling spin on the CQ); the agent runs them on the
//! blocking pool.

use std::net::Ipv6Addr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    BasicCompletionQueue, PollCompletionQueueError, WorkCompletionStatus,
};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu, PortState};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, QueuePairType,
    SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::book::{Completions, QpState, QpStateMachine, WriteOp};
use super::wire::{common_mtu, QpInfo, RdmaTarget, MAX_24};
use super::{library_present, MrInfo, RdmaConfig};
use crate::cuda::GpuRegion;
use crate::error::{Error, Result};
use crate::shm::Mapping;

fn unavailable(what: &str, e: impl std::fmt::Display) -> Error {
    Error::RdmaUnavailable(format!("{what}: {e}"))
}

fn mtu_bytes(m: Mtu) -> u32 {
    match m {
        Mtu::Mtu256 => 256,
        Mtu::Mtu512 => 512,
        Mtu::Mtu1024 => 1024,
        Mtu::Mtu2048 => 2048,
        Mtu::Mtu4096 => 4096,
    }
}

fn mtu_of(bytes: u32) -> Mtu {
    match bytes {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

/// A registered region: the MR and the memory it covers (a host mapping or a GPU buffer), kept
/// alive as long as the MR.
struct CachedMr {
    region: u64,
    gpu: bool,
    keep: Arc<dyn std::any::Any + Send + Sync>,
    mr: Arc<MemoryRegion>,
}

impl CachedMr {
    fn holds(&self, region: u64, gpu: bool, what: *const u8) -> bool {
        self.region == region && self.gpu == gpu && Arc::as_ptr(&self.keep).cast::<u8>() == what
    }
}

/// One opened RDMA device.
pub struct RdmaEngine {
    cfg: RdmaConfig,
    device: String,
    ctx: Arc<DeviceContext>,
    pd: Arc<ProtectionDomain>,
    lid: u16,
    gid: Ipv6Addr,
    mtu: u32,
    mrs: Mutex<Vec<CachedMr>>,
}

impl std::fmt::Debug for RdmaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaEngine")
            .field("device", &self.device)
            .field("lid", &self.lid)
            .field("gid", &self.gid)
            .field("mtu", &self.mtu)
            .finish_non_exhaustive()
    }
}

impl RdmaEngine {
    /// Open the configured (or first) device and check its port is active.
    pub fn open(cfg: &RdmaConfig) -> Result<Arc<RdmaEngine>> {
        if !library_present() {
            return Err(Error::RdmaUnavailable("libibverbs.so.1 not found".into()));
        }
        let list = DeviceList::new().map_err(|e| unavailable("device list", e))?;
        let dev = list
            .iter()
            .find(|d| cfg.device.as_deref().is_none_or(|n| d.name() == n))
            .ok_or_else(|| Error::RdmaUnavailable("no RDMA device".into()))?;
        let device = dev.name();
        let ctx = dev.open().map_err(|e| unavailable("open device", e))?;
        let port = ctx
            .query_port(cfg.port)
            .map_err(|e| unavailable("query port", e))?;
        if port.port_state() != PortState::Active {
            return Err(Error::RdmaUnavailable(format!(
                "{device} port {} is not active ({:?})",
                cfg.port,
                port.port_state()
            )));
        }
        let gid = ctx
            .query_gid(cfg.port, u32::from(cfg.gid_index))
            .map_err(|e| unavailable("query GID", e))?;
        let pd = ctx
            .alloc_pd()
            .map_err(|e| unavailable("protection domain", e))?;
        Ok(Arc::new(RdmaEngine {
            cfg: cfg.clone(),
            device,
            lid: port.lid(),
            gid: Ipv6Addr::from(gid),
            mtu: mtu_bytes(port.active_mtu()),
            ctx,
            pd,
            mrs: Mutex::new(Vec::new()),
        }))
    }

    /// The device name.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Register `map` (the memory of agent region `region`) for local use and remote writes,
    /// once; later calls return the cached keys. Entries of regions that are gone (the cache holds
    /// the last reference to their mapping) are dropped first, so the cache stays bounded by the
    /// live regions.
    pub fn register(&self, region: u64, map: &Arc<Mapping>) -> Result<MrInfo> {
        let mut mrs = self.mrs.lock();
        mrs.retain(|c| Arc::strong_count(&c.keep) > 1);
        let what = Arc::as_ptr(map).cast::<u8>();
        if let Some(c) = mrs.iter().find(|c| c.holds(region, false, what)) {
            return Ok(info(&c.mr));
        }
        let base = map_base(map);
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite;
        // SAFETY: the mapping is kept alive by the cache entry for as long as the MR exists.
        let mr = unsafe { self.pd.reg_mr(base, map.len(), access) }
            .map_err(|e| unavailable("register memory", e))?;
        let out = info(&mr);
        mrs.push(CachedMr {
            region,
            gpu: false,
            keep: Arc::clone(map) as Arc<dyn std::any::Any + Send + Sync>,
            mr,
        });
        Ok(out)
    }

    /// Register GPU region `region`'s device buffer for GPU-direct RDMA through a dma-buf
    /// (`ibv_reg_dmabuf_mr`, iova = the device address, so offsets add to it), once.
    pub fn register_gpu(&self, region: u64, gpu: &Arc<GpuRegion>) -> Result<MrInfo> {
        let mut mrs = self.mrs.lock();
        mrs.retain(|c| Arc::strong_count(&c.keep) > 1);
        let what = Arc::as_ptr(gpu).cast::<u8>();
        if let Some(c) = mrs.iter().find(|c| c.holds(region, true, what)) {
            return Ok(info_at(&c.mr, gpu.device_ptr()));
        }
        let fd = gpu.dmabuf_fd()?;
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite;
        // SAFETY: the fd is a dma-buf of the whole buffer, which the cache entry keeps open.
        let mr = unsafe {
            self.pd
                .reg_dmabuf_mr(0, gpu.len(), gpu.device_ptr(), fd.as_raw_fd(), access)
        }
        .map_err(|e| unavailable("register GPU memory (dma-buf)", e))?;
        let out = info_at(&mr, gpu.device_ptr());
        mrs.push(CachedMr {
            region,
            gpu: true,
            keep: Arc::clone(gpu) as Arc<dyn std::any::Any + Send + Sync>,
            mr,
        });
        Ok(out)
    }

    /// A new RC queue pair in INIT, with its completion queue.
    pub fn endpoint(&self) -> Result<Endpoint> {
        let depth = u32::try_from(self.cfg.window).unwrap_or(256).max(1);
        let cq = self
            .ctx
            .create_cq_builder()
            .setup_cqe(depth)
            .build()
            .map_err(|e| unavailable("completion queue", e))?;
        let mut qp = self
            .pd
            .create_qp_builder()
            .setup_qp_type(QueuePairType::ReliableConnection)
            .setup_max_send_wr(depth)
            .setup_max_recv_wr(1)
            .setup_max_send_sge(1)
            .setup_send_cq(cq.clone())
            .setup_recv_cq(cq.clone())
            .build()
            .map_err(|e| unavailable("RC queue pair", e))?;
        let mut sm = QpStateMachine::default();
        sm.check(QpState::Init)?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(self.cfg.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        let res = qp.modify(&attr);
        sm.record(QpState::Init, res.is_ok());
        res.map_err(|e| unavailable("queue pair to INIT", e))?;
        let psn = rand::random::<u32>() & MAX_24;
        let local = QpInfo {
            qpn: qp.qp_number(),
            psn,
            lid: self.lid,
            gid: self.gid,
            mtu: self.mtu,
        };
        Ok(Endpoint {
            cfg: self.cfg.clone(),
            qp,
            cq,
            sm,
            local,
        })
    }
}

fn info(mr: &MemoryRegion) -> MrInfo {
    MrInfo {
        addr: mr.get_ptr() as u64,
        len: mr.region_len() as u64,
        lkey: mr.lkey(),
        rkey: mr.rkey(),
    }
}

/// A dma-buf MR is addressed by its iova (the device address we registered it at).
fn info_at(mr: &MemoryRegion, iova: u64) -> MrInfo {
    MrInfo {
        addr: iova,
        ..info(mr)
    }
}

fn map_base(map: &Mapping) -> usize {
    // SAFETY: a zero-length view only yields the base address.
    unsafe { map.slice(0, 0) }.map_or(0, |s| s.as_ptr() as usize)
}

/// One RC queue pair of a transfer.
pub struct Endpoint {
    cfg: RdmaConfig,
    qp: BasicQueuePair,
    cq: Arc<BasicCompletionQueue>,
    sm: QpStateMachine,
    local: QpInfo,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("local", &self.local)
            .field("state", &self.sm.state())
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    /// This end, for the peer.
    pub fn info(&self) -> QpInfo {
        self.local.clone()
    }

    /// INIT → RTR (towards `remote`) → RTS.
    pub fn connect(&mut self, remote: &QpInfo) -> Result<()> {
        remote.validate()?;
        self.sm.check(QpState::Rtr)?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu_of(common_mtu(self.local.mtu, remote.mtu)))
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(0)
            .setup_min_rnr_timer(12);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(remote.lid)
            .setup_port(self.cfg.port)
            .setup_service_level(0);
        if !remote.gid.is_unspecified() {
            ah.setup_grh_src_gid_index(self.cfg.gid_index)
                .setup_grh_dest_gid(&Gid::from(remote.gid))
                .setup_grh_hop_limit(64);
        }
        attr.setup_address_vector(&ah);
        let res = self.qp.modify(&attr);
        self.sm.record(QpState::Rtr, res.is_ok());
        res.map_err(|e| Error::Io(std::io::Error::other(format!("queue pair to RTR: {e}"))))?;
        self.sm.check(QpState::Rts)?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.local.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(0);
        let res = self.qp.modify(&attr);
        self.sm.record(QpState::Rts, res.is_ok());
        res.map_err(|e| Error::Io(std::io::Error::other(format!("queue pair to RTS: {e}"))))
    }

    /// Post every WRITE of `ops` from `local` into `target` and wait for their completions (all
    /// signalled, at most `window` in flight) until `deadline`.
    pub fn write(
        &mut self,
        ops: &[WriteOp],
        local: &MrInfo,
        target: &RdmaTarget,
        deadline: Instant,
    ) -> Result<()> {
        if !self.sm.can_send() {
            return Err(Error::Protocol(format!(
                "queue pair in {:?}, not RTS",
                self.sm.state()
            )));
        }
        let mut c = Completions::new(ops.len(), self.cfg.window, deadline);
        while !c.finished() {
            let room = c.room();
            if room > 0 {
                let first = c.posted();
                let mut guard = self.qp.start_post_send();
                for (i, op) in ops[first..first + room].iter().enumerate() {
                    let wr = guard
                        .construct_wr((first + i) as u64, WorkRequestFlags::Signaled)
                        .setup_write(target.rkey, target.addr + op.remote);
                    // SAFETY: the local MR covers the source region, which the caller keeps
                    // mapped (its Arc is held) until this call returns.
                    unsafe { wr.setup_sge(local.lkey, local.addr + op.local, op.len) };
                }
                if let Err(e) = guard.post() {
                    self.sm.fail();
                    return Err(Error::Io(std::io::Error::other(format!("post WRITE: {e}"))));
                }
                c.on_posted(room);
            }
            match self.cq.start_poll() {
                Ok(poller) => {
                    for wc in poller {
                        let ok = wc.status() == WorkCompletionStatus::Success as u32;
                        let detail = format!("{:?}", WorkCompletionStatus::from(wc.status()));
                        if let Err(e) = c.on_completion(wc.wr_id(), ok, &detail) {
                            self.sm.fail();
                            return Err(e);
                        }
                    }
                }
                Err(PollCompletionQueueError::CompletionQueueEmpty) => {
                    std::thread::sleep(Duration::from_micros(20));
                }
                Err(e) => {
                    self.sm.fail();
                    return Err(Error::Io(std::io::Error::other(format!("poll CQ: {e}"))));
                }
            }
            if let Err(e) = c.check_deadline(Instant::now()) {
                self.sm.fail();
                return Err(e);
            }
        }
        Ok(())
    }
}
