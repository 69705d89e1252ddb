//! Agent configuration: validated values with their defaults in one place.

use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::regions::RegistryLimits;

/// Scripted faults for tests (never set in production).
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Data writers stop sending after this many bytes of one transfer (and wait until cancelled),
    /// so a test can act "mid-transfer" deterministically.
    pub stall_data_after_bytes: Option<u64>,
}

/// Everything the agent needs besides its listeners.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// This agent's id (the node name, by default the host name).
    pub agent_id: String,
    /// Address peers and clients use to reach this agent (`host:port`); defaults to the bound one.
    pub advertise: Option<String>,
    /// Data streams per peer.
    pub data_streams: usize,
    /// Deadline of a local call that gives none.
    pub default_deadline: Duration,
    /// Longest deadline a local call may ask for.
    pub max_deadline: Duration,
    /// How long reserved blocks stay reserved without a transfer.
    pub lease_ttl: Duration,
    /// How long arrived blocks wait for the client to take them.
    pub hold_ttl: Duration,
    /// Deadline of a peer connect plus handshake.
    pub connect_timeout: Duration,
    /// Deadline to read the rest of a frame or payload once it started.
    pub io_timeout: Duration,
    /// Registry bounds.
    pub limits: RegistryLimits,
    /// Most local connections at once.
    pub max_local_conns: usize,
    /// Most peer sessions (incoming control connections) at once.
    pub max_peer_sessions: usize,
    /// Most transfers in flight at once (both directions).
    pub max_inflight: usize,
    /// RDMA use (only effective in a build with the `rdma` feature and a device).
    pub rdma: crate::rdma::RdmaConfig,
    /// Scripted faults.
    pub faults: Faults,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            agent_id: "kvagent".into(),
            advertise: None,
            data_streams: 4,
            default_deadline: Duration::from_secs(30),
            max_deadline: Duration::from_secs(600),
            lease_ttl: Duration::from_secs(60),
            hold_ttl: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(30),
            limits: RegistryLimits {
                max_regions: 64,
                max_leases: 65536,
                max_region_bytes: 1 << 40,
            },
            max_local_conns: 1024,
            max_peer_sessions: 1024,
            max_inflight: 4096,
            rdma: crate::rdma::RdmaConfig::default(),
            faults: Faults::default(),
        }
    }
}

impl AgentConfig {
    /// Check the values.
    pub fn validate(&self) -> Result<()> {
        if self.agent_id.is_empty() || self.agent_id.len() > 253 {
            return Err(Error::BadRequest("agent_id must be 1..=253 bytes".into()));
        }
        if !(1..=16).contains(&self.data_streams) {
            return Err(Error::BadRequest("data_streams must be 1..=16".into()));
        }
        if self.default_deadline > self.max_deadline || self.max_deadline.is_zero() {
            return Err(Error::BadRequest(
                "default_deadline must be within (0, max_deadline]".into(),
            ));
        }
        Ok(())
    }
}

/// Where the Unix socket lives and who may use it.
#[derive(Debug, Clone)]
pub struct SocketConfig {
    /// Socket path.
    pub path: PathBuf,
    /// Group allowed to connect (mode 0660); None means owner only (0600).
    pub group: Option<u32>,
}
