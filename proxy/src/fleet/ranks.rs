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
//! in `X-data-parallel-rank` (vLLM 0.32 honours the header). Each rank's
//! blocks are also indexed under the name `<pod>#dp<rank>` (never a fleet
//! pod, so the scheduler never sees it), and its load is read from the
//! `engine="<rank>"` series of the engine's metrics.
//!
//! The choice, [`pick`], is pure: the rank holding the longest prefix of the
//! request; among equals, the least loaded by vLLM's own DP balancing score
//! (`waiting * 4 + running`, plus the requests this sidecar sent there since
//! the last scrape, so a burst between two scrapes spreads); then the lowest
//! rank.

use parking_lot::Mutex;
use serde::Serialize;

use super::EngineLoad;

/// The header vLLM reads the rank from.
pub const RANK_HEADER: &str = "x-data-parallel-rank";

/// Chooses the local engine's rank for a request about to be sent to it,
/// names it in `X-data-parallel-rank` (replacing a client's), and predicts
/// the request's blocks on that rank; `None` without data parallelism.
pub(crate) fn stamp(
    config: &crate::config::Config,
    fleet: &super::Fleet,
    prefix: &crate::prefix::PrefixState,
    ctx: &crate::request::RequestCtx,
    headers: &mut http::HeaderMap,
) -> Option<u32> {
    let n = config.engine.data_parallel_size;
    if n <= 1 {
        return None;
    }
    let ranks = fleet.ranks();
    ranks.set_size(n);
    let names = rank_pods(prefix, n);
    let matches = prefix.matches(ctx);
    let rank = ranks.choose(|r| held(&matches, &names, r))?;
    if let Some(name) = names.get(rank as usize) {
        prefix.predict(name, ctx);
        prefix.record(name, ctx);
    }
    headers.insert(RANK_HEADER, http::HeaderValue::from(rank));
    Some(rank)
}

/// `/debug/route`'s view of the ranks: the one a request run here now would
/// get, and each rank's matched blocks and score; `None` without data
/// parallelism.
pub(crate) fn explain(
    app: &crate::app::App,
    ctx: &crate::request::RequestCtx,
) -> Option<serde_json::Value> {
    let n = app.config.engine.data_parallel_size;
    if n <= 1 {
        return None;
    }
    let ranks = app.fleet.ranks();
    ranks.set_size(n);
    let names = rank_pods(&app.prefix, n);
    let matches = app.prefix.matches(ctx);
    let (rank, views) = ranks.explain(|r| held(&matches, &names, r));
    let loads = ranks.snapshot();
    let rows: Vec<serde_json::Value> = views
        .iter()
        .zip(loads)
        .map(|(v, l)| {
            serde_json::json!({
                "rank": v.rank, "matched_blocks": v.matched_blocks, "score": v.score,
                "waiting": l.load.waiting, "running": l.load.running,
                "kv_usage": l.load.kv_usage, "picked_since_scrape": l.picked,
            })
        })
        .collect();
    Some(serde_json::json!({"size": n, "rank": rank, "ranks": rows}))
}

fn rank_pods(prefix: &crate::prefix::PrefixState, n: u32) -> Vec<String> {
    let (_, local) = prefix.local_pod();
    (0..n).map(|r| rank_pod(local, r)).collect()
}

fn held(matches: &std::collections::HashMap<String, u32>, names: &[String], rank: u32) -> u32 {
    names
        .get(rank as usize)
        .and_then(|n| matches.get(n))
        .copied()
        .unwrap_or(0)
}

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

    /// Picks the rank for a request given the blocks each rank holds of it
    /// (`matched(rank)`), and counts the pick; `None` without ranks.
    pub fn choose(&self, matched: impl Fn(u32) -> u32) -> Option<u32> {
        let mut r = self.0.lock();
        let rank = pick(&views(&r, &matched))?;
        if let Some(slot) = r.get_mut(rank as usize) {
            slot.picked = slot.picked.saturating_add(1);
        }
        Some(rank)
    }

    /// What [`Self::choose`] would pick now, and every rank's view, without
    /// counting a pick (`/debug/route`).
    pub fn explain(&self, matched: impl Fn(u32) -> u32) -> (Option<u32>, Vec<RankView>) {
        let v = views(&self.0.lock(), &matched);
        (pick(&v), v)
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

/// The prefix-index name of a rank of pod `pod`.
pub fn rank_pod(pod: &str, rank: u32) -> String {
    format!("{pod}#dp{rank}")
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
        let picks: Vec<u32> = (0..4).filter_map(|_| r.choose(|_| 0)).collect();
        assert_eq!(picks, [0, 1, 0, 1]);
        let busy = EngineLoad {
            waiting: 3,
            ..EngineLoad::default()
        };
        r.set_loads(&[(0, busy), (1, EngineLoad::default())]);
        assert_eq!(r.snapshot().iter().map(|s| s.picked).sum::<u32>(), 0);
        assert_eq!(r.choose(|_| 0), Some(1));
        // A prefix held on rank 0 outweighs its queue.
        assert_eq!(r.choose(|rank| u32::from(rank == 0) * 4), Some(0));
    }

    #[test]
    fn one_rank_is_no_data_parallelism() {
        let r = Ranks::default();
        r.set_size(1);
        assert_eq!(r.choose(|_| 0), None);
    }
}
