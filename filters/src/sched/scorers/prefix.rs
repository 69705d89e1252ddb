//! `prefix-cache-scorer`: prefer endpoints that already hold the request's
//! prefix in their KV cache. The caller fills `EndpointView::prefix` from the
//! prefix index (precise, from KV events; or approximate, from this mesh's own
//! decisions). llm-d's formula:
//!
//! `score = w · min(1, matchedTokens / matchLengthScaleTokens)² + (1 − w) · matchedBlocks / promptBlocks`
//!
//! where `w = matchLengthWeight`. With the default `w = 0` the score is the
//! fraction of the prompt's blocks already cached; raising `w` rewards long
//! absolute matches (a 6k-token hit on a 60k prompt) over short prompts fully hit.
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `matchLengthWeight` | `0.0` | share of the absolute-length term, 0..=1 |
//! | `matchLengthScaleTokens` | `8192` | matched tokens at which the length term saturates (≥ 1) |
//! | `prefixMatchInfoProducerName` | none | name of the producer plugin feeding the match (must exist when set) |
//!
//! ```yaml
//! plugins:
//!   - type: precise-prefix-cache-producer
//!   - type: prefix-cache-scorer
//!     parameters:
//!       matchLengthWeight: 0.3
//!       prefixMatchInfoProducerName: precise-prefix-cache-producer
//! ```

use serde::Deserialize;

use crate::sched::error::ParamError;
use crate::sched::params::check_range;
use crate::sched::plugin::Scorer;
use crate::sched::view::{EndpointView, RequestView};

/// Type name.
pub const TYPE: &str = "prefix-cache-scorer";

/// Parameters of `prefix-cache-scorer`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct PrefixCacheParams {
    /// Share of the absolute-length term.
    pub match_length_weight: f64,
    /// Tokens at which the length term saturates.
    pub match_length_scale_tokens: u32,
    /// Producer plugin feeding the match info.
    pub prefix_match_info_producer_name: Option<String>,
}

impl Default for PrefixCacheParams {
    fn default() -> Self {
        PrefixCacheParams {
            match_length_weight: 0.0,
            match_length_scale_tokens: 8192,
            prefix_match_info_producer_name: None,
        }
    }
}

impl PrefixCacheParams {
    /// Ranges.
    pub fn validate(&self) -> Result<(), ParamError> {
        check_range("matchLengthWeight", self.match_length_weight, 0.0, 1.0)?;
        if self.match_length_scale_tokens == 0 {
            return Err(ParamError::invalid(
                "matchLengthScaleTokens",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}

/// Scores by cached prefix.
#[derive(Debug, Clone)]
pub struct PrefixCacheScorer {
    /// Parameters.
    pub params: PrefixCacheParams,
}

impl PrefixCacheScorer {
    /// The score of one endpoint for one request.
    pub fn score_one(&self, req: &RequestView, ep: &EndpointView) -> f64 {
        let w = self.params.match_length_weight;
        let bs = if ep.prefix.block_size > 0 {
            ep.prefix.block_size
        } else {
            ep.load.block_size
        };
        let tokens = f64::from(ep.prefix.matched_blocks) * f64::from(bs);
        let scale = f64::from(self.params.match_length_scale_tokens.max(1));
        let len_term = (tokens / scale).min(1.0).powi(2);
        let frac = if req.prompt_blocks == 0 {
            0.0
        } else {
            (f64::from(ep.prefix.matched_blocks) / f64::from(req.prompt_blocks)).min(1.0)
        };
        (w * len_term + (1.0 - w) * frac).clamp(0.0, 1.0)
    }
}

impl Scorer for PrefixCacheScorer {
    fn score(&self, req: &RequestView, eps: &[EndpointView], cands: &[usize], out: &mut [f64]) {
        for (o, &i) in out.iter_mut().zip(cands) {
            *o = self.score_one(req, &eps[i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::view::PrefixMatch;

    fn ep(blocks: u32) -> EndpointView {
        EndpointView {
            prefix: PrefixMatch {
                matched_blocks: blocks,
                block_size: 16,
            },
            ..EndpointView::new("e")
        }
    }

    fn req(blocks: u32) -> RequestView {
        RequestView {
            prompt_blocks: blocks,
            prompt_tokens: blocks * 16,
            ..RequestView::default()
        }
    }

    #[test]
    fn fraction_of_blocks_by_default() {
        let s = PrefixCacheScorer {
            params: PrefixCacheParams::default(),
        };
        assert_eq!(s.score_one(&req(100), &ep(25)), 0.25);
        assert_eq!(s.score_one(&req(100), &ep(0)), 0.0);
        assert_eq!(s.score_one(&req(0), &ep(3)), 0.0);
        // A match longer than the prompt (stale index) still caps at 1.
        assert_eq!(s.score_one(&req(10), &ep(20)), 1.0);
    }

    #[test]
    fn length_term() {
        let s = PrefixCacheScorer {
            params: PrefixCacheParams {
                match_length_weight: 1.0,
                match_length_scale_tokens: 1600,
                prefix_match_info_producer_name: None,
            },
        };
        // 50 blocks * 16 = 800 tokens: (800/1600)^2 = 0.25.
        assert_eq!(s.score_one(&req(1000), &ep(50)), 0.25);
        assert_eq!(s.score_one(&req(1000), &ep(500)), 1.0);
        let half = PrefixCacheScorer {
            params: PrefixCacheParams {
                match_length_weight: 0.5,
                ..s.params.clone()
            },
        };
        assert_eq!(half.score_one(&req(100), &ep(50)), 0.5 * 0.25 + 0.5 * 0.5);
    }

    #[test]
    fn validate() {
        let bad = PrefixCacheParams {
            match_length_weight: 1.5,
            ..PrefixCacheParams::default()
        };
        assert_eq!(
            bad.validate().map_err(|e| e.path),
            Err("matchLengthWeight".into())
        );
    }
}
