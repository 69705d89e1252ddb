//! The `migration` section of `proxy.yaml`: continuing a streamed
//! generation on another pod when the engine (or the peer sidecar) serving it
//! fails after bytes reached the client (docs/migration.md). On by default.
//!
//! ```yaml
//! migration:
//!   max_migrations: 3   # per request; 0 turns migration off
//!   deadline: 30m       # no migration once the request is this old
//!   pd_kv_lease: 20s    # P/D: a failed decode leg is re-sent with the same
//!                       # kv_transfer_params this long after prefill answered
//! ```

use serde::{Deserialize, Serialize};

use super::Duration;

/// See the module docs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Migration {
    /// Most times one request moves to another pod (a P/D decode leg's
    /// re-sends included); 0: never (the stream ends with an error event, as
    /// without migration).
    pub max_migrations: u8,
    /// A request older than this (from its arrival) is not migrated: its
    /// stream ends. Capped in effect by `timeouts.overall`.
    pub deadline: Duration,
    /// P/D (`nixl`): a decode leg that fails before any byte is sent again
    /// with the same `kv_transfer_params`, to another decode pod, until this
    /// long after the prefill answered; later, the request is computed again
    /// whole. vLLM 0.32's NixlConnector holds a finished prefill's blocks
    /// for `kv_lease_duration` (30 s by default) unless a decode renews the
    /// lease; the default leaves 10 s of that for the re-send to reach the
    /// next engine. Re-sends count against `max_migrations`, so 0 there
    /// turns them off too.
    pub pd_kv_lease: Duration,
}

impl Migration {
    /// Whether a stream may migrate at all.
    pub fn enabled(&self) -> bool {
        self.max_migrations > 0
    }
}

impl Default for Migration {
    fn default() -> Self {
        Self {
            max_migrations: 3,
            deadline: Duration::from_secs(1800),
            pd_kv_lease: Duration::from_secs(20),
        }
    }
}
