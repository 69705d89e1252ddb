//! The `prefix` section (how prompts become block keys) and `engine.kv_events`
//! (where the local engine publishes its KV cache events), with their defaults
//! and the checks that span fields ([`validate`]).

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{ByteSize, Config, Duration};

/// How prompts become block keys (docs/prefix.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Prefix {
    /// `auto`, `builtin`, `engine`, `none` or a Hugging Face model directory.
    pub tokenizer: TokenizerChoice,
    /// Tokens per KV block until the engine says otherwise (its KV events or
    /// `vllm:cache_config_info`).
    pub block_size: u32,
    /// Seed of the local block keys; the same on every sidecar of a mesh.
    pub hash_seed: String,
    /// A prompt longer than this is tokenized only up to here (counted in
    /// `kvmesh_prefix_tokenize_capped_total`).
    pub max_tokenize_bytes: ByteSize,
    /// Token ids of shared prompt prefixes kept to skip re-tokenizing them.
    pub token_cache_bytes: ByteSize,
    /// Deadline of one `/tokenize` call to the engine (`tokenizer: engine`).
    pub engine_tokenize_timeout: Duration,
    /// Most (block, medium) entries the index keeps per pod.
    pub index_max_blocks_per_pod: usize,
    /// Characters per text block in approximate mode.
    pub approx_chunk_chars: usize,
    /// Text blocks remembered per pod in approximate mode (LRU).
    pub approx_blocks_per_pod: usize,
    /// Precise mode: how long a routing decision counts as the chosen pod holding the request's
    /// blocks before its engine's KV events say so (0: off). Keeps a burst that shares a prefix
    /// together.
    pub predict_ttl: Duration,
    /// Precise mode: most predicted blocks kept per pod.
    pub predict_blocks_per_pod: usize,
}

/// Which tokenizer the prefix stage uses.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TokenizerChoice {
    /// `engine` when `engine.kv_events` is set, else `none`.
    #[default]
    Auto,
    /// The simulator's deterministic tokenizer.
    Builtin,
    /// The local engine's `/tokenize`, once per request.
    Engine,
    /// No tokenizer: approximate text blocks, recorded per routing decision.
    None,
    /// A model directory with `tokenizer.json` (+ `tokenizer_config.json`,
    /// `chat_template.jinja`).
    Dir(PathBuf),
}

/// The local engine's KV event sockets (vLLM `--kv-events-config`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvEvents {
    /// The engine's PUB endpoint as given to the engine, e.g. `tcp://*:5557`.
    pub endpoint: String,
    /// The engine's ROUTER replay endpoint, if it has one.
    pub replay_endpoint: Option<String>,
    /// Only messages whose topic starts with this are used (empty: all).
    pub topic: String,
    /// `auto` follows vLLM's rule from the consumer's side (the engine binds
    /// when the endpoint has `*`, `::` or `ipc://`, so the sidecar connects;
    /// otherwise the engine connects and the sidecar binds).
    pub socket: SocketMode,
    /// Deadline of each step of one replay (connect, each reply).
    pub replay_timeout: Duration,
    /// Longest pause between reconnect attempts (the backoff doubles up to it).
    pub reconnect_max: Duration,
    /// With a replay endpoint: after this long without a live batch, the
    /// replay socket is asked for what followed the last applied one (0: off).
    pub silence_check: Duration,
}

/// Bind or connect the SUB socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SocketMode {
    #[default]
    Auto,
    Connect,
    Bind,
}

impl Default for Prefix {
    fn default() -> Self {
        Self {
            tokenizer: TokenizerChoice::Auto,
            block_size: 16,
            hash_seed: String::new(),
            max_tokenize_bytes: ByteSize(256 * 1024),
            token_cache_bytes: ByteSize(64 * 1024 * 1024),
            engine_tokenize_timeout: Duration::from_millis(500),
            index_max_blocks_per_pod: 1 << 20,
            approx_chunk_chars: 256,
            approx_blocks_per_pod: 65_536,
            predict_ttl: Duration::from_secs(2),
            predict_blocks_per_pod: 65_536,
        }
    }
}

impl Default for KvEvents {
    fn default() -> Self {
        Self {
            endpoint: "tcp://*:5557".to_owned(),
            replay_endpoint: None,
            topic: String::new(),
            socket: SocketMode::Auto,
            replay_timeout: Duration::from_secs(2),
            reconnect_max: Duration::from_secs(5),
            silence_check: Duration::from_secs(5),
        }
    }
}

impl TokenizerChoice {
    /// Parses the config or flag value.
    pub fn parse(s: &str) -> Result<Self, String> {
        Ok(match s.trim() {
            "" => return Err("tokenizer must not be empty".to_owned()),
            "auto" => Self::Auto,
            "builtin" => Self::Builtin,
            "engine" => Self::Engine,
            "none" => Self::None,
            dir => Self::Dir(PathBuf::from(dir)),
        })
    }

    /// `Auto` resolved against whether KV events are configured.
    pub fn resolve(&self, kv_events: bool) -> Self {
        match self {
            Self::Auto if kv_events => Self::Engine,
            Self::Auto => Self::None,
            other => other.clone(),
        }
    }
}

impl fmt::Display for TokenizerChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Builtin => f.write_str("builtin"),
            Self::Engine => f.write_str("engine"),
            Self::None => f.write_str("none"),
            Self::Dir(p) => write!(f, "{}", p.display()),
        }
    }
}

impl Serialize for TokenizerChoice {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for TokenizerChoice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// The endpoint the sidecar dials or binds for `endpoint` given to the engine,
/// and whether it binds. The engine is local, so a wildcard host it binds on
/// is reached on loopback.
pub fn consumer_endpoint(endpoint: &str, mode: SocketMode) -> (String, bool) {
    let engine_binds = endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://");
    let bind = match mode {
        SocketMode::Auto => !engine_binds,
        SocketMode::Connect => false,
        SocketMode::Bind => true,
    };
    (
        if bind {
            endpoint.to_owned()
        } else {
            dial(endpoint)
        },
        bind,
    )
}

/// A wildcard bind address as a loopback dial address.
pub fn dial(endpoint: &str) -> String {
    endpoint
        .replacen("tcp://*:", "tcp://127.0.0.1:", 1)
        .replacen("tcp://0.0.0.0:", "tcp://127.0.0.1:", 1)
        .replacen("tcp://[::]:", "tcp://[::1]:", 1)
}

/// `tcp://host:port` with a port: what the zeromq build here can use.
fn check_tcp(field: &str, ep: &str) -> Result<(), (String, String)> {
    let bad = |m: String| Err((field.to_owned(), m));
    let Some(rest) = ep.strip_prefix("tcp://") else {
        if ep.starts_with("ipc://") || ep.starts_with("inproc://") {
            return bad(format!(
                "{ep:?}: only tcp:// endpoints are supported (give the engine a tcp endpoint)"
            ));
        }
        return bad(format!("{ep:?} must look like tcp://host:port"));
    };
    match rest.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(()),
        _ => bad(format!("{ep:?} must look like tcp://host:port")),
    }
}

/// Rules for `prefix` and `engine.kv_events` that one field's type cannot express.
pub fn validate(c: &Config) -> Result<(), (String, String)> {
    let err = |field: &str, msg: &str| Err((field.to_owned(), msg.to_owned()));
    let p = &c.prefix;
    if p.block_size == 0 || p.block_size > 4096 {
        return err("prefix.block_size", "must be between 1 and 4096 tokens");
    }
    if p.index_max_blocks_per_pod < 8 {
        return err("prefix.index_max_blocks_per_pod", "must be at least 8");
    }
    if p.approx_chunk_chars == 0 {
        return err("prefix.approx_chunk_chars", "must be at least 1");
    }
    if p.approx_blocks_per_pod == 0 {
        return err("prefix.approx_blocks_per_pod", "must be at least 1");
    }
    if p.predict_ttl.get() > std::time::Duration::from_secs(60) {
        return err(
            "prefix.predict_ttl",
            "must be at most 60s (KV events arrive after the prefill; 0 turns it off)",
        );
    }
    if p.predict_blocks_per_pod == 0 {
        return err("prefix.predict_blocks_per_pod", "must be at least 1");
    }
    if let TokenizerChoice::Dir(dir) = &p.tokenizer {
        if !dir.join("tokenizer.json").is_file() {
            return Err((
                "prefix.tokenizer".to_owned(),
                format!(
                    "{} has no tokenizer.json (use a model directory, builtin, engine or none)",
                    dir.display()
                ),
            ));
        }
    }
    if let Some(k) = &c.engine.kv_events {
        check_tcp("engine.kv_events.endpoint", &k.endpoint)?;
        if let Some(r) = &k.replay_endpoint {
            check_tcp("engine.kv_events.replay_endpoint", r)?;
            if dial(r) == dial(&k.endpoint) {
                return err(
                    "engine.kv_events.replay_endpoint",
                    "must differ from engine.kv_events.endpoint",
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn consumer_follows_vllms_rule_from_the_other_side() {
        assert_eq!(
            consumer_endpoint("tcp://*:5557", SocketMode::Auto),
            ("tcp://127.0.0.1:5557".to_owned(), false)
        );
        assert_eq!(
            consumer_endpoint("tcp://[::]:5557", SocketMode::Auto),
            ("tcp://[::1]:5557".to_owned(), false)
        );
        assert_eq!(
            consumer_endpoint("tcp://10.0.0.5:5557", SocketMode::Auto),
            ("tcp://10.0.0.5:5557".to_owned(), true)
        );
        assert_eq!(
            consumer_endpoint("tcp://127.0.0.1:9", SocketMode::Connect),
            ("tcp://127.0.0.1:9".to_owned(), false)
        );
    }

    #[test]
    fn tokenizer_choice_round_trips() {
        for s in ["auto", "builtin", "engine", "none", "/models/x"] {
            assert_eq!(TokenizerChoice::parse(s).unwrap().to_string(), s);
        }
        assert!(TokenizerChoice::parse(" ").is_err());
        assert_eq!(TokenizerChoice::Auto.resolve(true), TokenizerChoice::Engine);
        assert_eq!(TokenizerChoice::Auto.resolve(false), TokenizerChoice::None);
    }

    #[test]
    fn bad_sections_are_located() {
        let e = crate::config::from_yaml_str(
            "engine:\n  kv_events:\n    endpoint: ipc:///tmp/x\n",
            "p.yaml",
        )
        .unwrap_err();
        assert_eq!(
            (e.path.as_str(), e.line),
            ("engine.kv_events.endpoint", Some(3))
        );
        let e = crate::config::from_yaml_str("prefix:\n  block_size: 0\n", "p.yaml").unwrap_err();
        assert_eq!((e.path.as_str(), e.line), ("prefix.block_size", Some(2)));
        let e = crate::config::from_yaml_str("prefix:\n  tokenizr: none\n", "p.yaml").unwrap_err();
        assert_eq!(e.path, "prefix.tokenizr");
        let ok = crate::config::from_yaml_str(
            "prefix:\n  tokenizer: builtin\n  hash_seed: s\nengine:\n  kv_events:\n    endpoint: tcp://*:5557\n    replay_endpoint: tcp://*:5558\n",
            "p.yaml",
        )
        .unwrap();
        assert_eq!(ok.prefix.tokenizer, TokenizerChoice::Builtin);
        assert_eq!(
            ok.engine.kv_events.unwrap().replay_endpoint.as_deref(),
            Some("tcp://*:5558")
        );
    }
}
