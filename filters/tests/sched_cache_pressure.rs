//! Prefix groups that need more KV than the fleet has, arriving in a cycle
//! (group 0, 1, …, G−1, 0, 1, …), on a toy fleet whose pods evict least
//! recently used blocks the way vLLM's free-block queue does. Every group
//! comes back just after its pod evicted it, unless a pod keeps a set of
//! groups it can hold and takes nothing else: `eviction-cost-scorer`
//! (deploy/examples/filters-cache-pressure.yaml) makes one; round-robin and
//! a home per group do not.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvmesh_filters::sched::{
    EndpointView, FilterConfig, LoadSnapshot, PrefixMatch, RequestView, Scheduler,
};

const BLOCK: u32 = 32;
/// KV blocks per pod (vLLM keeps one of them as its null block).
const POD_BLOCKS: u32 = 40;
/// Blocks every request of a group shares; its last block is its own.
const SHARED: u64 = 11;
/// Groups: 11 × 11 shared blocks = 121, 1.55x the fleet's 78 usable blocks.
const GROUPS: u64 = 11;
const CYCLES: u64 = 4;

/// One pod's prefix cache: block keys, least recently used first.
#[derive(Default)]
struct Lru(Vec<u64>);

impl Lru {
    /// Leading blocks of `keys` held.
    fn matched(&self, keys: &[u64]) -> u32 {
        keys.iter().take_while(|k| self.0.contains(k)).count() as u32
    }

    /// Runs a request: its blocks become the most recent, the last block
    /// first (vLLM frees a request's blocks tail first, so they are evicted
    /// before its prefix), and the least recent go past capacity.
    fn run(&mut self, keys: &[u64]) {
        self.0.retain(|k| !keys.contains(k));
        self.0.extend(keys.iter().rev());
        let usable = (POD_BLOCKS - 1) as usize;
        if self.0.len() > usable {
            self.0.drain(..self.0.len() - usable);
        }
    }
}

fn scheduler(yaml: &str) -> Scheduler {
    Scheduler::new(&FilterConfig::from_yaml(yaml, "filters.yaml").unwrap()).unwrap()
}

fn example(name: &str) -> String {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    std::fs::read_to_string(dir.join(name)).unwrap()
}

/// Request `n`'s block keys: its group's shared blocks, then one of its own.
fn keys(n: u64, groups: u64) -> Vec<u64> {
    let group = n % groups;
    let mut k: Vec<u64> = (0..SHARED).map(|b| ((group + 1) << 32) | b).collect();
    k.push(u64::MAX - n);
    k
}

/// Sends `cycles` cycles of `groups` groups through `sched` (round-robin
/// without one) to two pods named `ids`: where each request went, and the
/// hit tokens over the prompt tokens after the first cycle.
fn play(sched: Option<&Scheduler>, ids: [&str; 2], groups: u64, cycles: u64) -> (Vec<usize>, f64) {
    let mut pods = [Lru::default(), Lru::default()];
    let (mut routes, mut hits, mut queries) = (Vec::new(), 0u64, 0u64);
    for n in 0..groups * cycles {
        let k = keys(n, groups);
        let req = RequestView {
            prompt_tokens: k.len() as u32 * BLOCK,
            prompt_blocks: k.len() as u32,
            block_keys: k.clone(),
            ..RequestView::new(format!("r{n}"), "m")
        };
        let eps: Vec<EndpointView> = ids
            .iter()
            .zip(&pods)
            .map(|(id, lru)| EndpointView {
                models: vec!["m".into()],
                load: LoadSnapshot {
                    block_size: BLOCK,
                    num_blocks: POD_BLOCKS,
                    ..LoadSnapshot::default()
                },
                prefix: PrefixMatch {
                    matched_blocks: lru.matched(&k),
                    block_size: BLOCK,
                },
                ..EndpointView::new(*id)
            })
            .collect();
        let to = match sched {
            Some(s) => s.schedule(&req, &eps, n, n).unwrap().route.primary().index,
            None => (n % 2) as usize,
        };
        if n >= groups {
            hits += u64::from(eps[to].prefix.matched_blocks * BLOCK);
            queries += u64::from(req.prompt_tokens);
        }
        pods[to].run(&k);
        routes.push(to);
    }
    (routes, hits as f64 / queries as f64)
}

/// Pod names as a fleet's sidecars would have them: loopback ports.
fn pairs() -> Vec<[String; 2]> {
    (0..12)
        .map(|i| {
            [
                format!("127.0.0.1:{}", 41000 + 7 * i),
                format!("127.0.0.1:{}", 52000 + 13 * i),
            ]
        })
        .collect()
}

#[test]
fn round_robin_hits_nothing() {
    for [a, b] in pairs() {
        assert_eq!(play(None, [&a, &b], GROUPS, CYCLES).1, 0.0);
    }
}

#[test]
fn one_pod_keeps_what_it_holds_and_the_other_takes_the_overflow() {
    let (mut rates, mut default_rates) = (Vec::new(), Vec::new());
    for [a, b] in pairs() {
        let pressure = scheduler(&example("filters-cache-pressure.yaml"));
        let (_, rate) = play(Some(&pressure), [&a, &b], GROUPS, CYCLES);
        rates.push(rate);
        // Ideal: 3 of 11 groups resident (3 × 12 blocks of 39), hitting 11
        // of their 12 blocks: 0.25.
        assert!(rate >= 0.2, "{a} {b}: hit rate {rate:.3}");
        let default = scheduler(&example("filters-default.yaml"));
        default_rates.push(play(Some(&default), [&a, &b], GROUPS, CYCLES).1);
    }
    eprintln!("hit rates, cycles 2-{CYCLES}: with eviction-cost-scorer {rates:.3?}, the default {default_rates:.3?}");
    // A home per group hits only when hashing happens to give a pod no more
    // groups than it holds.
    let thrashed = default_rates.iter().filter(|&&r| r < 0.05).count();
    assert!(
        thrashed >= 3,
        "the default's hit rates: {default_rates:.3?}"
    );
}

#[test]
fn groups_that_fit_are_routed_as_by_the_default() {
    // 2 groups fit on one pod: no request is cold after the first cycle,
    // and every decision is the default's, also once the pods count as full
    // (each request's own block fills them).
    for [a, b] in pairs() {
        let pressure = scheduler(&example("filters-cache-pressure.yaml"));
        let default = scheduler(&example("filters-default.yaml"));
        let (with, rate) = play(Some(&pressure), [&a, &b], 2, 30);
        assert_eq!(with, play(Some(&default), [&a, &b], 2, 30).0);
        assert!(rate > 0.9, "{rate}");
    }
}
