//! The `kvmesh-proxy` binary: everything lives in the library's `cli` module.

// jemalloc rather than glibc malloc, as linkerd2-proxy does for its sidecar:
// under the proxy's churn of short-lived, body-sized buffers on several
// worker threads, glibc's arenas kept the bytes in use flat while their
// footprint crept up by fragmentation for most of a million requests; jemalloc's
// size classes and time-based purging keep resident memory flat
// (docs/robustness.md, "Soak").
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    kvmesh_proxy::cli::main()
}
