//! A vLLM-faithful engine simulator for kvmesh's tests, benchmarks and demo.
//!
//! It serves vLLM's OpenAI surface (completions and chat, streaming and not,
//! `/v1/models`, `/health`, `/tokenize`, `/metrics`, `/reset_prefix_cache`),
//! keeps a block-level prefix cache with LRU eviction, publishes KV-cache
//! events over ZMQ in vLLM's wire format (with replay), exports vLLM's (or
//! SGLang's) metrics, answers P/D requests like a NixlConnector or SGLang
//! bootstrap engine, and runs a virtual-time batch scheduler so latencies
//! behave like a real engine's under load. Faults are scriptable.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvmesh_engine_sim::SimError> {
//! use kvmesh_engine_sim::{Engine, SimConfig};
//! let engine = Engine::start_local(SimConfig::new("tiny").with_time_scale(100.0)).await?;
//! println!("serving on {}", engine.base_url());
//! engine.faults().fail_next(503);
//! engine.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! See `README.md` for the latency model and where the simulator differs
//! from vLLM on purpose.

pub mod calibrate;
pub mod cli;
pub mod config;
mod core;
mod engine;
pub mod faults;
mod http;
pub mod kv;
pub mod metrics;
mod pd;
pub mod process;
pub mod profile;
pub mod stats;

pub use calibrate::{fit_ttft, secant, TtftFit, TtftSample};
pub use config::{
    Flavor, KvEventsConfig, KvEventsFormat, KvagentConfig, Role, SimConfig, TokenizerChoice,
};
pub use engine::{Engine, SimHandle};
pub use faults::{FaultScript, Faults};
pub use kv::client::{replay, DecodedBatch, DecodedEvent, KvMessage, KvSubscriber};
pub use kv::publisher::KvEndpoints;
pub use process::SimProcess;
pub use profile::{LatencyProfile, StepLoad};
pub use stats::{CompletedRequest, ReceivedRequest, SimStats};

/// Why an engine could not start or act.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("KV events: {0}")]
    KvEvents(String),
    #[error("I/O: {0}")]
    Io(#[source] std::io::Error),
    #[error("the engine has stopped")]
    Stopped,
    #[error("simulator process: {0}")]
    Process(String),
}
