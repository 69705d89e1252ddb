//! Case 4: block keys computed in Rust equal what vLLM itself computes and publishes.
//!
//! vLLM runs with `--prefix-caching-hash-algo sha256_cbor` and a fixed `PYTHONHASHSEED`. For a
//! completion prompt, the same prompt with a `cache_salt`, and a chat request:
//! * the token ids `HfTokenizer` computes in Rust (the chat rendered with the model's template by
//!   minijinja) equal vLLM's own `/tokenize`;
//! * the `BlockStored` events vLLM published for the request (received on our own SUB socket, decoded
//!   by `kvmesh_filters::prefix::kvevents`) carry exactly the hashes `VllmCborHasher` computes from the
//!   Rust token ids, block for block, salt included.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use kvmesh_filters::prefix::hash::VllmCborHasher;
use kvmesh_filters::prefix::kvevents::{KvEvent, KvMessage};
use kvmesh_filters::prefix::tokenize::{ChatMessage, HfTokenizer, Tokenizer};
use serde_json::{json, Value};

use super::events::EventTap;
use super::http::Http;
use super::report::note;
use super::{long_prompt, model_dir, BLOCK_SIZE, MODEL};

/// What the sidecar tokenizes for a probe.
pub enum Input {
    Prompt(String),
    Chat(Vec<ChatMessage>),
}

/// One request whose published block hashes are checked.
pub struct HashProbe {
    pub name: &'static str,
    /// Body for `/tokenize` (`prompt` or `messages`).
    pub tokenize: Value,
    /// Path and body of the inference request.
    pub path: &'static str,
    pub request: Value,
    pub cache_salt: Option<&'static str>,
    pub input: Input,
}

/// The three probes: completion, salted completion, chat.
pub fn probes() -> Vec<HashProbe> {
    let prompt = long_prompt("hashes", 140);
    let chat = vec![
        ChatMessage {
            role: "system".into(),
            content: long_prompt("hashes-system", 90),
        },
        ChatMessage {
            role: "user".into(),
            content: "Which pods hold this prefix?".into(),
        },
    ];
    let messages: Vec<Value> = chat
        .iter()
        .map(|m| json!({"role": m.role, "content": m.content}))
        .collect();
    vec![
        HashProbe {
            name: "completion",
            tokenize: json!({"model": MODEL, "prompt": prompt}),
            path: "/v1/completions",
            request: json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}),
            cache_salt: None,
            input: Input::Prompt(prompt.clone()),
        },
        HashProbe {
            name: "completion with cache_salt",
            tokenize: json!({"model": MODEL, "prompt": prompt}),
            path: "/v1/completions",
            request: json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                            "cache_salt": "tenant-a"}),
            cache_salt: Some("tenant-a"),
            input: Input::Prompt(prompt.clone()),
        },
        HashProbe {
            name: "chat",
            tokenize: json!({"model": MODEL, "messages": messages}),
            path: "/v1/chat/completions",
            request: json!({"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0}),
            cache_salt: None,
            input: Input::Chat(chat),
        },
    ]
}

/// The model's tokenizer and chat template, loaded the way the sidecar loads them.
pub fn rust_tokenizer() -> Result<HfTokenizer> {
    let dir = model_dir();
    let tokenizer = std::fs::read(dir.join("tokenizer.json")).context("tokenizer.json")?;
    let config = std::fs::read_to_string(dir.join("tokenizer_config.json")).ok();
    let template = std::fs::read_to_string(dir.join("chat_template.jinja")).ok();
    HfTokenizer::from_parts(&tokenizer, config.as_deref(), template.as_deref())
        .context("loading HfTokenizer")
}

/// The token ids computed in Rust for a probe (completion: with BOS; chat: rendered, generation
/// prompt added, as vLLM's `/tokenize` does by default).
pub fn rust_tokens(tokenizer: &HfTokenizer, probe: &HashProbe) -> Result<Vec<u32>> {
    Ok(match &probe.input {
        Input::Prompt(text) => tokenizer.encode(text, true)?,
        Input::Chat(messages) => tokenizer.encode_chat(messages, true)?,
    })
}

/// vLLM's token ids for a probe, from its own `/tokenize`.
pub async fn vllm_tokens(http: &Http, engine_url: &str, probe: &HashProbe) -> Result<Vec<u32>> {
    let reply = http
        .post_json(&format!("{engine_url}/tokenize"), &probe.tokenize)
        .await?
        .json()?;
    reply["tokens"]
        .as_array()
        .context("no tokens in /tokenize reply")?
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .context("token id")
        })
        .collect()
}

/// Makes the probe's request and checks the hashes vLLM published for its prompt blocks against
/// `hasher` applied to `tokens`.
pub async fn check_published(
    http: &Http,
    tap: &EventTap,
    engine_url: &str,
    hasher: &VllmCborHasher,
    probe: &HashProbe,
    tokens: &[u32],
) -> Result<()> {
    let want = hasher.block_hashes(tokens, BLOCK_SIZE, probe.cache_salt);
    ensure!(
        want.len() >= 3,
        "{}: prompt too short for a useful check ({} tokens)",
        probe.name,
        tokens.len()
    );
    tap.drain()?; // events of earlier requests
    http.post_json(&format!("{engine_url}{}", probe.path), &probe.request)
        .await?
        .json()?;

    let got = tokio::task::block_in_place(|| {
        tap.collect_until(Duration::from_secs(15), |msgs| {
            stored(msgs)
                .iter()
                .map(|s| s.block_hashes.len())
                .sum::<usize>()
                >= want.len()
        })
    })?;
    let stored_events = stored(&got);
    let published: Vec<u64> = stored_events
        .iter()
        .flat_map(|s| s.block_hashes.iter().copied())
        .collect();
    ensure!(
        published[..want.len()] == want[..],
        "{}: vLLM published {:x?}, Rust computed {:x?}",
        probe.name,
        &published[..want.len()],
        want
    );
    // The prompt's blocks come as one root event carrying their tokens.
    let first = stored_events[0];
    ensure!(
        first.parent_block_hash.is_none(),
        "{}: first stored event has a parent",
        probe.name
    );
    ensure!(
        first.block_size as usize == BLOCK_SIZE,
        "{}: block size {}",
        probe.name,
        first.block_size
    );
    let covered = first.block_hashes.len() * BLOCK_SIZE;
    ensure!(
        first.token_ids[..] == tokens[..covered],
        "{}: event tokens differ from /tokenize",
        probe.name
    );
    ensure!(
        first.salt() == probe.cache_salt,
        "{}: event salt {:?}, want {:?}",
        probe.name,
        first.salt(),
        probe.cache_salt
    );
    note(&format!(
        "single: {}: {} tokens, {} block hashes equal vLLM's (first {:016x})",
        probe.name,
        tokens.len(),
        want.len(),
        want[0]
    ));
    Ok(())
}

fn stored(msgs: &[KvMessage]) -> Vec<&kvmesh_filters::prefix::kvevents::BlockStored> {
    msgs.iter()
        .flat_map(|m| m.batch.events.iter())
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) if s.is_main_group() => Some(s),
            _ => None,
        })
        .collect()
}

/// Harness for case 2: after `POST /reset_prefix_cache` and the next request, vLLM publishes
/// `AllBlocksCleared` (at its next engine step), followed by the new request's blocks.
pub async fn reset_is_published(http: &Http, tap: &EventTap, engine_url: &str) -> Result<()> {
    tap.drain()?;
    let reset = http
        .post_empty(&format!("{engine_url}/reset_prefix_cache"))
        .await?;
    ensure!(
        reset.status.is_success(),
        "reset_prefix_cache: HTTP {}",
        reset.status
    );
    let body = json!({"model": MODEL, "prompt": long_prompt("after-reset", 60), "max_tokens": 1, "temperature": 0});
    http.post_json(&format!("{engine_url}/v1/completions"), &body)
        .await?
        .json()?;
    let got = tokio::task::block_in_place(|| {
        tap.collect_until(Duration::from_secs(15), |msgs| {
            let events: Vec<&KvEvent> = msgs.iter().flat_map(|m| m.batch.events.iter()).collect();
            let cleared = events
                .iter()
                .position(|e| matches!(e, KvEvent::AllBlocksCleared));
            cleared.is_some_and(|i| {
                events[i..]
                    .iter()
                    .any(|e| matches!(e, KvEvent::BlockStored(_)))
            })
        })
    })?;
    let seqs: Vec<u64> = got.iter().map(|m| m.seq).collect();
    ensure!(
        seqs.windows(2).all(|w| w[1] == w[0] + 1),
        "sequence numbers not consecutive: {seqs:?}"
    );
    note(&format!(
        "single: reset published as AllBlocksCleared, then new blocks (seq {seqs:?})"
    ));
    Ok(())
}
