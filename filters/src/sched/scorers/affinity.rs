//! `prefix-affinity-scorer`: give every prefix a home. Each request's prefix
//! anchor (the block key a few blocks past what most candidates already
//! hold, see [`prefix_anchor`]) ranks the candidates by rendezvous
//! (highest-random-weight) hashing, with bounded loads: a candidate already
//! carrying more than `(1 + loadFactor)` times the mean load goes after the
//! others. The first in that order scores 1.0, the next `1 − 1/m`, and so on
//! down to `1/m` for the last of `m` candidates; a request without an anchor
//! scores 0.5 everywhere.
//!
//! Why it matters under cache pressure:
//!
//! * **Every sidecar agrees without talking.** The order depends on the anchor
//!   and the endpoint ids only, so a cold prefix arriving at four sidecars at
//!   once lands on one pod, not four, before any KV event or mesh delta says
//!   where it went.
//! * **A home survives eviction.** When a pod evicts a prefix, the precise
//!   index forgets it; the next request for it would go anywhere and evict
//!   something else there. The anchor sends it home again.
//! * **Groups are partitioned, not replicated.** Each pod is home to about
//!   1/N of the prefixes; only a prefix hot enough to overload its home
//!   spills, and then always to the same second pod (bounded-load consistent
//!   hashing, Mirrokni, Thorup and Zadimoghaddam, 2018).
//! * **A prefix most pods hold names no home.** The anchor is taken past the
//!   blocks a majority of the candidates already hold: one system prompt
//!   under every conversation would otherwise give all conversations the same
//!   home, and they would pile onto it up to the load bound. A majority, not
//!   all: a pod without the system prompt would otherwise keep every
//!   conversation anchored on it, and never be anyone's home.
//!
//! Load is [`LoadSnapshot::requests`](crate::sched::LoadSnapshot::requests):
//! requests this mesh has in flight to the endpoint, or its engine's running
//! plus waiting count when that is larger.
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `loadFactor` | `0.25` | how far above the mean load a home may be before its prefixes spill (≥ 0) |
//!
//! ```yaml
//! plugins:
//!   - type: prefix-affinity-scorer
//!     parameters:
//!       loadFactor: 0.5
//! ```

use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64;

use crate::sched::error::ParamError;
use crate::sched::plugin::Scorer;
use crate::sched::view::{common_prefix_blocks, prefix_anchor, EndpointView, RequestView};

/// Type name.
pub const TYPE: &str = "prefix-affinity-scorer";

/// Parameters of `prefix-affinity-scorer`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct AffinityParams {
    /// Headroom over the mean load before a home counts as full.
    pub load_factor: f64,
}

impl Default for AffinityParams {
    fn default() -> Self {
        AffinityParams { load_factor: 0.25 }
    }
}

impl AffinityParams {
    /// `loadFactor` must be a finite, non-negative number.
    pub fn validate(&self) -> Result<(), ParamError> {
        if !(self.load_factor.is_finite() && self.load_factor >= 0.0) {
            return Err(ParamError::invalid(
                "loadFactor",
                "must be a finite number ≥ 0",
            ));
        }
        Ok(())
    }
}

/// Scores by rendezvous rank of the request's prefix anchor, with bounded loads.
#[derive(Debug, Clone, Default)]
pub struct AffinityScorer {
    /// Parameters.
    pub params: AffinityParams,
}

/// The load the bound is taken over.
fn load(ep: &EndpointView) -> u64 {
    u64::from(ep.load.requests())
}

/// The rendezvous weight of `endpoint` for `anchor`: the endpoint id's hash
/// combined with the anchor and mixed (splitmix64's finalizer), so that
/// neighbouring anchors rank endpoints independently.
pub fn weight(anchor: u64, endpoint: &str) -> u64 {
    let mut z = xxh3_64(endpoint.as_bytes()) ^ anchor;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Scorer for AffinityScorer {
    fn score(&self, req: &RequestView, eps: &[EndpointView], cands: &[usize], out: &mut [f64]) {
        let common = common_prefix_blocks(eps, cands);
        let Some(anchor) = prefix_anchor(&req.block_keys, common) else {
            out.fill(0.5);
            return;
        };
        let m = cands.len();
        let total: u64 = cands.iter().map(|&i| load(&eps[i])).sum();
        // Mirrokni et al.'s bound: a bin may take the new ball while its load
        // stays within ⌈(1 + ε) · (total + 1) / m⌉.
        let cap = ((1.0 + self.params.load_factor) * (total + 1) as f64 / m.max(1) as f64).ceil();
        let mut order: Vec<(bool, u64, usize)> = cands
            .iter()
            .enumerate()
            .map(|(pos, &i)| {
                let full = (load(&eps[i]) + 1) as f64 > cap;
                (full, weight(anchor, &eps[i].id), pos)
            })
            .collect();
        // Homes with room first, then by weight, highest first.
        order.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        for (rank, (_, _, pos)) in order.into_iter().enumerate() {
            out[pos] = 1.0 - rank as f64 / m as f64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::view::LoadSnapshot;

    fn ep(id: &str, in_flight: u32) -> EndpointView {
        EndpointView {
            load: LoadSnapshot {
                in_flight,
                ..LoadSnapshot::default()
            },
            ..EndpointView::new(id)
        }
    }

    /// A one-block prompt whose key (and so whose anchor) is `anchor`.
    fn req(anchor: Option<u64>) -> RequestView {
        RequestView {
            block_keys: anchor.into_iter().collect(),
            ..RequestView::new("r", "m")
        }
    }

    fn scores(r: &RequestView, eps: &[EndpointView]) -> Vec<f64> {
        let cands: Vec<usize> = (0..eps.len()).collect();
        let mut out = vec![0.0; eps.len()];
        AffinityScorer::default().score(r, eps, &cands, &mut out);
        out
    }

    fn home(r: &RequestView, eps: &[EndpointView]) -> String {
        let s = scores(r, eps);
        let best = (0..eps.len())
            .max_by(|&a, &b| s[a].total_cmp(&s[b]))
            .unwrap();
        eps[best].id.clone()
    }

    #[test]
    fn same_anchor_same_home_in_any_candidate_order() {
        let eps = vec![ep("a", 0), ep("b", 0), ep("c", 0), ep("d", 0)];
        let mut rev = eps.clone();
        rev.reverse();
        for anchor in 0..50u64 {
            assert_eq!(
                home(&req(Some(anchor)), &eps),
                home(&req(Some(anchor)), &rev)
            );
        }
    }

    #[test]
    fn anchors_spread_over_homes() {
        let eps = vec![ep("a", 0), ep("b", 0), ep("c", 0), ep("d", 0)];
        let mut count = std::collections::HashMap::new();
        for anchor in 0..400u64 {
            *count.entry(home(&req(Some(anchor)), &eps)).or_insert(0) += 1;
        }
        assert_eq!(count.len(), 4);
        assert!(
            count.values().all(|&n| (60..=140).contains(&n)),
            "{count:?}"
        );
    }

    #[test]
    fn removing_a_pod_moves_only_its_prefixes() {
        let eps = vec![ep("a", 0), ep("b", 0), ep("c", 0), ep("d", 0)];
        let fewer: Vec<EndpointView> = eps.iter().filter(|e| e.id != "c").cloned().collect();
        for anchor in 0..200u64 {
            let before = home(&req(Some(anchor)), &eps);
            if before != "c" {
                assert_eq!(before, home(&req(Some(anchor)), &fewer));
            }
        }
    }

    #[test]
    fn an_overloaded_home_spills_to_the_same_second_pod() {
        let idle = vec![ep("a", 0), ep("b", 0), ep("c", 0), ep("d", 0)];
        let anchor = 7;
        let first = home(&req(Some(anchor)), &idle);
        let second = {
            let s = scores(&req(Some(anchor)), &idle);
            let mut by: Vec<usize> = (0..4).collect();
            by.sort_by(|&a, &b| s[b].total_cmp(&s[a]));
            idle[by[1]].id.clone()
        };
        // The home carries 6 of 8 requests in flight: over 1.25 × 9 / 4.
        let busy: Vec<EndpointView> = idle
            .iter()
            .map(|e| ep(&e.id, if e.id == first { 6 } else { 1 }))
            .collect();
        assert_eq!(home(&req(Some(anchor)), &busy), second);
        // Slightly above the mean is still home.
        let warm: Vec<EndpointView> = idle
            .iter()
            .map(|e| ep(&e.id, if e.id == first { 3 } else { 2 }))
            .collect();
        assert_eq!(home(&req(Some(anchor)), &warm), first);
    }

    /// Conversations under one system prompt (blocks 0..8, the same keys in
    /// each), each with its own history after it.
    fn conversation(id: u64) -> RequestView {
        RequestView {
            block_keys: (0..8).chain((0..8).map(|b| 1000 * (id + 1) + b)).collect(),
            ..RequestView::new("r", "m")
        }
    }

    fn holding(mut e: EndpointView, blocks: u32) -> EndpointView {
        e.prefix.matched_blocks = blocks;
        e
    }

    /// Where 40 conversations under one system prompt have their homes,
    /// with the prompt held by the first `holders` of four idle pods.
    fn conversation_homes(holders: usize) -> std::collections::HashSet<String> {
        let eps: Vec<EndpointView> = ["a", "b", "c", "d"]
            .iter()
            .enumerate()
            .map(|(i, id)| holding(ep(id, 0), if i < holders { 8 } else { 0 }))
            .collect();
        (0..40).map(|c| home(&conversation(c), &eps)).collect()
    }

    #[test]
    fn a_prefix_most_pods_hold_names_no_home() {
        // The system prompt is on every pod, or on three of four: each
        // conversation is anchored past it, in its own history, and the
        // conversations spread over all four, the pod without it included.
        assert_eq!(conversation_homes(4).len(), 4);
        assert_eq!(conversation_homes(3).len(), 4);
        // On two pods only, the system prompt still is the anchor: every
        // conversation under it has that prompt's home.
        assert_eq!(conversation_homes(2).len(), 1);
        assert_eq!(conversation_homes(0).len(), 1);
    }

    #[test]
    fn the_common_prefix_is_what_a_majority_holds() {
        let eps: Vec<EndpointView> = [0, 8, 8, 20]
            .iter()
            .enumerate()
            .map(|(i, &b)| holding(ep(&i.to_string(), 0), b))
            .collect();
        assert_eq!(
            common_prefix_blocks(&eps, &[0, 1, 2, 3]),
            8,
            "3 of 4 hold 8"
        );
        assert_eq!(common_prefix_blocks(&eps, &[0, 3]), 0, "both must hold it");
        assert_eq!(common_prefix_blocks(&eps, &[0, 1, 3]), 8, "2 of 3");
        assert_eq!(common_prefix_blocks(&eps, &[3]), 20);
        assert_eq!(common_prefix_blocks(&eps, &[]), 0);
    }

    #[test]
    fn the_anchor_is_four_blocks_past_the_common_prefix() {
        let keys: Vec<u64> = (10..30).collect();
        assert_eq!(prefix_anchor(&keys, 0), Some(13));
        assert_eq!(prefix_anchor(&keys, 8), Some(21));
        assert_eq!(prefix_anchor(&keys, 18), Some(29), "the last key");
        assert_eq!(prefix_anchor(&keys[..2], 0), Some(11));
        assert_eq!(prefix_anchor(&[], 3), None);
    }

    #[test]
    fn no_anchor_is_neutral() {
        let eps = vec![ep("a", 0), ep("b", 3)];
        assert_eq!(scores(&req(None), &eps), vec![0.5, 0.5]);
    }

    #[test]
    fn scores_are_ranks_in_unit_range() {
        let eps = vec![ep("a", 0), ep("b", 0), ep("c", 0), ep("d", 0)];
        let mut s = scores(&req(Some(1)), &eps);
        s.sort_by(f64::total_cmp);
        assert_eq!(s, vec![0.25, 0.5, 0.75, 1.0]);
    }

    #[test]
    fn load_factor_is_checked() {
        let bad = AffinityParams { load_factor: -1.0 };
        assert!(bad.validate().is_err());
        assert!(AffinityParams::default().validate().is_ok());
    }
}
