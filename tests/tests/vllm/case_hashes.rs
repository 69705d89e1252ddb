//! Case 4: block keys computed in Rust equal what vLLM itself computes and publishes.
//!
//! vLLM runs with `--prefix-caching-hash-algo sha256_cbor` and a fixed `PYTHONHASHSEED`. For a
//! completion prompt, the same prompt with a `cache_salt`, and a chat request, the case asks vLLM's
//! `/tokenize` for the token ids, makes the request, and checks that the `BlockStored` events vLLM
//! published (received on our own SUB socket, decoded by `kvmesh_filters::prefix::kvevents`) carry
//! exactly the hashes `VllmCborHasher` computes from those ids, block for block, salt included.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use kvmesh_filters::prefix::hash::VllmCborHasher;
use kvmesh_filters::prefix::kvevents::{KvEvent, KvMessage};
use serde_json::{json, Value};

use super::events::EventTap;
use super::http::Http;
use super::report::note;
use super::{long_prompt, BLOCK_SIZE, MODEL};

/// One request whose published block hashes are checked.
pub struct HashProbe {
    pub name: &'static str,
    /// Body for `/tokenize` (`prompt` or `messages`).
    pub tokenize: Value,
    /// Path and body of the inference request.
    pub path: &'static str,
    pub request: Value,
    pub cache_salt: Option<&'static str>,
}

/// The three probes: completion, salted completion, chat.
pub fn probes() -> Vec<HashProbe> {
    let prompt = long_prompt("hashes", 140);
    let messages = json!([
        {"role": "system", "content": long_prompt("hashes-system", 90)},
        {"role": "user", "content": "Which pods hold this prefix?"}
    ]);
    vec![
        HashProbe {
            name: "completion",
            tokenize: json!({"model": MODEL, "prompt": prompt}),
            path: "/v1/completions",
            request: json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}),
            cache_salt: None,
        },
        HashProbe {
            name: "completion with cache_salt",
            tokenize: json!({"model": MODEL, "prompt": prompt}),
            path: "/v1/completions",
            request: json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                            "cache_salt": "tenant-a"}),
            cache_salt: Some("tenant-a"),
        },
        HashProbe {
            name: "chat",
            tokenize: json!({"model": MODEL, "messages": messages}),
            path: "/v1/chat/completions",
            request: json!({"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0}),
            cache_salt: None,
        },
    ]
}

/// vLLM's token ids for a probe, from its own `/tokenize`.
pub async fn vllm_tokens(http: &Http, engine_url: &str, probe: &HashProbe) -> Result<Vec<u32>> {
    let reply = http.post_json(&format!("{engine_url}/tokenize"), &probe.tokenize).await?.json()?;
    reply["tokens"]
        .as_array()
        .context("no tokens in /tokenize reply")?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).context("token id"))
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
    ensure!(want.len() >= 3, "{}: prompt too short for a useful check ({} tokens)", probe.name, tokens.len());
    tap.drain()?; // events of earlier requests
    http.post_json(&format!("{engine_url}{}", probe.path), &probe.request).await?.json()?;

    let got = tokio::task::block_in_place(|| {
        tap.collect_until(Duration::from_secs(15), |msgs| {
            stored(msgs).iter().map(|s| s.block_hashes.len()).sum::<usize>() >= want.len()
        })
    })?;
    let stored_events = stored(&got);
    let published: Vec<u64> = stored_events.iter().flat_map(|s| s.block_hashes.iter().copied()).collect();
    ensure!(
        published[..want.len()] == want[..],
        "{}: vLLM published {:x?}, Rust computed {:x?}",
        probe.name,
        &published[..want.len()],
        want
    );
    // The prompt's blocks come as one root event carrying their tokens.
    let first = stored_events[0];
    ensure!(first.parent_block_hash.is_none(), "{}: first stored event has a parent", probe.name);
    ensure!(first.block_size as usize == BLOCK_SIZE, "{}: block size {}", probe.name, first.block_size);
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
