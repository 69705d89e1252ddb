//! The agent's one error type. Every error has a stable wire code (sent to local clients and peers,
//! used as the `cause` label of the failure metric) and says who failed: the local client, the peer
//! agent, this agent, or a device that is absent.

use serde::{Deserialize, Serialize};

/// Stable, machine-readable error codes, as they appear on the local API and the peer protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The message could not be parsed or was out of bounds (client's fault; do not retry as is).
    BadRequest,
    /// The message's protocol version is not one this agent speaks.
    UnsupportedVersion,
    /// The destination has no free blocks for the transfer (retry later or elsewhere).
    NoRoom,
    /// The region id or name is not registered.
    UnknownRegion,
    /// No transfer or lease is known under that id.
    UnknownTransfer,
    /// Source and destination block layouts differ.
    LayoutMismatch,
    /// A deadline passed.
    Timeout,
    /// The peer agent disconnected or could not be reached.
    PeerLost,
    /// The transfer was aborted by either side.
    Aborted,
    /// The shared memory could not be used (bad fd, unsealed, too small).
    Shm,
    /// CUDA is not available on this node (no driver or feature off).
    CudaUnavailable,
    /// RDMA is not available on this node (no libibverbs, no device or feature off).
    RdmaUnavailable,
    /// A configured limit (connections, leases, regions, frames) was reached.
    Limit,
    /// A peer broke the agent-to-agent protocol.
    Protocol,
    /// Local I/O failed.
    Io,
}

impl ErrorCode {
    /// The code as text (the metric label and the wire spelling).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::UnsupportedVersion => "unsupported_version",
            ErrorCode::NoRoom => "no_room",
            ErrorCode::UnknownRegion => "unknown_region",
            ErrorCode::UnknownTransfer => "unknown_transfer",
            ErrorCode::LayoutMismatch => "layout_mismatch",
            ErrorCode::Timeout => "timeout",
            ErrorCode::PeerLost => "peer_lost",
            ErrorCode::Aborted => "aborted",
            ErrorCode::Shm => "shm",
            ErrorCode::CudaUnavailable => "cuda_unavailable",
            ErrorCode::RdmaUnavailable => "rdma_unavailable",
            ErrorCode::Limit => "limit",
            ErrorCode::Protocol => "protocol",
            ErrorCode::Io => "io",
        }
    }

    /// Whether the same call may succeed if simply tried again later.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::NoRoom | ErrorCode::Timeout | ErrorCode::PeerLost | ErrorCode::Limit
        )
    }
}

/// Errors of the agent, its local API and its client.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A malformed or out-of-bounds request from a local client.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// A message in a protocol version this agent does not speak.
    #[error("unsupported local API version {got} (this agent speaks {want})")]
    UnsupportedVersion {
        /// Version the client sent.
        got: u32,
        /// Version the agent speaks.
        want: u32,
    },
    /// Handshake with a peer agent failed on the version.
    #[error("peer agent speaks protocol version {theirs}, this agent speaks {ours}")]
    VersionMismatch {
        /// Our version.
        ours: u16,
        /// The peer's version.
        theirs: u16,
    },
    /// The destination has no free blocks.
    #[error("no room: {wanted} blocks wanted, {free} free in {region}")]
    NoRoom {
        /// Region (name) that is full.
        region: String,
        /// Blocks asked for.
        wanted: u32,
        /// Blocks free at the time.
        free: u32,
    },
    /// No such region.
    #[error("unknown region {0}")]
    UnknownRegion(String),
    /// No such transfer or lease.
    #[error("unknown transfer {0}")]
    UnknownTransfer(String),
    /// Block layouts differ between the ends.
    #[error("layout mismatch: {0}")]
    LayoutMismatch(String),
    /// A deadline passed.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The peer agent went away.
    #[error("peer lost: {0}")]
    PeerLost(String),
    /// The transfer was aborted.
    #[error("aborted: {0}")]
    Aborted(String),
    /// Shared memory could not be used.
    #[error("shared memory: {0}")]
    Shm(String),
    /// CUDA is absent.
    #[error("CUDA unavailable: {0}")]
    CudaUnavailable(String),
    /// RDMA is absent.
    #[error("RDMA unavailable: {0}")]
    RdmaUnavailable(String),
    /// A limit was reached.
    #[error("limit reached: {0}")]
    Limit(String),
    /// The peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// Local I/O failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// An error reported by the agent (seen by a client) or by a peer agent.
    #[error("{code}: {message}", code = code.as_str())]
    Remote {
        /// The code the other side sent.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
}

impl Error {
    /// The stable code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            Error::BadRequest(_) => ErrorCode::BadRequest,
            Error::UnsupportedVersion { .. } => ErrorCode::UnsupportedVersion,
            Error::VersionMismatch { .. } => ErrorCode::UnsupportedVersion,
            Error::NoRoom { .. } => ErrorCode::NoRoom,
            Error::UnknownRegion(_) => ErrorCode::UnknownRegion,
            Error::UnknownTransfer(_) => ErrorCode::UnknownTransfer,
            Error::LayoutMismatch(_) => ErrorCode::LayoutMismatch,
            Error::Timeout(_) => ErrorCode::Timeout,
            Error::PeerLost(_) => ErrorCode::PeerLost,
            Error::Aborted(_) => ErrorCode::Aborted,
            Error::Shm(_) => ErrorCode::Shm,
            Error::CudaUnavailable(_) => ErrorCode::CudaUnavailable,
            Error::RdmaUnavailable(_) => ErrorCode::RdmaUnavailable,
            Error::Limit(_) => ErrorCode::Limit,
            Error::Protocol(_) => ErrorCode::Protocol,
            Error::Io(_) => ErrorCode::Io,
            Error::Remote { code, .. } => *code,
        }
    }

    /// Rebuild an error received on the wire.
    pub fn remote(code: ErrorCode, message: impl Into<String>) -> Self {
        Error::Remote {
            code,
            message: message.into(),
        }
    }
}

/// Result with the agent's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;
