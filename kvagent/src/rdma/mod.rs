//! RDMA verbs (feature `rdma`, through `sideway`, which loads `libibverbs.so.1` at run time).
//!
//! * [`wire`]: what agents exchange over their TCP control connection to connect an RC queue pair
//!   (QPN, LID/GID, PSN, MTU) and to let the sender write (memory-region address, rkey, landing
//!   blocks). Always compiled and tested.
//! * [`book`]: the write plan, the queue-pair state machine and completion accounting with
//!   deadlines. Always compiled and tested.
//! * `verbs` (feature `rdma`): [`RdmaEngine`] (device, protection domain, memory regions) and
//!   [`Endpoint`] (one RC queue pair per transfer: INIT → RTR → RTS, RDMA WRITEs, CQ polling).
//!   Without the feature the same names exist and [`RdmaEngine::open`] answers
//!   [`Error::RdmaUnavailable`], so the agent code has one shape.
//!
//! The agent opens the engine at start; when that fails (no library, no device, port down, or a
//! build without the feature) it logs why, exports `kvagent_rdma_available 0` and does not
//! announce [`Caps::RDMA`](crate::planner::Caps), so peers never offer it RDMA and every remote
//! transfer is TCP. A transfer whose RDMA set-up or WRITEs fail falls back to TCP, counted in
//! `kvagent_rdma_fallbacks_total{reason}`.

pub mod book;
#[cfg(feature = "rdma")]
mod verbs;
pub mod wire;

#[cfg(not(feature = "rdma"))]
use crate::error::{Error, Result};

#[cfg(feature = "rdma")]
pub use verbs::{Endpoint, RdmaEngine};

/// How the agent uses RDMA.
#[derive(Debug, Clone)]
pub struct RdmaConfig {
    /// Try to open a device at start (`--rdma off` clears it).
    pub enabled: bool,
    /// Device name (`mlx5_0`); the first device when None.
    pub device: Option<String>,
    /// Port number on the device (from 1).
    pub port: u8,
    /// GID table index (RoCE v2 is usually 1 or 3; InfiniBand 0).
    pub gid_index: u8,
    /// Largest single RDMA WRITE.
    pub max_msg: u32,
    /// Most WRITEs in flight per transfer (also the send-queue and CQ depth).
    pub window: usize,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            device: None,
            port: 1,
            gid_index: 0,
            max_msg: 1 << 30,
            window: 128,
        }
    }
}

/// Keys and address of a registered memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrInfo {
    /// Virtual address of the first registered byte.
    pub addr: u64,
    /// Bytes registered.
    pub len: u64,
    /// Local key (for our work requests).
    pub lkey: u32,
    /// Remote key (for the peer's WRITEs).
    pub rkey: u32,
}

#[cfg(not(feature = "rdma"))]
pub use stub::{Endpoint, RdmaEngine};

#[cfg(not(feature = "rdma"))]
mod stub {
    //! Without the `rdma` feature: the engine cannot be opened, so nothing else is reachable
    //! (the types are uninhabited).
    use std::sync::Arc;
    use std::time::Instant;

    use super::book::WriteOp;
    use super::wire::{QpInfo, RdmaTarget};
    use super::{MrInfo, RdmaConfig};
    use crate::error::{Error, Result};
    use crate::shm::Mapping;

    /// No RDMA in this build.
    #[derive(Debug)]
    pub enum RdmaEngine {}

    /// No RDMA in this build.
    #[derive(Debug)]
    pub enum Endpoint {}

    impl RdmaEngine {
        /// Always `rdma_unavailable` in a build without the `rdma` feature.
        pub fn open(_cfg: &RdmaConfig) -> Result<Arc<RdmaEngine>> {
            Err(Error::RdmaUnavailable(
                "this kvagent was built without the `rdma` feature".into(),
            ))
        }
        /// Device name.
        pub fn device(&self) -> &str {
            match *self {}
        }
        /// Register a region.
        pub fn register(&self, _region: u64, _map: &Arc<Mapping>) -> Result<MrInfo> {
            match *self {}
        }
        /// Register a GPU buffer (dma-buf).
        pub fn register_gpu(
            &self,
            _region: u64,
            _gpu: &Arc<crate::cuda::GpuRegion>,
        ) -> Result<MrInfo> {
            match *self {}
        }
        /// A queue pair.
        pub fn endpoint(&self) -> Result<Endpoint> {
            match *self {}
        }
    }

    impl Endpoint {
        /// This end.
        pub fn info(&self) -> QpInfo {
            match *self {}
        }
        /// Connect.
        pub fn connect(&mut self, _remote: &QpInfo) -> Result<()> {
            match *self {}
        }
        /// Write.
        pub fn write(
            &mut self,
            _ops: &[WriteOp],
            _local: &MrInfo,
            _target: &RdmaTarget,
            _deadline: Instant,
        ) -> Result<()> {
            match *self {}
        }
    }
}

/// One RDMA device.
#[derive(Debug, Clone)]
pub struct RdmaDevice {
    /// Device name, e.g. `mlx5_0`.
    pub name: String,
}

#[cfg(not(feature = "rdma"))]
/// List RDMA devices (needs the `rdma` feature).
pub fn devices() -> Result<Vec<RdmaDevice>> {
    Err(Error::RdmaUnavailable(
        "this kvagent was built without the `rdma` feature".into(),
    ))
}

#[cfg(not(feature = "rdma"))]
/// Open a device, allocate a PD, CQ and RC QP, and register `map` (needs the `rdma` feature).
pub fn probe_registration(
    _device: Option<&str>,
    _map: &crate::shm::Mapping,
) -> Result<Registration> {
    Err(Error::RdmaUnavailable(
        "this kvagent was built without the `rdma` feature".into(),
    ))
}

/// What a successful registration probe produced.
#[derive(Debug, Clone)]
pub struct Registration {
    /// Device used.
    pub device: String,
    /// Local key of the memory region.
    pub lkey: u32,
    /// Remote key a peer would write with.
    pub rkey: u32,
    /// Queue pair number.
    pub qp_num: u32,
}

/// Whether `libibverbs.so.1` can be loaded (checked before any verbs call).
pub fn library_present() -> bool {
    // SAFETY: dlopen/dlclose of a library name; no symbols are used.
    unsafe {
        let h = libc::dlopen(
            c"libibverbs.so.1".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_LOCAL,
        );
        if h.is_null() {
            false
        } else {
            libc::dlclose(h);
            true
        }
    }
}

#[cfg(feature = "rdma")]
pub use with_rdma::{devices, probe_registration};

#[cfg(feature = "rdma")]
mod with_rdma {
    use sideway::ibverbs::device::{DeviceInfo, DeviceList};
    use sideway::ibverbs::queue_pair::{QueuePair, QueuePairType};
    use sideway::ibverbs::AccessFlags;

    use super::{library_present, RdmaDevice, Registration};
    use crate::error::{Error, Result};
    use crate::shm::Mapping;

    fn unavailable(what: &str, e: impl std::fmt::Display) -> Error {
        Error::RdmaUnavailable(format!("{what}: {e}"))
    }

    /// List RDMA devices.
    pub fn devices() -> Result<Vec<RdmaDevice>> {
        if !library_present() {
            return Err(Error::RdmaUnavailable("libibverbs.so.1 not found".into()));
        }
        let list = DeviceList::new().map_err(|e| unavailable("device list", e))?;
        Ok(list.iter().map(|d| RdmaDevice { name: d.name() }).collect())
    }

    /// Open a device, allocate a PD, a CQ and an RC QP, and register `map` for remote writes.
    pub fn probe_registration(device: Option<&str>, map: &Mapping) -> Result<Registration> {
        if !library_present() {
            return Err(Error::RdmaUnavailable("libibverbs.so.1 not found".into()));
        }
        let list = DeviceList::new().map_err(|e| unavailable("device list", e))?;
        let dev = list
            .iter()
            .find(|d| device.is_none_or(|n| d.name() == n))
            .ok_or_else(|| Error::RdmaUnavailable("no RDMA device".into()))?;
        let name = dev.name();
        let ctx = dev.open().map_err(|e| unavailable("open device", e))?;
        let pd = ctx
            .alloc_pd()
            .map_err(|e| unavailable("protection domain", e))?;
        let cq = ctx
            .create_cq_builder()
            .setup_cqe(256)
            .build()
            .map_err(|e| unavailable("completion queue", e))?;
        let qp = pd
            .create_qp_builder()
            .setup_qp_type(QueuePairType::ReliableConnection)
            .setup_max_send_wr(256)
            .setup_send_cq(cq.clone())
            .setup_recv_cq(cq.clone())
            .build()
            .map_err(|e| unavailable("RC queue pair", e))?;
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead;
        // SAFETY: the mapping outlives the memory region (both dropped at the end of this call).
        let mr = unsafe { pd.reg_mr(map_ptr(map), map.len(), access) }
            .map_err(|e| unavailable("register memory", e))?;
        Ok(Registration {
            device: name,
            lkey: mr.lkey(),
            rkey: mr.rkey(),
            qp_num: qp.qp_number(),
        })
    }

    fn map_ptr(map: &Mapping) -> usize {
        // SAFETY: a zero-length view only yields the base address.
        unsafe { map.slice(0, 0) }.map_or(0, |s| s.as_ptr() as usize)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn no_rdma_device_is_a_clear_error() {
        // This machine has no RDMA device (and the default build no RDMA): both must say so.
        let map = crate::shm::Mapping::create("rdma-test", 4096).unwrap();
        match probe_registration(None, &map) {
            Err(e) => assert_eq!(e.code(), crate::error::ErrorCode::RdmaUnavailable, "{e}"),
            Ok(r) => assert!(!r.device.is_empty(), "a device machine registers for real"),
        }
        let opened = RdmaEngine::open(&RdmaConfig::default());
        #[cfg(not(feature = "rdma"))]
        assert!(
            matches!(&opened, Err(e) if e.code() == crate::error::ErrorCode::RdmaUnavailable),
            "{opened:?}"
        );
        #[cfg(feature = "rdma")]
        match opened {
            Err(e) => assert_eq!(e.code(), crate::error::ErrorCode::RdmaUnavailable, "{e}"),
            Ok(engine) => {
                // A device machine: the engine registers and makes queue pairs for real.
                let map = std::sync::Arc::new(map);
                let mr = engine.register(1, &map).unwrap();
                assert!(mr.len >= 4096);
                let again = engine.register(1, &map).unwrap();
                assert_eq!(mr, again, "registration is cached per region");
                let ep = engine.endpoint().unwrap();
                ep.info().validate().unwrap();
            }
        }
    }
}
