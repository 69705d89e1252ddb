//! Readiness: polls the local engine's health path every
//! `engine.health_interval`, each poll bounded by the same interval, and
//! publishes the latest answer for `/ready`. Runs until shutdown.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use http::{Request, Uri};

use crate::app::App;
use crate::body::UpstreamBody;
use crate::shutdown::Shutdown;

pub async fn probe_engine(app: Arc<App>, shutdown: Shutdown) {
    let engine = &app.config.engine;
    let interval = engine.health_interval.get();
    let uri = match format!("{}{}", engine.url, engine.health_path).parse::<Uri>() {
        Ok(u) => u,
        Err(e) => {
            // Validation checks the path, so this is unreachable in practice.
            tracing::error!(error = %e, "engine health URL is invalid; readiness stays false");
            return;
        }
    };
    loop {
        let ok = poll_once(&app, &uri, interval).await;
        let was = app.engine_ready.swap(ok, Ordering::AcqRel);
        if ok != was {
            if ok {
                tracing::info!(engine = %engine.url, "engine is ready");
            } else {
                tracing::warn!(engine = %engine.url, "engine stopped answering its health check");
            }
        }
        tokio::select! {
            _ = shutdown.triggered() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

async fn poll_once(app: &App, uri: &Uri, deadline: std::time::Duration) -> bool {
    let mut req = Request::new(UpstreamBody::empty());
    *req.uri_mut() = uri.clone();
    match tokio::time::timeout(deadline, app.client.request(req)).await {
        Ok(Ok(resp)) => resp.status().is_success(),
        Ok(Err(e)) => {
            tracing::trace!(error = %e, "engine health check failed");
            false
        }
        Err(_) => false,
    }
}
