//! Which hash tag spreads a Valkey cluster's load: one per model and stripe
//! of pods (what `proxy/src/valkey/keys.rs` does), or one per model and
//! prefix anchor (a prompt's first block: a prefix's whole tree on one slot).
//!
//! Measured on the prompts of the peers benchmark's two workloads, keyed as
//! the sidecar keys them (the builtin tokenizer, the chat template, 16-token
//! blocks): how many anchors they have, the hottest one's share of the
//! requests, and, over 3 primaries, the busiest primary's share of the
//! requests under each tagging (1/3 is even).

use anyhow::Result;
use kvmesh_filters::prefix::index::PrefixIndex;
use kvmesh_filters::prefix::tokenize::{Builtin, ChatMessage, Tokenizer};
use kvmesh_loadgen::workload::{Prompt, Workload};
use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64;

/// Primaries the spread is judged over.
const PRIMARIES: usize = 3;
/// Pods whose stripes the per-pod tagging spreads over.
const PODS: usize = 1000;

/// One workload's figures.
#[derive(Debug, Clone, Serialize)]
pub struct TagSpread {
    pub workload: String,
    pub requests: usize,
    /// Distinct first blocks.
    pub anchors: usize,
    pub hottest_anchor_share: f64,
    /// The busiest of 3 primaries' share when the tag is the anchor.
    pub per_anchor_busiest_primary: f64,
    /// The same when the tag is the pod's stripe (3 stripes over 1000 pods,
    /// each pod writing its own blocks and every lookup asking every stripe).
    pub per_pod_stripe_busiest_primary: f64,
}

/// The figures for the shared-prefix-pressure and multi-turn-chat workloads.
pub fn measure() -> Result<Vec<TagSpread>> {
    use crate::demo::peers::{chat::chat_setup, pressure_setup};
    let (_, pressure) = pressure_setup(4, 2000)?;
    let (_, chat) = chat_setup(4, 5)?;
    Ok(vec![
        spread("shared-prefix-pressure", &pressure.build(1))?,
        spread("multi-turn-chat", &chat.build(1))?,
    ])
}

fn spread(name: &str, w: &Workload) -> Result<TagSpread> {
    let index = PrefixIndex::default();
    let mut anchors: std::collections::HashMap<u64, usize> = Default::default();
    let mut requests = 0;
    for r in &w.requests {
        let tokens = match &r.prompt {
            Prompt::Text(t) => Builtin.encode(t, true)?,
            Prompt::Messages(ms) => {
                let ms: Vec<ChatMessage> = ms
                    .iter()
                    .map(|m| ChatMessage {
                        role: m.role.clone(),
                        content: m.content.clone(),
                    })
                    .collect();
                Builtin.encode_chat(&ms, true)?
            }
        };
        let Some(&anchor) = index.request_keys("m", None, &tokens, 16).first() else {
            continue;
        };
        *anchors.entry(anchor).or_default() += 1;
        requests += 1;
    }
    let n = requests.max(1) as f64;
    let mut per_primary = [0usize; PRIMARIES];
    for (a, c) in &anchors {
        per_primary[(xxh3_64(&a.to_le_bytes()) % PRIMARIES as u64) as usize] += c;
    }
    let mut pods = [0usize; PRIMARIES];
    for p in 0..PODS {
        pods[(xxh3_64(format!("10.0.{}.{}:8000", p / 250, p % 250).as_bytes()) % PRIMARIES as u64)
            as usize] += 1;
    }
    Ok(TagSpread {
        workload: name.to_owned(),
        requests,
        anchors: anchors.len(),
        hottest_anchor_share: anchors.values().copied().max().unwrap_or(0) as f64 / n,
        per_anchor_busiest_primary: per_primary.iter().copied().max().unwrap_or(0) as f64 / n,
        per_pod_stripe_busiest_primary: pods.iter().copied().max().unwrap_or(0) as f64
            / PODS as f64,
    })
}
