//! The `migration` section of `proxy.yaml`: continuing a streamed
//! generation on another pod when the engine (or the peer sidecar) serving it
//! fails after bytes reached the client (docs/migration.md). On by default.
//!
//! ```yaml
//! migration:
//!   max_migrations: 3   # per request; 0 turns migration off
//!   deadline: 30m       # no migration once the request is this old
//! ```

use serde::{Deserialize, Serialize};

use super::Duration;

/// See the module docs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Migration {
    /// Most times one request moves to another pod; 0: never (the stream
    /// ends with an error event, as without migration).
    pub max_migrations: u8,
    /// A request older than this (from its arrival) is not migrated: its
    /// stream ends. Capped in effect by `timeouts.overall`.
    pub deadline: Duration,
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
        }
    }
}
