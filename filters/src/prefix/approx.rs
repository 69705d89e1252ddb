//! The approximate prefix index, for engines that publish no KV events.
//!
//! Without events the mesh cannot know what an engine cached, only what it
//! sent there. So block keys come from the prompt text itself (chained xxh3
//! over chunks of `chunk_chars` characters, seeded by the model; no tokenizer
//! needed; a partial last chunk is not hashed), each routed request records
//! its keys against the chosen pod, and each pod forgets its least recently
//! routed blocks beyond a capacity (set it from the engine's KV size: blocks ×
//! tokens per block ÷ tokens per chunk). Matching is the longest run of
//! leading keys per pod, as in the precise index.
//!
//! Recency is kept within a quarter of the capacity
//! ([`ApproxIndex::record`]): a block recorded again within the pod's last
//! capacity/4 insertions is not moved, so it outlives at least 3/4 of the
//! capacity in later insertions rather than all of it. Prompts sent over and
//! over (shared system prompts, the same long document) then cost one lookup
//! per block, not a queue entry per block and the compactions that follow;
//! the engine's own eviction is no exact LRU of requests either.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::RwLock;
use xxhash_rust::xxh3::xxh3_64;

use crate::prefix::hash::{BlockKey, LocalHasher};
use crate::prefix::lru::Lru;

/// Settings of the approximate index.
#[derive(Debug, Clone)]
pub struct ApproxConfig {
    /// Characters per text block (about 4 characters per token in English).
    pub chunk_chars: usize,
    /// Blocks remembered per pod unless [`ApproxIndex::set_capacity`] says otherwise.
    pub default_blocks_per_pod: usize,
    pub hash_seed: String,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self {
            chunk_chars: 256,
            default_blocks_per_pod: 65_536,
            hash_seed: String::new(),
        }
    }
}

/// How much of a prompt one pod was sent before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApproxMatch {
    pub pod: String,
    pub blocks: usize,
}

/// See the module docs.
#[derive(Debug)]
pub struct ApproxIndex {
    hasher: LocalHasher,
    chunk_chars: usize,
    default_cap: usize,
    pods: RwLock<HashMap<String, Arc<RwLock<Lru<()>>>>>,
}

impl ApproxIndex {
    pub fn new(config: ApproxConfig) -> Self {
        Self {
            hasher: LocalHasher::new(&config.hash_seed),
            chunk_chars: config.chunk_chars.max(1),
            default_cap: config.default_blocks_per_pod.max(1),
            pods: RwLock::new(HashMap::new()),
        }
    }

    /// Keys of every full chunk of `text` for `model`.
    pub fn keys(&self, model: &str, text: &str) -> Vec<BlockKey> {
        self.keys_upto(model, text, usize::MAX)
    }

    /// Keys of the first `max_blocks` full chunks of `text` for `model`
    /// (`maxPrefixBlocksToMatch`): two prompts alike up to there are one
    /// prompt to the index, and the text beyond is not read.
    pub fn keys_upto(&self, model: &str, text: &str, max_blocks: usize) -> Vec<BlockKey> {
        let n = self.chunk_chars;
        let mut key = self.hasher.root(model, Some("\0approx"));
        let mut out = Vec::with_capacity((text.len() / n).min(max_blocks));
        let mut buf = Vec::with_capacity(8 + 4 * n);
        let mut push = |chunk: &[u8], key: &mut u64| {
            buf.clear();
            buf.extend_from_slice(&key.to_le_bytes());
            buf.extend_from_slice(chunk);
            *key = xxh3_64(&buf);
            out.push(*key);
        };
        // Within an ASCII window a character is a byte.
        let window = &text.as_bytes()[..text.len().min(n.saturating_mul(max_blocks))];
        if window.is_ascii() {
            for chunk in window.chunks_exact(n) {
                push(chunk, &mut key);
            }
        } else {
            let (mut start, mut count, mut blocks) = (0, 0, 0);
            for (i, c) in text.char_indices() {
                count += 1;
                if count == n {
                    let end = i + c.len_utf8();
                    push(&text.as_bytes()[start..end], &mut key);
                    start = end;
                    count = 0;
                    blocks += 1;
                    if blocks == max_blocks {
                        break;
                    }
                }
            }
        }
        out
    }

    fn pod(&self, pod: &str) -> Arc<RwLock<Lru<()>>> {
        if let Some(p) = self.pods.read().get(pod) {
            return p.clone();
        }
        self.pods
            .write()
            .entry(pod.to_owned())
            .or_insert_with(|| Arc::new(RwLock::new(Lru::new(self.default_cap))))
            .clone()
    }

    /// Remembers that `pod` was sent a prompt with these keys (one lock for
    /// the whole prompt). A key recorded within the pod's last capacity/4
    /// insertions keeps its place (see the module docs).
    pub fn record(&self, pod: &str, keys: &[BlockKey]) {
        let p = self.pod(pod);
        let mut lru = p.write();
        let fresh = (lru.max_weight() / 4) as u64;
        for &k in keys {
            lru.refresh(k, (), 1, fresh);
        }
    }

    /// Sets how many blocks `pod` is assumed to keep (drops the excess now).
    pub fn set_capacity(&self, pod: &str, blocks: usize) {
        let p = self.pod(pod);
        let mut lru = p.write();
        let mut fresh = Lru::new(blocks.max(1));
        std::mem::swap(&mut *lru, &mut fresh);
        // Re-insert the old entries oldest first so recency is kept.
        for k in fresh.keys_oldest_first() {
            lru.insert(k, (), 1);
        }
    }

    /// Forgets a pod.
    pub fn remove_pod(&self, pod: &str) {
        self.pods.write().remove(pod);
    }

    /// Per pod sent at least the first block: the longest run of leading keys
    /// it was sent; longest first, ties by name.
    pub fn match_prefix(&self, keys: &[BlockKey]) -> Vec<ApproxMatch> {
        let Some(&first) = keys.first() else {
            return Vec::new();
        };
        let pods: Vec<(String, Arc<RwLock<Lru<()>>>)> = self
            .pods
            .read()
            .iter()
            .map(|(n, p)| (n.clone(), p.clone()))
            .collect();
        let mut out: Vec<ApproxMatch> = pods
            .into_iter()
            .filter_map(|(pod, p)| {
                let lru = p.read();
                lru.peek(first)?;
                let blocks = keys.iter().take_while(|&&k| lru.peek(k).is_some()).count();
                Some(ApproxMatch { pod, blocks })
            })
            .collect();
        out.sort_by(|a, b| b.blocks.cmp(&a.blocks).then_with(|| a.pod.cmp(&b.pod)));
        out
    }

    /// Heap bytes, from capacities.
    pub fn memory_bytes(&self) -> usize {
        self.pods
            .read()
            .values()
            .map(|p| p.read().memory_bytes())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idx(cap: usize) -> ApproxIndex {
        ApproxIndex::new(ApproxConfig {
            chunk_chars: 8,
            default_blocks_per_pod: cap,
            hash_seed: String::new(),
        })
    }

    #[test]
    fn shared_text_prefixes_share_keys() {
        let a = idx(100);
        let k1 = a.keys("m", "0123456789abcdefXYZ");
        let k2 = a.keys("m", "0123456789abcdeQ");
        assert_eq!(k1.len(), 2, "partial chunk not hashed");
        assert_eq!(k1[0], k2[0]);
        assert_ne!(k1[1], k2[1]);
        assert_ne!(a.keys("other", "01234567"), a.keys("m", "01234567"));
        // Chunks count characters, not bytes.
        assert_eq!(a.keys("m", "ééééééééé").len(), 1);
        assert_eq!(a.keys("m", "ééééé").len(), 0);
    }

    #[test]
    fn records_again_keep_a_prompt_and_its_recency() {
        // Capacity 64: the freshness window is 16 insertions.
        let a = idx(64);
        let shared = a.keys("m", &"s".repeat(8 * 40));
        for _ in 0..100 {
            a.record("p", &shared);
        }
        assert_eq!(a.match_prefix(&shared)[0].blocks, 40);
        // 24 new blocks fit beside the 40; the shared prompt stays whole.
        a.record("p", &a.keys("m", &"n".repeat(8 * 24)));
        assert_eq!(a.match_prefix(&shared)[0].blocks, 40);
        // The shared prompt, recorded again, is newer than the 24 blocks:
        // 24 more evict those, not the prompt.
        a.record("p", &shared);
        a.record("p", &a.keys("m", &"o".repeat(8 * 24)));
        assert_eq!(a.match_prefix(&shared)[0].blocks, 40);
    }

    #[test]
    fn the_window_keeps_the_leading_keys_and_ignores_the_rest() {
        let a = idx(100);
        for text in ["0123456789abcdef".repeat(10), "é0123456789abcde".repeat(10)] {
            let all = a.keys("m", &text);
            assert_eq!(all.len(), 20);
            for max in [0, 1, 7, 20, 21] {
                assert_eq!(a.keys_upto("m", &text, max), all[..max.min(20)], "{max}");
            }
            // Prompts alike up to the window are one prompt to the index.
            let mut other = text[..text.char_indices().nth(8 * 7).unwrap().0].to_owned();
            other.push_str(&"z".repeat(80));
            assert_eq!(a.keys_upto("m", &other, 7), all[..7]);
            assert_ne!(a.keys_upto("m", &other, 8), all[..8]);
        }
        // An ASCII window with other characters after it, and a window whose
        // byte length ends inside a two-byte character.
        for text in [
            "a".repeat(16) + &"é".repeat(24),
            "a".to_owned() + &"é".repeat(40),
        ] {
            let all = a.keys("m", &text);
            for max in 0..=all.len() + 1 {
                assert_eq!(
                    a.keys_upto("m", &text, max),
                    all[..max.min(all.len())],
                    "{max}"
                );
            }
        }
    }

    #[test]
    fn routed_prompts_match_and_age_out() {
        let a = idx(4);
        let long = a.keys("m", &"x".repeat(8 * 3));
        a.record("p1", &long);
        a.record("p2", &long[..1]);
        assert_eq!(
            a.match_prefix(&long),
            [
                ApproxMatch {
                    pod: "p1".into(),
                    blocks: 3
                },
                ApproxMatch {
                    pod: "p2".into(),
                    blocks: 1
                }
            ]
        );
        // p1 holds 4 blocks: two more prompts push the first one out.
        a.record("p1", &a.keys("m", &"y".repeat(16)));
        assert_eq!(
            a.match_prefix(&long),
            [ApproxMatch {
                pod: "p2".into(),
                blocks: 1
            }]
        );
        a.set_capacity("p2", 1);
        a.remove_pod("p2");
        assert!(a.match_prefix(&long).iter().all(|m| m.pod != "p2"));
        assert!(a.match_prefix(&[]).is_empty());
    }
}
