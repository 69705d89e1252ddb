//! The token prefix cache: tokenize the part of a prompt seen before only once.
//!
//! Prompts that share a system prompt or a conversation prefix share a prefix
//! of rendered text. A tokenizer's [`Tokenizer::split_points`] (for a Hugging
//! Face tokenizer: its special tokens, which it splits out before any other
//! processing) are places where a text may be cut and its pieces tokenized
//! alone with the same ids. So the text is cut there; each piece's ids are
//! cached under the hash of the *whole* text before the cut, linked to the
//! cached piece before it; a later prompt walks its cuts, reuses every cached
//! piece that continues the chain, and tokenizes only the rest.
//!
//! Bounded: cached ids are evicted least recently used first once they pass
//! `max_bytes`. Pieces shorter than `min_piece_bytes` are merged with the next.
//! [`CachedTokenizer::encode_capped`] caps the cost of one very long prompt.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use xxhash_rust::xxh3::Xxh3;

use super::{ChatInput, ChatMessage, TokenizeError, Tokenizer};
use crate::prefix::lru::Lru;

/// Limits of the token prefix cache.
#[derive(Debug, Clone)]
pub struct TokenCacheConfig {
    /// Most bytes of cached token ids.
    pub max_bytes: usize,
    /// Shortest piece of text cached on its own.
    pub min_piece_bytes: usize,
}

impl Default for TokenCacheConfig {
    fn default() -> Self {
        Self {
            max_bytes: 64 << 20,
            min_piece_bytes: 256,
        }
    }
}

/// Counters, for metrics and the effective-rate benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Text bytes whose ids came from the cache.
    pub reused_bytes: u64,
    /// Text bytes actually tokenized.
    pub tokenized_bytes: u64,
    /// Prompts cut short by [`CachedTokenizer::encode_capped`].
    pub capped: u64,
    pub entries: usize,
    /// Bytes of cached ids.
    pub bytes: usize,
}

/// Token ids of a prompt whose tokenization may have been capped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CappedIds {
    /// Exact ids of a prefix of the prompt (all of it unless `capped`).
    pub ids: Vec<u32>,
    pub capped: bool,
    /// `ids.len()` when not capped; else an estimate for the whole prompt.
    pub estimated_tokens: usize,
}

#[derive(Debug)]
struct Piece {
    /// Hash of the text before this piece (the previous link).
    parent: u64,
    ids: Arc<[u32]>,
}

/// A [`Tokenizer`] with the token prefix cache in front (see the module docs).
#[derive(Debug)]
pub struct CachedTokenizer<T> {
    inner: T,
    min_piece: usize,
    cache: Mutex<Lru<Piece>>,
    reused: AtomicU64,
    tokenized: AtomicU64,
    capped: AtomicU64,
}

fn seed(add_special_tokens: bool) -> Xxh3 {
    let mut h = Xxh3::new();
    h.update(&[u8::from(add_special_tokens), 0x6b]);
    h
}

impl<T: Tokenizer> CachedTokenizer<T> {
    pub fn new(inner: T, config: TokenCacheConfig) -> Self {
        Self {
            inner,
            min_piece: config.min_piece_bytes.max(1),
            cache: Mutex::new(Lru::new(config.max_bytes)),
            reused: AtomicU64::new(0),
            tokenized: AtomicU64::new(0),
            capped: AtomicU64::new(0),
        }
    }

    pub fn inner(&self) -> &T {
        &self.inner
    }

    pub fn stats(&self) -> CacheStats {
        let c = self.cache.lock();
        CacheStats {
            reused_bytes: self.reused.load(Ordering::Relaxed),
            tokenized_bytes: self.tokenized.load(Ordering::Relaxed),
            capped: self.capped.load(Ordering::Relaxed),
            entries: c.len(),
            bytes: c.weight(),
        }
    }

    /// Byte offsets (> 0, ascending) where `text` may be cut.
    fn cuts(&self, text: &str) -> Vec<usize> {
        let mut cuts: Vec<usize> = Vec::new();
        for p in self.inner.split_points() {
            if !p.is_empty() {
                cuts.extend(
                    text.match_indices(p.as_str())
                        .map(|(i, _)| i)
                        .filter(|&i| i > 0),
                );
            }
        }
        cuts.sort_unstable();
        cuts.dedup();
        cuts
    }

    fn encode_piece(
        &self,
        piece: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        self.tokenized
            .fetch_add(piece.len() as u64, Ordering::Relaxed);
        self.inner.encode(piece, add_special_tokens)
    }

    fn encode_cached(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let cuts = self.cuts(text);
        if cuts.is_empty() || text.len() < self.min_piece {
            return self.encode_piece(text, add_special_tokens);
        }
        // Hash of the text before each cut (streaming, one pass).
        let mut h = seed(add_special_tokens);
        let root = h.digest();
        let mut prefix_hashes = Vec::with_capacity(cuts.len());
        let mut last = 0;
        for &c in &cuts {
            h.update(&text.as_bytes()[last..c]);
            prefix_hashes.push(h.digest());
            last = c;
        }
        // Walk the cached chain as far as it goes.
        let (mut at, mut at_hash) = (0usize, root);
        let mut reused: Vec<Arc<[u32]>> = Vec::new();
        {
            let mut cache = self.cache.lock();
            for (&c, &ph) in cuts.iter().zip(&prefix_hashes) {
                let hit = match cache.peek(ph) {
                    Some(p) if p.parent == at_hash => Some(p.ids.clone()),
                    _ => None,
                };
                if let Some(ids) = hit {
                    cache.get(ph);
                    reused.push(ids);
                    at = c;
                    at_hash = ph;
                }
            }
        }
        let mut ids: Vec<u32> = Vec::with_capacity(text.len() / 3 + 4);
        for r in &reused {
            ids.extend_from_slice(r);
        }
        self.reused.fetch_add(at as u64, Ordering::Relaxed);
        // Tokenize the rest piece by piece, caching each piece that is long enough.
        let mut new_pieces: Vec<(u64, Piece, usize)> = Vec::new();
        let mut piece_start = at;
        for (&c, &ph) in cuts.iter().zip(&prefix_hashes) {
            if c <= at || c - piece_start < self.min_piece {
                continue;
            }
            let piece = self.encode_piece(
                &text[piece_start..c],
                add_special_tokens && piece_start == 0,
            )?;
            let piece: Arc<[u32]> = piece.into();
            ids.extend_from_slice(&piece);
            let weight = piece.len() * 4 + 64;
            new_pieces.push((
                ph,
                Piece {
                    parent: at_hash,
                    ids: piece,
                },
                weight,
            ));
            at_hash = ph;
            piece_start = c;
        }
        let tail =
            self.encode_piece(&text[piece_start..], add_special_tokens && piece_start == 0)?;
        ids.extend_from_slice(&tail);
        if !new_pieces.is_empty() {
            let mut cache = self.cache.lock();
            for (key, piece, weight) in new_pieces {
                cache.insert(key, piece, weight);
            }
        }
        Ok(ids)
    }

    /// Like [`Tokenizer::encode`], but tokenizes at most `max_bytes` of a long
    /// prompt (cut at a split point if one is in the second half of the
    /// budget, else before a space, dropping the last token, which the cut may
    /// have changed) and estimates the total from the bytes per token seen.
    pub fn encode_capped(
        &self,
        text: &str,
        add_special_tokens: bool,
        max_bytes: usize,
    ) -> Result<CappedIds, TokenizeError> {
        if text.len() <= max_bytes {
            let ids = self.encode(text, add_special_tokens)?;
            let n = ids.len();
            return Ok(CappedIds {
                ids,
                capped: false,
                estimated_tokens: n,
            });
        }
        self.capped.fetch_add(1, Ordering::Relaxed);
        let split_cut = self
            .cuts(&text[..floor_char_boundary(text, max_bytes)])
            .into_iter()
            .rev()
            .find(|&c| c >= max_bytes / 2);
        let (cut, exact) = match split_cut {
            Some(c) => (c, true),
            None => (space_cut(text, max_bytes), false),
        };
        let mut ids = self.encode(&text[..cut], add_special_tokens)?;
        if !exact {
            ids.pop();
        }
        let estimated_tokens = if cut == 0 {
            text.len() / 4
        } else {
            (ids.len() as u128 * text.len() as u128 / cut as u128) as usize
        };
        Ok(CappedIds {
            ids,
            capped: true,
            estimated_tokens,
        })
    }
}

fn floor_char_boundary(text: &str, at: usize) -> usize {
    let mut i = at.min(text.len());
    while i > 0 && !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// The last offset ≤ `max` right before a space that follows a non-space, else
/// the last char boundary ≤ `max`.
fn space_cut(text: &str, max: usize) -> usize {
    let end = floor_char_boundary(text, max);
    let b = text.as_bytes();
    (1..end)
        .rev()
        .find(|&i| b[i] == b' ' && !b[i - 1].is_ascii_whitespace())
        .unwrap_or(end)
}

impl<T: Tokenizer> Tokenizer for CachedTokenizer<T> {
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        self.encode_cached(text, add_special_tokens)
    }

    fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        self.inner.render_chat(messages, add_generation_prompt)
    }

    fn render_chat_input(&self, input: &ChatInput) -> Result<String, TokenizeError> {
        self.inner.render_chat_input(input)
    }

    fn chat_template_adds_bos(&self) -> bool {
        self.inner.chat_template_adds_bos()
    }

    fn chat_add_special_tokens(&self, input: Option<&ChatInput>) -> bool {
        self.inner.chat_add_special_tokens(input)
    }

    fn decode_token(&self, id: u32) -> String {
        self.inner.decode_token(id)
    }

    fn split_points(&self) -> &[String] {
        self.inner.split_points()
    }
}

#[cfg(test)]
mod tests {
    use super::super::Builtin;
    use super::*;

    fn chat(system: &str, user: &str) -> Vec<ChatMessage> {
        vec![
            ChatMessage {
                role: "system".into(),
                content: system.into(),
            },
            ChatMessage {
                role: "user".into(),
                content: user.into(),
            },
        ]
    }

    #[test]
    fn reuses_a_shared_system_prompt_with_identical_ids() {
        let c = CachedTokenizer::new(
            Builtin,
            TokenCacheConfig {
                max_bytes: 1 << 20,
                min_piece_bytes: 64,
            },
        );
        let system = "You are a careful assistant. ".repeat(40);
        for q in [
            "How long is data kept?",
            "Can I get a refund?",
            "Who are you?",
        ] {
            let want = Builtin.encode_chat(&chat(&system, q), true).unwrap();
            assert_eq!(c.encode_chat(&chat(&system, q), true).unwrap(), want);
        }
        let s = c.stats();
        assert!(s.reused_bytes >= 2 * system.len() as u64, "{s:?}");
        assert!(s.tokenized_bytes < 2 * system.len() as u64, "{s:?}");
    }

    #[test]
    fn a_tiny_budget_still_gives_exact_ids() {
        let c = CachedTokenizer::new(
            Builtin,
            TokenCacheConfig {
                max_bytes: 100,
                min_piece_bytes: 1,
            },
        );
        let system = "policy text ".repeat(50);
        for q in ["a", "b", "c"] {
            let want = Builtin.encode_chat(&chat(&system, q), true).unwrap();
            assert_eq!(c.encode_chat(&chat(&system, q), true).unwrap(), want);
        }
        assert!(c.stats().bytes <= 100);
    }

    #[test]
    fn capping_tokenizes_a_prefix_and_estimates_the_rest() {
        let c = CachedTokenizer::new(Builtin, TokenCacheConfig::default());
        let text = "word ".repeat(1000);
        let full = Builtin.encode(&text, true).unwrap();
        let capped = c.encode_capped(&text, true, 1000).unwrap();
        assert!(capped.capped);
        assert!(capped.ids.len() < full.len() && full.starts_with(&capped.ids));
        let est = capped.estimated_tokens as f64;
        assert!(
            (est - full.len() as f64).abs() / (full.len() as f64) < 0.05,
            "{est}"
        );
        let small = c.encode_capped("short", true, 1000).unwrap();
        assert_eq!(
            (small.capped, small.ids),
            (false, Builtin.encode("short", true).unwrap())
        );
        assert_eq!(c.stats().capped, 1);
    }
}
