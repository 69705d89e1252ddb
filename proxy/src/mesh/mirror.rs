//! The local pod's KV block set as the mesh needs it for snapshots.
//!
//! The prefix index stores block keys, not the tokens they were hashed from,
//! and cannot hand a pod's blocks back out; a peer joining late needs them in
//! a form its own index can ingest. So the mesh keeps this mirror of the local
//! engine's stored blocks, fed by the same applied batches it forwards: per
//! engine block hash, its parent hash and tokens (one block each), medium,
//! LoRA name, salt and key model. A snapshot is the mirror replayed as
//! synthesized `BlockStored` events, parents before children.
//!
//! Bounded: at most `max_blocks`; past it new blocks are not mirrored (peers
//! still get them live; only a later snapshot misses them) and counted.

use std::collections::HashMap;
use std::sync::Arc;

use kvmesh_filters::prefix::kvevents::{BlockStored, EventBatch, KvEvent, Medium};

/// Events per synthesized snapshot batch (one frame each).
const SNAPSHOT_BATCH: usize = 256;

struct Block {
    parent: Option<u64>,
    tokens: Box<[u32]>,
    block_size: u32,
    medium: Medium,
    lora: Option<Arc<str>>,
    salt: Option<Arc<str>>,
    model: Arc<str>,
    /// Physical copies stored (each `BlockRemoved` drops one).
    copies: u32,
}

/// See the module docs.
pub struct Mirror {
    blocks: HashMap<u64, Block>,
    max_blocks: usize,
    /// Blocks not mirrored because the mirror was full.
    pub skipped: u64,
}

impl Mirror {
    pub fn new(max_blocks: usize) -> Self {
        Self {
            blocks: HashMap::new(),
            max_blocks,
            skipped: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    pub fn clear(&mut self) {
        self.blocks.clear();
    }

    /// Applies one local batch keyed by `model`.
    pub fn apply(&mut self, model: &Arc<str>, batch: &EventBatch) {
        for ev in &batch.events {
            match ev {
                KvEvent::BlockStored(s) => self.stored(model, s),
                KvEvent::BlockRemoved(r) => {
                    if r.group_idx.unwrap_or(0) != 0 {
                        continue;
                    }
                    for h in &r.block_hashes {
                        if let Some(b) = self.blocks.get_mut(h) {
                            b.copies = b.copies.saturating_sub(1);
                            if b.copies == 0 {
                                self.blocks.remove(h);
                            }
                        }
                    }
                }
                KvEvent::AllBlocksCleared => self.blocks.clear(),
            }
        }
    }

    fn stored(&mut self, model: &Arc<str>, s: &BlockStored) {
        let bs = s.block_size as usize;
        if !s.is_main_group() || bs == 0 {
            return;
        }
        let lora: Option<Arc<str>> = s.lora_name.as_deref().map(Arc::from);
        let salt: Option<Arc<str>> = s.salt().map(Arc::from);
        let mut parent = s.parent_block_hash;
        for (i, (&h, tokens)) in s
            .block_hashes
            .iter()
            .zip(s.token_ids.chunks_exact(bs))
            .enumerate()
        {
            if let Some(b) = self.blocks.get_mut(&h) {
                b.copies = b.copies.saturating_add(1);
            } else if self.blocks.len() >= self.max_blocks {
                self.skipped += 1;
            } else {
                self.blocks.insert(
                    h,
                    Block {
                        parent,
                        tokens: tokens.into(),
                        block_size: s.block_size,
                        medium: s.medium,
                        lora: lora.clone(),
                        // The salt seeds only a chain's root block.
                        salt: if i == 0 { salt.clone() } else { None },
                        model: model.clone(),
                        copies: 1,
                    },
                );
            }
            parent = Some(h);
        }
    }

    /// The mirror as batches of synthesized `BlockStored` events (one block
    /// each), every parent before its children, grouped by key model.
    pub fn snapshot(&self) -> Vec<(Arc<str>, EventBatch)> {
        let mut out: Vec<(Arc<str>, EventBatch)> = Vec::new();
        let mut emitted: std::collections::HashSet<u64> =
            std::collections::HashSet::with_capacity(self.blocks.len());
        let mut chain = Vec::new();
        for &start in self.blocks.keys() {
            // Walk up to the first ancestor already emitted (or absent), then
            // emit the chain top-down.
            chain.clear();
            let mut cur = Some(start);
            while let Some(h) = cur {
                if emitted.contains(&h) {
                    break;
                }
                let Some(b) = self.blocks.get(&h) else { break };
                chain.push(h);
                cur = b.parent;
                if chain.len() > self.blocks.len() {
                    break; // a cycle cannot happen with real hashes; stay bounded anyway
                }
            }
            for &h in chain.iter().rev() {
                if !emitted.insert(h) {
                    continue;
                }
                let Some(b) = self.blocks.get(&h) else {
                    continue;
                };
                let ev = KvEvent::BlockStored(BlockStored {
                    block_hashes: vec![h],
                    parent_block_hash: b.parent,
                    token_ids: b.tokens.to_vec(),
                    block_size: b.block_size,
                    medium: b.medium,
                    lora_name: b.lora.as_deref().map(str::to_owned),
                    cache_salt: b.salt.as_deref().map(str::to_owned),
                    ..BlockStored::default()
                });
                match out.last_mut() {
                    Some((m, batch)) if *m == b.model && batch.events.len() < SNAPSHOT_BATCH => {
                        batch.events.push(ev);
                    }
                    _ => out.push((
                        b.model.clone(),
                        EventBatch {
                            ts: 0.0,
                            events: vec![ev],
                            dp_rank: None,
                            unknown_events: 0,
                        },
                    )),
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use kvmesh_filters::prefix::index::{IndexConfig, PrefixIndex};
    use kvmesh_filters::prefix::kvevents::BlockRemoved;

    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, first_token: u32) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: (first_token..first_token + 4 * hashes.len() as u32).collect(),
            block_size: 4,
            ..BlockStored::default()
        })
    }

    fn batch(events: Vec<KvEvent>) -> EventBatch {
        EventBatch {
            ts: 0.0,
            events,
            dp_rank: None,
            unknown_events: 0,
        }
    }

    #[test]
    fn a_snapshot_rebuilds_the_same_index_matches() {
        let model: Arc<str> = Arc::from("m");
        let live = batch(vec![
            stored(&[1, 2, 3], None, 0),
            stored(&[4], Some(3), 12),
            stored(&[5], Some(2), 100),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![5],
                ..BlockRemoved::default()
            }),
        ]);
        let direct = PrefixIndex::new(IndexConfig::default());
        let a = direct.pod("a").unwrap();
        direct.apply(a, &model, &live);
        let mut mirror = Mirror::new(100);
        mirror.apply(&model, &live);
        assert_eq!(mirror.len(), 4);
        let via = PrefixIndex::new(IndexConfig::default());
        let b = via.pod("a").unwrap();
        for (m, batch) in mirror.snapshot() {
            let s = via.apply(b, &m, &batch);
            assert_eq!(s.unknown_parent, 0);
        }
        let keys = direct.request_keys("m", None, &(0..16).collect::<Vec<_>>(), 4);
        assert_eq!(direct.match_prefix(&keys)[0].blocks, 4);
        assert_eq!(via.match_prefix(&keys)[0].blocks, 4);
    }

    #[test]
    fn bounded_and_cleared() {
        let model: Arc<str> = Arc::from("m");
        let mut mirror = Mirror::new(2);
        mirror.apply(&model, &batch(vec![stored(&[1, 2, 3], None, 0)]));
        assert_eq!((mirror.len(), mirror.skipped), (2, 1));
        mirror.apply(&model, &batch(vec![KvEvent::AllBlocksCleared]));
        assert_eq!(mirror.len(), 0);
    }
}
