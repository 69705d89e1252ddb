//! The prefix index: which pod holds how much of a request's prefix.
//!
//! * A global map, in [`SHARDS`] `RwLock` shards, from block key (the local
//!   chained hash of [`crate::prefix::hash`]) to the pods holding it, each with
//!   its medium and a count of physical copies (duplicate stores are counted,
//!   and each `BlockRemoved` drops one copy).
//! * Per pod, a map from the engine's block hash to the block key, so that a
//!   `BlockRemoved` (which names only engine hashes) and a `BlockStored`'s
//!   `parent_block_hash` can be resolved (docs/wire-formats.md §2.4,
//!   option A).
//!
//! Concurrency: any number of readers ([`PrefixIndex::match_prefix`]) run
//! alongside one writer per pod feed (each pod's state has its own mutex; a
//! writer holds at most one shard lock at a time, so no lock cycle exists).
//!
//! Memory is bounded per pod: at most `max_blocks_per_pod` (block, medium)
//! entries. Stores are stamped with a per-pod epoch that advances every
//! 1/8 of the cap; when a pod passes its cap, whole oldest epochs are dropped
//! (least recently stored first; a block stored again moves to the newest
//! epoch), leaving it at about 7/8 of the cap.

mod matcher;
mod shard;
mod table;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};

use crate::prefix::hash::{extend_keys, BlockKey, LocalHasher};
use crate::prefix::kvevents::{BlockRemoved, BlockStored, EventBatch, KvEvent};
use matcher::Matcher;
use shard::Shard;
pub(crate) use shard::{map_bytes, MixMap};
use table::U64Map;

/// Number of global shards (a power of two).
pub const SHARDS: usize = 64;
const SHARD_SHIFT: u32 = 64 - SHARDS.trailing_zeros();

/// A pod, interned by the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodId(pub u16);

/// How much of a request's prefix one pod holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixMatch {
    pub pod: PodId,
    /// Leading blocks held in any medium.
    pub blocks: usize,
    /// Leading blocks all held on the GPU (`<= blocks`).
    pub gpu_blocks: usize,
}

/// Index limits.
#[derive(Debug, Clone)]
pub struct IndexConfig {
    /// Most (block, medium) entries kept per pod before eviction.
    pub max_blocks_per_pod: usize,
    /// Seed of the local block keys (the same on every router of a mesh).
    pub hash_seed: String,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            max_blocks_per_pod: 1 << 20,
            hash_seed: String::new(),
        }
    }
}

/// What one [`PrefixIndex::apply`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ApplyStats {
    /// Blocks stored (counting duplicate copies).
    pub stored: usize,
    /// Block copies removed.
    pub removed: usize,
    /// `AllBlocksCleared` events seen (the pod was cleared).
    pub cleared: usize,
    /// Stored events skipped: not the main full-attention group, or no tokens.
    pub skipped_events: usize,
    /// Stored events whose parent this index never saw (not indexed).
    pub unknown_parent: usize,
    /// Removals of engine hashes this index does not know.
    pub unknown_removed: usize,
    /// Entries dropped to stay under the per-pod cap.
    pub evicted: usize,
}

/// A block key an [`PrefixIndex::apply_touching`] batch changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Touched {
    pub key: BlockKey,
    /// The index in the batch of the `BlockStored` event that stored it, or
    /// [`Touched::REMOVED`].
    pub event: u32,
}

impl Touched {
    /// `event` of a key a removal or an eviction touched.
    pub const REMOVED: u32 = u32::MAX;

    fn removed(key: BlockKey) -> Self {
        Touched {
            key,
            event: Self::REMOVED,
        }
    }
}

/// Index size, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexStats {
    pub pods: usize,
    /// Distinct block keys.
    pub keys: usize,
    /// (block, pod, medium) entries.
    pub entries: usize,
    /// Heap bytes, computed from table capacities.
    pub memory_bytes: usize,
}

/// Why a pod could not be added.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    #[error("the prefix index holds at most 65535 pods")]
    TooManyPods,
}

#[derive(Debug, Default)]
struct PodState {
    /// Engine block hash → block key.
    engine: U64Map,
    /// (block, medium) entries this pod holds.
    entries: usize,
    epoch: u32,
    stored_in_epoch: usize,
    /// Engine hashes stored in each live epoch, oldest first; entry `i` is
    /// epoch `epoch - (len - 1 - i)`. Stale hashes are skipped when evicting.
    epochs: std::collections::VecDeque<Vec<u64>>,
}

#[derive(Debug, Default)]
struct PodTable {
    by_name: HashMap<String, PodId>,
    slots: Vec<Option<(String, Arc<Mutex<PodState>>)>>,
    free: Vec<u16>,
}

/// The prefix index (see the module docs).
#[derive(Debug)]
pub struct PrefixIndex {
    hasher: LocalHasher,
    shards: Box<[RwLock<Shard>]>,
    pods: RwLock<PodTable>,
    max_per_pod: usize,
    block_size: AtomicU32,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new(IndexConfig::default())
    }
}

fn shard_of(key: BlockKey) -> usize {
    (key >> SHARD_SHIFT) as usize
}

impl PrefixIndex {
    pub fn new(config: IndexConfig) -> Self {
        Self {
            hasher: LocalHasher::new(&config.hash_seed),
            shards: (0..SHARDS).map(|_| RwLock::new(Shard::default())).collect(),
            pods: RwLock::new(PodTable::default()),
            max_per_pod: config.max_blocks_per_pod.max(8),
            block_size: AtomicU32::new(0),
        }
    }

    /// The hasher whose keys this index stores; hash requests with it.
    pub fn hasher(&self) -> &LocalHasher {
        &self.hasher
    }

    /// Block keys of a request, as this index stores them.
    pub fn request_keys(
        &self,
        model: &str,
        cache_salt: Option<&str>,
        tokens: &[u32],
        block_size: usize,
    ) -> Vec<BlockKey> {
        self.hasher
            .block_keys(model, cache_salt, tokens, block_size)
    }

    /// The block size of the last stored event (0 before any).
    pub fn block_size(&self) -> u32 {
        self.block_size.load(Ordering::Relaxed)
    }

    /// The id of pod `name`, adding it if new.
    pub fn pod(&self, name: &str) -> Result<PodId, IndexError> {
        if let Some(&id) = self.pods.read().by_name.get(name) {
            return Ok(id);
        }
        let mut t = self.pods.write();
        if let Some(&id) = t.by_name.get(name) {
            return Ok(id);
        }
        let id = match t.free.pop() {
            Some(i) => i,
            None => u16::try_from(t.slots.len()).map_err(|_| IndexError::TooManyPods)?,
        };
        let slot = Some((name.to_owned(), Arc::new(Mutex::new(PodState::default()))));
        match t.slots.get_mut(usize::from(id)) {
            Some(s) => *s = slot,
            None => t.slots.push(slot),
        }
        t.by_name.insert(name.to_owned(), PodId(id));
        Ok(PodId(id))
    }

    /// The name of a pod, if it is still indexed.
    pub fn pod_name(&self, pod: PodId) -> Option<String> {
        self.pods
            .read()
            .slots
            .get(usize::from(pod.0))?
            .as_ref()
            .map(|(n, _)| n.clone())
    }

    fn state(&self, pod: PodId) -> Option<Arc<Mutex<PodState>>> {
        self.pods
            .read()
            .slots
            .get(usize::from(pod.0))?
            .as_ref()
            .map(|(_, s)| s.clone())
    }

    /// Applies one batch of `pod`'s events. `model` is the served model (from
    /// the topic or the pod's config); an event's `lora_name` overrides it.
    pub fn apply(&self, pod: PodId, model: &str, batch: &EventBatch) -> ApplyStats {
        self.apply_inner(pod, model, batch, None)
    }

    /// [`Self::apply`], also pushing onto `touched` every block key whose
    /// holding by `pod` the batch may have changed (stored, removed or
    /// evicted; a key may appear more than once), each with the index of
    /// the `BlockStored` event that stored it ([`Touched::REMOVED`] for
    /// removals and evictions), so a caller can read the event's
    /// `lora_name`. An `AllBlocksCleared` pushes nothing: `cleared` in the
    /// stats says the pod starts over. A writer that mirrors one pod
    /// elsewhere reads each touched key's new state with
    /// [`Self::pod_mediums`].
    pub fn apply_touching(
        &self,
        pod: PodId,
        model: &str,
        batch: &EventBatch,
        touched: &mut Vec<Touched>,
    ) -> ApplyStats {
        self.apply_inner(pod, model, batch, Some(touched))
    }

    fn apply_inner(
        &self,
        pod: PodId,
        model: &str,
        batch: &EventBatch,
        mut touched: Option<&mut Vec<Touched>>,
    ) -> ApplyStats {
        let mut stats = ApplyStats::default();
        let Some(state) = self.state(pod) else {
            return stats;
        };
        let mut st = state.lock();
        let mut keys = Vec::new();
        for (i, ev) in batch.events.iter().enumerate() {
            match ev {
                KvEvent::BlockStored(s) => {
                    let evicted_before = stats.evicted;
                    self.stored(pod, model, s, &mut st, &mut keys, &mut stats);
                    if let Some(t) = touched.as_deref_mut() {
                        let event = u32::try_from(i).unwrap_or(Touched::REMOVED);
                        t.extend(keys.iter().map(|&key| Touched { key, event }));
                        if stats.evicted > evicted_before {
                            // Eviction drops whole epochs: every key the
                            // pod still maps may have lost a holder.
                            t.extend(st.engine.iter().map(|(_, key)| Touched::removed(key)));
                        }
                    }
                    keys.clear();
                }
                KvEvent::BlockRemoved(r) => {
                    if let Some(t) = touched.as_deref_mut() {
                        t.extend(
                            r.block_hashes
                                .iter()
                                .filter_map(|&h| st.engine.get(h))
                                .map(Touched::removed),
                        );
                    }
                    self.removed(pod, r, &mut st, &mut stats)
                }
                KvEvent::AllBlocksCleared => {
                    self.clear_locked(pod, &mut st);
                    stats.cleared += 1;
                }
            }
        }
        stats
    }

    /// The media `pod` holds block `key` in, one bit per
    /// [`crate::prefix::kvevents::Medium::code`] (0: not held).
    pub fn pod_mediums(&self, pod: PodId, key: BlockKey) -> u8 {
        let shard = self.shards[shard_of(key)].read();
        shard.pod_mediums(shard.raw(key), pod.0)
    }

    /// Every block key `pod` holds, with its media as in
    /// [`Self::pod_mediums`]: what a writer rewrites when the copy it keeps
    /// elsewhere was lost.
    pub fn pod_blocks(&self, pod: PodId) -> Vec<(BlockKey, u8)> {
        let Some(state) = self.state(pod) else {
            return Vec::new();
        };
        let mut keys: Vec<BlockKey> = state.lock().engine.iter().map(|(_, k)| k).collect();
        keys.sort_unstable();
        keys.dedup();
        keys.into_iter()
            .map(|k| (k, self.pod_mediums(pod, k)))
            .filter(|&(_, m)| m != 0)
            .collect()
    }

    fn stored(
        &self,
        pod: PodId,
        model: &str,
        s: &BlockStored,
        st: &mut PodState,
        keys: &mut Vec<BlockKey>,
        stats: &mut ApplyStats,
    ) {
        let bs = s.block_size as usize;
        if !s.is_main_group() || bs == 0 || s.token_ids.len() < bs || s.block_hashes.is_empty() {
            stats.skipped_events += 1;
            return;
        }
        self.block_size.store(s.block_size, Ordering::Relaxed);
        let parent = match s.parent_block_hash {
            None => self
                .hasher
                .root(s.lora_name.as_deref().unwrap_or(model), s.salt()),
            Some(p) => match st.engine.get(p) {
                Some(k) => k,
                None => {
                    stats.unknown_parent += 1;
                    return;
                }
            },
        };
        let n = s.block_hashes.len().min(s.token_ids.len() / bs);
        keys.clear();
        extend_keys(parent, &s.token_ids[..n * bs], bs, keys);
        for (&engine, &key) in s.block_hashes.iter().zip(keys.iter()) {
            st.engine.insert(engine, key);
            if self.shards[shard_of(key)]
                .write()
                .store(key, pod.0, s.medium, st.epoch)
            {
                st.entries += 1;
            }
            if st.epochs.is_empty() {
                st.epochs.push_back(Vec::new());
            }
            if let Some(cur) = st.epochs.back_mut() {
                cur.push(engine);
            }
            st.stored_in_epoch += 1;
            if st.stored_in_epoch >= self.max_per_pod / 8 {
                st.epoch = st.epoch.wrapping_add(1);
                st.stored_in_epoch = 0;
                st.epochs.push_back(Vec::new());
            }
            stats.stored += 1;
        }
        if st.entries > self.max_per_pod {
            stats.evicted += self.evict(pod, st);
        }
    }

    fn removed(&self, pod: PodId, r: &BlockRemoved, st: &mut PodState, stats: &mut ApplyStats) {
        if r.group_idx.unwrap_or(0) != 0 {
            return;
        }
        for engine in &r.block_hashes {
            let Some(key) = st.engine.get(*engine) else {
                stats.unknown_removed += 1;
                continue;
            };
            let out = self.shards[shard_of(key)]
                .write()
                .remove_one(key, pod.0, r.medium);
            st.entries = st.entries.saturating_sub(out.holders_gone);
            if !out.pod_still_holds {
                st.engine.remove(*engine);
            }
            stats.removed += 1;
        }
    }

    /// Drops the oldest epochs until the pod is at 7/8 of its cap.
    fn evict(&self, pod: PodId, st: &mut PodState) -> usize {
        let target = self.max_per_pod - self.max_per_pod / 8;
        let mut evicted = 0;
        while st.entries > target && st.epochs.len() > 1 {
            let oldest_epoch = st.epoch.wrapping_sub((st.epochs.len() - 1) as u32);
            let Some(hashes) = st.epochs.pop_front() else {
                break;
            };
            for engine in hashes {
                let Some(key) = st.engine.get(engine) else {
                    continue;
                };
                let out = self.shards[shard_of(key)]
                    .write()
                    .remove_pod_where(key, pod.0, |h| h.epoch == oldest_epoch);
                st.entries = st.entries.saturating_sub(out.holders_gone);
                evicted += out.holders_gone;
                if !out.pod_still_holds {
                    st.engine.remove(engine);
                }
            }
        }
        evicted
    }

    fn clear_locked(&self, pod: PodId, st: &mut PodState) {
        for (_, key) in st.engine.iter() {
            self.shards[shard_of(key)]
                .write()
                .remove_pod_where(key, pod.0, |_| true);
        }
        *st = PodState::default();
    }

    /// Forgets everything `pod` holds (engine restart, cache reset).
    pub fn clear_pod(&self, pod: PodId) {
        if let Some(state) = self.state(pod) {
            self.clear_locked(pod, &mut state.lock());
        }
    }

    /// Clears `pod` and releases its id (it may be reused for a new pod).
    pub fn remove_pod(&self, pod: PodId) {
        let Some(state) = self.state(pod) else { return };
        let mut st = state.lock();
        self.clear_locked(pod, &mut st);
        let mut t = self.pods.write();
        if let Some(slot) = t.slots.get_mut(usize::from(pod.0)) {
            if let Some((name, _)) = slot.take() {
                t.by_name.remove(&name);
                t.free.push(pod.0);
            }
        }
    }

    /// For each pod holding at least the first block, the length of the
    /// longest run of leading `keys` it holds; longest first, ties by pod id.
    pub fn match_prefix(&self, keys: &[BlockKey]) -> Vec<PrefixMatch> {
        let mut guards: Vec<Option<RwLockReadGuard<'_, Shard>>> =
            (0..SHARDS).map(|_| None).collect();
        let mut m = Matcher::default();
        // Keys are looked up in chunks (8, 16, … 64) before any is examined:
        // the lookups are independent, so the CPU overlaps their cache misses,
        // while a miss on the first key still costs only one small chunk.
        let mut raw: Vec<u64> = Vec::with_capacity(64);
        let (mut pos, mut chunk) = (0, 8);
        while pos < keys.len() {
            let end = (pos + chunk).min(keys.len());
            raw.clear();
            for &k in &keys[pos..end] {
                let s = shard_of(k);
                raw.push(
                    guards[s]
                        // Several shard guards are held at once: a plain
                        // `read()` would queue behind a waiting writer while
                        // holding another shard, and two such readers could
                        // deadlock with two writers. Recursive reads never
                        // wait for writers; a writer holds one shard at a time.
                        .get_or_insert_with(|| self.shards[s].read_recursive())
                        .raw(k),
                );
            }
            // Blocks held by several pods keep their holders in a list: a
            // second, dependent miss. Touching the lists of the whole chunk
            // first overlaps those misses as well.
            let mut touched = 0;
            for (&k, &v) in keys[pos..end].iter().zip(&raw) {
                if let Some(g) = &guards[shard_of(k)] {
                    touched ^= g.touch(v);
                }
            }
            std::hint::black_box(touched);
            for (&k, &v) in keys[pos..end].iter().zip(&raw) {
                if let Some(g) = &guards[shard_of(k)] {
                    m.step(g, v);
                }
                if m.done() {
                    break;
                }
            }
            if m.done() {
                break;
            }
            pos = end;
            chunk = (chunk * 2).min(64);
        }
        m.finish()
    }

    /// Sizes, for metrics and the memory benchmark.
    pub fn stats(&self) -> IndexStats {
        let mut s = IndexStats::default();
        for sh in self.shards.iter() {
            let g = sh.read();
            s.keys += g.len();
            s.memory_bytes += g.memory_bytes();
        }
        let states: Vec<Arc<Mutex<PodState>>> = self
            .pods
            .read()
            .slots
            .iter()
            .flatten()
            .map(|(_, st)| st.clone())
            .collect();
        s.pods = states.len();
        for st in states {
            let st = st.lock();
            s.entries += st.entries;
            s.memory_bytes += st.engine.memory_bytes()
                + st.epochs.iter().map(|e| e.capacity() * 8).sum::<usize>();
        }
        s
    }
}

#[cfg(test)]
mod tests;
