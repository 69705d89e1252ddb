//! kvmesh: the command line around the sidecar, in the manner of `linkerd`
//! beside `linkerd2-proxy`. The sidecar binary (`kvmesh-proxy`, crate
//! `kvmesh_proxy`) is the data plane alone; everything an operator or a
//! developer runs from a laptop lives here, so the sidecar image links none
//! of the simulator, the load generator or the plotting code.
//!
//! Module map: [`cli`] (arguments and dispatch), [`inject`] (add and remove
//! the sidecar in Kubernetes manifests), [`stat`] (the fleet table from any
//! admin port), [`prefix`] (token ids and block hashes of a request),
//! [`demo`] (a simulated fleet with sidecars, and the peers benchmark in
//! [`demo::peers`]), [`bench`] (load generation and the overhead and peers
//! benchmarks), [`scale`] (one sidecar in front of an emulated fleet of up to
//! 1000 pods, on the mesh and on Valkey), [`autoscale`] (the autoscaling hook
//! in a closed loop: a fleet that starts and stops pods on its answers).
//!
//! The demo and the benchmarks (`demo`, `bench`, `scale`, `autoscale`) are the lab: they
//! link the engine simulator (and through it kvagent), the load generator and
//! its plotting. They sit behind the `lab` cargo feature, on by default so
//! that `cargo run -p kvmesh -- demo` works from a checkout; the ops commands
//! (`inject`, `uninject`, `stat`, `check-config`, `prefix`) need none of it,
//! and `--no-default-features` builds them alone.

#[cfg(feature = "lab")]
pub mod autoscale;
#[cfg(feature = "lab")]
pub mod bench;
pub mod cli;
#[cfg(feature = "lab")]
pub mod demo;
pub mod inject;
pub mod prefix;
#[cfg(feature = "lab")]
pub mod scale;
pub mod stat;
