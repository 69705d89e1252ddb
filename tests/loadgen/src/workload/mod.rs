//! Workloads: deterministic lists of requests modelled on the field's standard
//! routing benchmarks (docs/bench-tool.md, "Workloads", names each source), each in a `small` size for
//! CI on a 2-core machine and a `full` size with the field's parameters.
//!
//! A workload is plain data ([`Workload`]): the same seed gives the same
//! requests, byte for byte. Every generator takes its parameters as a public
//! struct, so a harness can scale it; `Params::small()` / `Params::full()`
//! give the documented sizes, and `suggested_load` the load the field runs
//! it with (scaled to the size).

mod chat;
mod long_body;
mod multi_turn;
mod pd;
mod pressure;
mod shared_prefix;
pub mod text;

use std::sync::Arc;

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

pub use chat::ChatParams;
pub use long_body::LongBodyParams;
pub use multi_turn::MultiTurnParams;
pub use pd::PdParams;
pub use pressure::PressureParams;
pub use shared_prefix::SharedPrefixParams;

use crate::error::LoadgenError;
use crate::load::Load;

/// Which OpenAI endpoint a request uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Api {
    /// `POST /v1/completions` with a text prompt.
    Completions,
    /// `POST /v1/chat/completions` with messages.
    Chat,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// The prompt of a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Prompt {
    /// Shared (`Arc`) so that requests repeating a prompt hold it once.
    Text(Arc<str>),
    Messages(Vec<Message>),
}

/// One request of a workload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestSpec {
    /// User (session) id: sticky spreading keeps a user on one target, and
    /// ordered workloads send a user's requests one after the other.
    pub user: u32,
    pub api: Api,
    pub prompt: Prompt,
    /// Fixed output length: sent as `max_tokens` with `ignore_eos: true`.
    pub max_tokens: u32,
    pub stream: bool,
}

/// A named, finite list of requests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    pub name: String,
    pub requests: Vec<RequestSpec>,
    /// A user's next request is sent only after its previous one finished
    /// (multi-turn chat: each turn carries the previous ones).
    pub ordered_per_user: bool,
}

/// The two documented sizes of every workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Size {
    /// Seconds on a 2-core machine against a time-scaled simulator (CI).
    Small,
    /// The field's parameters.
    Full,
}

impl Size {
    /// Parses `small` / `ci` / `full`.
    pub fn parse(s: &str) -> Option<Size> {
        match s {
            "small" | "ci" => Some(Size::Small),
            "full" => Some(Size::Full),
            _ => None,
        }
    }
}

/// The workload names [`Workload::named`] knows.
pub const WORKLOAD_NAMES: [&str; 5] = ["shared-prefix", "multi-turn", "pd", "long-body", "tiny"];

impl RequestSpec {
    /// The HTTP path of the request.
    pub fn path(&self) -> &'static str {
        match self.api {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
        }
    }

    /// The JSON body sent for `model`. Streaming requests ask for usage in the
    /// last chunk (`stream_options.include_usage`), which is where
    /// `cached_tokens` arrives; vLLM rejects `stream_options` on a
    /// non-streaming request, so it is left out there.
    pub fn body(&self, model: &str) -> Result<Bytes, LoadgenError> {
        let mut body = json!({
            "model": model,
            "max_tokens": self.max_tokens,
            "ignore_eos": true,
            "temperature": 0.0,
            "stream": self.stream,
        });
        if let Value::Object(map) = &mut body {
            match &self.prompt {
                Prompt::Text(t) => map.insert("prompt".into(), Value::String(t.to_string())),
                Prompt::Messages(m) => map.insert("messages".into(), serde_json::to_value(m)?),
            };
            if self.stream {
                map.insert("stream_options".into(), json!({"include_usage": true}));
            }
        }
        Ok(Bytes::from(serde_json::to_vec(&body)?))
    }

    /// Prompt length in words (≈ tokens under the builtin tokenizer).
    pub fn prompt_words(&self) -> usize {
        match &self.prompt {
            Prompt::Text(t) => t.split_whitespace().count(),
            Prompt::Messages(m) => m.iter().map(|m| m.content.split_whitespace().count()).sum(),
        }
    }
}

impl Workload {
    /// A workload by name (see [`WORKLOAD_NAMES`]) and size, with its
    /// suggested load.
    pub fn named(name: &str, size: Size, seed: u64) -> Result<(Workload, Load), LoadgenError> {
        Ok(match name {
            "shared-prefix" => {
                let p = SharedPrefixParams::sized(size);
                (p.build(seed), p.suggested_load())
            }
            "multi-turn" => {
                let p = MultiTurnParams::sized(size);
                (p.build(seed), p.suggested_load())
            }
            "pd" => {
                let p = PdParams::sized(size);
                (p.build(seed), p.suggested_load())
            }
            "long-body" => {
                let p = LongBodyParams::sized(size);
                (p.build(seed), p.suggested_load())
            }
            "tiny" => {
                let n = match size {
                    Size::Small => 2_000,
                    Size::Full => 50_000,
                };
                (tiny(n, seed), Load::closed(32, n))
            }
            other => return Err(LoadgenError::UnknownWorkload(other.to_string())),
        })
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// Whether it has no request.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }
}

/// Small non-streaming completions (16-word prompt, 8 tokens out): the
/// proxy-overhead case, where the engine costs nothing and the path is all.
pub fn tiny(requests: usize, seed: u64) -> Workload {
    let mut rng = StdRng::seed_from_u64(seed);
    let prompts: Vec<Arc<str>> = (0..64).map(|_| text::words(&mut rng, 16).into()).collect();
    Workload {
        name: "tiny".into(),
        requests: (0..requests)
            .map(|i| RequestSpec {
                user: i as u32,
                api: Api::Completions,
                prompt: Prompt::Text(prompts[i % prompts.len()].clone()),
                max_tokens: 8,
                stream: false,
            })
            .collect(),
        ordered_per_user: false,
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
