//! What every request shares: the effective config, metrics, the upstream
//! connection pool and the scheduler.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::path::Scheduler;
use crate::upstream::UpstreamClient;

pub struct App {
    pub config: Arc<Config>,
    pub metrics: Arc<Metrics>,
    pub client: UpstreamClient,
    pub scheduler: Scheduler,
    /// Set by the readiness probe once the local engine answers its health check.
    pub engine_ready: Arc<AtomicBool>,
}
