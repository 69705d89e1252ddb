//! The local engine's load: scrapes its Prometheus metrics every
//! `engine.metrics_interval`, each scrape bounded by `engine.metrics_timeout`
//! (vLLM's `/metrics` can stall for seconds under load), and records what it
//! read in the fleet ([`crate::fleet::Fleet::set_load`]). Also learns the engine's
//! KV block size, which the prefix stage and the scheduler need.
//!
//! When the engine has LoRA on (its metrics declare `vllm:lora_requests_info`)
//! it also reads the engine's `/v1/models` every `engine.models_interval`
//! (under the same deadline) and, with that gauge, keeps the local pod's live
//! LoRA adapters in the fleet ([`crate::fleet::adapters`]); the mesh and the
//! Valkey record publish them. An engine without LoRA is never asked.
//!
//! What each outcome means for the local pod:
//! * load read: fresh load, healthy;
//! * the engine answered without load series (metrics disabled, another
//!   engine kind, an error status): fresh, healthy, load as last known (zero
//!   at first), warned once, because routing without load is still routing;
//! * a timeout: nothing recorded; the data ages until `healthy-fresh-filter`
//!   drops the pod;
//! * no connection for [`UNHEALTHY_AFTER`]: unhealthy until it answers again.
//!
//! Runs until shutdown.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Uri};
use http_body_util::{BodyExt, Limited};
use tokio::time::Instant;

use crate::body::UpstreamBody;
use crate::config::Config;
use crate::fleet::{
    adapters, parse_engine_metrics, parse_lora_info, parse_rank_loads, EngineLoad, Fleet, LoraInfo,
};
use crate::routing::Routing;
use crate::shutdown::Shutdown;
use crate::upstream::UpstreamClient;

/// What the scrape reads and writes: the engine's settings, a client to
/// ask it with, the fleet its load goes to, the engine's block size it
/// learns, and routing's counter of failed scrapes.
pub struct Scrape {
    pub config: Arc<Config>,
    pub client: UpstreamClient,
    pub fleet: Arc<Fleet>,
    pub engine_block_size: Arc<std::sync::atomic::AtomicU32>,
    pub routing: Arc<Routing>,
}

/// Refused connections for this long mark the local pod unhealthy.
pub const UNHEALTHY_AFTER: Duration = Duration::from_secs(2);
/// Largest metrics text read (a vLLM scrape is ~100 KiB; histograms grow with labels).
const MAX_METRICS_BYTES: usize = 8 * 1024 * 1024;
/// Largest `/v1/models` answer read (a card is ~500 bytes).
const MAX_MODELS_BYTES: usize = 1024 * 1024;

enum Outcome {
    /// The load, and what the LoRA gauge says (`None`: no gauge).
    Load(EngineLoad, Option<LoraInfo>),
    /// The engine answered but said nothing about its load.
    NoLoad(&'static str),
    /// The scrape took longer than its deadline.
    Timeout,
    /// No connection, or the connection failed.
    Unreachable,
}

/// The scrape loop; spawned once per sidecar and owned by its task set.
pub async fn scrape_engine(app: Scrape, shutdown: Shutdown) {
    let engine = &app.config.engine;
    let interval = engine.metrics_interval.get();
    let deadline = engine.metrics_timeout.get();
    let uri = match format!("{}{}", engine.url, engine.metrics_path).parse::<Uri>() {
        Ok(u) => u,
        Err(e) => {
            // Validation checks the path, so this is unreachable in practice.
            tracing::error!(error = %e, "engine metrics URL is invalid; load stays unknown");
            return;
        }
    };
    let models_uri = format!("{}/v1/models", engine.url).parse::<Uri>().ok();
    let local = app.fleet.local_id().to_owned();
    app.fleet.ranks().set_size(engine.data_parallel_size);
    // What the engine said last: `/v1/models`' adapters and the LoRA gauge;
    // a failed read keeps them.
    let mut listed: Vec<String> = Vec::new();
    let mut lora: Option<LoraInfo> = None;
    let mut models_due = Instant::now();
    let mut last = EngineLoad::default();
    let mut unreachable_since: Option<Instant> = None;
    let mut warned_no_load = false;
    loop {
        let started = Instant::now();
        let outcome = tokio::select! {
            _ = shutdown.triggered() => return,
            o = scrape_once(&app, &uri, deadline) => o,
        };
        if let Outcome::Load(_, info) = &outcome {
            lora.clone_from(info);
        }
        // Without LoRA on there is nothing to list; nor while the engine does
        // not answer (the read would only wait out its deadline too).
        if lora.is_none() {
            listed.clear();
        }
        let answering = matches!(outcome, Outcome::Load(..) | Outcome::NoLoad(_));
        let due = lora.is_some() && answering && Instant::now() >= models_due;
        if let Some(uri) = models_uri.as_ref().filter(|_| due) {
            models_due = Instant::now() + engine.models_interval.get();
            let read = tokio::select! {
                _ = shutdown.triggered() => return,
                l = read_models(&app, uri, deadline) => l,
            };
            if let Some(l) = read {
                listed = l;
            }
        }
        let live = adapters::live_set(&app.config.pod.lora_adapters, &listed, lora.as_ref());
        if app.fleet.set_lora_adapters(&local, live.clone()) {
            tracing::info!(adapters = ?live, "the engine's LoRA adapters changed");
        }
        let now = Instant::now();
        match outcome {
            Outcome::Load(load, _) => {
                if load.block_size > 0 {
                    app.engine_block_size
                        .store(load.block_size, Ordering::Relaxed);
                }
                last = load;
                app.fleet.set_load(&local, load, now);
                app.fleet.set_healthy(&local, true);
                unreachable_since = None;
                warned_no_load = false;
            }
            Outcome::NoLoad(why) => {
                app.routing.metrics.scrape_failed(why);
                if !warned_no_load {
                    tracing::warn!(url = %uri, why, "the engine's metrics hold no load figures; load-aware scoring sees this pod as idle");
                    warned_no_load = true;
                }
                app.fleet.set_load(&local, last, now);
                app.fleet.set_healthy(&local, true);
                unreachable_since = None;
            }
            Outcome::Timeout => {
                app.routing.metrics.scrape_failed("timeout");
                tracing::debug!(url = %uri, ?deadline, "engine metrics scrape timed out");
            }
            Outcome::Unreachable => {
                app.routing.metrics.scrape_failed("connect");
                let since = *unreachable_since.get_or_insert(started);
                if now.saturating_duration_since(since) >= UNHEALTHY_AFTER {
                    app.fleet.set_healthy(&local, false);
                }
            }
        }
        tokio::select! {
            _ = shutdown.triggered() => return,
            _ = tokio::time::sleep_until(started + interval) => {}
        }
    }
}

async fn scrape_once(app: &Scrape, uri: &Uri, deadline: Duration) -> Outcome {
    let mut req = Request::new(UpstreamBody::empty());
    *req.uri_mut() = uri.clone();
    let fetch = async {
        let resp = match app.client.request(req).await {
            Ok(r) => r,
            Err(e) => {
                tracing::trace!(error = %e, "engine metrics scrape failed");
                return Outcome::Unreachable;
            }
        };
        if !resp.status().is_success() {
            return Outcome::NoLoad("status");
        }
        let body = match Limited::new(resp.into_body(), MAX_METRICS_BYTES)
            .collect()
            .await
        {
            Ok(c) => c.to_bytes(),
            Err(_) => return Outcome::Unreachable,
        };
        let text = String::from_utf8_lossy(&body);
        if let Some((queries, hits)) = crate::stat::prefix_counters(app.config.engine.kind, &text) {
            app.fleet.update_stats(app.fleet.local_id(), |s| {
                s.prefix_queries = queries;
                s.prefix_hits = hits;
            });
        }
        if app.config.engine.data_parallel_size > 1 {
            let ranks = parse_rank_loads(app.config.engine.kind, &text);
            app.fleet.ranks().set_loads(&ranks);
        }
        match parse_engine_metrics(app.config.engine.kind, &text) {
            Some(load) => Outcome::Load(load, parse_lora_info(&text)),
            None => Outcome::NoLoad("parse"),
        }
    };
    tokio::time::timeout(deadline, fetch)
        .await
        .unwrap_or(Outcome::Timeout)
}

/// The adapters the engine's `/v1/models` lists; `None` when it did not
/// answer a model list within `deadline`.
async fn read_models(app: &Scrape, uri: &Uri, deadline: Duration) -> Option<Vec<String>> {
    let mut req = Request::new(UpstreamBody::empty());
    *req.uri_mut() = uri.clone();
    let fetch = async {
        let resp = app.client.request(req).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = Limited::new(resp.into_body(), MAX_MODELS_BYTES)
            .collect()
            .await
            .ok()?
            .to_bytes();
        adapters::parse_models(&body)
    };
    let found = tokio::time::timeout(deadline, fetch).await.ok().flatten();
    if found.is_none() {
        tracing::debug!(url = %uri, "the engine's /v1/models did not answer a model list");
    }
    found
}
