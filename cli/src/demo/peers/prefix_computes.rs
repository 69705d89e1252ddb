//! Where a shared-prefix run's prompt tokens went, request by request: each
//! request's group prefix (its system prompt) was either found cached on the
//! pod it reached, or computed there, and a computed one is put down to one
//! of three causes. [`super::lru_reference`] says how much a placement
//! costs; this says, from the engines' own answers, why.
//!
//! The pod each request reached comes from the engines' logs, and what it
//! found cached from its answer's usage (`prompt_tokens_details.
//! cached_tokens`). Requests are taken in the workload's order (the order
//! they were sent).

use std::collections::{HashMap, HashSet};

use serde::Serialize;

/// A run's served requests by what their group prefix cost them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PrefixComputes {
    /// Found the prefix cached on the pod they reached (all of it but at
    /// most one block).
    pub hit: u64,
    /// The prefix's first request of the run: computed wherever it went.
    pub first: u64,
    /// Computed it on a pod that had not been sent this prefix before in the
    /// run, while another pod had: the router moved the group.
    pub moved: u64,
    /// Computed it again on a pod that had been sent this prefix before: the
    /// engine evicted it since, or was still prefilling it for an earlier
    /// request when this one was scheduled.
    pub again: u64,
}

/// One served request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    /// Its index in the workload (arrival order).
    pub index: usize,
    /// The pod it reached.
    pub pod: usize,
    /// Prompt tokens it found cached.
    pub cached: u64,
}

/// Sorts `served` into [`PrefixComputes`]. `groups[index]` names request
/// `index`'s prefix (requests of one group share it); the prefix is
/// `prefix_tokens` long, and counts as computed when more than one
/// `block_size` block of it was not cached.
pub fn classify(
    groups: &[u64],
    served: &[Served],
    prefix_tokens: u64,
    block_size: u64,
) -> PrefixComputes {
    let mut order: Vec<&Served> = served.iter().filter(|s| s.index < groups.len()).collect();
    order.sort_by_key(|s| s.index);
    let mut sent: HashMap<u64, HashSet<usize>> = HashMap::new();
    let mut out = PrefixComputes::default();
    for s in order {
        let pods = sent.entry(groups[s.index]).or_default();
        let computed = s.cached + block_size < prefix_tokens;
        let count = match (computed, pods.is_empty(), pods.contains(&s.pod)) {
            (false, _, _) => &mut out.hit,
            (true, true, _) => &mut out.first,
            (true, false, true) => &mut out.again,
            (true, false, false) => &mut out.moved,
        };
        *count += 1;
        pods.insert(s.pod);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(index: usize, pod: usize, cached: u64) -> Served {
        Served { index, pod, cached }
    }

    #[test]
    fn each_computed_prefix_is_put_down_to_its_cause() {
        // Groups 7 and 9; a 64-token prefix in blocks of 16.
        let groups = [7, 9, 7, 7, 7, 9, 7];
        let served = [
            at(6, 1, 64), // a hit on the pod that computed it at 4
            at(0, 0, 0),  // group 7 first seen
            at(1, 2, 0),  // group 9 first seen
            at(2, 0, 64), // a hit where it was computed
            at(3, 1, 0),  // moved: pod 1 never had group 7
            at(4, 0, 16), // computed again on pod 0: evicted there
            at(5, 2, 48), // one block short: still a hit
        ];
        let c = classify(&groups, &served, 64, 16);
        assert_eq!(
            c,
            PrefixComputes {
                hit: 3,
                first: 2,
                moved: 1,
                again: 1,
            }
        );
    }

    #[test]
    fn requests_outside_the_workload_are_left_out() {
        let c = classify(&[1], &[at(0, 0, 0), at(5, 0, 0)], 64, 16);
        assert_eq!(c.first + c.moved + c.again + c.hit, 1);
    }
}
