//! The data-parallel ranks of the local engine (`engine.data_parallel_size`
//! above 1: vLLM's `--data-parallel-size`, N engine ranks behind one HTTP
//! port, each with its own KV cache and queue).
//!
//! Routing is two-level. The fleet, the scheduler and the mesh see the pod as
//! one endpoint: its load is the sum over ranks, its prefix entries the union
//! of the ranks' blocks (every rank's KV events are applied to the pod), so
//! peers send a request to the pod that holds its prefix on some rank. The
//! pod's own sidecar, which alone sees each rank's state fresh, then picks
//! the rank of every request it runs on its engine ([`pick`]) and names it
//! in `X-data-parallel-rank` (`crate::headers::RANK`; vLLM 0.32 honours it). Each rank's
//! blocks are also indexed under the name `<pod>#dp<rank>` (never a fleet
//! pod, so the scheduler never sees it), and its load is read from the
//! `engine="<rank>"` series of the engine's metrics.
//!
//! The choice, [`pick`], is pure: the rank holding the longest prefix of the
//! request; among equals, the least loaded by vLLM's own DP balancing score
//! (`waiting * 4 + running`, plus the requests this sidecar sent there since
//! the last scrape, so a burst between two scrapes spreads); then the lowest
//! rank. The schedule stage makes it (`crate::routing::rank`), the
//! accounting stage counts it ([`Ranks::picked`]).

use parking_lot::Mutex;
use serde::Serialize;

use super::EngineLoad;

/// One rank as the sidecar sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct RankLoad {
    pub rank: u32,
    /// Its last scraped load (zero before the first scrape).
    pub load: EngineLoad,
    /// Requests this sidecar sent to it since that scrape.
    pub picked: u32,
}

/// What a rank offers one request: for [`pick`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankView {
    pub rank: u32,
    /// Leading blocks of the request it holds.
    pub matched_blocks: u32,
    /// vLLM's balancing score: `waiting * 4 + running`, plus picks since the scrape.
    pub score: u64,
}

/// The local engine's ranks (empty: no data parallelism).
#[derive(Debug, Default)]
pub struct Ranks(Mutex<Vec<RankLoad>>);

impl Ranks {
    /// Sizes the table to `n` ranks (1: none kept); a no-op at that size.
    pub fn set_size(&self, n: u32) {
        let mut r = self.0.lock();
        let want = if n > 1 { n as usize } else { 0 };
        if r.len() == want {
            return;
        }
        r.clear();
        if n > 1 {
            r.extend((0..n).map(|rank| RankLoad {
                rank,
                ..RankLoad::default()
            }));
        }
    }

    /// Records a scrape: each rank's load (ranks outside the table are
    /// ignored); the picks since the last scrape are now in the loads.
    pub fn set_loads(&self, loads: &[(u32, EngineLoad)]) {
        let mut r = self.0.lock();
        for &(rank, load) in loads {
            if let Some(slot) = r.get_mut(rank as usize) {
                slot.load = load;
                slot.picked = 0;
            }
        }
    }

    /// Every rank now, for `/debug/route`.
    pub fn snapshot(&self) -> Vec<RankLoad> {
        self.0.lock().clone()
    }

    /// How many ranks are kept (0: no data parallelism).
    pub fn size(&self) -> u32 {
        u32::try_from(self.0.lock().len()).unwrap_or(u32::MAX)
    }

    /// What each rank offers a request, given the blocks of it each holds
    /// (`matched(rank)`): for [`pick`].
    pub fn views(&self, matched: impl Fn(u32) -> u32) -> Vec<RankView> {
        views(&self.0.lock(), &matched)
    }

    /// A request was sent to `rank`: it weighs on the rank's score until
    /// the next scrape sees it in the engine's own counts.
    pub fn picked(&self, rank: u32) {
        if let Some(slot) = self.0.lock().get_mut(rank as usize) {
            slot.picked = slot.picked.saturating_add(1);
        }
    }
}

fn views(ranks: &[RankLoad], matched: &impl Fn(u32) -> u32) -> Vec<RankView> {
    ranks
        .iter()
        .map(|s| RankView {
            rank: s.rank,
            matched_blocks: matched(s.rank),
            score: score(s),
        })
        .collect()
}

fn score(s: &RankLoad) -> u64 {
    u64::from(s.load.waiting) * 4 + u64::from(s.load.running) + u64::from(s.picked)
}

/// The rank for one request (see the module docs); `None` for no ranks.
pub fn pick(ranks: &[RankView]) -> Option<u32> {
    ranks
        .iter()
        .min_by_key(|r| (std::cmp::Reverse(r.matched_blocks), r.score, r.rank))
        .map(|r| r.rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(rank: u32, matched_blocks: u32, score: u64) -> RankView {
        RankView {
            rank,
            matched_blocks,
            score,
        }
    }

    #[test]
    fn the_longest_prefix_wins_then_the_least_loaded_then_the_lowest() {
        assert_eq!(pick(&[v(0, 2, 0), v(1, 5, 9), v(2, 1, 0)]), Some(1));
        assert_eq!(pick(&[v(0, 0, 7), v(1, 0, 3), v(2, 0, 3)]), Some(1));
        assert_eq!(pick(&[v(0, 0, 0), v(1, 0, 0)]), Some(0));
        assert_eq!(pick(&[]), None);
    }

    #[test]
    fn picks_since_the_scrape_spread_a_burst() {
        let r = Ranks::default();
        r.set_size(2);
        let choose = |held: &dyn Fn(u32) -> u32| {
            let rank = pick(&r.views(held));
            if let Some(rank) = rank {
                r.picked(rank);
            }
            rank
        };
        let picks: Vec<u32> = (0..4).filter_map(|_| choose(&|_| 0)).collect();
        assert_eq!(picks, [0, 1, 0, 1]);
        let busy = EngineLoad {
            waiting: 3,
            ..EngineLoad::default()
        };
        r.set_loads(&[(0, busy), (1, EngineLoad::default())]);
        assert_eq!(r.snapshot().iter().map(|s| s.picked).sum::<u32>(), 0);
        assert_eq!(choose(&|_| 0), Some(1));
        // A prefix held on rank 0 outweighs its queue.
        assert_eq!(choose(&|rank| u32::from(rank == 0) * 4), Some(0));
    }

    #[test]
    fn one_rank_is_no_data_parallelism() {
        let r = Ranks::default();
        r.set_size(1);
        assert_eq!(r.size(), 0);
        assert_eq!(pick(&r.views(|_| 0)), None);
    }
}
