//! Capacity at SLO, measured rather than read off the grid: the grid brackets
//! each router's capacity between its highest passing rate and the first
//! rate it misses, and bisection narrows that bracket with a few more rates
//! (each run over every seed, like a grid rate) until the first miss lies
//! within [`TOLERANCE`] of the capacity, or [`MAX_PROBES`] rates were added.
//!
//! One rule throughout, the grid's: a rate passes when the medians over
//! seeds meet the SLO with no failed request ([`sweep::meets`]), and the
//! capacity is the highest rate that passes with every lower rate measured
//! passing too ([`sweep::capacity`]). Probes only ever fall inside the
//! bracket, so they refine that rule and never contradict it. The true
//! capacity lies in `[capacity, first miss)`: the report gives both.

use super::sweep::{self, Point, Run, Slo};

/// The bracket is closed when the first miss is within this share above the
/// capacity (so the capacity is known to within 5%).
pub const TOLERANCE: f64 = 0.05;
/// At most this many rates added per router and workload (the full run's
/// default): each costs a run per seed in real time. From a grid bracket of
/// 1.33x (45 to 60, 60 to 80) three close it to 5%.
pub const MAX_PROBES: usize = 3;
/// `--quick`'s default: one, which halves the grid's bracket, to stay within
/// its 10 minutes.
pub const QUICK_PROBES: usize = 1;
/// Probes are rounded to this (simulated req/s), for readable tables.
const STEP: f64 = 0.25;

/// A router's capacity bracket: the capacity (`None`: not even the lowest
/// rate measured passes) and the lowest measured rate above it, which
/// misses (`None`: every measured rate passes).
pub fn bracket(points: &[Point], router: &str, slo: &Slo) -> [Option<f64>; 2] {
    let cap = sweep::capacity(points, router, slo);
    let above = points
        .iter()
        .filter(|p| p.router == router)
        .map(|p| p.rate)
        .filter(|&r| cap.is_none_or(|c| r > c))
        .reduce(f64::min);
    [cap, above]
}

/// The next rate to run for `router`, or `None` when its bracket is closed.
///
/// * capacity and a miss above it: their midpoint, until the miss is within
///   [`TOLERANCE`] of the capacity;
/// * a miss at the lowest rate: half of it (the bracket is `(0, miss)`);
/// * no miss: the grid continued, one step (its last) above the highest
///   rate, or 1.5x it with one rate measured.
pub fn next_probe(points: &[Point], router: &str, slo: &Slo) -> Option<f64> {
    let probe = match bracket(points, router, slo) {
        [Some(c), Some(miss)] if miss - c <= TOLERANCE * c => return None,
        [Some(c), Some(miss)] => (c + miss) / 2.0,
        [None, Some(miss)] => miss / 2.0,
        [Some(c), None] => {
            let below = points
                .iter()
                .filter(|p| p.router == router && p.rate < c)
                .map(|p| p.rate)
                .reduce(f64::max);
            c + below.map_or(c / 2.0, |b| c - b)
        }
        [None, None] => return None,
    };
    let rounded = (probe / STEP).round() * STEP;
    // Rounding must not land on a measured rate (a bracket this narrow is
    // already finer than the rounding).
    let measured = points
        .iter()
        .any(|p| p.router == router && p.rate == rounded);
    (rounded > 0.0 && !measured).then_some(rounded)
}

/// Each seed's capacity on its own (its runs alone judged by the SLO, at the
/// rates measured), in the order of `seeds`: the spread the median hides.
pub fn per_seed(runs: &[Run], router: &str, seeds: &[u64], slo: &Slo) -> Vec<Option<f64>> {
    seeds
        .iter()
        .map(|&seed| {
            let mine: Vec<Run> = runs
                .iter()
                .filter(|r| r.router == router && r.seed == seed)
                .cloned()
                .collect();
            sweep::capacity(&sweep::points(&mine), router, slo)
        })
        .collect()
}

/// The largest computed-to-ideal ratio (medians over seeds) at the rates up
/// to `capacity`; at the lowest rate measured when there is no capacity, so
/// that every router that ran has one.
pub fn computed_vs_ideal(points: &[Point], router: &str, capacity: Option<f64>) -> Option<f64> {
    let mine = points.iter().filter(|p| p.router == router);
    match capacity {
        Some(c) => mine
            .filter(|p| p.rate <= c)
            .filter_map(|p| p.computed_vs_ideal)
            .reduce(f64::max),
        None => mine
            .filter(|p| p.computed_vs_ideal.is_some())
            .min_by(|a, b| a.rate.total_cmp(&b.rate))
            .and_then(|p| p.computed_vs_ideal),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLO: Slo = Slo {
        ttft_p90_ms: 1000.0,
        itl_p99_ms: 100.0,
    };

    /// A router whose TTFT p90 crosses the SLO at `knee` req/s.
    fn point(router: &str, rate: f64, knee: f64) -> Point {
        let ttft = if rate <= knee { 500.0 } else { 2000.0 };
        let run = Run {
            router: router.to_owned(),
            rate,
            seed: 1,
            requests: 10,
            errors: 0,
            ttft_p50_ms: Some(ttft),
            ttft_p90_ms: Some(ttft),
            ttft_p99_ms: Some(ttft),
            itl_p50_ms: Some(50.0),
            itl_p99_ms: Some(50.0),
            e2e_p50_ms: Some(ttft),
            hit_rate: None,
            computed_tokens: (rate * 10.0) as u64,
            computed_per_engine: vec![],
            preemptions: 0,
            recomputed_tokens: 0,
            placement_replay_vs_ideal: None,
            prefix_computes: None,
            ideal_computed_tokens: Some(100),
            requests_per_engine: vec![],
            goodput: 1.0,
            sent_share: None,
        };
        sweep::points(&[run]).remove(0)
    }

    /// Bisects `knee` from `grid` the way the benchmark does.
    fn bisect(grid: &[f64], knee: f64) -> (Vec<Point>, usize) {
        let mut points: Vec<Point> = grid.iter().map(|&r| point("a", r, knee)).collect();
        let mut probes = 0;
        while probes < MAX_PROBES {
            let Some(rate) = next_probe(&points, "a", &SLO) else {
                break;
            };
            points.push(point("a", rate, knee));
            probes += 1;
        }
        (points, probes)
    }

    #[test]
    fn three_probes_close_a_bracket_of_the_grid_to_five_percent() {
        // 45 passes, 60 misses: 52.5 passes, 56.25 misses, 54.5 passes.
        let (points, probes) = bisect(&[30.0, 45.0, 60.0], 55.0);
        assert_eq!(probes, 3);
        let [cap, miss] = bracket(&points, "a", &SLO);
        let (cap, miss) = (cap.unwrap(), miss.unwrap());
        assert!(cap <= 55.0 && 55.0 < miss, "{cap} {miss}");
        assert!(miss - cap <= TOLERANCE * cap, "{cap} {miss}");
        assert_eq!(next_probe(&points, "a", &SLO), None);
    }

    #[test]
    fn brackets_open_below_and_above_the_grid() {
        // Missing at the lowest rate: probe half of it.
        let low = [point("a", 40.0, 10.0), point("a", 60.0, 10.0)];
        assert_eq!(bracket(&low, "a", &SLO), [None, Some(40.0)]);
        assert_eq!(next_probe(&low, "a", &SLO), Some(20.0));
        // Passing everywhere: the grid's step above the top, or half again
        // with one rate.
        let high = [point("a", 40.0, 100.0), point("a", 60.0, 100.0)];
        assert_eq!(bracket(&high, "a", &SLO), [Some(60.0), None]);
        assert_eq!(next_probe(&high, "a", &SLO), Some(80.0));
        assert_eq!(next_probe(&high[..1], "a", &SLO), Some(60.0));
        // Nothing measured: nothing to probe.
        assert_eq!(next_probe(&high, "b", &SLO), None);
    }

    #[test]
    fn a_pass_above_a_miss_does_not_move_the_bracket() {
        // Noise: 40 misses, 60 passes. The capacity is 20; the bracket is
        // (20, 40), as the grid's rule reads it.
        let pts = [
            point("a", 20.0, 100.0),
            point("a", 40.0, 0.0),
            point("a", 60.0, 100.0),
        ];
        assert_eq!(bracket(&pts, "a", &SLO), [Some(20.0), Some(40.0)]);
        assert_eq!(next_probe(&pts, "a", &SLO), Some(30.0));
    }

    #[test]
    fn the_ratio_is_the_worst_up_to_the_capacity() {
        // computed = 10 x rate over an ideal of 100: rate / 10.
        let pts = [
            point("a", 20.0, 40.0),
            point("a", 40.0, 40.0),
            point("a", 60.0, 40.0),
        ];
        assert_eq!(computed_vs_ideal(&pts, "a", Some(40.0)), Some(4.0));
        assert_eq!(computed_vs_ideal(&pts, "a", None), Some(2.0));
        assert_eq!(computed_vs_ideal(&pts, "b", Some(40.0)), None);
    }
}
