//! The workload each pool serves, measured: its arrival rate and the tokens
//! of an average request, from every pod's engine counters ([`EngineWork`])
//! and queue, sampled over a window.
//!
//! Arrivals are what finished plus what the pool took on: `Δfinished +
//! Δ(in system)`, so a pool that falls behind still shows the rate it is
//! asked for, not the rate it manages. A pod's requests in system are its
//! engine's `waiting + running`, or the sidecars' in-flight count to it
//! where that is larger ([`in_system`]): an engine counts a request only
//! from the step after it arrived. Requests the sidecars hold for a pool
//! (flow control) are in its system too. Tokens per request are ratios
//! of the counters' deltas over the same window (prompt, cached, generated
//! per finished request).
//!
//! Each pod is measured from its first sample inside the window to its
//! last, so a pod that joined during it adds what it served since, and one
//! that left (scaled down) what it took before it went; a counter that went
//! down (the engine restarted) counts from zero.

use std::collections::VecDeque;
use std::time::Duration;

use kvmesh_filters::sched::Role;
use serde::Serialize;
use tokio::time::Instant;

use crate::fleet::{EngineWork, HeldCounts, PodSnapshot};

/// One pod's counters at one sample.
#[derive(Debug, Clone)]
struct PodCount {
    id: String,
    role: Role,
    work: EngineWork,
    in_system: u64,
}

#[derive(Debug, Clone)]
struct Sample {
    at: Instant,
    pods: Vec<PodCount>,
    /// Requests the sidecars held for each pool (flow control), summed
    /// over every pod's sidecar.
    held: HeldCounts,
}

/// A pool's workload over the window.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Workload {
    /// Requests per second arriving at the pool.
    pub arrival_rate: f64,
    /// Per finished request: prompt tokens, of which not found cached
    /// (computed), and tokens generated.
    pub prompt_tokens: f64,
    pub uncached_tokens: f64,
    pub output_tokens: f64,
    /// The mean square of a finished request's prompt (tokens²), from the
    /// engines' prompt-length histograms ([`crate::fleet::PromptSpread`]);
    /// `None` where no pod of the pool exports one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_sq: Option<f64>,
    /// Seconds the rates span.
    pub window_s: f64,
}

/// The samples of the last window (and the one just before it, so a rate
/// always spans the whole window once the sidecar has run that long).
#[derive(Debug)]
pub struct History {
    window: Duration,
    samples: VecDeque<Sample>,
}

impl History {
    pub fn new(window: Duration) -> Self {
        Self {
            window,
            samples: VecDeque::new(),
        }
    }

    /// When the last sample was taken.
    pub fn last_at(&self) -> Option<Instant> {
        self.samples.back().map(|s| s.at)
    }

    /// Whether the samples span the whole window yet (a sidecar that
    /// started less than a window ago has not seen what its peers saw).
    pub fn is_full(&self) -> bool {
        match (self.samples.front(), self.samples.back()) {
            (Some(a), Some(b)) => b.at.saturating_duration_since(a.at) >= self.window,
            _ => false,
        }
    }

    /// Records the counters of every pod that reports them, and the
    /// requests every sidecar holds.
    pub fn record(&mut self, at: Instant, pods: &[PodSnapshot]) {
        let held = pods.iter().map(|p| p.held).sum();
        let pods = pods
            .iter()
            .filter(|p| p.load_age_ms.is_some())
            .filter_map(|p| {
                Some(PodCount {
                    id: p.info.id.clone(),
                    role: p.info.role,
                    work: p.load.work?,
                    in_system: in_system(p),
                })
            })
            .collect();
        self.samples.push_back(Sample { at, pods, held });
        // Keep one sample at or before the window's start, none older.
        while self
            .samples
            .get(1)
            .is_some_and(|s| at.saturating_duration_since(s.at) >= self.window)
        {
            self.samples.pop_front();
        }
    }

    /// The workload of the pods of `role` over the window; `None` until two
    /// samples span some time, or when no request of the pool finished in
    /// the window (tokens per request are then unknown).
    pub fn workload(&self, role: Role) -> Option<Workload> {
        self.workload_over(role, self.samples.len())
    }

    /// The arrival rate of the pods of `role` over the last `samples`
    /// samples only (at least two), and the seconds they span: what the
    /// window's average has not caught up with yet when the rate jumps.
    pub fn recent_rate(&self, role: Role, samples: usize) -> Option<(f64, f64)> {
        let w = self.workload_over(role, samples.max(2))?;
        Some((w.arrival_rate, w.window_s))
    }

    fn workload_over(&self, role: Role, samples: usize) -> Option<Workload> {
        let skip = self.samples.len().saturating_sub(samples);
        let (first, last) = (self.samples.get(skip)?, self.samples.back()?);
        let span = last.at.saturating_duration_since(first.at).as_secs_f64();
        if span <= 0.0 {
            return None;
        }
        let (mut finished, mut prompt, mut cached, mut generated) = (0u64, 0u64, 0u64, 0u64);
        // Over the pods whose engines export the prompt histogram: finished,
        // prompt tokens, and the histogram's two sums.
        let mut spread = [0u64; 4];
        let mut in_system_change = 0i64;
        // Every pod of the pool seen in the span, from its first sample in it
        // to its last: a pod that left (scaled down, or its load went stale)
        // still counts what it took while it was there.
        let in_span: Vec<&Sample> = self.samples.iter().skip(skip).collect();
        let mut ids: Vec<&str> = Vec::new();
        for p in in_span.iter().flat_map(|s| &s.pods) {
            if p.role == role && !ids.contains(&p.id.as_str()) {
                ids.push(&p.id);
            }
        }
        for id in ids {
            let mut seen = in_span
                .iter()
                .filter_map(|s| s.pods.iter().find(|p| p.id == id));
            let Some(then) = seen.next() else {
                continue;
            };
            let now = seen.next_back().unwrap_or(then);
            let delta = |a: u64, b: u64| if a >= b { a - b } else { a };
            finished += delta(now.work.finished, then.work.finished);
            prompt += delta(now.work.prompt_tokens, then.work.prompt_tokens);
            cached += delta(now.work.cached_tokens, then.work.cached_tokens);
            generated += delta(now.work.generation_tokens, then.work.generation_tokens);
            if let (Some(a), Some(b)) = (now.work.prompt_spread, then.work.prompt_spread) {
                for (sum, d) in spread.iter_mut().zip([
                    delta(now.work.finished, then.work.finished),
                    delta(now.work.prompt_tokens, then.work.prompt_tokens),
                    delta(a.tokens, b.tokens),
                    delta(a.tokens_sq, b.tokens_sq),
                ]) {
                    *sum = sum.saturating_add(d);
                }
            }
            in_system_change += i64::try_from(now.in_system).unwrap_or(i64::MAX)
                - i64::try_from(then.in_system).unwrap_or(i64::MAX);
        }
        // Requests held for the pool (flow control) were asked of it too.
        in_system_change += i64::from(last.held.of(role)) - i64::from(first.held.of(role));
        if finished == 0 {
            return None;
        }
        let arrivals = (finished as f64 + in_system_change as f64).max(0.0);
        let per = |n: u64| n as f64 / finished as f64;
        Some(Workload {
            arrival_rate: arrivals / span,
            prompt_tokens: per(prompt),
            uncached_tokens: per(prompt.saturating_sub(cached)),
            output_tokens: per(generated),
            prompt_tokens_sq: mean_square(spread),
            window_s: span,
        })
    }
}

/// The requests a pod holds: its engine's queue and batch, or what the
/// sidecars have in flight to it when that is more. An engine takes new
/// requests in between its steps, so while a prefill pod runs a long step
/// the requests sent to it meanwhile are in no count of its own yet: the
/// mesh's count shows them a step earlier, and a burst with them.
fn in_system(p: &PodSnapshot) -> u64 {
    let engine = u64::from(p.load.waiting) + u64::from(p.load.running);
    let mesh = u64::from(p.in_flight_local) + u64::from(p.in_flight_mesh);
    engine.max(mesh)
}

/// The mean square of a prompt from `[finished, prompt tokens, histogram
/// tokens, histogram tokens²]` summed over a window: the histogram's mean
/// square, scaled by how far its mean is from the exact counters' (bucket
/// midpoints sit off the prompts they hold).
fn mean_square([finished, prompt, tokens, tokens_sq]: [u64; 4]) -> Option<f64> {
    if finished == 0 || tokens == 0 || prompt == 0 {
        return None;
    }
    let scale = prompt as f64 / tokens as f64;
    Some(tokens_sq as f64 / finished as f64 * scale * scale)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Pod `id` of `role` that has finished `finished` requests of 1000
    /// prompt tokens (400 cached) and 200 generated, `in_system` waiting.
    fn pod(id: &str, role: Role, finished: u64, in_system: u32) -> PodSnapshot {
        let mut p = crate::autoscale::tests::pod(role, in_system, 0.0, Some(10));
        p.info.id = id.to_owned();
        p.load.work = Some(EngineWork {
            finished,
            prompt_tokens: finished * 1000,
            cached_tokens: finished * 400,
            generation_tokens: finished * 200,
            prompt_spread: None,
        });
        p
    }

    #[test]
    fn requests_sidecars_hold_for_a_pool_are_its_arrivals() {
        let t0 = Instant::now();
        let mut h = History::new(Duration::from_secs(60));
        let mut a = pod("a", Role::Prefill, 100, 2);
        h.record(t0, std::slice::from_ref(&a));
        // 10 s later: 20 finished, and flow control holds 30 more for the
        // prefill pool in some sidecar (on a decode pod, say).
        a.load.work.as_mut().unwrap().finished = 120;
        a.load.work.as_mut().unwrap().prompt_tokens = 120_000;
        a.load.work.as_mut().unwrap().cached_tokens = 48_000;
        a.load.work.as_mut().unwrap().generation_tokens = 24_000;
        let mut holder = pod("d", Role::Decode, 0, 0);
        holder.load.work = None;
        holder.held.prefill = 30;
        h.record(t0 + Duration::from_secs(10), &[a, holder]);
        let w = h.workload(Role::Prefill).unwrap();
        assert!(
            (w.arrival_rate - 5.0).abs() < 1e-9,
            "(20 + 30) / 10 s: {w:?}"
        );
        assert_eq!(
            h.workload(Role::Decode),
            None,
            "held for prefill, not decode"
        );
    }

    #[test]
    fn arrivals_count_what_finished_and_what_queued_and_tokens_are_per_finished_request() {
        let t0 = Instant::now();
        let mut h = History::new(Duration::from_secs(60));
        assert_eq!(h.workload(Role::Both), None);
        h.record(
            t0,
            &[pod("a", Role::Both, 100, 0), pod("b", Role::Both, 50, 2)],
        );
        assert_eq!(h.workload(Role::Both), None, "one sample spans no time");
        // 10 s later: 40 + 20 finished, a's queue grew by 10.
        h.record(
            t0 + Duration::from_secs(10),
            &[pod("a", Role::Both, 140, 10), pod("b", Role::Both, 70, 2)],
        );
        let w = h.workload(Role::Both).unwrap();
        assert!((w.arrival_rate - 7.0).abs() < 1e-9, "{w:?}"); // (60 + 10) / 10 s
        assert!((w.prompt_tokens - 1000.0).abs() < 1e-9);
        assert!((w.uncached_tokens - 600.0).abs() < 1e-9);
        assert!((w.output_tokens - 200.0).abs() < 1e-9);
        assert_eq!(h.workload(Role::Decode), None, "no pod of the pool");
    }

    #[test]
    fn requests_the_mesh_sent_that_the_engine_does_not_count_yet_are_arrivals() {
        let t0 = Instant::now();
        let mut h = History::new(Duration::from_secs(60));
        h.record(t0, &[pod("a", Role::Prefill, 100, 1)]);
        // 10 s later: 20 finished; the engine, mid-step, counts 1 waiting,
        // but the sidecars have 9 in flight to it.
        let mut busy = pod("a", Role::Prefill, 120, 1);
        busy.in_flight_local = 4;
        busy.in_flight_mesh = 5;
        h.record(t0 + Duration::from_secs(10), &[busy]);
        let w = h.workload(Role::Prefill).unwrap();
        // (20 finished + 9 in flight - 1 before) / 10 s.
        assert!((w.arrival_rate - 2.8).abs() < 1e-9, "{w:?}");
        // Once the engine counts them, the arrivals are not counted twice:
        // the same 28 over 20 s.
        let mut caught_up = pod("a", Role::Prefill, 120, 9);
        caught_up.in_flight_local = 9;
        h.record(t0 + Duration::from_secs(20), &[caught_up]);
        let w = h.workload(Role::Prefill).unwrap();
        assert!((w.arrival_rate - 1.4).abs() < 1e-9, "{w:?}");
    }

    #[test]
    fn a_pod_that_joins_counts_from_its_first_sample_and_a_restart_from_zero() {
        let t0 = Instant::now();
        let mut h = History::new(Duration::from_secs(60));
        h.record(t0, &[pod("a", Role::Decode, 100, 0)]);
        h.record(
            t0 + Duration::from_secs(5),
            &[
                pod("a", Role::Decode, 110, 0),
                pod("new", Role::Decode, 3, 0),
            ],
        );
        // a restarted: its counter went down, so all 4 are new.
        h.record(
            t0 + Duration::from_secs(10),
            &[
                pod("a", Role::Decode, 4, 0),
                pod("new", Role::Decode, 13, 0),
            ],
        );
        let w = h.workload(Role::Decode).unwrap();
        assert!((w.arrival_rate - 1.4).abs() < 1e-9, "{w:?}"); // (4 + 10) / 10 s
    }

    #[test]
    fn a_pod_that_left_during_the_window_still_counts_what_it_took() {
        let t0 = Instant::now();
        let mut h = History::new(Duration::from_secs(60));
        let both = |a: u64, b: u64| [pod("a", Role::Prefill, a, 0), pod("b", Role::Prefill, b, 1)];
        h.record(t0, &both(100, 100));
        h.record(t0 + Duration::from_secs(5), &both(110, 110));
        // b is scaled down: gone from the fleet the hook reads.
        h.record(
            t0 + Duration::from_secs(10),
            &[pod("a", Role::Prefill, 120, 0)],
        );
        let w = h.workload(Role::Prefill).unwrap();
        // a took 20 and b 10 (its one in flight unchanged): 30 in 10 s.
        assert!((w.arrival_rate - 3.0).abs() < 1e-9, "{w:?}");
        // Over the last two samples b is not seen twice: a's 10 in 5 s.
        let (recent, _) = h.recent_rate(Role::Prefill, 2).unwrap();
        assert!((recent - 2.0).abs() < 1e-9, "{recent}");
    }

    #[test]
    fn the_window_keeps_one_sample_before_its_start() {
        let t0 = Instant::now();
        let mut h = History::new(Duration::from_secs(10));
        for (i, f) in [0u64, 10, 20, 30, 40].into_iter().enumerate() {
            h.record(
                t0 + Duration::from_secs(5 * i as u64),
                &[pod("a", Role::Prefill, f, 0)],
            );
        }
        // Samples at 10, 15 and 20 s remain: the rate spans 10 s.
        let w = h.workload(Role::Prefill).unwrap();
        assert!((w.window_s - 10.0).abs() < 1e-9, "{w:?}");
        assert!((w.arrival_rate - 2.0).abs() < 1e-9);
        // The rate jumps: 50 finished in the last 5 s.
        h.record(
            t0 + Duration::from_secs(25),
            &[pod("a", Role::Prefill, 90, 0)],
        );
        let long = h.workload(Role::Prefill).unwrap().arrival_rate;
        let (recent, span) = h.recent_rate(Role::Prefill, 2).unwrap();
        assert!((recent - 10.0).abs() < 1e-9, "{recent}");
        assert!((span - 5.0).abs() < 1e-9, "{span}");
        assert!((long - 6.0).abs() < 1e-9, "{long}"); // (90 - 30) / 10 s
    }

    #[test]
    fn the_prompts_mean_square_comes_from_the_histogram_scaled_to_the_exact_mean() {
        let t0 = Instant::now();
        let mut h = History::new(Duration::from_secs(60));
        let spread = |finished: u64| {
            let mut p = pod("a", Role::Prefill, finished, 0);
            if let Some(w) = p.load.work.as_mut() {
                // Bucket means 10% above the exact 1000 tokens a prompt.
                w.prompt_spread = Some(crate::fleet::PromptSpread {
                    tokens: finished * 1100,
                    tokens_sq: finished * 1100 * 1100 * 2,
                });
            }
            p
        };
        h.record(t0, &[spread(10)]);
        h.record(t0 + Duration::from_secs(10), &[spread(30)]);
        let w = h.workload(Role::Prefill).unwrap();
        // 2 × 1100² scaled by (1000 / 1100)²: 2 × 1000².
        let sq = w.prompt_tokens_sq.unwrap();
        assert!((sq - 2.0e6).abs() < 1.0, "{w:?}");
        // A pool without the histogram has no spread.
        h.record(
            t0 + Duration::from_secs(20),
            &[pod("b", Role::Decode, 5, 0)],
        );
        h.record(
            t0 + Duration::from_secs(30),
            &[pod("b", Role::Decode, 9, 0)],
        );
        assert_eq!(h.workload(Role::Decode).unwrap().prompt_tokens_sq, None);
    }
}
