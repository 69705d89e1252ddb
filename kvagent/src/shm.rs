//! Shared host memory: memfd creation, sealing checks and mappings.
//!
//! A client hands the agent a memfd with SCM_RIGHTS; the agent maps it shared and reads or writes
//! blocks in place. The fd must be sealed against shrinking (`F_SEAL_SHRINK`): otherwise a client
//! could truncate it under the agent and turn the next access into a SIGBUS that kills every
//! transfer on the node. Bytes in the mapping are plain data the other process may change at any
//! time; the agent never derives an invariant from them, it only copies them.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// A shared, read-write mapping of a memfd (or any shm fd), unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory; concurrent access is by raw copies only (see module doc),
// and the pointer stays valid until drop.
unsafe impl Send for Mapping {}
// SAFETY: as above; no method hands out references tied to interior state.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Create a new memfd of `len` bytes, sealed against shrinking, and map it.
    pub fn create(name: &str, len: usize) -> Result<Self> {
        let cname =
            std::ffi::CString::new(name).map_err(|_| Error::Shm("name has a NUL".into()))?;
        // SAFETY: valid C string; flags are constants.
        let raw = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(Error::Shm(format!(
                "memfd_create: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `raw` is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len).map_err(|_| Error::Shm("size too large".into()))?;
        // SAFETY: fd is valid.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(Error::Shm(format!(
                "ftruncate: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: fd is valid; F_ADD_SEALS takes an int.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } != 0 {
            return Err(Error::Shm(format!(
                "seal: {}",
                std::io::Error::last_os_error()
            )));
        }
        Self::map(fd, len)
    }

    /// Map a client's fd after checking it is sealed against shrinking and holds `len` bytes.
    pub fn from_client_fd(fd: OwnedFd, len: usize) -> Result<Self> {
        // SAFETY: fd is valid for the call.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(Error::Shm(
                "the fd must be a memfd sealed with F_SEAL_SHRINK (create it with MFD_ALLOW_SEALING)"
                    .into(),
            ));
        }
        // SAFETY: zeroed stat is a valid out-parameter.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd valid, st is writable.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(Error::Shm(format!(
                "fstat: {}",
                std::io::Error::last_os_error()
            )));
        }
        let size = usize::try_from(st.st_size).unwrap_or(0);
        if size < len {
            return Err(Error::Shm(format!(
                "fd holds {size} bytes, the layout needs {len}"
            )));
        }
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::Shm("empty region".into()));
        }
        // SAFETY: a fresh shared mapping of a valid fd; the kernel picks the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::Shm(format!(
                "mmap: {}",
                std::io::Error::last_os_error()
            )));
        }
        let ptr =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| Error::Shm("mmap gave null".into()))?;
        Ok(Self { ptr, len, fd })
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never true for a built mapping).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The fd behind the mapping (to pass to an agent).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn check(&self, off: usize, len: usize) -> Result<()> {
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::Shm(format!(
                "range {off}+{len} outside {} bytes",
                self.len
            ))),
        }
    }

    /// Copy `dst.len()` bytes at `off` out of the mapping.
    pub fn read(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        self.check(off, dst.len())?;
        // SAFETY: range checked; dst is a distinct Rust buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    /// Copy `src` into the mapping at `off`.
    pub fn write(&self, off: usize, src: &[u8]) -> Result<()> {
        self.check(off, src.len())?;
        // SAFETY: range checked; src is a distinct Rust buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(off), src.len())
        };
        Ok(())
    }

    /// Copy `len` bytes from this mapping at `src_off` to `dst` at `dst_off` (the same-node path).
    pub fn copy_to(&self, src_off: usize, dst: &Mapping, dst_off: usize, len: usize) -> Result<()> {
        self.check(src_off, len)?;
        dst.check(dst_off, len)?;
        // SAFETY: both ranges checked; `copy` tolerates overlap when both are the same mapping.
        unsafe {
            std::ptr::copy(
                self.ptr.as_ptr().add(src_off),
                dst.ptr.as_ptr().add(dst_off),
                len,
            )
        };
        Ok(())
    }

    /// A byte slice over part of the mapping, for socket writes.
    ///
    /// # Safety
    /// Another process may write these bytes concurrently; the caller only copies them out (to a
    /// socket) and must not rely on their values staying put.
    pub unsafe fn slice(&self, off: usize, len: usize) -> Result<&[u8]> {
        self.check(off, len)?;
        // SAFETY: range checked; see the function's contract.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) })
    }

    /// A mutable byte slice over part of the mapping, for socket reads straight into place.
    ///
    /// # Safety
    /// The caller must be the only writer of this range inside the agent (the lease bookkeeping
    /// guarantees it) and must not keep the slice beyond the read.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, off: usize, len: usize) -> Result<&mut [u8]> {
        self.check(off, len)?;
        // SAFETY: range checked; see the function's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len came from a successful mmap and are unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn two_mappings_of_one_memfd_share_bytes() {
        let a = Mapping::create("t", 8192).unwrap();
        let dup = a.fd().try_clone_to_owned().unwrap();
        let b = Mapping::from_client_fd(dup, 8192).unwrap();
        a.write(100, b"hello").unwrap();
        let mut out = [0u8; 5];
        b.read(100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        assert!(
            a.write(8190, b"xyz").is_err(),
            "out of range write must fail"
        );
    }

    #[test]
    fn unsealed_or_short_fds_are_refused() {
        let a = Mapping::create("t", 4096).unwrap();
        let dup = a.fd().try_clone_to_owned().unwrap();
        let err = Mapping::from_client_fd(dup, 8192).unwrap_err();
        assert!(err.to_string().contains("needs 8192"), "{err}");
        // A plain memfd without seals.
        let raw = unsafe { libc::memfd_create(c"u".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) };
        let err = Mapping::from_client_fd(fd, 4096).unwrap_err();
        assert!(err.to_string().contains("F_SEAL_SHRINK"), "{err}");
    }
}
