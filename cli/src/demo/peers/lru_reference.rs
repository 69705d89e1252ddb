//! A reference for the computed-to-ideal ratio: the prompt tokens a good
//! online placement makes engines that evict least recently used blocks
//! compute, replayed one request at a time, so that no load, no race between
//! sidecars and no stale index adds anything.
//!
//! The ideal placement of the shared-prefix workloads computes each group's
//! system prompt once, as if the engines' caches never evicted. Their
//! working set is larger than the fleet's KV, so something is evicted
//! whatever the router does, and what comes back is computed again. An
//! engine evicts by recency (vLLM's free-block queue); no router chooses
//! what it drops. This module replays a workload through per-pod LRU caches
//! with this placement:
//!
//! * a request goes to the pod holding the longest cached prefix of it;
//! * where none holds any, to its group's first pod (the pod its first
//!   block went to the first time it was seen), and a group seen for the
//!   first time to the pod that is first pod to the fewest groups.
//!
//! It is a reference, not a bound: it knows nothing a sidecar does not, and
//! a router that keeps groups apart better can compute less. A clairvoyant
//! eviction (Belady's) on the same placement would compute the ideal's
//! tokens on the quick run's workloads: the gap between the ideal and this
//! reference is the engines' eviction order.
//!
//! The same replay takes a run's own placement too (which engine each
//! request reached, [`placed_lru_tokens`]): what the run computed above
//! that is what its load added, and what that lies above this reference is
//! its placement's.
//!
//! A pod's cache holds `num_blocks` blocks of `block_size` words (the
//! simulated engines count a word as a token). A request's blocks, prompt
//! and answer, are freed when it ends, the last first (vLLM frees them in
//! reverse, so that a prompt's tail goes before its head); a hit moves the
//! blocks it used to the most recent end. A prompt's cached prefix is
//! computed from its first uncached block on.

use std::collections::{BTreeMap, HashMap};

use kvmesh_loadgen::workload::Prompt;
use kvmesh_loadgen::Workload;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Prompt tokens (words) the placement above makes `engines` pods of
/// `num_blocks` blocks compute for `workload`, one request at a time.
/// Requests without a text prompt are skipped.
pub fn online_lru_tokens(
    workload: &Workload,
    engines: usize,
    num_blocks: usize,
    block_size: usize,
) -> u64 {
    let engines = engines.max(1);
    let mut first_pod: HashMap<u64, usize> = HashMap::new();
    let mut firsts = vec![0usize; engines];
    replay(
        workload,
        engines,
        num_blocks,
        block_size,
        |_, prompt, held| {
            let best = held.iter().copied().max().unwrap_or(0);
            Some(match prompt.first() {
                _ if best > 0 => held.iter().position(|&h| h == best).unwrap_or(0),
                Some(&head) => *first_pod.entry(head).or_insert_with(|| {
                    let p = (0..firsts.len()).min_by_key(|&p| firsts[p]).unwrap_or(0);
                    firsts[p] += 1;
                    p
                }),
                None => 0,
            })
        },
    )
}

/// Prompt tokens (words) the same LRU caches compute, one request at a
/// time, when request `n` goes to pod `placed[n]`: a run's own placement
/// with the load, the races and the stale index taken away, so that what a
/// run computes above it is what its load added (running requests holding
/// KV, preemptions, prefills of one prefix that overlap), and what it lies
/// above [`online_lru_tokens`] is its placement's. Requests placed nowhere
/// (`None`, or past `placed`'s end) are skipped.
pub fn placed_lru_tokens(
    workload: &Workload,
    placed: &[Option<usize>],
    engines: usize,
    num_blocks: usize,
    block_size: usize,
) -> u64 {
    let engines = engines.max(1);
    replay(workload, engines, num_blocks, block_size, |n, _, _| {
        placed.get(n).copied().flatten().filter(|&p| p < engines)
    })
}

/// Replays `workload` one request at a time through `engines` LRU caches,
/// each request on the pod `place(n, its block keys, each pod's cached
/// prefix length)` names (none: skipped); the prompt tokens computed.
fn replay(
    workload: &Workload,
    engines: usize,
    num_blocks: usize,
    block_size: usize,
    mut place: impl FnMut(usize, &[u64], &[usize]) -> Option<usize>,
) -> u64 {
    let block_size = block_size.max(1);
    let mut pods: Vec<LruBlocks> = (0..engines).map(|_| LruBlocks::new(num_blocks)).collect();
    let mut computed = 0u64;
    for (n, r) in workload.requests.iter().enumerate() {
        let Prompt::Text(text) = &r.prompt else {
            continue;
        };
        let words: Vec<&str> = text.split_whitespace().collect();
        let prompt = chain(&words, block_size);
        let held: Vec<usize> = pods.iter().map(|p| p.prefix_len(&prompt)).collect();
        let Some(pod) = place(n, &prompt, &held) else {
            continue;
        };
        let cached = held[pod].min(prompt.len());
        computed += words.len().saturating_sub(cached * block_size) as u64;
        // The answer's full blocks, unique to this request.
        let total = words.len() + r.max_tokens as usize;
        let answer = (prompt.len()..total / block_size)
            .map(|i| xxh3_64_with_seed(&(i as u64).to_le_bytes(), !(n as u64)));
        let blocks: Vec<u64> = prompt.iter().copied().chain(answer).collect();
        pods[pod].free_in_reverse(&blocks);
    }
    computed
}

/// The chained keys of `words`' full blocks: each hashes its words and the
/// key before it, so a key names the whole prefix up to its block.
fn chain(words: &[&str], block_size: usize) -> Vec<u64> {
    let mut parent = 0u64;
    words
        .chunks_exact(block_size)
        .map(|chunk| {
            let text = chunk.join(" ");
            parent = xxh3_64_with_seed(text.as_bytes(), parent);
            parent
        })
        .collect()
}

/// One pod's cached blocks in recency order.
struct LruBlocks {
    capacity: usize,
    clock: u64,
    stamp: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
}

impl LruBlocks {
    fn new(capacity: usize) -> Self {
        LruBlocks {
            capacity,
            clock: 0,
            stamp: HashMap::new(),
            order: BTreeMap::new(),
        }
    }

    /// Leading blocks of `keys` this pod holds.
    fn prefix_len(&self, keys: &[u64]) -> usize {
        keys.iter()
            .take_while(|k| self.stamp.contains_key(k))
            .count()
    }

    /// A finished request's blocks, freed last first: its first block ends
    /// the most recent, its last is evicted before it. Then the least
    /// recently used blocks go until the pod holds its capacity.
    fn free_in_reverse(&mut self, keys: &[u64]) {
        for &k in keys.iter().rev() {
            self.clock += 1;
            if let Some(old) = self.stamp.insert(k, self.clock) {
                self.order.remove(&old);
            }
            self.order.insert(self.clock, k);
        }
        while self.stamp.len() > self.capacity {
            let Some((_, k)) = self.order.pop_first() else {
                break;
            };
            self.stamp.remove(&k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_loadgen::workload::{Api, PressureParams, RequestSpec};

    fn text(prefix: &str, blocks: usize, question: &str) -> RequestSpec {
        let mut words: Vec<String> = (0..blocks * 4).map(|i| format!("{prefix}{i}")).collect();
        words.push(question.to_owned());
        RequestSpec {
            user: 0,
            api: Api::Completions,
            prompt: Prompt::Text(words.join(" ").into()),
            max_tokens: 0,
            stream: true,
        }
    }

    fn workload(requests: Vec<RequestSpec>) -> Workload {
        Workload {
            name: "t".into(),
            requests,
            ordered_per_user: false,
        }
    }

    /// Two groups that fit one pod each: each prompt is computed once, the
    /// questions always.
    #[test]
    fn groups_that_fit_are_computed_once() {
        let w = workload(vec![
            text("a", 2, "q1"),
            text("b", 2, "q2"),
            text("a", 2, "q3"),
            text("b", 2, "q4"),
        ]);
        // Blocks of 4 words: each prompt is 2 blocks and a 1-word question.
        assert_eq!(online_lru_tokens(&w, 2, 8, 4), 2 * 8 + 4);
        // On one pod of 4 blocks both groups still fit (2 blocks each).
        assert_eq!(online_lru_tokens(&w, 1, 4, 4), 2 * 8 + 4);
    }

    /// A cycle of three groups through one pod that holds two thrashes: LRU
    /// evicts each group just before it comes back.
    #[test]
    fn a_cycle_longer_than_the_cache_is_computed_every_time() {
        let w = workload(
            (0..6)
                .map(|i| text(["a", "b", "c"][i % 3], 2, "q"))
                .collect(),
        );
        assert_eq!(online_lru_tokens(&w, 1, 4, 4), 6 * 9);
        // Three pods hold one group each.
        assert_eq!(online_lru_tokens(&w, 3, 4, 4), 3 * 8 + 6);
    }

    /// Evicted tail first: a pod short of one block keeps the head of the
    /// prompt it freed, and the next request for it computes only the rest.
    #[test]
    fn a_prompt_loses_its_tail_first() {
        let w = workload(vec![
            text("a", 3, "q"),
            text("b", 1, "q"),
            text("a", 3, "q"),
        ]);
        // a: 3 blocks + 1 word; b takes 1 block: the pod of 3 evicts a's
        // third block, the second `a` computes 4 words and the question.
        assert_eq!(online_lru_tokens(&w, 1, 3, 4), 13 + 5 + 5);
    }

    /// A given placement replays as placed: the online placement's own
    /// choices give its tokens, and splitting each group over two pods
    /// computes every prompt on both.
    #[test]
    fn a_given_placement_is_replayed_as_placed() {
        let w = workload(vec![
            text("a", 2, "q1"),
            text("b", 2, "q2"),
            text("a", 2, "q3"),
            text("b", 2, "q4"),
        ]);
        let online = online_lru_tokens(&w, 2, 8, 4);
        assert_eq!(
            placed_lru_tokens(&w, &[Some(0), Some(1), Some(0), Some(1)], 2, 8, 4),
            online
        );
        let split = placed_lru_tokens(&w, &[Some(0), Some(0), Some(1), Some(1)], 2, 8, 4);
        assert_eq!(split, 4 * 9);
        // A request placed nowhere (or on no such pod) is left out.
        assert_eq!(placed_lru_tokens(&w, &[Some(0), None, Some(7)], 2, 8, 4), 9);
    }

    /// On a pressured shared-prefix workload the reference lies above the
    /// ideal (nothing evicted), and equals it when every group fits.
    #[test]
    fn the_pressure_workload_sits_above_its_ideal() {
        let p = PressureParams::small(200);
        let w = p.build(1);
        let ideal = p.ideal_computed_tokens(&w);
        // The fleet holds far less than the groups' prompts.
        let pressed = online_lru_tokens(&w, 4, 40, 16);
        assert!(pressed > ideal, "{pressed} vs {ideal}");
        // With room for every group, only each group's first request computes its prompt.
        let roomy = online_lru_tokens(&w, 4, 100_000, 16);
        let whole_blocks = (p.system_tokens / 16 * 16) as u64;
        assert!(roomy <= ideal + (p.requests as u64) * (p.system_tokens as u64 - whole_blocks));
        assert!(roomy < pressed);
    }
}
