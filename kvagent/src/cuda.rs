//! GPU memory (feature `cuda`, through `cudarc` with the driver loaded at run time).
//!
//! Before any CUDA call the driver library's presence is checked, so a node without a GPU gets
//! [`Error::CudaUnavailable`] and the agent falls back to host memory; without the feature every
//! call says the build has no CUDA. The agent announces [`Caps::CUDA`](crate::planner::Caps)
//! only when a device answered.

use crate::error::{Error, Result};

/// A CUDA IPC memory handle as an engine exports it (`cudaIpcGetMemHandle`, 64 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; 64]);

impl IpcHandle {
    /// Parse the 128 hex digits a connector sends.
    pub fn from_hex(s: &str) -> Result<Self> {
        let s = s.trim();
        if s.len() != 128 || !s.is_ascii() {
            return Err(Error::BadRequest(
                "a CUDA IPC handle is 128 hex digits".into(),
            ));
        }
        let mut out = [0u8; 64];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
                .map_err(|_| Error::BadRequest("a CUDA IPC handle is 128 hex digits".into()))?;
        }
        Ok(Self(out))
    }
}

/// The first CUDA device, if the driver and a device are there.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Device count.
    pub count: i32,
    /// Name of device 0.
    pub name: String,
}

/// Capability bits from CUDA (0 when unavailable).
pub fn caps() -> u32 {
    if available().is_ok() {
        crate::planner::Caps::CUDA
    } else {
        0
    }
}

#[cfg(not(feature = "cuda"))]
/// Whether CUDA can be used here.
pub fn available() -> Result<DeviceInfo> {
    Err(Error::CudaUnavailable(
        "this kvagent was built without the `cuda` feature".into(),
    ))
}

#[cfg(not(feature = "cuda"))]
/// Open an engine's GPU buffer (needs the `cuda` feature).
pub fn open_ipc(_handle: &IpcHandle, _device: i32, _len: usize) -> Result<GpuRegion> {
    Err(Error::CudaUnavailable(
        "this kvagent was built without the `cuda` feature".into(),
    ))
}

#[cfg(not(feature = "cuda"))]
/// A GPU buffer opened from an IPC handle (never built without the feature).
#[derive(Debug)]
pub struct GpuRegion {
    _never: (),
}

#[cfg(not(feature = "cuda"))]
impl GpuRegion {
    fn none<T>() -> Result<T> {
        Err(Error::CudaUnavailable(
            "built without the `cuda` feature".into(),
        ))
    }

    /// Copy device bytes to host memory.
    pub fn copy_to_host(&self, _off: usize, _dst: &mut [u8]) -> Result<()> {
        Self::none()
    }

    /// Copy host bytes to device memory.
    pub fn copy_from_host(&self, _off: usize, _src: &[u8]) -> Result<()> {
        Self::none()
    }

    /// A dma-buf fd of the whole buffer, for GPU-direct RDMA registration.
    pub fn dmabuf_fd(&self) -> Result<std::os::fd::OwnedFd> {
        Self::none()
    }

    /// Device address of the buffer.
    pub fn device_ptr(&self) -> u64 {
        0
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        0
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        true
    }
}

#[cfg(feature = "cuda")]
pub use with_cuda::{available, open_ipc, GpuRegion};

#[cfg(feature = "cuda")]
mod with_cuda {
    use std::os::fd::{FromRawFd, OwnedFd};

    use cudarc::driver::{result, sys};

    use super::{DeviceInfo, IpcHandle};
    use crate::error::{Error, Result};

    fn driver_err(what: &str, e: result::DriverError) -> Error {
        Error::CudaUnavailable(format!("{what}: {e:?}"))
    }

    /// Whether CUDA can be used here: the driver library loads, initialises and has a device.
    pub fn available() -> Result<DeviceInfo> {
        // SAFETY: only tries to dlopen the driver library.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::CudaUnavailable(
                "libcuda.so (the NVIDIA driver) not found".into(),
            ));
        }
        result::init().map_err(|e| driver_err("cuInit", e))?;
        let count = result::device::get_count().map_err(|e| driver_err("device count", e))?;
        if count < 1 {
            return Err(Error::CudaUnavailable("no CUDA device".into()));
        }
        let dev = result::device::get(0).map_err(|e| driver_err("device 0", e))?;
        let name = result::device::get_name(dev).map_err(|e| driver_err("device name", e))?;
        Ok(DeviceInfo { count, name })
    }

    /// A GPU buffer opened from an engine's IPC handle; closed on drop.
    #[derive(Debug)]
    pub struct GpuRegion {
        ptr: sys::CUdeviceptr,
        len: usize,
        ctx: sys::CUcontext,
    }

    // SAFETY: the device pointer and context are plain handles usable from any thread once the
    // context is made current (every method does so).
    unsafe impl Send for GpuRegion {}
    // SAFETY: as above; methods take &self and do not mutate the handles.
    unsafe impl Sync for GpuRegion {}

    /// Open an engine's GPU buffer of `len` bytes on `device` from its IPC handle.
    pub fn open_ipc(handle: &IpcHandle, device: i32, len: usize) -> Result<GpuRegion> {
        available()?;
        let dev = result::device::get(device).map_err(|e| driver_err("device", e))?;
        // SAFETY: dev is a valid device; the primary context is released on drop.
        let ctx = unsafe { result::primary_ctx::retain(dev) }
            .map_err(|e| driver_err("primary context", e))?;
        // SAFETY: ctx was just retained.
        unsafe { result::ctx::set_current(ctx) }.map_err(|e| driver_err("set context", e))?;
        let mut raw = sys::CUipcMemHandle_st { reserved: [0; 64] };
        for (d, s) in raw.reserved.iter_mut().zip(handle.0) {
            *d = s as core::ffi::c_char;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out pointer is valid; the handle comes from another process's export.
        let rc = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        };
        rc.result()
            .map_err(|e| driver_err("cuIpcOpenMemHandle", e))?;
        Ok(GpuRegion { ptr, len, ctx })
    }

    impl GpuRegion {
        /// Copy device bytes to host memory (the TCP path's staging step).
        pub fn copy_to_host(&self, off: usize, dst: &mut [u8]) -> Result<()> {
            if off.checked_add(dst.len()).is_none_or(|e| e > self.len) {
                return Err(Error::BadRequest("range outside the GPU region".into()));
            }
            // SAFETY: ctx is alive while self is.
            unsafe { result::ctx::set_current(self.ctx) }
                .map_err(|e| driver_err("set context", e))?;
            // SAFETY: range checked against the opened allocation.
            unsafe { result::memcpy_dtoh_sync(dst, self.ptr + off as u64) }
                .map_err(|e| driver_err("memcpy", e))
        }

        /// Copy host bytes to device memory (landing blocks taken by a GPU client).
        pub fn copy_from_host(&self, off: usize, src: &[u8]) -> Result<()> {
            if off.checked_add(src.len()).is_none_or(|e| e > self.len) {
                return Err(Error::BadRequest("range outside the GPU region".into()));
            }
            // SAFETY: ctx is alive while self is.
            unsafe { result::ctx::set_current(self.ctx) }
                .map_err(|e| driver_err("set context", e))?;
            // SAFETY: range checked against the opened allocation.
            unsafe { result::memcpy_htod_sync(self.ptr + off as u64, src) }
                .map_err(|e| driver_err("memcpy", e))
        }

        /// A dma-buf fd of the whole buffer (`cuMemGetHandleForAddressRange`), which RDMA
        /// registers with `ibv_reg_dmabuf_mr` for GPU-direct transfers.
        pub fn dmabuf_fd(&self) -> Result<OwnedFd> {
            // SAFETY: ctx is alive while self is.
            unsafe { result::ctx::set_current(self.ctx) }
                .map_err(|e| driver_err("set context", e))?;
            let mut fd: core::ffi::c_int = -1;
            // SAFETY: out pointer is a valid int; the range is the opened allocation.
            let rc = unsafe {
                sys::cuMemGetHandleForAddressRange(
                    (&mut fd as *mut core::ffi::c_int).cast(),
                    self.ptr,
                    self.len,
                    sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                    0,
                )
            };
            rc.result().map_err(|e| driver_err("dma-buf export", e))?;
            if fd < 0 {
                return Err(Error::CudaUnavailable("dma-buf export gave no fd".into()));
            }
            // SAFETY: the driver returned a new fd that we now own.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        }

        /// Device address of the buffer.
        pub fn device_ptr(&self) -> u64 {
            self.ptr
        }

        /// Bytes.
        pub fn len(&self) -> usize {
            self.len
        }

        /// Whether the buffer is empty.
        pub fn is_empty(&self) -> bool {
            self.len == 0
        }
    }

    impl Drop for GpuRegion {
        fn drop(&mut self) {
            // SAFETY: ptr came from cuIpcOpenMemHandle and is closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_gpu_means_a_clear_cuda_unavailable() {
        // This test machine has no GPU (and the default build has no CUDA): both must say so.
        if let Err(e) = available() {
            assert_eq!(e.code(), crate::error::ErrorCode::CudaUnavailable);
            assert_eq!(caps(), 0);
            let h = IpcHandle([0; 64]);
            let err = open_ipc(&h, 0, 4096).unwrap_err();
            assert_eq!(
                err.code(),
                crate::error::ErrorCode::CudaUnavailable,
                "{err}"
            );
        } else {
            assert_eq!(caps(), crate::planner::Caps::CUDA);
        }
    }

    #[test]
    fn ipc_handles_parse_from_hex() {
        let hex = "ab".repeat(64);
        assert_eq!(IpcHandle::from_hex(&hex).ok(), Some(IpcHandle([0xab; 64])));
        assert!(IpcHandle::from_hex("abc").is_err());
        assert!(IpcHandle::from_hex(&"zz".repeat(64)).is_err());
    }
}
