//! The second level of routing with data parallelism: which of the local
//! engine's ranks a request runs on (`engine.data_parallel_size` above 1;
//! the ranks and their loads are kept in [`crate::fleet::ranks`]).
//!
//! The schedule stage chooses it ([`choose`]) and names it in
//! `RequestCtx::dp_rank`, for whichever of the plan's targets runs on the
//! local engine; the accounting stage counts the pick and predicts the
//! request's blocks on that rank when such a target is taken up; the call
//! to the engine names it in `X-data-parallel-rank`. Choosing changes
//! nothing: a request that ends up elsewhere leaves no trace on the ranks.

use std::collections::HashMap;

use crate::fleet::ranks::{pick, RankView, Ranks};
use crate::prefix::{rank_pod, PrefixState};
use crate::request::RequestCtx;

use super::Inputs;

/// The rank a run of `ctx` on the local engine gets now; `None` without
/// data parallelism.
pub fn choose(i: Inputs<'_>, ctx: &RequestCtx) -> Option<u32> {
    let ranks = i.fleet.ranks();
    pick(&views(ranks, i.prefix, ctx)?)
}

/// `/debug/route`'s view of the ranks: the one a request run here now would
/// get, and each rank's matched blocks and score; `None` without data
/// parallelism.
pub fn explain(i: Inputs<'_>, ctx: &RequestCtx) -> Option<serde_json::Value> {
    let ranks = i.fleet.ranks();
    let views = views(ranks, i.prefix, ctx)?;
    let rows: Vec<serde_json::Value> = views
        .iter()
        .zip(ranks.snapshot())
        .map(|(v, l)| {
            serde_json::json!({
                "rank": v.rank, "matched_blocks": v.matched_blocks, "score": v.score,
                "waiting": l.load.waiting, "running": l.load.running,
                "kv_usage": l.load.kv_usage, "picked_since_scrape": l.picked,
            })
        })
        .collect();
    Some(serde_json::json!({"size": views.len(), "rank": pick(&views), "ranks": rows}))
}

/// What each rank offers `ctx`: the leading blocks of it the rank holds
/// (its blocks are indexed under `<pod>#dp<rank>`), and its load.
fn views(ranks: &Ranks, prefix: &PrefixState, ctx: &RequestCtx) -> Option<Vec<RankView>> {
    let size = ranks.size();
    if size <= 1 {
        return None;
    }
    let (_, local) = prefix.local_pod();
    let names: Vec<String> = (0..size).map(|r| rank_pod(local, r)).collect();
    let matches: HashMap<String, u32> = prefix.matches(ctx);
    let held = |rank: u32| {
        names
            .get(rank as usize)
            .and_then(|n| matches.get(n))
            .copied()
            .unwrap_or(0)
    };
    Some(ranks.views(held))
}
