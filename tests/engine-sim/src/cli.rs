//! The `kvmesh-engine-sim` command line, parsed into a [`SimConfig`].

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use crate::config::{
    Flavor, KvEventsConfig, KvEventsFormat, KvagentConfig, Role, SimConfig, TokenizerChoice,
};
use crate::profile::LatencyProfile;
use crate::{Engine, SimError};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum FlavorArg {
    Vllm,
    Sglang,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum RoleArg {
    Both,
    Prefill,
    Decode,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum FormatArg {
    Map,
    Array,
}

/// A simulated vLLM (or SGLang) engine.
#[derive(Debug, Parser)]
#[command(name = "kvmesh-engine-sim", version)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// Address to serve HTTP on, e.g. 127.0.0.1:8000.
    #[arg(long, required = true)]
    listen: Option<String>,
    /// Served model name.
    #[arg(long, required = true)]
    model: Option<String>,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV blocks (default: the profile's KV capacity, else 4096).
    #[arg(long)]
    num_blocks: Option<usize>,
    /// Running-request limit (default: the profile's vLLM default, else 256).
    #[arg(long)]
    max_num_seqs: Option<usize>,
    #[arg(long, default_value_t = 8192)]
    max_model_len: usize,
    /// Tokens per streamed event after the first (vLLM `--stream-interval`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    stream_interval: u32,
    /// KV-event PUB endpoint (vLLM rule: bind if it has `*` or `::`, else connect).
    #[arg(long)]
    kv_events_endpoint: Option<String>,
    /// KV-event replay ROUTER endpoint (bound).
    #[arg(long)]
    kv_events_replay: Option<String>,
    #[arg(long, value_enum, default_value = "map")]
    kv_events_format: FormatArg,
    /// KV-event topic (frame 0); default `kv@<listen>@<model>`.
    #[arg(long)]
    kv_events_topic: Option<String>,
    /// Latency profile: small-gpu, large-gpu, vllm-cpu-tiny, gpu:MODEL@GPU[xTP][/LINK], or a YAML file.
    #[arg(long, default_value = "small-gpu")]
    profile: String,
    /// Simulated seconds per real second.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Seed of the latency spread (a profile's `api_overhead_std_ms`, `step_std_ratio`).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, value_enum, default_value = "vllm")]
    flavor: FlavorArg,
    #[arg(long, value_enum, default_value = "both")]
    role: RoleArg,
    /// `builtin` or a directory with tokenizer.json.
    #[arg(long, default_value = "builtin")]
    tokenizer: String,
    /// NixlConnector engine id (default: a fresh UUID).
    #[arg(long)]
    engine_id: Option<String>,
    /// Simulated seconds a prefill engine holds blocks for a decode that
    /// never fetches them (vLLM before its NIXL lease: `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`,
    /// 480; vLLM 0.32: `kv_lease_duration`, 30, renewed by the decode's heartbeats).
    #[arg(long, default_value_t = 480.0)]
    pd_hold_timeout_s: f64,
    /// vLLM's `--data-parallel-size`: this many independent engine ranks
    /// behind the one HTTP port, chosen by `X-data-parallel-rank` or, without
    /// it, the least loaded; rank r publishes KV events on the endpoint's port + r.
    #[arg(long, default_value_t = 1)]
    data_parallel_size: usize,
    /// vLLM's `--enable-lora --max-loras N` with runtime updates on: serves
    /// `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` and exports
    /// `vllm:lora_requests_info`; 0, the default, is LoRA off.
    #[arg(long, default_value_t = 0)]
    max_loras: usize,
    /// Speak the kvmesh KV connector through the node agent at this socket
    /// (`kvmesh-kvagent run --socket`): prefill sends real bytes to the agent
    /// the proxy names, decode takes them from this one.
    #[arg(long, value_name = "PATH")]
    kvagent_socket: Option<PathBuf>,
    /// Bytes of one KV block moved by the kvagent connector.
    #[arg(long, default_value_t = 65_536)]
    kvagent_block_bytes: u64,
    /// Staging blocks registered with the agent (most blocks one transfer moves).
    #[arg(long, default_value_t = 256)]
    kvagent_staging_blocks: u32,
    /// Real milliseconds a kvagent send or wait may take before it fails.
    #[arg(long, default_value_t = 30_000)]
    kvagent_deadline_ms: u64,
}

/// What the binary does besides serving.
#[derive(Debug, Subcommand)]
enum Command {
    /// Print a latency profile's costs (and, for `gpu:` profiles, how they were derived).
    Profile {
        /// A profile name, `gpu:MODEL@GPU[xTP][/LINK]`, or a YAML file.
        #[arg(long)]
        profile: String,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

impl Args {
    /// The engine configuration these arguments describe.
    pub fn to_config(&self) -> Result<SimConfig, SimError> {
        let missing = |what: &str| SimError::Config(format!("--{what} is required"));
        let model = self.model.clone().ok_or_else(|| missing("model"))?;
        let listen = self.listen.as_deref().ok_or_else(|| missing("listen"))?;
        let profile = LatencyProfile::load(&self.profile)?;
        let block_size = self.block_size.max(1);
        let num_blocks = self
            .num_blocks
            .unwrap_or_else(|| match profile.kv_cache_tokens {
                Some(tokens) => (tokens / block_size).max(1),
                None => 4096,
            });
        let max_num_seqs = self
            .max_num_seqs
            .unwrap_or_else(|| profile.max_num_seqs.unwrap_or(256));
        let mut cfg = SimConfig::new(model.clone())
            .with_block_size(self.block_size)
            .with_num_blocks(num_blocks)
            .with_max_num_seqs(max_num_seqs)
            .with_max_model_len(self.max_model_len)
            .with_stream_interval(self.stream_interval as usize)
            .with_data_parallel_size(self.data_parallel_size)
            .with_max_loras(self.max_loras)
            .with_profile(profile)
            .with_time_scale(self.time_scale)
            .with_seed(self.seed)
            .with_flavor(match self.flavor {
                FlavorArg::Vllm => Flavor::Vllm,
                FlavorArg::Sglang => Flavor::Sglang,
            })
            .with_role(match self.role {
                RoleArg::Both => Role::Both,
                RoleArg::Prefill => Role::Prefill,
                RoleArg::Decode => Role::Decode,
            });
        if self.tokenizer != "builtin" {
            cfg = cfg.with_tokenizer(TokenizerChoice::HfDir(PathBuf::from(&self.tokenizer)));
        }
        if let Some(id) = &self.engine_id {
            cfg = cfg.with_engine_id(id.clone());
        }
        cfg.pd_hold_timeout_s = self.pd_hold_timeout_s.max(0.0);
        if let Some(socket) = &self.kvagent_socket {
            cfg = cfg.with_kvagent(KvagentConfig {
                socket: socket.clone(),
                block_bytes: self.kvagent_block_bytes.max(1),
                staging_blocks: self.kvagent_staging_blocks.max(1),
                deadline: std::time::Duration::from_millis(self.kvagent_deadline_ms),
            });
        }
        if let Some(ep) = &self.kv_events_endpoint {
            let mut k = KvEventsConfig::new(ep.clone());
            k.replay_endpoint = self.kv_events_replay.clone();
            k.topic = self
                .kv_events_topic
                .clone()
                .unwrap_or_else(|| format!("kv@{listen}@{model}"));
            k.format = match self.kv_events_format {
                FormatArg::Map => KvEventsFormat::Map,
                FormatArg::Array => KvEventsFormat::Array,
            };
            cfg = cfg.with_kv_events(k);
        }
        if let Some((_, port)) = listen.rsplit_once(':') {
            cfg.side_channel_port = port.parse().unwrap_or(cfg.side_channel_port);
        }
        Ok(cfg)
    }
}

/// Runs the binary: print a profile, or serve until Ctrl-C.
pub async fn run(args: Args) -> Result<(), SimError> {
    if let Some(Command::Profile { profile, json }) = &args.command {
        let text = crate::profile::report::render(profile, *json)?;
        println!("{text}");
        return Ok(());
    }
    let cfg = args.to_config()?;
    let listen = args.listen.as_deref().unwrap_or_default();
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(SimError::Io)?;
    let engine = Engine::start(cfg, listener).await?;
    tracing::info!(addr = %engine.addr(), kv = ?engine.kv_endpoints(), "kvmesh-engine-sim serving");
    let _ = tokio::signal::ctrl_c().await;
    engine.shutdown().await;
    Ok(())
}
