//! `token-cost-scorer`: prefer the endpoint where the request costs the least
//! work before its first token, counted in tokens:
//!
//! * **U**: the prompt tokens it would compute there (the part of its prompt
//!   the endpoint does not hold, [`RequestView::uncached_tokens`]);
//! * **P**: the prompt tokens already waiting to be prefilled there, sent by
//!   any sidecar of the mesh ([`LoadSnapshot::prefill_tokens`]);
//! * **D**: when the endpoint's KV cache cannot hold what it runs plus what
//!   waits plus this request, the tokens that must leave the cache first
//!   (running requests finishing): `max(0, K + P + U − C)`, with `K` the KV
//!   tokens its running requests hold and `C` its KV capacity (0 when the
//!   engine does not report it: no such term).
//!
//! `cost = prefillWeight · (U + P) + kvWeight · D`, and `score = (min cost + s) / (cost + s)`
//! over the candidates, `s = softTokens`: costs a few hundred tokens apart
//! score about the same (affinity and the other scorers decide), a pod with
//! a queue of thousands of tokens scores far below an idle one.
//!
//! This is the cost NVIDIA Dynamo's KV router minimises (the blocks a worker
//! would prefill plus the blocks it holds for active requests), with the KV
//! counted only past capacity: a pod whose cache has room is not held back
//! by the decode batch it runs, and a pod whose queue waits for KV (long
//! prompts, little KV per pod: admission, not prefill, is its limit) is seen
//! as busy even when few of its requests are prefilling. Request counts
//! (`active-request-scorer`, `prefix-affinity-scorer`'s bound) see neither: a
//! pod running three 8k-token prompts looks as loaded as one running three
//! 100-token chats.
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `prefillWeight` | `1.0` | weight of the prompt tokens to prefill, the request's and those queued (≥ 0; 0 leaves the KV term alone, as the built-in default does) |
//! | `kvWeight` | `1.0` | weight of the KV tokens to be freed before admission (≥ 0) |
//! | `softTokens` | `256` | tokens added to every cost before the ratio (≥ 1) |
//!
//! With both terms this is the cost NVIDIA Dynamo's router minimises; on
//! the simulated fleets it moved requests off their cached prefixes at every
//! brief queue and lost (docs/filters.md, "The built-in default"), so the
//! built-in default keeps the KV term alone:
//!
//! ```yaml
//! plugins:
//!   - type: token-cost-scorer
//!     parameters:
//!       prefillWeight: 0
//! ```

use serde::Deserialize;

use crate::sched::error::ParamError;
use crate::sched::plugin::Scorer;
use crate::sched::view::{EndpointView, RequestView};

/// Type name.
pub const TYPE: &str = "token-cost-scorer";

/// Parameters of `token-cost-scorer`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct TokenCostParams {
    /// Weight of the prompt tokens to prefill (the request's and those queued).
    pub prefill_weight: f64,
    /// Weight of the KV tokens to be freed before the request is admitted.
    pub kv_weight: f64,
    /// Tokens added to every cost before the ratio.
    pub soft_tokens: f64,
}

impl Default for TokenCostParams {
    fn default() -> Self {
        TokenCostParams {
            prefill_weight: 1.0,
            kv_weight: 1.0,
            soft_tokens: 256.0,
        }
    }
}

impl TokenCostParams {
    /// `prefillWeight` and `kvWeight` finite and ≥ 0, `softTokens` finite and ≥ 1.
    pub fn validate(&self) -> Result<(), ParamError> {
        for (name, w) in [
            ("prefillWeight", self.prefill_weight),
            ("kvWeight", self.kv_weight),
        ] {
            if !(w.is_finite() && w >= 0.0) {
                return Err(ParamError::invalid(name, "must be a finite number ≥ 0"));
            }
        }
        if !(self.soft_tokens.is_finite() && self.soft_tokens >= 1.0) {
            return Err(ParamError::invalid(
                "softTokens",
                "must be a finite number ≥ 1",
            ));
        }
        Ok(())
    }
}

/// Scores by the tokens of work the request costs each endpoint.
#[derive(Debug, Clone, Default)]
pub struct TokenCostScorer {
    /// Parameters.
    pub params: TokenCostParams,
}

impl TokenCostScorer {
    /// The request's cost at `ep`, in tokens (see the module docs).
    pub fn cost(&self, req: &RequestView, ep: &EndpointView) -> f64 {
        let uncached = req.uncached_tokens(&ep.prefix);
        let pending = ep.load.prefill_tokens;
        let capacity = ep.load.kv_capacity_tokens();
        let debt = if capacity == 0 {
            0
        } else {
            (ep.load.kv_used_tokens() + pending + uncached).saturating_sub(capacity)
        };
        self.params.prefill_weight * (uncached + pending) as f64
            + self.params.kv_weight * debt as f64
    }
}

impl Scorer for TokenCostScorer {
    fn score(&self, req: &RequestView, eps: &[EndpointView], cands: &[usize], out: &mut [f64]) {
        let soft = self.params.soft_tokens;
        for (o, &i) in out.iter_mut().zip(cands) {
            *o = self.cost(req, &eps[i]);
        }
        let min = out.iter().copied().fold(f64::INFINITY, f64::min);
        for o in out.iter_mut() {
            *o = (min + soft) / (*o + soft);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::view::{LoadSnapshot, PrefixMatch};

    /// A 1024-token prompt of 64 blocks.
    fn req() -> RequestView {
        RequestView {
            prompt_tokens: 1024,
            prompt_blocks: 64,
            ..RequestView::new("r", "m")
        }
    }

    /// An endpoint holding `held` of the prompt's 64 blocks, `pending`
    /// prefill tokens queued, `kv_usage` of 512 blocks of 16 tokens.
    fn ep(held: u32, pending: u64, kv_usage: f64) -> EndpointView {
        EndpointView {
            load: LoadSnapshot {
                prefill_tokens: pending,
                kv_usage,
                num_blocks: 512,
                block_size: 16,
                ..LoadSnapshot::default()
            },
            prefix: PrefixMatch {
                matched_blocks: held,
                block_size: 16,
            },
            ..EndpointView::new("e")
        }
    }

    fn scores(eps: &[EndpointView]) -> Vec<f64> {
        let cands: Vec<usize> = (0..eps.len()).collect();
        let mut out = vec![0.0; eps.len()];
        TokenCostScorer::default().score(&req(), eps, &cands, &mut out);
        out
    }

    #[test]
    fn the_cost_is_uncached_plus_pending_plus_kv_past_capacity() {
        let s = TokenCostScorer::default();
        // Half the prompt held, 100 tokens queued, the cache nearly empty.
        assert_eq!(s.cost(&req(), &ep(32, 100, 0.0)), 612.0);
        // 7800 of 8192 KV tokens in use: 7800 + 100 + 512 − 8192 = 220 must
        // leave first.
        let full = ep(32, 100, 7800.0 / 8192.0);
        assert_eq!(s.cost(&req(), &full), 612.0 + 220.0);
        // Without a reported capacity there is no KV term.
        let mut unknown = full.clone();
        unknown.load.num_blocks = 0;
        assert_eq!(s.cost(&req(), &unknown), 612.0);
    }

    #[test]
    fn a_cached_prefix_wins_until_its_queue_costs_more_than_it_saves() {
        // Pod 0 holds 60 of 64 blocks; pod 1 none.
        let idle = scores(&[ep(60, 0, 0.1), ep(0, 0, 0.1)]);
        assert_eq!(idle[0], 1.0);
        assert!(idle[1] < 0.4, "{idle:?}");
        // 2000 tokens queued at the holder: recomputing 1024 elsewhere is cheaper.
        let queued = scores(&[ep(60, 2000, 0.1), ep(0, 0, 0.1)]);
        assert!(queued[0] < queued[1], "{queued:?}");
        assert_eq!(queued[1], 1.0);
    }

    #[test]
    fn a_pod_whose_queue_waits_for_kv_scores_below_one_with_room() {
        // Both hold the prefix; pod 0's cache is full with little queued.
        let s = scores(&[ep(60, 200, 0.99), ep(60, 0, 0.2)]);
        assert!(s[0] < s[1], "{s:?}");
    }

    #[test]
    fn equal_costs_score_one_and_scores_stay_in_unit_range() {
        assert_eq!(scores(&[ep(0, 0, 0.0), ep(0, 0, 0.0)]), vec![1.0, 1.0]);
        for s in scores(&[ep(0, 0, 1.0), ep(64, 9000, 0.5), ep(10, 1, 0.0)]) {
            assert!((0.0..=1.0).contains(&s), "{s}");
        }
    }

    #[test]
    fn parameters_are_checked() {
        let bad = TokenCostParams {
            kv_weight: -1.0,
            ..TokenCostParams::default()
        };
        assert!(bad.validate().is_err());
        let bad = TokenCostParams {
            soft_tokens: 0.5,
            ..TokenCostParams::default()
        };
        assert!(bad.validate().is_err());
        assert!(TokenCostParams::default().validate().is_ok());
    }
}
