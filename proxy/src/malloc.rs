//! glibc malloc tuning for the proxy's allocation pattern, applied once at
//! start by `kvmesh-proxy run`.
//!
//! Each inference request allocates a few buffers of its body's size (the
//! connection's read buffer, the whole body, the block keys), and frees them
//! when it ends. With glibc's defaults, buffers over the dynamic mmap
//! threshold get fresh pages from the kernel, and a worker's arena hands the
//! freed top of its heap back (`madvise`) as soon as load dips, so the next
//! request faults the same pages in again: on 200 KB bodies that churn was
//! about a tenth of the proxy's CPU. Here buffers up to [`MMAP_THRESHOLD`]
//! come from the arenas, and an arena keeps up to [`TRIM_THRESHOLD`] of
//! freed memory at its top for reuse. Memory stays bounded: glibc makes at
//! most 8 arenas per core, and larger buffers are still mapped and unmapped
//! one by one.

/// Allocations at least this large are mapped on their own.
pub const MMAP_THRESHOLD: usize = 4 << 20;
/// Free memory an arena keeps at its top before returning it to the kernel.
pub const TRIM_THRESHOLD: usize = 32 << 20;

/// Applies the settings above (glibc only; elsewhere nothing). Call before
/// the runtime starts its threads.
pub fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let set = |param: libc::c_int, value: usize| {
            let value = libc::c_int::try_from(value).unwrap_or(libc::c_int::MAX);
            // SAFETY: mallopt only changes allocator parameters; it is called
            // before any other thread exists, and 0 (failure) leaves the
            // defaults, which are correct, only slower.
            unsafe { libc::mallopt(param, value) }
        };
        if set(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 0
            || set(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 0
        {
            tracing::debug!("mallopt refused; glibc malloc defaults stay");
        }
    }
}
