//! `proxy.yaml`: the sidecar's configuration as validated types.
//!
//! Loading follows one order (style habit 3): strict decode (`deny_unknown_fields`,
//! typed values such as [`Duration`] that reject bad input while the parser still
//! knows the line), then defaults (every default lives in this file, in the
//! `Default` impls), then a validation pass for rules that span fields
//! ([`load`]). Every error names the file, line and dotted field.
//!
//! Extension points: later stages add their own top-level sections here (`mesh`,
//! `pd`, `filters`, engine `kv_events`), each as one struct with its defaults
//! beside it and its checks in [`load::validate`].

pub mod autoscale;
pub mod index;
pub mod load;
pub mod mesh;
pub mod migration;
pub mod pd;
pub mod prefix;
pub mod traces;
mod units;

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use autoscale::Autoscale;
pub use index::Index;
pub use load::{from_yaml_str, load_file, ConfigError, ConfigErrorKind};
pub use mesh::Mesh;
pub use migration::Migration;
pub use pd::{OnPrefillFailure, Pd, PdConnector};
pub use prefix::{KvEvents, Prefix, SocketMode, TokenizerChoice};
pub use traces::{OtlpEndpoint, OtlpProtocol, Tracing};
pub use units::{ByteSize, Duration, EngineUrl, Fraction};

/// The whole `proxy.yaml`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub listeners: Listeners,
    pub engine: Engine,
    pub upstream: Upstream,
    pub timeouts: Timeouts,
    pub limits: Limits,
    /// The threads that serve requests.
    pub runtime: Runtime,
    pub logging: Logging,
    /// Who this pod is: role, served models, adapters, labels.
    pub pod: Pod,
    /// How requests are placed: the filter config file and its reloading.
    pub scheduling: Scheduling,
    /// How prompts become block keys: tokenizer, block size, index limits.
    pub prefix: Prefix,
    /// The mesh: this pod's mesh port, identity, peer discovery (docs/mesh.md).
    pub mesh: Mesh,
    /// Where the fleet's prefix index and load live: the mesh, or Valkey
    /// past a few hundred pods (docs/mesh.md).
    pub index: Index,
    /// How a request split into prefill and decode is carried out (docs/pd.md).
    pub pd: Pd,
    /// Streams continued on another pod when theirs fails mid-way (docs/migration.md).
    pub migration: Migration,
    /// The targets the autoscaling hook sizes each pool against (docs/autoscaling.md).
    pub autoscale: Autoscale,
    /// OpenTelemetry spans exported over OTLP (docs/observability.md#traces);
    /// absent: no spans, `traceparent` passed through unchanged.
    pub tracing: Option<Tracing>,
}

/// Where the sidecar listens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Listeners {
    /// The OpenAI-compatible port clients use (HTTP/1.1, h2c, or TLS when `tls` is set).
    pub client: SocketAddr,
    /// Health, readiness, metrics and the effective config.
    pub admin: SocketAddr,
    /// TLS on the client port; absent means plain HTTP.
    pub tls: Option<Tls>,
}

/// PEM files for TLS on the client port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tls {
    /// Certificate chain, leaf first.
    pub cert: PathBuf,
    /// Private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// The local engine this sidecar stands beside.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Engine {
    /// Base URL, `http://host:port` (the engine listens on localhost only).
    pub url: EngineUrl,
    pub kind: EngineKind,
    /// Polled for readiness; any 2xx means the engine is up.
    pub health_path: String,
    pub health_interval: Duration,
    /// Where the engine's Prometheus metrics are scraped by the load stage.
    pub metrics_path: String,
    /// How often the metrics are scraped for load-aware routing.
    pub metrics_interval: Duration,
    /// Deadline of one scrape (vLLM's `/metrics` can stall for seconds); a
    /// scrape that misses it is skipped, and the load data ages.
    pub metrics_timeout: Duration,
    /// How often the engine's `/v1/models` is read for the LoRA adapters it
    /// has loaded at run time (each read bounded by `metrics_timeout`).
    pub models_interval: Duration,
    /// The engine's KV cache event sockets; absent: no events (approximate
    /// prefix routing, or the engine's `/tokenize` with an empty index).
    pub kv_events: Option<KvEvents>,
    /// vLLM's `--data-parallel-size`: engine ranks behind `url`, each with its
    /// own KV cache and queue. Above 1, the sidecar picks the rank of every
    /// request it runs on its engine (`X-data-parallel-rank`), reads each
    /// rank's load (`engine="rank"` series) and KV events (`dp_rank`, on
    /// `kv_events.endpoint`'s port + rank); docs/mesh.md.
    pub data_parallel_size: u32,
}

/// Which engine speaks on `engine.url`; it decides metric names and P/D protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    Vllm,
    Sglang,
}

/// What this pod announces about itself to the scheduler (and, through the
/// mesh, to its peers). Its identity is its sidecar's advertised address.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Pod {
    /// `prefill`, `decode` or `both` (an ordinary engine).
    pub role: kvmesh_filters::sched::Role,
    /// Model names the engine serves (vLLM's `--served-model-name`); empty
    /// means unknown, and `model-filter` then passes this pod by default.
    pub models: Vec<String>,
    /// LoRA adapters the engine always has loaded; those it loads at run
    /// time are learned from it (`engine.models_interval`, docs/filters.md).
    pub lora_adapters: Vec<String>,
    /// Labels for `label-selector-filter`.
    pub labels: std::collections::BTreeMap<String, String>,
    /// The IP of the node the pod runs on (the downward API's
    /// `status.hostIP`): its kvagent listens there, at `pd.kvagent_port`, and
    /// the mesh announces that address so prefill pods send this pod's KV
    /// blocks to it (docs/pd.md). Unset: the agent is taken to be on the
    /// engine's host (one node, or loopback tests).
    pub node_ip: Option<std::net::IpAddr>,
}

/// The scheduler's filter config (`filters.yaml`, docs/filters.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Scheduling {
    /// The filter config; without it the built-in default is used.
    pub filters: Option<PathBuf>,
    /// How often the file is checked for changes (size and modification time).
    pub reload_interval: Duration,
}

/// Connection pooling towards the engine and peer sidecars.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Upstream {
    /// Speak HTTP/2 prior knowledge (h2c) to upstreams instead of HTTP/1.1.
    pub http2: bool,
    /// Idle keep-alive connections kept per upstream.
    pub max_idle_per_host: usize,
    /// An idle pooled connection is closed after this long.
    pub idle_timeout: Duration,
}

/// Every network wait has one of these deadlines.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// TCP connect to an upstream.
    pub connect: Duration,
    /// From sending the request to the upstream's response head.
    pub first_byte: Duration,
    /// Longest silence between two chunks of a response body.
    pub stream_idle: Duration,
    /// Whole request, from accept of the request to the end of the response.
    pub overall: Duration,
    /// TLS handshake with a client.
    pub tls_handshake: Duration,
    /// A client's request head, from when the connection waits for one
    /// until its last header byte (HTTP/1.1; on the mesh port, a new
    /// connection's first request): a client trickling its headers is cut.
    pub request_head: Duration,
    /// Reading a request's whole body (capped by `overall`): a client
    /// trickling its body gets 408.
    pub request_body: Duration,
    /// How long shutdown waits for in-flight requests before cutting them.
    pub shutdown_drain: Duration,
}

/// Sizes and counts with a stated policy when exceeded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest request body; larger ones get 413.
    pub max_body_bytes: ByteSize,
    /// Concurrent client connections; further accepts wait for a slot.
    pub max_connections: usize,
}

/// The async runtime the sidecar runs on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Runtime {
    /// Threads serving client connections, each with its own single-threaded
    /// runtime and engine pool, every request wholly on the thread that
    /// accepted its connection. 1 (linkerd2-proxy's default) also runs the
    /// admin port, the mesh, scrapes and probes on that thread; more are
    /// added beside it for a sidecar given several cores.
    pub worker_threads: usize,
}

/// Structured logs with `tracing`; `RUST_LOG`, when set, overrides `level`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Logging {
    /// An `EnvFilter` directive: `info`, `kvmesh_proxy=debug,info`, ...
    pub level: String,
    pub format: LogFormat,
    /// One JSON line per request on the `kvmesh::access` target (info).
    pub access_log: bool,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

// ---- defaults: the only place they are written ----

impl Default for Listeners {
    fn default() -> Self {
        Self {
            client: SocketAddr::from(([0, 0, 0, 0], 8000)),
            admin: SocketAddr::from(([0, 0, 0, 0], 9090)),
            tls: None,
        }
    }
}

impl Default for Engine {
    fn default() -> Self {
        Self {
            url: EngineUrl::local(8200),
            kind: EngineKind::Vllm,
            health_path: "/health".to_owned(),
            health_interval: Duration::from_millis(1000),
            metrics_path: "/metrics".to_owned(),
            metrics_interval: Duration::from_millis(250),
            metrics_timeout: Duration::from_millis(1000),
            models_interval: Duration::from_millis(2000),
            kv_events: None,
            data_parallel_size: 1,
        }
    }
}

impl Default for Scheduling {
    fn default() -> Self {
        Self {
            filters: None,
            reload_interval: Duration::from_millis(1000),
        }
    }
}

impl Default for Upstream {
    fn default() -> Self {
        Self {
            http2: false,
            max_idle_per_host: 256,
            idle_timeout: Duration::from_secs(90),
        }
    }
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(2),
            first_byte: Duration::from_secs(300),
            stream_idle: Duration::from_secs(60),
            overall: Duration::from_secs(1800),
            tls_handshake: Duration::from_secs(10),
            request_head: Duration::from_secs(30),
            request_body: Duration::from_secs(60),
            shutdown_drain: Duration::from_secs(30),
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: ByteSize(32 * 1024 * 1024),
            max_connections: 10_000,
        }
    }
}

impl Default for Runtime {
    fn default() -> Self {
        Self { worker_threads: 1 }
    }
}

impl Default for Logging {
    fn default() -> Self {
        Self {
            level: "info".to_owned(),
            format: LogFormat::Text,
            access_log: false,
        }
    }
}
