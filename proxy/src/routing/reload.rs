//! Hot reload of the filter config: the file named by `scheduling.filters`
//! is checked every `scheduling.reload_interval` (size and modification
//! time; no inotify, so it works on every filesystem and with Kubernetes'
//! ConfigMap symlink swaps). A changed file that loads becomes the active
//! config at once (requests already scheduling keep the one they hold); one
//! that does not is logged with its `file:line:col: field` and counted in
//! `kvmesh_filters_reload_errors_total`, and the previous config stays.
//! Runs until shutdown.

use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use super::{FiltersError, Routing};
use crate::config::Config;
use crate::shutdown::Shutdown;

/// What identifies a version of the file: modification time and length.
type Stamp = Option<(SystemTime, u64)>;

/// The watch loop over `routing`'s filter file; spawned once per sidecar
/// that has one.
pub async fn watch(routing: Arc<Routing>, config: Arc<Config>, shutdown: Shutdown) {
    let Some(path) = routing.file().map(Path::to_path_buf) else {
        return;
    };
    let interval = config.scheduling.reload_interval.get();
    let mut seen = stamp(&path).await;
    loop {
        tokio::select! {
            _ = shutdown.triggered() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let now = stamp(&path).await;
        if now == seen {
            continue;
        }
        seen = now;
        match load(&path, config.pd.min_uncached_tokens).await {
            Ok(active) => {
                routing.swap(active);
                routing.metrics.reloaded();
                tracing::info!(file = %path.display(), "filter config reloaded");
            }
            Err(e) => {
                routing.metrics.reload_failed();
                tracing::error!(error = %e, "filter config rejected; the previous one stays active");
            }
        }
    }
}

async fn stamp(path: &Path) -> Stamp {
    let m = tokio::fs::metadata(path).await.ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// The one loader ([`super::load_filters_with`]), off the runtime's threads:
/// reading and compiling a file blocks.
async fn load(path: &Path, pd_threshold: Option<u32>) -> Result<super::Active, FiltersError> {
    let path = path.to_path_buf();
    let file = path.display().to_string();
    tokio::task::spawn_blocking(move || super::load_filters_with(&path, pd_threshold))
        .await
        .map_err(|e| FiltersError::Read {
            file,
            source: std::io::Error::other(e),
        })?
}
