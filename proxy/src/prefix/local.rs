//! The local pod's KV updates as the prefix state hands them on (to the
//! mesh's publish loop and the Valkey writer), once the KV-event feed
//! (`crate::kvevents`) applied them.

use std::sync::Arc;

use kvmesh_filters::prefix::index::Touched;
use kvmesh_filters::prefix::kvevents::EventBatch;
use tokio::sync::broadcast;

/// One change to the local pod's cached blocks, as the mesh forwards it.
#[derive(Debug, Clone)]
pub enum LocalKvUpdate {
    /// A batch applied to the local pod, keyed by `model` (see
    /// [`super`] on key models).
    Batch {
        seq: u64,
        model: Arc<str>,
        batch: Arc<EventBatch>,
        /// The block keys the batch touched, when a subscriber asked for
        /// them ([`super::PrefixState::tracks_touched`]: the Valkey
        /// writer); empty otherwise.
        touched: Arc<[Touched]>,
    },
    /// The engine restarted: everything it held is gone.
    Cleared,
}

/// The next local update from `rx`, or never once it is gone (`None`): how a
/// task that selects on local updates beside other work waits on them.
pub async fn recv_local(
    rx: &mut Option<broadcast::Receiver<LocalKvUpdate>>,
) -> Result<LocalKvUpdate, broadcast::error::RecvError> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}
