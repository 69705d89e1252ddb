//! The prefix stage's machinery: which tokenizer, the block keys of a
//! request, and [`PrefixState`], the per-sidecar state the schedule stage asks
//! "how many leading blocks of this prompt does each pod hold?".
//!
//! Two modes, fixed at start by `prefix.tokenizer`:
//! * **precise** (`builtin`, a model directory, or `engine`): the prompt is
//!   tokenized once (never for pass-through paths), cut into full blocks of the
//!   engine's block size and hashed with
//!   [`PrefixIndex::request_keys`]; the index is fed by KV events (the local
//!   engine's through [`crate::kvevents`], peers' through the mesh);
//! * **approximate** (`none`): keys from text chunks
//!   ([`ApproxIndex`]), recorded against the pod each routing decision picks.
//!
//! Block size: the engine's, learned from its KV events, else from its
//! `vllm:cache_config_info` (the fleet scraper), else `prefix.block_size`.
//!
//! Key model: block keys are seeded by a model name, the same on both sides:
//! events are keyed by the topic's model (`kv@pod@model`), else the pod's first
//! `pod.models`, else ""; a request by its `model` when it names a LoRA
//! adapter or `pod.models` is set, else the same default. An event's
//! `lora_name` overrides its model.

mod local;
pub mod metrics;
pub mod tokenize;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use kvmesh_filters::prefix::approx::{ApproxConfig, ApproxIndex};
use kvmesh_filters::prefix::index::{ApplyStats, IndexConfig, PodId, PrefixIndex};
use kvmesh_filters::prefix::kvevents::EventBatch;
use kvmesh_filters::prefix::predicted::PredictedIndex;
use kvmesh_filters::prefix::tokenize::Inexact;
use prometheus_client::registry::Registry;
use tokio::sync::broadcast;

use crate::config::{Config, TokenizerChoice};
use crate::request::{RequestCtx, RequestView};
use crate::upstream::UpstreamClient;
pub use local::{recv_local, LocalKvUpdate};
use metrics::PrefixMetrics;
pub use tokenize::{LocalTokenizer, PrefixError, Tokenized};

/// Local KV updates buffered for slow mesh subscribers before they lag.
pub const LOCAL_UPDATES_CAPACITY: usize = 4096;
/// Approximate decisions buffered for the Valkey index's writer before it lags.
const DECISIONS_CAPACITY: usize = 4096;

/// An approximate routing decision: a request of `model` whose prompt has
/// text block keys `keys` was sent to pod `pod` (for the Valkey index,
/// which shares it with the other sidecars; the mesh publishes its own).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApproxDecision {
    pub model: String,
    pub pod: String,
    pub keys: Vec<u64>,
}

/// How `config` matches prompts, as [`PrefixState::mode`] will.
pub fn mode_of(config: &Config) -> Mode {
    match config
        .prefix
        .tokenizer
        .resolve(config.engine.kv_events.is_some())
    {
        TokenizerChoice::None | TokenizerChoice::Auto => Mode::Approximate,
        _ => Mode::Precise,
    }
}

/// What computing one request's keys reads besides [`PrefixState`]: the
/// engine's address and the pooled client (`tokenizer: engine`), and the
/// block size the engine reported. Borrowed per request.
#[derive(Clone, Copy)]
pub struct Compute<'a> {
    /// The local engine's URL (`tokenizer: engine` asks its `/tokenize`).
    pub engine_url: &'a crate::config::EngineUrl,
    pub client: &'a UpstreamClient,
    /// The local engine's KV block size from its metrics (0: not yet known).
    pub engine_block_size: &'a AtomicU32,
    /// Approximate mode: most leading text blocks read (`maxPrefixBlocksToMatch`).
    pub approx_max_blocks: usize,
}

/// How prompts are matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Token block keys against the KV-event index.
    Precise,
    /// Text chunk keys against the routing-decision index.
    Approximate,
}

enum Source {
    Local(LocalTokenizer),
    Engine,
    Approx,
}

/// Everything the prefix stage shares across requests (see the module docs).
pub struct PrefixState {
    source: Source,
    index: Arc<PrefixIndex>,
    approx: ApproxIndex,
    /// Precise mode: where requests were just routed, until their events arrive.
    predicted: PredictedIndex,
    local_pod: PodId,
    local_name: String,
    /// The model events and model-less requests are keyed by.
    default_model: String,
    models: Vec<String>,
    adapters: Vec<String>,
    config: crate::config::Prefix,
    local_updates: broadcast::Sender<LocalKvUpdate>,
    /// Approximate decisions, for the Valkey index's writer.
    decisions: broadcast::Sender<Arc<ApproxDecision>>,
    /// Local updates carry the block keys each batch touched (the Valkey
    /// writer reads them; the mesh does not).
    track_touched: bool,
    /// Tokenization, KV event ingestion and the prefix index.
    pub metrics: PrefixMetrics,
}

impl std::fmt::Debug for PrefixState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixState")
            .field("mode", &self.mode())
            .field("local_pod", &self.local_name)
            .finish()
    }
}

impl PrefixState {
    /// Builds the state for a sidecar whose pod id is `local_pod`; reads the
    /// tokenizer directory, if one is configured, once.
    /// Its families are registered in `registry`.
    pub fn new(
        config: &Config,
        local_pod: &str,
        registry: &mut Registry,
    ) -> Result<Self, PrefixError> {
        let p = &config.prefix;
        let cache = usize::try_from(p.token_cache_bytes.0).unwrap_or(usize::MAX);
        let source = match p.tokenizer.resolve(config.engine.kv_events.is_some()) {
            TokenizerChoice::Builtin => Source::Local(LocalTokenizer::builtin(cache)),
            TokenizerChoice::Dir(dir) => Source::Local(LocalTokenizer::from_dir(&dir, cache)?),
            TokenizerChoice::Engine => Source::Engine,
            TokenizerChoice::None | TokenizerChoice::Auto => Source::Approx,
        };
        let index = Arc::new(PrefixIndex::new(IndexConfig {
            max_blocks_per_pod: p.index_max_blocks_per_pod,
            hash_seed: p.hash_seed.clone(),
        }));
        // The local pod is interned first; an index that cannot hold one pod
        // does not exist (the limit is 65535).
        let local = index
            .pod(local_pod)
            .map_err(|e| PrefixError::Engine(e.to_string()))?;
        let approx = ApproxIndex::new(ApproxConfig {
            chunk_chars: p.approx_chunk_chars,
            default_blocks_per_pod: p.approx_blocks_per_pod,
            hash_seed: p.hash_seed.clone(),
        });
        let predicted = PredictedIndex::new(p.predict_ttl.get(), p.predict_blocks_per_pod);
        let (local_updates, _) = broadcast::channel(LOCAL_UPDATES_CAPACITY);
        let (decisions, _) = broadcast::channel(DECISIONS_CAPACITY);
        Ok(Self {
            source,
            index,
            approx,
            predicted,
            local_pod: local,
            local_name: local_pod.to_owned(),
            default_model: config.pod.models.first().cloned().unwrap_or_default(),
            models: config.pod.models.clone(),
            adapters: config.pod.lora_adapters.clone(),
            config: p.clone(),
            local_updates,
            decisions,
            track_touched: config.index.backend == crate::config::index::Backend::Valkey,
            metrics: PrefixMetrics::register(registry),
        })
    }

    pub fn mode(&self) -> Mode {
        match self.source {
            Source::Approx => Mode::Approximate,
            _ => Mode::Precise,
        }
    }

    /// The precise index (KV events of every pod).
    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.index
    }

    /// The approximate index (routing decisions).
    pub fn approx(&self) -> &ApproxIndex {
        &self.approx
    }

    /// The local pod's index id and name.
    pub fn local_pod(&self) -> (PodId, &str) {
        (self.local_pod, &self.local_name)
    }

    /// The index id of pod `name` (interned on first use).
    pub fn pod_id(&self, name: &str) -> Option<PodId> {
        self.index.pod(name).ok()
    }

    /// The model events of a pod are keyed by, given the topic's model.
    pub fn event_model<'a>(&'a self, topic_model: Option<&'a str>) -> &'a str {
        topic_model
            .filter(|m| !m.is_empty())
            .unwrap_or(&self.default_model)
    }

    /// The model a request's keys are seeded by (see the module docs).
    pub fn request_model<'a>(&'a self, model: Option<&'a str>) -> &'a str {
        match model {
            Some(m) if self.adapters.iter().any(|a| a == m) => m,
            Some(m) if !self.models.is_empty() => m,
            _ => &self.default_model,
        }
    }

    /// Tokens per KV block: learned from events, else the engine's metrics,
    /// else `prefix.block_size`.
    pub fn block_size(&self, engine_block_size: &AtomicU32) -> u32 {
        match self.index.block_size() {
            0 => match engine_block_size.load(Ordering::Relaxed) {
                0 => self.config.block_size,
                n => n,
            },
            n => n,
        }
    }

    /// Applies a batch of `pod`'s events (the mesh calls this for peers).
    pub fn apply(&self, pod: &str, model: &str, batch: &EventBatch) -> ApplyStats {
        match self.index.pod(pod) {
            Ok(id) => self.index.apply(id, model, batch),
            Err(_) => ApplyStats::default(),
        }
    }

    /// Forgets a pod that left the fleet (its index id may be reused).
    pub fn remove_pod(&self, pod: &str) {
        if pod == self.local_name {
            return;
        }
        if let Ok(id) = self.index.pod(pod) {
            self.index.remove_pod(id);
        }
        self.approx.remove_pod(pod);
        self.predicted.remove_pod(pod);
    }

    /// Local KV updates, for the mesh to forward to peers. Bounded: a
    /// receiver that falls more than [`LOCAL_UPDATES_CAPACITY`] behind gets
    /// `Lagged` and has lost updates; it must resync its peers from a snapshot
    /// of the index (the mesh does).
    pub fn subscribe_local(&self) -> broadcast::Receiver<LocalKvUpdate> {
        self.local_updates.subscribe()
    }

    /// Applies a batch of the local pod's KV events keyed by `model` and
    /// hands it to the local subscribers (the mesh, the Valkey writer): what
    /// the KV-event feed does with every batch it takes in order, and what
    /// `kvmesh bench scale` feeds emulated pods through.
    pub fn ingest_local(&self, seq: u64, model: Arc<str>, batch: &EventBatch) -> ApplyStats {
        let mut touched = Vec::new();
        let stats = if self.track_touched {
            self.index
                .apply_touching(self.local_pod, &model, batch, &mut touched)
        } else {
            self.index.apply(self.local_pod, &model, batch)
        };
        if self.has_local_subscribers() {
            self.publish_local(LocalKvUpdate::Batch {
                seq,
                model,
                batch: Arc::new(batch.clone()),
                touched: touched.into(),
            });
        }
        stats
    }

    /// Approximate decisions from now on ([`Self::record`]). Bounded: a
    /// receiver more than a few thousand behind gets `Lagged` and has lost
    /// some.
    pub fn subscribe_decisions(&self) -> broadcast::Receiver<Arc<ApproxDecision>> {
        self.decisions.subscribe()
    }

    /// Whether local updates carry the keys each batch touched.
    pub fn tracks_touched(&self) -> bool {
        self.track_touched
    }

    pub(crate) fn has_local_subscribers(&self) -> bool {
        self.local_updates.receiver_count() > 0
    }

    pub(crate) fn publish_local(&self, update: LocalKvUpdate) {
        // No subscriber (no mesh) is fine: the update is dropped.
        let _ = self.local_updates.send(update);
    }

    /// The prefix stage: fills `ctx.block_keys` and `ctx.prompt_tokens` for an
    /// inference request. Never fails the request: a prompt that cannot be
    /// tokenized is routed without prefix information (and counted).
    pub async fn compute(&self, c: Compute<'_>, ctx: &mut RequestCtx) {
        let Some(view) = ctx.view.as_ref() else {
            return;
        };
        let started = std::time::Instant::now();
        let (keys, tokens, outcome) = self.keys_for(c, view, ctx.id()).await;
        ctx.block_keys = keys;
        if tokens.is_some() {
            ctx.prompt_tokens = tokens;
        }
        self.metrics
            .tokenized(outcome, started.elapsed().as_secs_f64());
    }

    async fn keys_for(
        &self,
        c: Compute<'_>,
        view: &RequestView,
        request_id: &str,
    ) -> (Vec<u64>, Option<u32>, &'static str) {
        let max = usize::try_from(self.config.max_tokenize_bytes.0).unwrap_or(usize::MAX);
        if let (Some(reason), Mode::Precise) = (view.inexact, self.mode()) {
            // Keyed on the text alone: its leading blocks may still match.
            self.metrics.inexact(reason.as_str());
        }
        let tokenized = match &self.source {
            Source::Approx => {
                let keys = tokenize::approx_text(&view.prompt)
                    .map(|text| {
                        self.approx.keys_upto(
                            self.request_model(view.model.as_deref()),
                            cut(&text, max),
                            c.approx_max_blocks,
                        )
                    })
                    .unwrap_or_default();
                let outcome = if keys.is_empty() { "none" } else { "ok" };
                return (keys, None, outcome);
            }
            Source::Local(t) => {
                let r = self.local_ids(t, view, max, request_id);
                let s = t.cache().stats();
                self.metrics.token_cache(s.reused_bytes, s.tokenized_bytes);
                r
            }
            Source::Engine => match self.engine_ids(c, view, max, request_id).await {
                Some(r) => r,
                None => return (Vec::new(), None, "capped"),
            },
        };
        match tokenized {
            Ok(Some(t)) => {
                let bs = self.block_size(c.engine_block_size) as usize;
                let keys = self.keys_of(view, &t.ids, bs);
                let tokens = Some(u32::try_from(t.prompt_tokens).unwrap_or(u32::MAX));
                (keys, tokens, if t.capped { "capped" } else { "ok" })
            }
            Ok(None) => (Vec::new(), None, "none"),
            Err(e) => {
                tracing::debug!(request_id, error = %e, "prompt not tokenized; routing without prefix match");
                (Vec::new(), None, "error")
            }
        }
    }

    /// A local tokenizer's ids of the request's template input (tools,
    /// documents, ...; docs/prefix.md, "Request shapes"), or of its messages
    /// alone when it has none or the template refused it (counted as
    /// `template_error`: the engine will answer the request itself).
    fn local_ids(
        &self,
        t: &LocalTokenizer,
        view: &RequestView,
        max: usize,
        request_id: &str,
    ) -> Result<Option<Tokenized>, PrefixError> {
        // vLLM's default when the request has no template input to say otherwise.
        let mut add_gen = true;
        if let Some(input) = view.chat.as_deref() {
            match t.tokenize_chat_input(input, max) {
                Ok(ids) => return Ok(Some(ids)),
                Err(e) => {
                    tracing::debug!(request_id, error = %e, "template input not rendered; keys approximate");
                    self.metrics.inexact(Inexact::Template.as_str());
                    add_gen = input.add_generation_prompt;
                }
            }
        }
        t.tokenize(&view.prompt, add_gen, max)
    }

    /// `tokenizer: engine`: the engine's `/tokenize` of the request's
    /// template input, or of its messages alone when it has none or the
    /// engine refused it (counted as `template_error`); a timeout or a
    /// connection error is not asked again. `None`: a chat too long to ask
    /// about (capped).
    async fn engine_ids(
        &self,
        c: Compute<'_>,
        view: &RequestView,
        max: usize,
        request_id: &str,
    ) -> Option<Result<Option<Tokenized>, PrefixError>> {
        let engine = c.engine_url.to_string();
        let deadline = self.config.engine_tokenize_timeout.get();
        let model = view.model.as_deref();
        let mut add_gen = true;
        if let Some(input) = view.chat.as_deref() {
            let r = tokenize::engine_tokenize_chat_input(
                c.client, &engine, model, input, max, deadline,
            )
            .await;
            match r {
                Err(e @ PrefixError::EngineRefused { .. }) => {
                    tracing::debug!(request_id, error = %e, "template input refused by the engine; keys approximate");
                    self.metrics.inexact(Inexact::Template.as_str());
                    add_gen = input.add_generation_prompt;
                }
                r => return Some(r),
            }
        }
        if tokenize::engine_skips_chat(&view.prompt, max) {
            return None;
        }
        Some(
            tokenize::engine_tokenize(
                c.client,
                &engine,
                model,
                &view.prompt,
                add_gen,
                max,
                deadline,
            )
            .await,
        )
    }

    /// The precise block keys of token ids `ids` of request `view`.
    pub fn keys_of(&self, view: &RequestView, ids: &[u32], block_size: usize) -> Vec<u64> {
        self.index.request_keys(
            self.request_model(view.model.as_deref()),
            view.cache_salt.as_deref(),
            ids,
            block_size,
        )
    }

    /// Leading blocks of this request's prompt each pod holds, by pod id
    /// (pods holding none are absent). The schedule stage's one call.
    pub fn matches(&self, ctx: &RequestCtx) -> HashMap<String, u32> {
        let mut out = HashMap::new();
        if ctx.block_keys.is_empty() {
            return out;
        }
        let n = |b: usize| u32::try_from(b).unwrap_or(u32::MAX);
        match self.mode() {
            Mode::Precise => {
                for m in self.index.match_prefix(&ctx.block_keys) {
                    if let Some(name) = self.index.pod_name(m.pod) {
                        out.insert(name, n(m.blocks));
                    }
                }
                let now = std::time::Instant::now();
                for (pod, blocks) in self.predicted.match_prefix(&ctx.block_keys, now) {
                    let e = out.entry(pod).or_insert(0);
                    *e = (*e).max(n(blocks));
                }
            }
            Mode::Approximate => {
                for m in self.approx.match_prefix(&ctx.block_keys) {
                    out.insert(m.pod, n(m.blocks));
                }
            }
        }
        out
    }

    /// Precise mode: predicts that `pod_id` will hold this request's blocks,
    /// which the scheduler just sent there, until the engine's events say so
    /// (`prefix.predict_ttl`; docs/prefix.md). A no-op in approximate mode,
    /// where [`Self::record`] does this for good.
    pub fn predict(&self, pod_id: &str, ctx: &RequestCtx) {
        if self.mode() == Mode::Precise && !ctx.block_keys.is_empty() {
            self.predicted
                .record(pod_id, &ctx.block_keys, std::time::Instant::now());
        }
    }

    /// Records that this request was sent to `pod_id` (approximate mode; a
    /// no-op in precise mode, where the engine's events say what it cached),
    /// and hands the decision to its subscribers (the Valkey index).
    pub fn record(&self, pod_id: &str, ctx: &RequestCtx) {
        if self.mode() == Mode::Approximate && !ctx.block_keys.is_empty() {
            self.approx.record(pod_id, &ctx.block_keys);
            if self.decisions.receiver_count() > 0 {
                let model = ctx.view.as_ref().and_then(|v| v.model.as_deref());
                let _ = self.decisions.send(Arc::new(ApproxDecision {
                    model: self.request_model(model).to_owned(),
                    pod: pod_id.to_owned(),
                    keys: ctx.block_keys.clone(),
                }));
            }
        }
    }
}

#[cfg(test)]
mod tests;

/// The prefix-index name of data-parallel rank `rank` of pod `pod`: each
/// rank's blocks are indexed under it (as well as under the pod), a name
/// the fleet never holds, so the scheduler never sees it.
pub fn rank_pod(pod: &str, rank: u32) -> String {
    format!("{pod}#dp{rank}")
}

/// `text` cut to at most `max` bytes, on a character boundary.
fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while end > 0 && !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}
