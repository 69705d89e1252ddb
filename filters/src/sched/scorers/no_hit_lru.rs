//! `no-hit-lru-scorer`: spread cold requests (no endpoint holds any of the
//! prefix) over the endpoints that received a cold request least recently,
//! so new prefixes seed different caches instead of piling onto the least
//! loaded pod of the moment.
//!
//! * Cold request: endpoints that never got a cold request score 1.0; the
//!   others, ordered from least to most recently used, score
//!   `(m − 1 − rank) / m` (the most recent scores 0).
//! * Warm request (some endpoint has a hit): 0.5 for every candidate, which
//!   leaves the ranking to the other scorers.
//!
//! After each real decision for a cold request the chosen endpoints (target,
//! or prefill and decode) move to the most-recent end. The state is a bounded
//! LRU of `lruSize` endpoint ids behind a mutex; when full, the least recently
//! used id is forgotten (it then counts as "never used", which is what it
//! nearly is). No clock is read: recency is the order of decisions.
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `lruSize` | `1024` | endpoint ids remembered (≥ 1) |
//!
//! ```yaml
//! plugins:
//!   - type: no-hit-lru-scorer
//!     parameters:
//!       lruSize: 2048
//! ```

use std::collections::{BTreeMap, HashMap};

use parking_lot::Mutex;
use serde::Deserialize;
use xxhash_rust::xxh3::Xxh3DefaultBuilder;

use crate::sched::decision::Route;
use crate::sched::error::ParamError;
use crate::sched::plugin::Scorer;
use crate::sched::view::{EndpointView, RequestView};

/// Type name.
pub const TYPE: &str = "no-hit-lru-scorer";

/// Parameters of `no-hit-lru-scorer`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct NoHitLruParams {
    /// Endpoint ids remembered.
    pub lru_size: usize,
}

impl Default for NoHitLruParams {
    fn default() -> Self {
        NoHitLruParams { lru_size: 1024 }
    }
}

impl NoHitLruParams {
    /// `lruSize` must be positive.
    pub fn validate(&self) -> Result<(), ParamError> {
        if self.lru_size == 0 {
            return Err(ParamError::invalid("lruSize", "must be at least 1"));
        }
        Ok(())
    }
}

/// Id → sequence of its last cold request, and the reverse for eviction.
/// xxh3 instead of SipHash: the keys are endpoint ids from discovery, not
/// client input, and the lookup runs once per candidate per cold request.
#[derive(Debug, Default)]
struct Lru {
    by_id: HashMap<String, u64, Xxh3DefaultBuilder>,
    by_seq: BTreeMap<u64, String>,
    next: u64,
}

/// Spreads cold requests.
#[derive(Debug)]
pub struct NoHitLruScorer {
    params: NoHitLruParams,
    lru: Mutex<Lru>,
}

impl NoHitLruScorer {
    /// A scorer with empty history.
    pub fn new(params: NoHitLruParams) -> Self {
        NoHitLruScorer {
            params,
            lru: Mutex::new(Lru::default()),
        }
    }

    fn touch(&self, id: &str) {
        let mut lru = self.lru.lock();
        let seq = lru.next;
        lru.next += 1;
        if let Some(old) = lru.by_id.insert(id.to_owned(), seq) {
            lru.by_seq.remove(&old);
        }
        lru.by_seq.insert(seq, id.to_owned());
        while lru.by_id.len() > self.params.lru_size.max(1) {
            let Some((_, evicted)) = lru.by_seq.pop_first() else {
                break;
            };
            lru.by_id.remove(&evicted);
        }
    }
}

fn is_cold(endpoints: &[EndpointView]) -> bool {
    endpoints.iter().all(|e| e.prefix.matched_blocks == 0)
}

impl Scorer for NoHitLruScorer {
    fn score(&self, _r: &RequestView, eps: &[EndpointView], cands: &[usize], out: &mut [f64]) {
        if !is_cold(eps) {
            out.fill(0.5);
            return;
        }
        // (seq, position) of candidates that got a cold request before.
        let mut used: Vec<(u64, usize)> = Vec::new();
        {
            let lru = self.lru.lock();
            for (pos, &i) in cands.iter().enumerate() {
                match lru.by_id.get(&eps[i].id) {
                    Some(&seq) => used.push((seq, pos)),
                    None => out[pos] = 1.0,
                }
            }
        }
        used.sort_unstable();
        let m = used.len() as f64;
        for (rank, &(_, pos)) in used.iter().enumerate() {
            out[pos] = (m - 1.0 - rank as f64) / m;
        }
    }

    fn post_decision(&self, _r: &RequestView, eps: &[EndpointView], route: &Route, _now: u64) {
        if !is_cold(eps) {
            return;
        }
        if let Some(p) = route.prefill() {
            self.touch(&p.id);
        }
        self.touch(&route.primary().id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::decision::Choice;
    use crate::sched::view::PrefixMatch;

    fn route(id: &str) -> Route {
        Route::Aggregated {
            target: Choice {
                id: id.into(),
                index: 0,
                fallbacks: vec![],
            },
        }
    }

    fn eps(n: usize) -> Vec<EndpointView> {
        (0..n).map(|i| EndpointView::new(format!("e{i}"))).collect()
    }

    fn scores(s: &NoHitLruScorer, eps: &[EndpointView]) -> Vec<f64> {
        let cands: Vec<usize> = (0..eps.len()).collect();
        let mut out = vec![9.0; eps.len()];
        s.score(&RequestView::default(), eps, &cands, &mut out);
        out
    }

    #[test]
    fn cold_requests_rotate() {
        let s = NoHitLruScorer::new(NoHitLruParams::default());
        let e = eps(3);
        assert_eq!(scores(&s, &e), vec![1.0, 1.0, 1.0]);
        s.post_decision(&RequestView::default(), &e, &route("e0"), 0);
        assert_eq!(scores(&s, &e), vec![0.0, 1.0, 1.0]);
        s.post_decision(&RequestView::default(), &e, &route("e1"), 0);
        s.post_decision(&RequestView::default(), &e, &route("e2"), 0);
        // e0 least recent, e2 most recent.
        let got = scores(&s, &e);
        assert!(got[0] > got[1] && got[1] > got[2], "{got:?}");
        assert_eq!(got[2], 0.0);
    }

    #[test]
    fn warm_requests_are_neutral_and_not_recorded() {
        let s = NoHitLruScorer::new(NoHitLruParams::default());
        let mut e = eps(2);
        e[1].prefix = PrefixMatch {
            matched_blocks: 2,
            block_size: 16,
        };
        assert_eq!(scores(&s, &e), vec![0.5, 0.5]);
        s.post_decision(&RequestView::default(), &e, &route("e0"), 0);
        assert_eq!(scores(&s, &eps(2)), vec![1.0, 1.0]);
    }

    #[test]
    fn bounded() {
        let s = NoHitLruScorer::new(NoHitLruParams { lru_size: 2 });
        let e = eps(3);
        for id in ["e0", "e1", "e2"] {
            s.post_decision(&RequestView::default(), &e, &route(id), 0);
        }
        assert_eq!(s.lru.lock().by_id.len(), 2);
        // e0 was forgotten and counts as never used.
        assert_eq!(scores(&s, &e)[0], 1.0);
    }
}
