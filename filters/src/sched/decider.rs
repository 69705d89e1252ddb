//! P/D deciders, used by `disagg-profile-handler` once the decode endpoint is
//! chosen: is a separate prefill leg worth it for this request?
//!
//! `prefix-based-pd-decider` (llm-d's name and parameters): disaggregate when
//! the prompt is at least `promptTokens` long and the part of it that the
//! chosen decode endpoint does *not* already hold in cache is at least
//! `nonCachedTokens`. A short uncached tail is cheaper to prefill in place
//! than to ship KV blocks for.
//!
//! kvmesh adds a load-aware rule, off unless `batchStallTokens` is set:
//! disaggregate also when uncached tokens x requests at the decode endpoint
//! reaches `batchStallTokens`. Prefilling `U` uncached tokens in place stalls
//! every request decoding there: each of the `R` gets one inter-token gap of
//! `U x t_p` (`t_p` the engine's prefill time per token), `R x U x t_p` of
//! decode time in all. A separate prefill leg costs this one request at most
//! its TTFT budget (beyond it the request misses its SLO either way), so it
//! pays once `R x U x t_p` reaches the TTFT SLO: `batchStallTokens` =
//! TTFT SLO / `t_p` (docs/pd.md, "The decision"). The rule needs no prompt
//! floor of its own: a short prompt reaches it only under a batch so large
//! that its summed stall is worth a whole TTFT budget. `R` is
//! [`LoadSnapshot::requests`](crate::sched::view::LoadSnapshot::requests):
//! the mesh's in-flight count there, or the engine's running + waiting when
//! larger (a waiting request waits behind the prefill too).
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `nonCachedTokens` | `0` | uncached prompt tokens that justify a prefill leg; `0` disables P/D (both rules) |
//! | `promptTokens` | `0` | minimum prompt length for the `nonCachedTokens` rule |
//! | `batchStallTokens` | `0` | kvmesh: uncached tokens x requests at the decode endpoint that justify a prefill leg; `0` turns the rule off (llm-d's behaviour) |
//!
//! `always-disagg-pd-decider`: always disaggregate (tests, benchmarks). No parameters.
//!
//! ```yaml
//! plugins:
//!   - type: prefix-based-pd-decider
//!     parameters:
//!       nonCachedTokens: 2048
//!       promptTokens: 1024
//!       batchStallTokens: 14300
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
    /// Minimum prompt length for the `nonCachedTokens` rule.
    pub prompt_tokens: u32,
    /// kvmesh: uncached tokens x requests at the decode endpoint that justify
    /// a prefill leg (0 = off: llm-d's behaviour).
    pub batch_stall_tokens: u64,
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
        let verdict = |disaggregate: bool, reason: String| Verdict {
            disaggregate,
            reason,
        };
        if p.non_cached_tokens == 0 {
            return verdict(false, "P/D off (nonCachedTokens 0)".to_owned());
        }
        let bs = if decode.prefix.block_size > 0 {
            decode.prefix.block_size
        } else {
            decode.load.block_size
        };
        let cached = u64::from(decode.prefix.matched_blocks) * u64::from(bs);
        let uncached = u64::from(req.prompt_tokens).saturating_sub(cached);
        // llm-d's rule first, with its reasons unchanged.
        let llm_d = if req.prompt_tokens < p.prompt_tokens {
            verdict(
                false,
                format!(
                    "prompt {} < promptTokens {}",
                    req.prompt_tokens, p.prompt_tokens
                ),
            )
        } else if uncached >= u64::from(p.non_cached_tokens) {
            return verdict(
                true,
                format!(
                    "uncached {uncached} >= nonCachedTokens {}",
                    p.non_cached_tokens
                ),
            );
        } else {
            verdict(
                false,
                format!(
                    "uncached {uncached} < nonCachedTokens {}",
                    p.non_cached_tokens
                ),
            )
        };
        if p.batch_stall_tokens == 0 {
            return llm_d;
        }
        // The load rule: every request at the decode pod would sit through
        // this prefill (the module doc has the physics).
        let requests = decode.load.requests();
        let stall = uncached.saturating_mul(u64::from(requests));
        let load = format!(
            "uncached {uncached} x {requests} requests = {stall} {} batchStallTokens {}",
            if stall >= p.batch_stall_tokens {
                ">="
            } else {
                "<"
            },
            p.batch_stall_tokens
        );
        if stall >= p.batch_stall_tokens {
            verdict(true, load)
        } else {
            verdict(false, format!("{}; {load}", llm_d.reason))
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
    use crate::sched::view::{LoadSnapshot, PrefixMatch};

    fn decider(non_cached: u32, min_prompt: u32, batch_stall: u64) -> PrefixBasedDecider {
        PrefixBasedDecider {
            params: PrefixBasedParams {
                non_cached_tokens: non_cached,
                prompt_tokens: min_prompt,
                batch_stall_tokens: batch_stall,
            },
        }
    }

    /// `prompt` tokens against a decode pod holding `hit_blocks` blocks of
    /// 16 of it, with `running` requests in its batch and `in_flight` from
    /// this mesh.
    fn on(
        d: &PrefixBasedDecider,
        prompt: u32,
        hit_blocks: u32,
        running: u32,
        in_flight: u32,
    ) -> Verdict {
        let req = RequestView {
            prompt_tokens: prompt,
            ..RequestView::default()
        };
        let ep = EndpointView {
            prefix: PrefixMatch {
                matched_blocks: hit_blocks,
                block_size: 16,
            },
            load: LoadSnapshot {
                running,
                in_flight,
                ..LoadSnapshot::default()
            },
            ..EndpointView::new("d")
        };
        d.decide(&req, &ep)
    }

    fn decide(non_cached: u32, min_prompt: u32, prompt: u32, hit_blocks: u32) -> Verdict {
        on(
            &decider(non_cached, min_prompt, 0),
            prompt,
            hit_blocks,
            0,
            0,
        )
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

    #[test]
    fn without_batch_stall_tokens_load_changes_nothing() {
        // llm-d's config: the same verdicts and reasons on an idle pod and
        // on one with 500 requests in its batch.
        let d = decider(2048, 1024, 0);
        for (running, in_flight) in [(0, 0), (500, 0), (0, 500)] {
            let v = on(&d, 1000, 0, running, in_flight);
            assert!(!v.disaggregate);
            assert_eq!(v.reason, "prompt 1000 < promptTokens 1024");
            let v = on(&d, 1500, 0, running, in_flight);
            assert!(!v.disaggregate);
            assert_eq!(v.reason, "uncached 1500 < nonCachedTokens 2048");
            let v = on(&d, 3000, 0, running, in_flight);
            assert!(v.disaggregate);
            assert_eq!(v.reason, "uncached 3000 >= nonCachedTokens 2048");
        }
    }

    #[test]
    fn batch_stall_splits_a_short_uncached_prompt_only_under_load() {
        let d = decider(2048, 1024, 14_300);
        // 1000 uncached tokens x 14 requests = 14000: below, kept whole,
        // with both rules' reasons.
        let v = on(&d, 1000, 0, 14, 0);
        assert!(!v.disaggregate);
        assert_eq!(
            v.reason,
            "prompt 1000 < promptTokens 1024; uncached 1000 x 14 requests = 14000 < batchStallTokens 14300"
        );
        // x 15 = 15000: split, below llm-d's prompt floor and uncached threshold.
        let v = on(&d, 1000, 0, 15, 0);
        assert!(v.disaggregate);
        assert_eq!(
            v.reason,
            "uncached 1000 x 15 requests = 15000 >= batchStallTokens 14300"
        );
        // The mesh's in-flight count counts when it is the larger.
        assert!(on(&d, 1000, 0, 2, 15).disaggregate);
        // Exactly at the threshold splits: 1100 x 13 = 14300.
        assert!(on(&d, 1100, 0, 13, 0).disaggregate);
        // Cached blocks do not stall anyone: 2000 - 75*16 = 800 uncached,
        // x 15 = 12000.
        let v = on(&d, 2000, 75, 15, 0);
        assert!(!v.disaggregate);
        assert_eq!(
            v.reason,
            "uncached 800 < nonCachedTokens 2048; uncached 800 x 15 requests = 12000 < batchStallTokens 14300"
        );
        // An idle pod: nobody to stall.
        assert!(!on(&d, 2000, 0, 0, 0).disaggregate);
        // llm-d's rule still splits on its own.
        assert!(on(&d, 3000, 0, 0, 0).disaggregate);
        // nonCachedTokens 0 turns P/D off, the load rule included.
        let off = decider(0, 0, 14_300);
        let v = on(&off, 100_000, 0, 1000, 0);
        assert!(!v.disaggregate);
        assert_eq!(v.reason, "P/D off (nonCachedTokens 0)");
    }

    #[test]
    fn batch_stall_tokens_is_parsed_and_checked() {
        let ok: PrefixBasedParams = crate::sched::params::parse(
            &serde_yaml_ng::from_str(
                "{nonCachedTokens: 2048, promptTokens: 1024, batchStallTokens: 14300}",
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(ok.batch_stall_tokens, 14_300);
        for bad in ["-1", "lots", "1.5"] {
            let v = serde_yaml_ng::from_str(&format!("{{batchStallTokens: {bad}}}")).unwrap();
            let e = crate::sched::params::parse::<PrefixBasedParams>(&v).unwrap_err();
            assert_eq!(e.path, "batchStallTokens", "{bad}: {e:?}");
        }
    }
}
