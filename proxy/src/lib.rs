//! kvmesh-proxy: the sidecar beside each vLLM/SGLang pod.
//!
//! A reverse proxy for the OpenAI API whose request path ([`path::handle`])
//! reads top to bottom: classify, prefix, schedule, execute, observe, each
//! stage in its own file. Start one in-process with [`Sidecar::start`]; the
//! binary is a thin shell over [`cli`].
//!
//! Module map: [`config`] (proxy.yaml), [`path`] (the request path),
//! [`request`] (the request core the stages, routing, P/D and the mesh
//! share: context, view, plan, one upstream call and its relay), [`error`]
//! and [`respond`] (what failed, and the one mapping to a client response),
//! [`body`] (relaying bodies under deadlines), `server` (accept,
//! TLS, graceful drain), `admin` (health, readiness, metrics, config),
//! [`metrics`], [`headers`], [`upstream`] (the pooled client), [`access`]
//! (access logs).

mod access;
mod admin;
mod app;
pub mod autoscale;
mod backoff;
mod body;
pub mod cli;
pub mod config;
mod error;
pub mod fleet;
mod flow;
#[cfg(test)]
mod graph_tests;
pub mod h1;
mod headers;
mod kvevents;
pub mod logging;
pub mod mesh;
mod metrics;
mod otel;
pub mod path;
mod pd;
pub mod prefix;
mod ready;
mod request;
mod respond;
pub mod routing;
mod scrape;
mod server;
mod shutdown;
mod sidecar;
pub mod stat;
mod tls;
mod upstream;
pub mod valkey;

pub use config::Config;
pub use error::{Culprit, ProxyError, Retry};
pub use shutdown::Shutdown;
pub use sidecar::{Sidecar, SidecarHandle, StartError};
