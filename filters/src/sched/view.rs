//! What the scheduler sees: one [`RequestView`] per request and one
//! [`EndpointView`] per candidate endpoint. Both are plain data the proxy fills
//! once (after parsing the body, and from its load and prefix state), so the
//! plugins never parse JSON, touch a socket or read a clock.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The kind of inference call, from the request path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PathKind {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
    /// Anything else the proxy decided to schedule.
    #[default]
    Other,
}

/// One inference request, as the schedule stage needs it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestView {
    /// The request id (`x-request-id` or generated), for traces.
    pub request_id: String,
    /// The `model` field as the client sent it.
    pub model: String,
    /// The LoRA adapter the model name names, when it names one (vLLM serves
    /// adapters under their own model name).
    pub lora_adapter: Option<String>,
    /// Completions, chat or other.
    pub path: PathKind,
    /// `stream: true`.
    pub stream: bool,
    /// `max_tokens` / `max_completion_tokens`, when given.
    pub max_tokens: Option<u32>,
    /// vLLM's `cache_salt`, when given (it changes every block key).
    pub cache_salt: Option<String>,
    /// The session key from the session header (e.g. `x-session-id`).
    pub session_key: Option<String>,
    /// Prompt length in tokens, exact or estimated.
    pub prompt_tokens: u32,
    /// Whether `prompt_tokens` came from a real tokenizer.
    pub prompt_tokens_exact: bool,
    /// Number of full prompt blocks (the denominator of the prefix score).
    pub prompt_blocks: u32,
    /// The prompt's chained block keys, as the prefix index keys them (empty
    /// when the prompt was not keyed); candidates' [`PrefixMatch`]es count
    /// blocks of these. `prefix-affinity-scorer` takes its anchor from them.
    pub block_keys: Vec<u64>,
}

/// How many blocks past the prefix most candidates already hold the prefix
/// anchor is taken: 4 blocks of 16 tokens name a system prompt or a
/// conversation's opening, and are short enough that almost every prompt has
/// them.
pub const ANCHOR_BLOCKS: usize = 4;

/// The prefix anchor of a prompt whose chained block keys are `keys`, when
/// most candidates already hold its first `common` blocks (see
/// [`common_prefix_blocks`]): the key [`ANCHOR_BLOCKS`] blocks past them (or
/// the last key of a shorter prompt). Requests that share those blocks share
/// the anchor, whatever follows.
///
/// A prefix most pods hold (one system prompt under every conversation) says
/// nothing about where a request should go; anchored on it, every
/// conversation would have the same home. Past it, each has its own.
pub fn prefix_anchor(keys: &[u64], common: usize) -> Option<u64> {
    let at = common.saturating_add(ANCHOR_BLOCKS).min(keys.len());
    keys.get(at.checked_sub(1)?).copied()
}

/// The prompt blocks that more than half of the candidates already hold: the
/// largest `n` such that a strict majority of `cands` match at least `n`
/// blocks (all of them, for one or two candidates).
///
/// A majority, not every candidate: one pod that holds nothing (new, or never
/// chosen) would otherwise keep the common prefix at 0, so every conversation
/// under a shared system prompt would stay anchored on that prompt, share
/// one home, and the pod would never be chosen.
pub fn common_prefix_blocks(eps: &[EndpointView], cands: &[usize]) -> usize {
    let mut matched: Vec<u32> = cands
        .iter()
        .map(|&i| eps[i].prefix.matched_blocks)
        .collect();
    if matched.is_empty() {
        return 0;
    }
    // The ((m − 1) / 2)-th smallest: the candidates from it up, a strict
    // majority, each match at least this many.
    let k = (matched.len() - 1) / 2;
    *matched.select_nth_unstable(k).1 as usize
}

impl RequestView {
    /// A request for `model` with everything else empty; fill the rest with
    /// struct update syntax.
    pub fn new(request_id: impl Into<String>, model: impl Into<String>) -> Self {
        RequestView {
            request_id: request_id.into(),
            model: model.into(),
            ..RequestView::default()
        }
    }

    /// Prompt tokens an endpoint holding `m` of the prompt would still
    /// compute: the share of the prompt's blocks it does not hold, in tokens.
    /// A share, not `prompt_tokens − matched tokens`: approximate keys are
    /// text chunks, not token blocks, so only their ratio means tokens.
    pub fn uncached_tokens(&self, m: &PrefixMatch) -> u64 {
        let prompt = u64::from(self.prompt_tokens);
        if self.prompt_blocks == 0 {
            return prompt;
        }
        let held = u64::from(m.matched_blocks.min(self.prompt_blocks));
        let blocks = u64::from(self.prompt_blocks);
        prompt - prompt * held / blocks
    }

    /// The adapter named by `model`, when `is_adapter` says the name is one of
    /// the LoRA adapters the mesh knows; the caller stores it in `lora_adapter`.
    pub fn adapter_from_model(model: &str, is_adapter: impl Fn(&str) -> bool) -> Option<String> {
        is_adapter(model).then(|| model.to_owned())
    }
}

/// The serving role of an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill only (P/D).
    Prefill,
    /// Decode only (P/D).
    Decode,
    /// Both: an ordinary aggregated engine.
    #[default]
    Both,
}

impl Role {
    /// Whether this endpoint can run a prefill leg.
    pub fn can_prefill(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    /// Whether this endpoint can run a decode leg (or a whole request).
    pub fn can_decode(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
}

/// The load figures of one endpoint, as last reported.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct LoadSnapshot {
    /// Requests waiting in the engine queue.
    pub waiting: u32,
    /// Requests running in the engine batch.
    pub running: u32,
    /// Requests this mesh sent that have not finished (fresher than the two above).
    pub in_flight: u32,
    /// KV-cache usage, 0..=1.
    pub kv_usage: f64,
    /// The engine's KV block size in tokens.
    pub block_size: u32,
    /// KV blocks in the engine's cache (0: not reported).
    #[serde(default)]
    pub num_blocks: u32,
    /// Prompt tokens the mesh has sent there that are still to be prefilled:
    /// each in-flight request's uncached part, from its routing decision
    /// until its first token (until its end, unstreamed).
    #[serde(default)]
    pub prefill_tokens: u64,
}

impl LoadSnapshot {
    /// Requests at the endpoint: those this mesh has in flight there, or its
    /// engine's running plus waiting count when that is larger (clients that
    /// bypass the mesh, or a mesh count not yet caught up).
    pub fn requests(&self) -> u32 {
        self.in_flight
            .max(self.running.saturating_add(self.waiting))
    }

    /// Tokens the engine's KV cache holds in all (0: not reported).
    pub fn kv_capacity_tokens(&self) -> u64 {
        u64::from(self.num_blocks) * u64::from(self.block_size)
    }

    /// Tokens of the KV cache the engine's running requests hold now.
    pub fn kv_used_tokens(&self) -> u64 {
        (self.kv_usage.clamp(0.0, 1.0) * self.kv_capacity_tokens() as f64) as u64
    }
}

/// How much of the current request's prefix the endpoint holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PrefixMatch {
    /// Consecutive blocks from block 0 the endpoint holds.
    pub matched_blocks: u32,
    /// Tokens per block of this match.
    pub block_size: u32,
}

impl PrefixMatch {
    /// Matched prefix length in tokens.
    pub fn matched_tokens(&self) -> u64 {
        u64::from(self.matched_blocks) * u64::from(self.block_size)
    }
}

/// One candidate endpoint for one request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EndpointView {
    /// Stable id, e.g. `10.0.0.5:8000`; decisions and traces name endpoints by it.
    pub id: String,
    /// Where to send the request (often equal to `id`).
    pub address: String,
    /// Prefill, decode or both.
    pub role: Role,
    /// Models served (base names). Empty means "not known".
    pub models: Vec<String>,
    /// LoRA adapters loaded now.
    pub lora_adapters: Vec<String>,
    /// Labels, for `label-selector-filter`.
    pub labels: BTreeMap<String, String>,
    /// Load snapshot.
    pub load: LoadSnapshot,
    /// Prefix match for the current request (from the prefix index).
    pub prefix: PrefixMatch,
    /// Whether the endpoint is believed healthy.
    pub healthy: bool,
    /// Age of the load/health data in milliseconds.
    pub staleness_ms: u64,
}

impl EndpointView {
    /// A healthy, fresh, idle endpoint serving both roles; fill the rest with
    /// struct update syntax.
    pub fn new(id: impl Into<String>) -> Self {
        let id = id.into();
        EndpointView {
            address: id.clone(),
            id,
            healthy: true,
            ..EndpointView::default()
        }
    }
}
