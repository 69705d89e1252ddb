//! P/D deciders, used by `disagg-profile-handler` once the decode endpoint is
//! chosen: is a separate prefill leg worth it for this request?
//!
//! `prefix-based-pd-decider` (llm-d's name and parameters): disaggregate when
//! the prompt is at least `promptTokens` long and the part of it that the
//! chosen decode endpoint does *not* already hold in cache is at least
//! `nonCachedTokens`. A short uncached tail is cheaper to prefill in place
//! than to ship KV blocks for.
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `nonCachedTokens` | `0` | uncached prompt tokens that justify a prefill leg; `0` disables P/D |
//! | `promptTokens` | `0` | minimum prompt length for P/D |
//!
//! `always-disagg-pd-decider`: always disaggregate (tests, benchmarks). No parameters.
//!
//! ```yaml
//! plugins:
//!   - type: prefix-based-pd-decider
//!     parameters:
//!       nonCachedTokens: 2048
//!       promptTokens: 1024
//! ```

use serde::Deserialize;

use crate::sched::plugin::{PdDecider, Verdict};
use crate::sched::view::{EndpointView, RequestView};

/// Type name of [`PrefixBasedDecider`].
pub const PREFIX_BASED_TYPE: &str = "prefix-based-pd-decider";
/// Type name of [`AlwaysDisaggDecider`].
pub const ALWAYS_TYPE: &str = "always-disagg-pd-decider";

/// Parameters of `prefix-based-pd-decider`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct PrefixBasedParams {
    /// Uncached tokens that justify a prefill leg (0 = off).
    pub non_cached_tokens: u32,
    /// Minimum prompt length.
    pub prompt_tokens: u32,
}

/// Disaggregates long, mostly uncached prompts.
#[derive(Debug, Clone)]
pub struct PrefixBasedDecider {
    /// Parameters.
    pub params: PrefixBasedParams,
}

impl PdDecider for PrefixBasedDecider {
    fn decide(&self, req: &RequestView, decode: &EndpointView) -> Verdict {
        let p = &self.params;
        let no = |reason: String| Verdict {
            disaggregate: false,
            reason,
        };
        if p.non_cached_tokens == 0 {
            return no("P/D off (nonCachedTokens 0)".to_owned());
        }
        if req.prompt_tokens < p.prompt_tokens {
            return no(format!(
                "prompt {} < promptTokens {}",
                req.prompt_tokens, p.prompt_tokens
            ));
        }
        let bs = if decode.prefix.block_size > 0 {
            decode.prefix.block_size
        } else {
            decode.load.block_size
        };
        let cached = u64::from(decode.prefix.matched_blocks) * u64::from(bs);
        let uncached = u64::from(req.prompt_tokens).saturating_sub(cached);
        if uncached >= u64::from(p.non_cached_tokens) {
            Verdict {
                disaggregate: true,
                reason: format!(
                    "uncached {uncached} >= nonCachedTokens {}",
                    p.non_cached_tokens
                ),
            }
        } else {
            no(format!(
                "uncached {uncached} < nonCachedTokens {}",
                p.non_cached_tokens
            ))
        }
    }
}

/// Always disaggregates.
#[derive(Debug, Clone, Default)]
pub struct AlwaysDisaggDecider;

impl PdDecider for AlwaysDisaggDecider {
    fn decide(&self, _req: &RequestView, _decode: &EndpointView) -> Verdict {
        Verdict {
            disaggregate: true,
            reason: "always-disagg-pd-decider".to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::view::PrefixMatch;

    fn decide(non_cached: u32, min_prompt: u32, prompt: u32, hit_blocks: u32) -> Verdict {
        let d = PrefixBasedDecider {
            params: PrefixBasedParams {
                non_cached_tokens: non_cached,
                prompt_tokens: min_prompt,
            },
        };
        let req = RequestView {
            prompt_tokens: prompt,
            ..RequestView::default()
        };
        let ep = EndpointView {
            prefix: PrefixMatch {
                matched_blocks: hit_blocks,
                block_size: 16,
            },
            ..EndpointView::new("d")
        };
        d.decide(&req, &ep)
    }

    #[test]
    fn thresholds() {
        let v = decide(2048, 0, 4100, 0);
        assert!(v.disaggregate);
        assert_eq!(v.reason, "uncached 4100 >= nonCachedTokens 2048");
        // 4100 - 200*16 = 900 uncached.
        let v = decide(2048, 0, 4100, 200);
        assert!(!v.disaggregate);
        assert_eq!(v.reason, "uncached 900 < nonCachedTokens 2048");
        assert!(!decide(2048, 8192, 4100, 0).disaggregate);
        assert!(!decide(0, 0, 100_000, 0).disaggregate);
        assert!(decide(2048, 4100, 4100, 0).disaggregate);
    }
}
