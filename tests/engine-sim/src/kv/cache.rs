//! The block pool and its prefix cache, shaped like vLLM's `BlockPool`.
//!
//! * A fixed number of blocks; a request holds `ceil(len / block_size)`.
//! * Only full blocks are cached, under their chained hash.
//! * Blocks with no holder sit in an LRU free queue; a cached free block is
//!   still a cache hit until it is reused, and reusing it evicts it
//!   (`BlockRemoved`). Freed request blocks go to the queue's tail in reverse
//!   order, so a prompt's tail blocks are evicted before its head.
//! * A held block (running request, or kept for a P/D transfer) is pinned.
//!
//! Events produced by one engine step accumulate in `pending` and leave as one
//! batch, removals before stores as in vLLM's captures.

use std::collections::HashMap;

use super::events::KvEvent;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    refs: u32,
    hash: Option<u64>,
    prev: u32,
    next: u32,
    in_free: bool,
}

/// Blocks, their holders and the hash → block map.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    cached: HashMap<u64, u32>,
    head: u32,
    tail: u32,
    free_len: usize,
    removed: Vec<u64>,
    stored: Vec<KvEvent>,
}

/// Full blocks of one request to commit: `ids[i]` under `hashes[i]`, `parent`
/// preceding `hashes[0]`, `tokens` their tokens, `first_index` the position of
/// the first one in the request (block 0 carries the salt).
#[derive(Debug, Clone, Copy)]
pub struct BlockRun<'a> {
    pub ids: &'a [u32],
    pub hashes: &'a [u64],
    pub parent: Option<u64>,
    pub tokens: &'a [u32],
    pub lora_name: Option<&'a str>,
    pub salt: Option<&'a str>,
    pub first_index: usize,
}

/// What committing full blocks added to the cache.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CommitStats {
    pub newly_cached: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` empty blocks (ids `0..num_blocks`).
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let mut pool = Self {
            block_size,
            blocks: Vec::with_capacity(num_blocks),
            cached: HashMap::with_capacity(num_blocks),
            head: NIL,
            tail: NIL,
            free_len: 0,
            removed: Vec::new(),
            stored: Vec::new(),
        };
        for i in 0..num_blocks {
            pool.blocks.push(Block {
                refs: 0,
                hash: None,
                prev: NIL,
                next: NIL,
                in_free: false,
            });
            pool.push_tail(i as u32);
        }
        pool
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks with no holder (cached or not).
    pub fn num_free(&self) -> usize {
        self.free_len
    }

    /// Blocks holding a cached full block (free or held).
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// Share of blocks held by requests (vLLM `kv_cache_usage_perc`).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        (self.blocks.len() - self.free_len) as f64 / self.blocks.len() as f64
    }

    /// Block ids of the longest cached prefix of `hashes`.
    pub fn match_prefix(&self, hashes: &[u64]) -> Vec<u32> {
        hashes
            .iter()
            .map_while(|h| self.cached.get(h).copied())
            .collect()
    }

    /// Whether block `id` has no holder.
    pub fn is_free(&self, id: u32) -> bool {
        self.blocks.get(id as usize).is_some_and(|b| b.in_free)
    }

    /// Whether `hash` is cached.
    pub fn contains(&self, hash: u64) -> bool {
        self.cached.contains_key(&hash)
    }

    /// Takes a hold on `ids` (cache hits): pinned until released.
    pub fn acquire(&mut self, ids: &[u32]) {
        for &id in ids {
            if let Some(b) = self.blocks.get(id as usize) {
                if b.in_free {
                    self.unlink(id);
                }
            }
            if let Some(b) = self.blocks.get_mut(id as usize) {
                b.refs += 1;
            }
        }
    }

    /// `n` fresh blocks from the LRU head, evicting cached ones, or `None`
    /// (and nothing taken) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free_len {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            let b = self.blocks.get_mut(id as usize)?;
            b.refs = 1;
            if let Some(h) = b.hash.take() {
                if self.cached.get(&h) == Some(&id) {
                    self.cached.remove(&h);
                    self.removed.push(h);
                }
            }
            out.push(id);
        }
        Some(out)
    }

    /// Registers full blocks `ids[i]` under `hashes[i]` (`parent` precedes
    /// `hashes[0]`); `tokens` are their tokens, `block_size` each. Blocks
    /// whose hash another block already caches stay uncached (vLLM dedupes the
    /// same way); a store event covers each run of newly cached blocks.
    pub fn commit(&mut self, run: BlockRun<'_>) -> CommitStats {
        let BlockRun {
            ids,
            hashes,
            mut parent,
            tokens,
            lora_name,
            salt,
            first_index,
        } = run;
        let bs = self.block_size;
        let mut stats = CommitStats::default();
        let mut run: Option<KvEvent> = None;
        for (i, (&id, &h)) in ids.iter().zip(hashes).enumerate() {
            let fresh = !self.cached.contains_key(&h);
            if fresh {
                self.cached.insert(h, id);
                if let Some(b) = self.blocks.get_mut(id as usize) {
                    b.hash = Some(h);
                }
                stats.newly_cached += 1;
                let toks = tokens.get(i * bs..(i + 1) * bs).unwrap_or(&[]);
                let extra = if first_index + i == 0 {
                    salt.map(|s| vec![s.to_string()])
                } else {
                    None
                };
                match &mut run {
                    Some(KvEvent::BlockStored {
                        block_hashes,
                        token_ids,
                        extra_keys,
                        ..
                    }) => {
                        block_hashes.push(h);
                        token_ids.extend_from_slice(toks);
                        extra_keys.push(extra);
                    }
                    _ => {
                        run = Some(KvEvent::BlockStored {
                            block_hashes: vec![h],
                            parent_block_hash: parent,
                            token_ids: toks.to_vec(),
                            block_size: bs,
                            lora_name: lora_name.map(str::to_string),
                            extra_keys: vec![extra],
                        });
                    }
                }
            } else if let Some(ev) = run.take() {
                self.stored.push(ev);
            }
            parent = Some(h);
        }
        if let Some(ev) = run {
            self.stored.push(ev);
        }
        stats
    }

    /// Drops a hold on each of `ids`; blocks nobody holds join the free
    /// queue's tail, last block first.
    pub fn release(&mut self, ids: &[u32]) {
        for &id in ids.iter().rev() {
            let now_free = match self.blocks.get_mut(id as usize) {
                Some(b) if b.refs > 0 => {
                    b.refs -= 1;
                    b.refs == 0
                }
                _ => false,
            };
            if now_free {
                self.push_tail(id);
            }
        }
    }

    /// Forgets every cached hash (vLLM `reset_prefix_cache`); true if anything
    /// was cached. Emits `AllBlocksCleared`.
    pub fn clear(&mut self) {
        for b in &mut self.blocks {
            b.hash = None;
        }
        self.cached.clear();
        self.removed.clear();
        self.stored.clear();
        self.stored.push(KvEvent::AllBlocksCleared);
    }

    /// A fresh pool of the same size (engine restart): no events.
    pub fn reset_all(&mut self) {
        *self = Self::new(self.blocks.len(), self.block_size);
    }

    /// The events since the last call: one `BlockRemoved` per evicted hash
    /// (as vLLM sends them), then the stores and clears.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        let mut out: Vec<KvEvent> = self
            .removed
            .drain(..)
            .map(|h| KvEvent::BlockRemoved {
                block_hashes: vec![h],
            })
            .collect();
        out.append(&mut self.stored);
        out
    }

    fn push_tail(&mut self, id: u32) {
        let tail = self.tail;
        if let Some(b) = self.blocks.get_mut(id as usize) {
            b.prev = tail;
            b.next = NIL;
            b.in_free = true;
        }
        match self.blocks.get_mut(tail as usize) {
            Some(t) => t.next = id,
            None => self.head = id,
        }
        self.tail = id;
        self.free_len += 1;
    }

    fn unlink(&mut self, id: u32) {
        let (prev, next) = match self.blocks.get_mut(id as usize) {
            Some(b) if b.in_free => {
                b.in_free = false;
                (b.prev, b.next)
            }
            _ => return,
        };
        match self.blocks.get_mut(prev as usize) {
            Some(p) => p.next = next,
            None => self.head = next,
        }
        match self.blocks.get_mut(next as usize) {
            Some(n) => n.prev = prev,
            None => self.tail = prev,
        }
        self.free_len -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(pool: &mut BlockPool, hashes: &[u64]) -> Vec<u32> {
        let ids = pool.allocate(hashes.len()).unwrap();
        let toks = vec![7u32; hashes.len() * pool.block_size()];
        pool.commit(BlockRun {
            ids: &ids,
            hashes,
            parent: None,
            tokens: &toks,
            lora_name: None,
            salt: None,
            first_index: 0,
        });
        ids
    }

    #[test]
    fn hits_survive_release_and_lru_evicts_oldest_tail_first() {
        let mut pool = BlockPool::new(4, 2);
        let a = store(&mut pool, &[1, 2]);
        pool.release(&a);
        let b = store(&mut pool, &[3, 4]);
        pool.release(&b);
        assert_eq!(pool.match_prefix(&[1, 2, 9]).len(), 2);
        let evs = pool.take_events();
        assert_eq!(evs.len(), 2);
        // Reusing one block evicts the least recently freed: prompt A's tail.
        let c = pool.allocate(1).unwrap();
        assert_eq!(c, vec![a[1]]);
        assert_eq!(
            pool.take_events(),
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![2]
            }]
        );
        assert_eq!(pool.match_prefix(&[1, 2]).len(), 1);
    }

    #[test]
    fn held_blocks_are_pinned() {
        let mut pool = BlockPool::new(2, 2);
        let a = store(&mut pool, &[1, 2]);
        assert!(pool.allocate(1).is_none());
        assert_eq!(pool.usage(), 1.0);
        pool.release(&a);
        let hit = pool.match_prefix(&[1]);
        pool.acquire(&hit);
        assert_eq!(pool.num_free(), 1);
        let got = pool.allocate(1).unwrap();
        assert_eq!(got, vec![a[1]]);
        assert!(pool.allocate(1).is_none());
    }

    #[test]
    fn commit_skips_duplicates_and_clear_reports() {
        let mut pool = BlockPool::new(4, 1);
        store(&mut pool, &[5]);
        let ids = pool.allocate(2).unwrap();
        let st = pool.commit(BlockRun {
            ids: &ids,
            hashes: &[5, 6],
            parent: None,
            tokens: &[1, 2],
            lora_name: None,
            salt: Some("s"),
            first_index: 0,
        });
        assert_eq!(st.newly_cached, 1);
        let evs = pool.take_events();
        assert!(
            matches!(&evs[1], KvEvent::BlockStored { block_hashes, parent_block_hash: Some(5), .. } if block_hashes == &vec![6])
        );
        pool.clear();
        assert_eq!(pool.take_events(), vec![KvEvent::AllBlocksCleared]);
        assert_eq!(pool.num_cached(), 0);
    }
}
