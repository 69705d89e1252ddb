//! `session-affinity-scorer`: keep a session on one endpoint, so its growing
//! conversation prefix stays in one cache. The session key comes from a
//! request header (the proxy fills `RequestView::session_key`, e.g. from
//! `x-session-id`). Rendezvous hashing over the candidates: the candidate
//! with the highest `hash(key, endpoint id)` scores 1.0, the others 0. When
//! that endpoint leaves (or is filtered out) only its sessions move, each to
//! its own next-highest candidate; sessions on other endpoints stay put.
//! Requests without a key score 0 everywhere (neutral).
//!
//! Parameters: none.
//!
//! ```yaml
//! plugins:
//!   - type: session-affinity-scorer
//! schedulingProfiles:
//!   - name: default
//!     plugins:
//!       - pluginRef: session-affinity-scorer
//!         weight: 5
//! ```

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::sched::plugin::Scorer;
use crate::sched::view::{EndpointView, RequestView};

/// Type name.
pub const TYPE: &str = "session-affinity-scorer";

/// Pins sessions by rendezvous hashing.
#[derive(Debug, Clone, Default)]
pub struct SessionAffinityScorer;

impl Scorer for SessionAffinityScorer {
    fn score(&self, req: &RequestView, eps: &[EndpointView], cands: &[usize], out: &mut [f64]) {
        out.fill(0.0);
        let Some(key) = req.session_key.as_deref().filter(|k| !k.is_empty()) else {
            return;
        };
        let seed = xxh3_64(key.as_bytes());
        let best = cands
            .iter()
            .enumerate()
            .max_by_key(|(_, &i)| (xxh3_64_with_seed(eps[i].id.as_bytes(), seed), &eps[i].id))
            .map(|(pos, _)| pos);
        if let Some(pos) = best {
            out[pos] = 1.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn winner(key: &str, eps: &[EndpointView]) -> Option<String> {
        let cands: Vec<usize> = (0..eps.len()).collect();
        let mut out = vec![0.0; eps.len()];
        let req = RequestView {
            session_key: Some(key.into()),
            ..RequestView::default()
        };
        SessionAffinityScorer.score(&req, eps, &cands, &mut out);
        out.iter()
            .position(|&s| s == 1.0)
            .map(|p| eps[p].id.clone())
    }

    #[test]
    fn sticky_and_minimal_disruption() {
        let eps: Vec<_> = (0..8)
            .map(|i| EndpointView::new(format!("10.0.0.{i}:8000")))
            .collect();
        let keys: Vec<String> = (0..200).map(|k| format!("session-{k}")).collect();
        let before: Vec<_> = keys.iter().map(|k| winner(k, &eps)).collect();
        // Same key, same endpoint.
        assert_eq!(before[7], winner(&keys[7], &eps));
        // Remove one endpoint: only its sessions move.
        let gone = eps[3].id.clone();
        let fewer: Vec<_> = eps.iter().filter(|e| e.id != gone).cloned().collect();
        for (k, b) in keys.iter().zip(&before) {
            let after = winner(k, &fewer);
            if b.as_deref() != Some(gone.as_str()) {
                assert_eq!(&after, b);
            }
        }
        // Sessions spread over endpoints.
        let distinct: std::collections::BTreeSet<_> = before.iter().collect();
        assert!(distinct.len() >= 6, "{distinct:?}");
    }

    #[test]
    fn no_key_is_neutral() {
        let eps = vec![EndpointView::new("a"), EndpointView::new("b")];
        let mut out = [9.0; 2];
        SessionAffinityScorer.score(&RequestView::default(), &eps, &[0, 1], &mut out);
        assert_eq!(out, [0.0, 0.0]);
    }
}
