//! Starting an engine and the handle tests hold: address, faults, what was
//! received and served, restart and shutdown.

use std::net::SocketAddr;
use std::sync::Arc;

use kvmesh_filters::prefix::tokenize::{Builtin, HfTokenizer, Tokenizer};
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{SimConfig, TokenizerChoice};
use crate::core::{Clock, Cmd, Core};
use crate::faults::Faults;
use crate::http::{self, Shared};
use crate::kv::publisher::{self, KvEndpoints};
use crate::metrics::EngineMetrics;
use crate::stats::{CompletedRequest, ReceivedRequest, Recorder, SimStats};
use crate::SimError;

/// Entry point: `Engine::start(config, listener)`.
#[derive(Debug)]
pub struct Engine;

/// A running engine. Dropping it stops the engine's tasks too (they watch a
/// cancellation token), but `shutdown().await` waits for them.
pub struct SimHandle {
    addr: SocketAddr,
    shared: Arc<Shared>,
    kv: Option<KvEndpoints>,
    /// Every rank's KV-event endpoints, rank order.
    kv_all: Vec<KvEndpoints>,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for SimHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimHandle")
            .field("addr", &self.addr)
            .field("model", &self.shared.cfg.model)
            .finish()
    }
}

impl Engine {
    /// Starts an engine serving on `listener` (bind it to port 0 in tests).
    /// Ready to serve when this returns: the KV sockets are bound and the
    /// listener is accepting.
    pub async fn start(
        mut config: SimConfig,
        listener: TcpListener,
    ) -> Result<SimHandle, SimError> {
        config.validate()?;
        let tokenizer: Arc<dyn Tokenizer> = match &config.tokenizer {
            TokenizerChoice::Builtin => Arc::new(Builtin),
            TokenizerChoice::HfDir(dir) => Arc::new(load_hf(dir)?),
        };
        let addr = listener.local_addr().map_err(SimError::Io)?;
        resolve_side_channel(&mut config, addr);
        let cancel = CancellationToken::new();
        let engine_id = config
            .engine_id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let mut tasks = Vec::new();
        let mut ranks = Vec::with_capacity(config.data_parallel_size);
        let mut kv_all = Vec::with_capacity(config.data_parallel_size);
        let adapters = Arc::new(crate::http::lora::Adapters::default());
        for rank in 0..config.data_parallel_size {
            let mut c = config.clone();
            c.dp_rank = u32::try_from(rank).unwrap_or(u32::MAX);
            if let Some(k) = &mut c.kv_events {
                k.endpoint = crate::http::dp::offset_port(&k.endpoint, rank);
                k.replay_endpoint = k
                    .replay_endpoint
                    .as_deref()
                    .map(|e| crate::http::dp::offset_port(e, rank));
            }
            let (shared, kv) = start_rank(
                c,
                &engine_id,
                tokenizer.clone(),
                adapters.clone(),
                &cancel,
                &mut tasks,
            )
            .await?;
            ranks.push(shared);
            kv_all.extend(kv);
        }
        let shared = ranks[0].clone();
        let kv = kv_all.first().cloned();
        tasks.push(tokio::spawn(http::serve(
            listener,
            Arc::new(http::dp::Ranks::new(ranks)),
            cancel.clone(),
        )));
        Ok(SimHandle {
            addr,
            shared,
            kv,
            kv_all,
            cancel,
            tasks,
        })
    }

    /// Binds `127.0.0.1:0` and starts; for tests and demos.
    pub async fn start_local(config: SimConfig) -> Result<SimHandle, SimError> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(SimError::Io)?;
        Self::start(config, listener).await
    }
}

/// One data-parallel rank: its core, metrics and KV publisher (see
/// [`SimConfig::data_parallel_size`]).
async fn start_rank(
    config: SimConfig,
    engine_id: &str,
    tokenizer: Arc<dyn Tokenizer>,
    adapters: Arc<crate::http::lora::Adapters>,
    cancel: &CancellationToken,
    tasks: &mut Vec<JoinHandle<()>>,
) -> Result<(Arc<Shared>, Option<KvEndpoints>), SimError> {
    let (pubtx, kv) = match &config.kv_events {
        Some(k) => {
            let (tx, eps, task) = publisher::start(k, cancel.clone()).await?;
            tasks.push(task);
            (Some(tx), Some(eps))
        }
        None => (None, None),
    };
    let metrics = Arc::new(Mutex::new(EngineMetrics::new(&config)));
    let clock = Clock::new(config.time_scale);
    let (core_tx, core_rx) = mpsc::channel(config.max_waiting);
    let core = Core::new(
        config.clone(),
        engine_id.to_owned(),
        clock,
        metrics.clone(),
        pubtx,
        core_tx.downgrade(),
    );
    tasks.push(tokio::spawn(core.run(core_rx, cancel.clone())));
    let kvagent = config.kvagent.clone().map(crate::pd::kvagent::Link::new);
    if let Some(link) = &kvagent {
        if let Err(reason) = link.register().await {
            tracing::warn!(%reason, "kvagent: no staging region yet (retried at the next transfer)");
        }
    }
    let shared = Arc::new(Shared {
        kvagent,
        adapters,
        cfg: config,
        engine_id: engine_id.to_owned(),
        tokenizer,
        core_tx,
        metrics,
        faults: Arc::new(Faults::default()),
        recorder: Arc::new(Recorder::default()),
        clock,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        fingerprint: format!(
            "vllm-0.32.0-sim{}",
            &uuid::Uuid::new_v4().simple().to_string()[..4]
        ),
    });
    Ok((shared, kv))
}

/// The side channel is served on the HTTP listener (`crate::pd::nixl`): an
/// unset host or port in the config means the listener's.
fn resolve_side_channel(config: &mut SimConfig, addr: SocketAddr) {
    if config.side_channel_port == 0 {
        config.side_channel_port = addr.port();
    }
    if config.side_channel_host.is_empty() {
        config.side_channel_host = if addr.ip().is_unspecified() {
            "127.0.0.1".to_string()
        } else {
            addr.ip().to_string()
        };
    }
}

/// `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`) of a
/// model directory.
fn load_hf(dir: &std::path::Path) -> Result<HfTokenizer, SimError> {
    let read = |name: &str| std::fs::read(dir.join(name));
    let json = read("tokenizer.json")
        .map_err(|e| SimError::Tokenizer(format!("{}/tokenizer.json: {e}", dir.display())))?;
    let config = read("tokenizer_config.json")
        .ok()
        .and_then(|b| String::from_utf8(b).ok());
    let template = read("chat_template.jinja")
        .ok()
        .and_then(|b| String::from_utf8(b).ok());
    HfTokenizer::from_parts(&json, config.as_deref(), template.as_deref())
        .map_err(|e| SimError::Tokenizer(format!("{}: {e}", dir.display())))
}

impl SimHandle {
    /// The HTTP address the engine serves on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn config(&self) -> &SimConfig {
        &self.shared.cfg
    }

    /// The NixlConnector `remote_engine_id` this engine reports.
    pub fn engine_id(&self) -> &str {
        &self.shared.engine_id
    }

    /// The KV-event endpoints, resolved (`None` without KV events); rank
    /// 0's with data parallelism.
    pub fn kv_endpoints(&self) -> Option<&KvEndpoints> {
        self.kv.as_ref()
    }

    /// Every data-parallel rank's KV-event endpoints, in rank order.
    pub fn kv_endpoints_by_rank(&self) -> &[KvEndpoints] {
        &self.kv_all
    }

    /// The fault script; changes apply to the next requests.
    pub fn faults(&self) -> &Faults {
        &self.shared.faults
    }

    /// Every HTTP request received (most recent 4096), bodies and headers.
    pub fn received_requests(&self) -> Vec<ReceivedRequest> {
        self.shared.recorder.received_list()
    }

    /// Every inference request served to the end (most recent 4096), with its
    /// simulated latencies.
    pub fn completed_requests(&self) -> Vec<CompletedRequest> {
        self.shared.recorder.completed_list()
    }

    /// The engine's counters and gauges now.
    pub fn stats(&self) -> SimStats {
        let m = self.shared.metrics.lock();
        SimStats {
            running: m.running,
            waiting: m.waiting,
            kv_usage: m.kv_usage,
            cached_blocks: m.cached_blocks,
            held_transfers: m.held_transfers,
            prefix_queries: m.prefix_queries,
            prefix_hits: m.prefix_hits,
            preempted_queries: m.preempted_queries,
            preempted_hits: m.preempted_hits,
            prompt_tokens: m.prompt_tokens,
            generation_tokens: m.generation_tokens,
            external_kv_tokens: m.by_source_external,
            failed_kv_transfers: m.nixl_failed_transfers,
            preemptions: m.preemptions,
            kv_batches_published: m.kv_batches_published,
            kv_batches_dropped: m.kv_batches_dropped,
        }
    }

    /// The `/metrics` text now.
    pub fn metrics_text(&self) -> String {
        self.shared.metrics.lock().render(&self.shared.cfg)
    }

    /// `POST /reset_prefix_cache`: true if the cache was cleared (only when no
    /// request holds blocks, as in vLLM); emits `AllBlocksCleared`.
    pub async fn reset_prefix_cache(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        if self
            .shared
            .core_tx
            .send(Cmd::ResetPrefixCache(tx))
            .await
            .is_err()
        {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// Simulates an engine restart: running and waiting requests fail, the
    /// cache is emptied without events, metrics reset, and the KV-event
    /// sequence starts again from 0 with an empty replay buffer.
    pub async fn restart(&self) -> Result<(), SimError> {
        let (tx, rx) = oneshot::channel();
        self.shared
            .core_tx
            .send(Cmd::Restart(tx))
            .await
            .map_err(|_| SimError::Stopped)?;
        rx.await.map_err(|_| SimError::Stopped)
    }

    /// Stops the engine and waits for its tasks.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
