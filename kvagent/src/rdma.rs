//! RDMA verbs (feature `rdma`, through `sideway`, which loads `libibverbs.so.1` at run time).
//!
//! What is here: device discovery, opening a device, a protection domain, a completion queue, an
//! RC queue pair and memory registration of a host region, each failing with
//! [`Error::RdmaUnavailable`] when the library or a device is absent. What is not yet here: the
//! queue-pair connection exchange and the RDMA WRITE data path, so the agent does not announce
//! [`Caps::RDMA`](crate::planner::Caps) and every remote transfer uses TCP
//! (`scripts/kvagent-device-check` exercises what exists on a machine with a device).

#[cfg(not(feature = "rdma"))]
use crate::error::{Error, Result};

/// Capability bits from RDMA (0 until the RDMA data path is wired; see the module doc).
pub fn caps() -> u32 {
    0
}

/// One RDMA device.
#[derive(Debug, Clone)]
pub struct RdmaDevice {
    /// Device name, e.g. `mlx5_0`.
    pub name: String,
}

#[cfg(not(feature = "rdma"))]
/// List RDMA devices.
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
        assert_eq!(
            caps(),
            0,
            "RDMA is not announced until its data path exists"
        );
    }
}
