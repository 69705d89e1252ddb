//! The plugin traits: [`Filter`] narrows the candidate set, [`Scorer`] rates
//! each candidate in [0, 1], [`Picker`] ranks the survivors by their weighted
//! totals, [`PdDecider`] says whether a request is worth a prefill leg, and
//! [`ProfileHandler`] decides which profiles run and how their results make a
//! route. Candidates are indices into the caller's endpoint slice, so a cycle
//! copies no endpoint data.

use crate::sched::decision::Route;
use crate::sched::error::ScheduleError;
use crate::sched::view::{EndpointView, RequestView};

/// Narrows the candidate set. Must only remove entries, never add or reorder
/// them; the scheduler relies on this to never return a filtered endpoint.
pub trait Filter: Send + Sync {
    /// Remove from `candidates` (indices into `endpoints`) what must not serve `req`.
    fn filter(&self, req: &RequestView, endpoints: &[EndpointView], candidates: &mut Vec<usize>);
}

/// Rates candidates. `out[i]` is the score of `endpoints[candidates[i]]`, in [0, 1].
pub trait Scorer: Send + Sync {
    /// Write one score per candidate into `out` (same length as `candidates`).
    fn score(
        &self,
        req: &RequestView,
        endpoints: &[EndpointView],
        candidates: &[usize],
        out: &mut [f64],
    );

    /// Called once after a real (not dry-run) decision, for scorers that learn
    /// from what was chosen. `now_ms` is the caller's clock.
    fn post_decision(
        &self,
        _req: &RequestView,
        _endpoints: &[EndpointView],
        _route: &Route,
        _now_ms: u64,
    ) {
    }
}

/// What a picker may use besides the scores.
#[derive(Debug)]
pub struct PickCtx {
    /// Seeded by the caller: the same seed gives the same decision.
    pub rng: SchedRng,
    /// A `/debug/route` what-if: stateful pickers must not advance.
    pub dry_run: bool,
}

/// Ranks candidates by their weighted totals.
pub trait Picker: Send + Sync {
    /// Push positions into `candidates` / `totals` onto `out`, best first, each
    /// at most once. The first is the choice, the rest are fallbacks.
    fn pick(
        &self,
        ctx: &mut PickCtx,
        endpoints: &[EndpointView],
        candidates: &[usize],
        totals: &[f64],
        out: &mut Vec<usize>,
    );
}

/// A decider's verdict, with the reason that goes into the trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Run a prefill leg.
    pub disaggregate: bool,
    /// Human-readable reason, e.g. `uncached 4100 >= nonCachedTokens 2048`.
    pub reason: String,
}

/// Decides, given the chosen decode endpoint, whether a prefill leg pays.
pub trait PdDecider: Send + Sync {
    /// The verdict for `req` on `decode`.
    fn decide(&self, req: &RequestView, decode: &EndpointView) -> Verdict;
}

/// The ranked result of running one profile: endpoint indices, best first, never empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProfileResult {
    /// Indices into the endpoint slice.
    pub ranked: Vec<usize>,
}

/// Runs a named profile for the current request (the scheduler implements it
/// and records each run in the trace).
pub trait ProfileRunner {
    /// Run `profile`: filters, scorers, picker.
    fn run(&mut self, profile: &str) -> Result<ProfileResult, ScheduleError>;
}

/// What a handler decided, before ids are resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandlerOutcome {
    /// One endpoint serves the whole request.
    Aggregated {
        /// Ranked endpoint indices.
        ranked: Vec<usize>,
        /// Why.
        reason: String,
    },
    /// A prefill leg, then a decode leg.
    Disaggregated {
        /// Ranked prefill endpoint indices.
        prefill: Vec<usize>,
        /// Ranked decode endpoint indices.
        decode: Vec<usize>,
        /// Why.
        reason: String,
    },
}

/// Decides which profiles run and how their results combine.
pub trait ProfileHandler: Send + Sync {
    /// The profile names this handler runs (checked against the config at load).
    fn profiles(&self) -> Vec<String>;

    /// Run profiles through `runner` and combine their results.
    fn handle(
        &self,
        runner: &mut dyn ProfileRunner,
        req: &RequestView,
        endpoints: &[EndpointView],
    ) -> Result<HandlerOutcome, ScheduleError>;
}

/// A small, fast, seedable generator (SplitMix64). Decisions must be
/// reproducible from `rng_seed`, so no global or OS randomness is used.
#[derive(Debug, Clone)]
pub struct SchedRng(u64);

impl SchedRng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SchedRng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform float in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        // 53 random bits: exactly representable, never 1.0.
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A uniform index below `n` (`n > 0`; 0 when `n == 0`).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        // Multiply-shift: unbiased enough for load spreading, no division.
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}
