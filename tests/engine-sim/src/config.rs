//! What one simulated engine is: model, flavor, role, cache geometry, latency
//! profile, time scale, KV-event sockets and P/D settings.
//!
//! `SimConfig::new(model)` gives a vLLM-like default engine; the `with_*`
//! methods change one field each so tests read as a sentence.

use std::path::PathBuf;
use std::time::Duration;

use crate::profile::LatencyProfile;

/// Which engine family the simulator imitates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Flavor {
    /// vLLM V1: `vllm:` metrics, uint64 event hashes, NixlConnector P/D.
    #[default]
    Vllm,
    /// SGLang: `sglang:` metrics, signed int64 event hashes, bootstrap P/D.
    Sglang,
}

/// The engine's part in prefill/decode disaggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    /// Aggregated serving (also accepts P/D parameters, as vLLM `kv_both`).
    #[default]
    Both,
    /// Prefill engine.
    Prefill,
    /// Decode engine.
    Decode,
}

/// How `BlockStored`/`BlockRemoved`/`AllBlocksCleared` are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvEventsFormat {
    /// Tagged map (vLLM >= 0.26, SGLang >= #37482); what vLLM 0.32 sends.
    #[default]
    Map,
    /// Legacy tagged array (vLLM <= 0.23).
    Array,
}

/// Where token ids come from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TokenizerChoice {
    /// `kvmesh_filters::prefix::tokenize::Builtin`.
    #[default]
    Builtin,
    /// A model directory with `tokenizer.json` (and `tokenizer_config.json`,
    /// `chat_template.jinja`): `kvmesh_filters::prefix::tokenize::HfTokenizer`,
    /// which tokenizes as vLLM's `/tokenize` does.
    HfDir(PathBuf),
}

/// The KV-event sockets, as vLLM's `--kv-events-config`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventsConfig {
    /// PUB endpoint; bound when it has `*`, `::` or is `ipc://`/`inproc://`,
    /// connected otherwise (vLLM's rule).
    pub endpoint: String,
    /// ROUTER replay endpoint (always bound), if any.
    pub replay_endpoint: Option<String>,
    /// Frame 0 of every message.
    pub topic: String,
    pub format: KvEventsFormat,
    /// Force bind (`Some(true)`) or connect (`Some(false)`) instead of vLLM's
    /// rule; SGLang's `"bind": true`. Tests bind `tcp://127.0.0.1:0`.
    pub bind: Option<bool>,
    /// Past batches kept for replay (vLLM `buffer_steps`).
    pub buffer_steps: usize,
}

impl KvEventsConfig {
    /// Events on `endpoint`, topic `kv@sim@<model>` style left to the caller.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            format: KvEventsFormat::Map,
            bind: None,
            buffer_steps: 10_000,
        }
    }
}

/// Everything one engine needs. Build with [`SimConfig::new`] and `with_*`.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Served model name (`model` in requests and responses).
    pub model: String,
    pub flavor: Flavor,
    pub role: Role,
    /// Tokens per KV block (vLLM `--block-size`, SGLang page size).
    pub block_size: usize,
    /// KV blocks in the pool (vLLM `num_gpu_blocks`).
    pub num_blocks: usize,
    /// Running-request limit (vLLM `--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Longest prompt + output (vLLM `--max-model-len`).
    pub max_model_len: usize,
    /// Tokens a streamed event carries (vLLM `--stream-interval`): the first
    /// token goes alone, then one event per this many, and the last with
    /// whatever is left (`http::openai::Interval`).
    pub stream_interval: usize,
    /// Waiting-queue limit; beyond it requests get 503 (vLLM has none by default).
    pub max_waiting: usize,
    /// Output length when a request gives no `max_tokens` (finish reason `stop`).
    pub default_max_tokens: usize,
    pub profile: LatencyProfile,
    /// Simulated seconds per real second (10 = ten times faster than real time).
    pub time_scale: f64,
    pub kv_events: Option<KvEventsConfig>,
    pub tokenizer: TokenizerChoice,
    /// NixlConnector engine id (`remote_engine_id`); a fresh UUID when `None`.
    pub engine_id: Option<String>,
    /// `remote_host` a prefill engine reports: where decode engines reach its
    /// side channel. Empty (the default): the HTTP listener's IP, or
    /// `127.0.0.1` when that is unspecified (`0.0.0.0`).
    pub side_channel_host: String,
    /// `remote_port` a prefill engine reports. The simulator serves its side
    /// channel on the HTTP port (`crate::pd::nixl`), so 0 (the default) means
    /// that port; vLLM's own default is 5600.
    pub side_channel_port: u16,
    /// Real time a decode engine allows one side-channel call (the fetch of a
    /// prefill engine's blocks) before it recomputes. Real, not simulated: it
    /// bounds a network wait.
    pub side_channel_timeout: Duration,
    /// Take P/D handoffs straight from the process-global registry when the
    /// prefill engine runs in this process (the demo), instead of calling its
    /// side channel. Tests turn it off to exercise the cross-process path.
    pub pd_in_process: bool,
    /// Simulated seconds a prefill engine holds blocks for a decode engine
    /// (vLLM before its NIXL lease: `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`, 480 s;
    /// vLLM 0.32: `kv_lease_duration`, 30 s, renewed by the decode's heartbeats).
    pub pd_hold_timeout_s: f64,
    /// Simulated seconds an SGLang half waits for the other (300 s).
    pub bootstrap_timeout_s: f64,
    /// SGLang `--disaggregation-bootstrap-port` (8998).
    pub bootstrap_port: u16,
    /// Data-parallel rank stamped into event batches and metrics (set per
    /// rank by the engine when `data_parallel_size` > 1).
    pub dp_rank: u32,
    /// vLLM `--data-parallel-size`: independent engine ranks (each its own
    /// KV cache, queue, KV-event stream and `engine="rank"` metrics) behind
    /// the one HTTP port (`crate::http::dp`).
    pub data_parallel_size: usize,
    /// Speak the kvmesh KV connector through this node agent (`crate::pd::kvagent`).
    pub kvagent: Option<KvagentConfig>,
    /// Seed of the latency model's spread (the profile's `*_std*` fields).
    pub seed: u64,
    /// vLLM `--max-loras` with `--enable-lora` and runtime updating on
    /// (`crate::http::lora`); 0 (the default): no LoRA, no adapter routes and
    /// no `vllm:lora_requests_info`.
    pub max_loras: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self::new("sim-model")
    }
}

impl SimConfig {
    /// A vLLM-like engine serving `model` with the `small-gpu` profile.
    pub fn new(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            flavor: Flavor::Vllm,
            role: Role::Both,
            block_size: 16,
            num_blocks: 4096,
            max_num_seqs: 256,
            max_model_len: 8192,
            stream_interval: 1,
            max_waiting: 8192,
            default_max_tokens: 16,
            profile: LatencyProfile::small_gpu(),
            time_scale: 1.0,
            kv_events: None,
            tokenizer: TokenizerChoice::Builtin,
            engine_id: None,
            side_channel_host: String::new(),
            side_channel_port: 0,
            side_channel_timeout: Duration::from_secs(5),
            pd_in_process: true,
            pd_hold_timeout_s: 480.0,
            bootstrap_timeout_s: 300.0,
            bootstrap_port: 8998,
            dp_rank: 0,
            data_parallel_size: 1,
            kvagent: None,
            seed: 0,
            max_loras: 0,
        }
    }

    pub fn with_flavor(mut self, flavor: Flavor) -> Self {
        self.flavor = flavor;
        self
    }

    pub fn with_role(mut self, role: Role) -> Self {
        self.role = role;
        self
    }

    pub fn with_block_size(mut self, block_size: usize) -> Self {
        self.block_size = block_size;
        self
    }

    pub fn with_num_blocks(mut self, num_blocks: usize) -> Self {
        self.num_blocks = num_blocks;
        self
    }

    pub fn with_max_num_seqs(mut self, max_num_seqs: usize) -> Self {
        self.max_num_seqs = max_num_seqs;
        self
    }

    pub fn with_max_model_len(mut self, max_model_len: usize) -> Self {
        self.max_model_len = max_model_len;
        self
    }

    pub fn with_stream_interval(mut self, tokens: usize) -> Self {
        self.stream_interval = tokens.max(1);
        self
    }

    pub fn with_profile(mut self, profile: LatencyProfile) -> Self {
        self.profile = profile;
        self
    }

    pub fn with_time_scale(mut self, time_scale: f64) -> Self {
        self.time_scale = time_scale;
        self
    }

    pub fn with_kv_events(mut self, kv_events: KvEventsConfig) -> Self {
        self.kv_events = Some(kv_events);
        self
    }

    pub fn with_engine_id(mut self, engine_id: impl Into<String>) -> Self {
        self.engine_id = Some(engine_id.into());
        self
    }

    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// See [`SimConfig::data_parallel_size`].
    pub fn with_data_parallel_size(mut self, n: usize) -> Self {
        self.data_parallel_size = n;
        self
    }

    /// See [`SimConfig::kvagent`].
    pub fn with_kvagent(mut self, kvagent: KvagentConfig) -> Self {
        self.kvagent = Some(kvagent);
        self
    }

    /// See [`SimConfig::pd_in_process`].
    pub fn with_pd_in_process(mut self, on: bool) -> Self {
        self.pd_in_process = on;
        self
    }

    /// See [`SimConfig::max_loras`].
    pub fn with_max_loras(mut self, n: usize) -> Self {
        self.max_loras = n;
        self
    }

    pub fn with_tokenizer(mut self, tokenizer: TokenizerChoice) -> Self {
        self.tokenizer = tokenizer;
        self
    }

    /// Checks the numbers make an engine that can run.
    pub fn validate(&self) -> Result<(), crate::SimError> {
        let bad = |what: &str| Err(crate::SimError::Config(what.to_string()));
        if self.model.is_empty() {
            return bad("model name is empty");
        }
        if self.data_parallel_size == 0 || self.data_parallel_size > 64 {
            return bad("data_parallel_size must be in 1..=64");
        }
        if self.block_size == 0 || self.block_size > 4096 {
            return bad("block_size must be in 1..=4096");
        }
        if self.num_blocks == 0 {
            return bad("num_blocks must be at least 1");
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be at least 1");
        }
        if self.max_model_len < 2 {
            return bad("max_model_len must be at least 2");
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return bad("time_scale must be a positive number");
        }
        if self.max_waiting == 0 {
            return bad("max_waiting must be at least 1");
        }
        self.profile.validate()
    }
}

/// Where an engine's node agent is and how its KV connector uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvagentConfig {
    /// The agent's local API socket.
    pub socket: PathBuf,
    /// Bytes of one KV block (one layer); a transfer moves one per prompt block.
    pub block_bytes: u64,
    /// Staging blocks registered with the agent (a transfer uses at most these).
    pub staging_blocks: u32,
    /// Real time one send or one wait may take before it fails.
    pub deadline: Duration,
}
