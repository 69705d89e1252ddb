//! `eviction-cost-scorer`: when every pod's KV is full and some pods'
//! caches earn nothing (they thrash), send the requests no pod holds to one
//! of those pods, the same one from every sidecar, so that the other pods
//! keep the prefix groups they hold and hit on them, instead of every pod
//! thrashing.
//!
//! Why: an engine's prefix cache evicts least recently used blocks. Groups
//! that arrive in a cycle longer than what a pod's KV holds (group 0, 1, …,
//! G−1, 0, 1, …) are each evicted just before they come back, on every pod
//! they are spread over: round-robin and a home per group (when a pod is
//! home to more groups than it holds) both hit nothing. A pod that takes no
//! new groups once full keeps what it holds and hits on it every cycle; the
//! groups that do not fit all go to one pod, which thrashes alone.
//!
//! * **Cold request** (no candidate holds `coldShare` or more of its
//!   prompt's blocks). The request *fits* a pod while the prompt tokens this
//!   scheduler sent there to compute, and those it would compute there, stay
//!   within its KV (`num_blocks × block_size`; vLLM frees cached blocks only
//!   to admit others, so what was computed there stays until evicted). A pod
//!   it does not fit is *cheap* when its recent hit share (prompt tokens
//!   served from its cache over those sent there, decayed over `halfLife`
//!   decisions) is below `cheapHitShare`: what it would evict earns little. The *sink* is the first cheap candidate in a
//!   fixed order of the pods' ids (the same in every sidecar, so that when
//!   every pod thrashes they all agree on one), skipping pods whose load is
//!   over `(1 + loadFactor)` times the candidates' mean (as
//!   `prefix-affinity-scorer` bounds a home). With a sink, every pod the
//!   request fits scores 1 (it evicts nothing), the sink 1 when no pod fits
//!   and 0.5 when one does, and the other pods 0; without a sink, every
//!   candidate scores 1.
//! * **Warm request**: 1 for every candidate; the prefix scorers decide.
//! * A pod that does not report its KV size (`num_blocks` 0) always fits,
//!   and while every pod's cache earns hits nothing is cheap: the scorer
//!   changes nothing until some pod's full cache earns nothing.
//! * A pod this scheduler sent nothing to in `forgetAfter` decisions is
//!   forgotten, and fits again: a pod that is no sink and whose groups
//!   stopped coming (or whose cache was emptied: an engine restart) would
//!   otherwise never be sent a cold request again.
//!
//! The state is, per endpoint id, the decayed hit and computed prompt tokens
//! and the tokens computed there since it was first seen, updated after
//! each real decision (the target, and a P/D split's prefill pod, whose
//! cache the prompt fills too). At most `maxEndpoints` ids are kept; when
//! full, the one updated longest ago is forgotten. No clock is read: recency
//! is the order of decisions.
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `coldShare` | `0.5` | a request whose best candidate holds less than this share of its prompt's blocks is cold (0..=1) |
//! | `cheapHitShare` | `0.2` | a full pod whose recent hit share is below this is cheap to evict from (0..=1) |
//! | `loadFactor` | `0.25` | a cheap pod over `(1 + loadFactor)` × the mean load is no sink (≥ 0) |
//! | `halfLife` | `256` | decisions after which a recorded token counts half (≥ 1) |
//! | `forgetAfter` | `512` | decisions without a request sent to a pod after which it is forgotten (≥ 1) |
//! | `maxEndpoints` | `1024` | endpoint ids remembered (≥ 1) |
//!
//! ```yaml
//! plugins:
//!   - type: eviction-cost-scorer
//!     parameters:
//!       cheapHitShare: 0.2
//! ```

use std::collections::HashMap;

use parking_lot::Mutex;
use serde::Deserialize;
use xxhash_rust::xxh3::Xxh3DefaultBuilder;

use crate::sched::decision::Route;
use crate::sched::error::ParamError;
use crate::sched::params::check_range;
use crate::sched::plugin::Scorer;
use crate::sched::scorers::affinity::weight;
use crate::sched::view::{EndpointView, RequestView};

/// Type name.
pub const TYPE: &str = "eviction-cost-scorer";

/// The anchor of the fixed pod order: any constant every sidecar shares.
const ORDER_ANCHOR: u64 = 0x6576_6963_7469_6f6e;

/// Parameters of `eviction-cost-scorer`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct EvictionCostParams {
    /// Below this share of the prompt's blocks held anywhere, a request is cold.
    pub cold_share: f64,
    /// Below this recent hit share, a full pod is cheap to evict from.
    pub cheap_hit_share: f64,
    /// Headroom over the mean load before a cheap pod is no sink.
    pub load_factor: f64,
    /// Decisions after which a recorded token counts half.
    pub half_life: u32,
    /// Decisions without a request sent to a pod after which it is forgotten.
    pub forget_after: u64,
    /// Endpoint ids remembered.
    pub max_endpoints: usize,
}

impl Default for EvictionCostParams {
    fn default() -> Self {
        EvictionCostParams {
            cold_share: 0.5,
            cheap_hit_share: 0.2,
            load_factor: 0.25,
            half_life: 256,
            forget_after: 512,
            max_endpoints: 1024,
        }
    }
}

impl EvictionCostParams {
    /// Ranges.
    pub fn validate(&self) -> Result<(), ParamError> {
        check_range("coldShare", self.cold_share, 0.0, 1.0)?;
        check_range("cheapHitShare", self.cheap_hit_share, 0.0, 1.0)?;
        if !(self.load_factor.is_finite() && self.load_factor >= 0.0) {
            return Err(ParamError::invalid(
                "loadFactor",
                "must be a finite number ≥ 0",
            ));
        }
        if self.half_life == 0 {
            return Err(ParamError::invalid("halfLife", "must be at least 1"));
        }
        if self.forget_after == 0 {
            return Err(ParamError::invalid("forgetAfter", "must be at least 1"));
        }
        if self.max_endpoints == 0 {
            return Err(ParamError::invalid("maxEndpoints", "must be at least 1"));
        }
        Ok(())
    }
}

/// What one endpoint's cache earned and cost recently.
#[derive(Debug, Clone, Copy, Default)]
struct PodStats {
    /// Prompt tokens served from its cache, decayed.
    hits: f64,
    /// Prompt tokens computed there, decayed.
    computed: f64,
    /// Prompt tokens computed there since first seen (not decayed).
    admitted: u64,
    /// The decision after which `hits` and `computed` were last decayed:
    /// the last that sent it a request.
    at: u64,
}

#[derive(Debug, Default)]
struct State {
    pods: HashMap<String, PodStats, Xxh3DefaultBuilder>,
    /// Real decisions seen.
    seq: u64,
}

/// Sends cold requests to a full pod whose cache earns little.
#[derive(Debug)]
pub struct EvictionCostScorer {
    params: EvictionCostParams,
    state: Mutex<State>,
}

impl EvictionCostScorer {
    /// A scorer with no history.
    pub fn new(params: EvictionCostParams) -> Self {
        EvictionCostScorer {
            params,
            state: Mutex::new(State::default()),
        }
    }

    fn decay(&self, s: &mut PodStats, now: u64) {
        let age = now.saturating_sub(s.at) as f64;
        let keep = 0.5f64.powf(age / f64::from(self.params.half_life.max(1)));
        s.hits *= keep;
        s.computed *= keep;
        s.at = now;
    }

    /// Whether no candidate holds `coldShare` of the prompt's blocks.
    fn is_cold(&self, req: &RequestView, eps: &[EndpointView], cands: &[usize]) -> bool {
        let blocks = f64::from(req.prompt_blocks);
        cands.iter().all(|&i| {
            f64::from(eps[i].prefix.matched_blocks.min(req.prompt_blocks))
                < self.params.cold_share * blocks
        })
    }

    fn record(&self, state: &mut State, req: &RequestView, ep: &EndpointView) {
        let computed = req.uncached_tokens(&ep.prefix);
        let hit = u64::from(req.prompt_tokens).saturating_sub(computed);
        let now = state.seq;
        let mut stats = self.stats(state, ep).copied().unwrap_or(PodStats {
            at: now,
            ..PodStats::default()
        });
        self.decay(&mut stats, now);
        stats.hits += hit as f64;
        stats.computed += computed as f64;
        stats.admitted = stats.admitted.saturating_add(computed);
        state.pods.insert(ep.id.clone(), stats);
        if state.pods.len() > self.params.max_endpoints.max(1) {
            let oldest = state
                .pods
                .iter()
                .min_by_key(|(_, s)| s.at)
                .map(|(id, _)| id.clone());
            if let Some(id) = oldest {
                state.pods.remove(&id);
            }
        }
    }

    /// What `state` remembers of `ep`: nothing once it was sent no request
    /// in `forgetAfter` decisions.
    fn stats<'s>(&self, state: &'s State, ep: &EndpointView) -> Option<&'s PodStats> {
        state
            .pods
            .get(&ep.id)
            .filter(|s| state.seq.saturating_sub(s.at) < self.params.forget_after)
    }

    /// Whether `req` fits in what is left of `ep`'s KV: the tokens it would
    /// compute there and those already sent there within its capacity (no
    /// capacity reported, or nothing remembered: it fits).
    fn fits(&self, state: &State, req: &RequestView, ep: &EndpointView) -> bool {
        let capacity = ep.load.kv_capacity_tokens();
        let need = req.uncached_tokens(&ep.prefix);
        capacity == 0
            || self
                .stats(state, ep)
                .is_none_or(|s| s.admitted.saturating_add(need) <= capacity)
    }

    /// Whether `req` does not fit in `ep`'s KV and its cache earns less than
    /// `cheapHitShare`.
    fn is_cheap(&self, state: &State, req: &RequestView, ep: &EndpointView) -> bool {
        if self.fits(state, req, ep) {
            return false;
        }
        let Some(stats) = self.stats(state, ep) else {
            return false;
        };
        // The share is a ratio of two sums decayed alike: no need to decay them first.
        let sent = stats.hits + stats.computed;
        sent > 0.0 && stats.hits < self.params.cheap_hit_share * sent
    }
}

impl Scorer for EvictionCostScorer {
    fn score(&self, req: &RequestView, eps: &[EndpointView], cands: &[usize], out: &mut [f64]) {
        out.fill(1.0);
        if req.prompt_blocks == 0 || !self.is_cold(req, eps, cands) {
            return;
        }
        let total: u64 = cands
            .iter()
            .map(|&i| u64::from(eps[i].load.requests()))
            .sum();
        let bound = (1.0 + self.params.load_factor) * (total + 1) as f64 / cands.len() as f64;
        let state = self.state.lock();
        let sink = cands
            .iter()
            .enumerate()
            .filter(|&(_, &i)| {
                f64::from(eps[i].load.requests().saturating_add(1)) <= bound.ceil()
                    && self.is_cheap(&state, req, &eps[i])
            })
            .max_by_key(|&(_, &i)| weight(ORDER_ANCHOR, &eps[i].id))
            .map(|(pos, _)| pos);
        let Some(sink) = sink else {
            return;
        };
        let mut any_fits = false;
        for (pos, &i) in cands.iter().enumerate() {
            if self.fits(&state, req, &eps[i]) {
                any_fits = true;
            } else {
                out[pos] = 0.0;
            }
        }
        // A pod the request fits evicts nothing: it goes before the sink.
        out[sink] = if any_fits { 0.5 } else { 1.0 };
    }

    fn post_decision(&self, req: &RequestView, eps: &[EndpointView], route: &Route, _now: u64) {
        let mut state = self.state.lock();
        state.seq += 1;
        for choice in route.prefill().into_iter().chain([route.primary()]) {
            if let Some(ep) = eps.get(choice.index) {
                self.record(&mut state, req, ep);
            }
        }
    }
}

#[cfg(test)]
mod tests;
