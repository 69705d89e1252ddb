//! A cloneable shutdown trigger shared by the listeners, the probes and the
//! embedding program (signal handler, test, demo).

use tokio_util::sync::CancellationToken;

/// Triggering it stops accepting, lets in-flight requests drain up to
/// `timeouts.shutdown_drain`, then stops the sidecar.
#[derive(Debug, Clone, Default)]
pub struct Shutdown {
    token: CancellationToken,
}

impl Shutdown {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn trigger(&self) {
        self.token.cancel();
    }

    pub fn is_triggered(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Resolves once triggered.
    pub async fn triggered(&self) {
        self.token.cancelled().await;
    }
}
