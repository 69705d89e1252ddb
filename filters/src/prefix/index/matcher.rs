//! One [`super::PrefixIndex::match_prefix`] walk: per pod, how many leading
//! blocks in a row it holds.
//!
//! The pods that hold the first block are the only candidates; each later
//! block keeps the candidates that hold it too and drops the others for good.
//! This is the hot loop of every routed request, so a block costs one pass
//! over its holders (setting bits, through a table from pod id to candidate
//! number) and a few word operations: candidates are bits in `alive` and
//! `on_gpu` masks, and a candidate's count is written once, when it drops.

use super::shard::Shard;
use super::{PodId, PrefixMatch};

/// "Not a candidate" in [`Matcher::slot_of`].
const NONE: u32 = u32::MAX;

#[derive(Debug, Default)]
pub(super) struct Matcher {
    /// Blocks examined so far.
    step: usize,
    /// One per candidate; `blocks` and `gpu_blocks` are final once the
    /// candidate's bit left `alive` (resp. `on_gpu`).
    matches: Vec<PrefixMatch>,
    /// Candidate number by pod id (`NONE` for other pods).
    slot_of: Vec<u32>,
    /// Bit sets over candidates, 64 per word: still holding every block;
    /// holding every block on the GPU; scratch for the current block.
    alive: Vec<u64>,
    on_gpu: Vec<u64>,
    held: Vec<u64>,
    held_gpu: Vec<u64>,
    alive_count: usize,
}

impl Matcher {
    /// Whether no candidate is left (the walk can stop).
    pub(super) fn done(&self) -> bool {
        self.step > 0 && self.alive_count == 0
    }

    /// Advances by one block whose packed holders are `v` (from `shard`).
    pub(super) fn step(&mut self, shard: &Shard, v: u64) {
        if self.step == 0 {
            self.start(shard, v);
        }
        if let ([alive], [on_gpu]) = (&mut self.alive[..], &mut self.on_gpu[..]) {
            // Up to 64 candidates (the common case): masks in registers.
            let (mut held, mut held_gpu) = (0u64, 0u64);
            let slot_of = &self.slot_of;
            shard.for_each_pod(v, |pod, gpu| {
                if let Some(&slot) = slot_of.get(usize::from(pod)) {
                    if slot < 64 {
                        held |= 1 << slot;
                        held_gpu |= u64::from(gpu) << slot;
                    }
                }
            });
            let (alive_was, on_gpu_was) = (*alive, *on_gpu);
            *alive &= held;
            *on_gpu &= held_gpu & held;
            self.settle(0, alive_was, on_gpu_was);
            self.step += 1;
            return;
        }
        self.held.fill(0);
        self.held_gpu.fill(0);
        let (slot_of, held, held_gpu) = (&self.slot_of, &mut self.held, &mut self.held_gpu);
        shard.for_each_pod(v, |pod, gpu| {
            let slot = slot_of.get(usize::from(pod)).copied().unwrap_or(NONE) as usize;
            if let (Some(h), Some(g)) = (held.get_mut(slot / 64), held_gpu.get_mut(slot / 64)) {
                *h |= 1 << (slot % 64);
                *g |= u64::from(gpu) << (slot % 64);
            }
        });
        for w in 0..self.alive.len() {
            let (Some(alive), Some(on_gpu), Some(&held), Some(&held_gpu)) = (
                self.alive.get_mut(w),
                self.on_gpu.get_mut(w),
                self.held.get(w),
                self.held_gpu.get(w),
            ) else {
                break;
            };
            let (alive_was, on_gpu_was) = (*alive, *on_gpu);
            *alive &= held;
            // On the GPU means held on the GPU by a candidate still alive.
            *on_gpu &= held_gpu & held;
            self.settle(w, alive_was, on_gpu_was);
        }
        self.step += 1;
    }

    /// Writes the counts of the candidates of word `w` that just dropped out
    /// of `alive` or `on_gpu` (rare: at most twice per candidate).
    fn settle(&mut self, w: usize, alive_was: u64, on_gpu_was: u64) {
        let (Some(&alive), Some(&on_gpu)) = (self.alive.get(w), self.on_gpu.get(w)) else {
            return;
        };
        if alive == alive_was && on_gpu == on_gpu_was {
            return;
        }
        for bit in Bits(on_gpu_was & !on_gpu) {
            if let Some(m) = self.matches.get_mut(w * 64 + bit) {
                m.gpu_blocks = self.step;
            }
        }
        let dropped = alive_was & !alive;
        for bit in Bits(dropped) {
            if let Some(m) = self.matches.get_mut(w * 64 + bit) {
                m.blocks = self.step;
            }
        }
        self.alive_count -= dropped.count_ones() as usize;
    }

    /// The first block: its holders become the candidates.
    fn start(&mut self, shard: &Shard, v: u64) {
        let (slot_of, matches) = (&mut self.slot_of, &mut self.matches);
        shard.for_each_pod(v, |pod, _| {
            let pod_ix = usize::from(pod);
            if slot_of.len() <= pod_ix {
                slot_of.resize(pod_ix + 1, NONE);
            }
            if slot_of[pod_ix] == NONE {
                slot_of[pod_ix] = matches.len() as u32;
                matches.push(PrefixMatch {
                    pod: PodId(pod),
                    blocks: 0,
                    gpu_blocks: 0,
                });
            }
        });
        let n = self.matches.len();
        let words = n.div_ceil(64);
        self.alive = (0..words)
            .map(|w| match n - w * 64 {
                r if r >= 64 => u64::MAX,
                r => (1 << r) - 1,
            })
            .collect();
        self.on_gpu = self.alive.clone();
        self.held = vec![0; words];
        self.held_gpu = vec![0; words];
        self.alive_count = n;
    }

    /// The matches, longest first, ties by pod id.
    pub(super) fn finish(mut self) -> Vec<PrefixMatch> {
        // Candidates still alive held every block examined.
        for (w, (&alive, &on_gpu)) in self.alive.iter().zip(&self.on_gpu).enumerate() {
            for bit in Bits(alive) {
                if let Some(m) = self.matches.get_mut(w * 64 + bit) {
                    m.blocks = self.step;
                }
            }
            for bit in Bits(on_gpu) {
                if let Some(m) = self.matches.get_mut(w * 64 + bit) {
                    m.gpu_blocks = self.step;
                }
            }
        }
        let mut out = self.matches;
        out.sort_by(|a, b| b.blocks.cmp(&a.blocks).then(a.pod.cmp(&b.pod)));
        out
    }
}

/// The positions of the set bits of a word, lowest first.
struct Bits(u64);

impl Iterator for Bits {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        if self.0 == 0 {
            return None;
        }
        let bit = self.0.trailing_zeros() as usize;
        self.0 &= self.0 - 1;
        Some(bit)
    }
}
