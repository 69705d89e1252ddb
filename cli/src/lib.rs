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
//! 1000 pods, on the mesh and on Valkey).

pub mod bench;
pub mod cli;
pub mod demo;
pub mod inject;
pub mod prefix;
pub mod scale;
pub mod stat;
