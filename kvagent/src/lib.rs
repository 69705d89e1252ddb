//! kvmesh-kvagent: the per-node KV transfer agent.
//!
//! Engine connectors register their KV staging memory (a memfd) with the node's agent over a
//! Unix socket ([`local`]), reserve blocks, send a request's blocks to another agent
//! ([`transfer`]) and wait for blocks to arrive. Agents talk a small versioned protocol over TCP
//! ([`peer`]); the [`planner`] picks the path (same-node copy, RDMA, TCP). [`client::LocalClient`]
//! is the Rust client of the local API. See `kvagent/README.md` for the protocols and operations.

pub mod agent;
pub mod bench;
pub mod client;
pub mod config;
pub mod cuda;
pub mod error;
pub mod gpu;
pub mod local;
pub mod metrics;
pub mod peer;
pub mod planner;
pub mod rdma;
pub mod regions;
pub mod shm;
pub mod transfer;
pub mod types;

pub use agent::{bind_local, Agent, AgentHandle, Listeners};
pub use client::{Arrival, LocalClient};
pub use config::{AgentConfig, SocketConfig};
pub use error::{Error, ErrorCode};
pub use transfer::{SendArgs, SendReport};
pub use types::{BlockLayout, TransferId};
