//! From runs to points: the figures of every (router, rate) over its seeds,
//! as medians with their min-max range, and each router's capacity at SLO.

use serde::Serialize;

/// What one run (one router, one rate, one seed) measured, in simulated time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Run {
    pub router: String,
    /// Offered load, simulated requests per second.
    pub rate: f64,
    pub seed: u64,
    pub requests: u64,
    pub errors: u64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub itl_p50_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
    pub e2e_p50_ms: Option<f64>,
    /// Prefix-cache hits over queries, in tokens, from the engines' own counters.
    pub hit_rate: Option<f64>,
    /// Prompt tokens the engines computed (not served from cache or
    /// received), `recomputed_tokens` included.
    pub computed_tokens: u64,
    /// The same per engine, in pod order.
    pub computed_per_engine: Vec<u64>,
    /// Requests the engines preempted (sent back to wait, KV recomputed).
    pub preemptions: u64,
    /// The part of `computed_tokens` that preempted requests computed again
    /// when they resumed (what they found cached not counted). vLLM counts
    /// these lookups apart from new requests' and does not export them.
    pub recomputed_tokens: u64,
    /// What an ideal placement would compute (each shared prefix once), where
    /// the workload defines it.
    pub ideal_computed_tokens: Option<u64>,
    /// This run's placement (the engine each request reached) replayed one
    /// request at a time through the engines' LRU caches, over the ideal
    /// placement's tokens (`lru_reference::placed_lru_tokens`): what
    /// `computed_tokens` lies above it is what the load added.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placement_replay_vs_ideal: Option<f64>,
    /// Shared-prefix workloads: the served requests by what their group
    /// prefix cost them (found cached, or computed first, after a move, or
    /// again on a pod that had it), from the engines' answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_computes: Option<super::prefix_computes::PrefixComputes>,
    /// Requests each engine served, in pod order.
    pub requests_per_engine: Vec<u64>,
    /// Share of requests that met the SLO (TTFT and mean ITL each within it).
    pub goodput: f64,
    /// The rate the client sent at over the offered rate, where a session
    /// waits for its previous answer (a slow router holds sends back there,
    /// and a rate not sent is not a rate sustained; see [`MIN_SENT_SHARE`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sent_share: Option<f64>,
}

/// One router at one rate: medians over seeds, with ranges.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Point {
    pub router: String,
    pub rate: f64,
    pub seeds: usize,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
    pub ttft_p90_range: Option<[f64; 2]>,
    pub ttft_p99_ms: Option<f64>,
    pub itl_p50_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
    pub itl_p99_range: Option<[f64; 2]>,
    pub e2e_p50_ms: Option<f64>,
    pub hit_rate: Option<f64>,
    pub hit_rate_range: Option<[f64; 2]>,
    pub computed_tokens: Option<f64>,
    pub computed_tokens_range: Option<[f64; 2]>,
    pub goodput: Option<f64>,
    pub goodput_range: Option<[f64; 2]>,
    /// Computed prompt tokens over the ideal placement's, where the workload
    /// defines one (each run's ratio, then the median over seeds).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub computed_vs_ideal: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub computed_vs_ideal_range: Option<[f64; 2]>,
    /// Median of the runs' `sent_share`, where they have one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sent_share: Option<f64>,
    /// Failed requests, summed over seeds.
    pub errors: u64,
}

/// The service-level objective of a workload, in simulated milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_p90_ms: f64,
    pub itl_p99_ms: f64,
}

/// The median of `v` (the mean of the middle two for an even count).
pub fn median(v: &[f64]) -> Option<f64> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    Some(if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    })
}

/// `[min, max]` of `v`.
pub fn range(v: &[f64]) -> Option<[f64; 2]> {
    let s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    let lo = s.iter().copied().reduce(f64::min)?;
    let hi = s.iter().copied().reduce(f64::max)?;
    Some([lo, hi])
}

/// The points of `runs`, one per (router, rate), in first-seen router order
/// and increasing rate.
pub fn points(runs: &[Run]) -> Vec<Point> {
    let mut keys: Vec<(String, f64)> = Vec::new();
    for r in runs {
        if !keys.iter().any(|(n, x)| *n == r.router && *x == r.rate) {
            keys.push((r.router.clone(), r.rate));
        }
    }
    // Rates bisection added come after the grid's: sort each router's.
    let order = |name: &str| keys.iter().position(|(n, _)| n == name);
    let mut sorted = keys.clone();
    sorted.sort_by(|(a, x), (b, y)| order(a).cmp(&order(b)).then(x.total_cmp(y)));
    let keys = sorted;
    keys.iter()
        .map(|(router, rate)| {
            let of: Vec<&Run> = runs
                .iter()
                .filter(|r| r.router == *router && r.rate == *rate)
                .collect();
            let col = |f: fn(&Run) -> Option<f64>| -> Vec<f64> {
                of.iter().filter_map(|r| f(r)).collect()
            };
            let ttft90 = col(|r| r.ttft_p90_ms);
            let itl99 = col(|r| r.itl_p99_ms);
            let hit = col(|r| r.hit_rate);
            let computed = col(|r| Some(r.computed_tokens as f64));
            let good = col(|r| Some(r.goodput));
            let vs_ideal = col(|r| {
                let ideal = r.ideal_computed_tokens.filter(|&i| i > 0)?;
                Some(r.computed_tokens as f64 / ideal as f64)
            });
            Point {
                router: router.clone(),
                rate: *rate,
                seeds: of.len(),
                ttft_p50_ms: median(&col(|r| r.ttft_p50_ms)),
                ttft_p90_ms: median(&ttft90),
                ttft_p90_range: range(&ttft90),
                ttft_p99_ms: median(&col(|r| r.ttft_p99_ms)),
                itl_p50_ms: median(&col(|r| r.itl_p50_ms)),
                itl_p99_ms: median(&itl99),
                itl_p99_range: range(&itl99),
                e2e_p50_ms: median(&col(|r| r.e2e_p50_ms)),
                hit_rate: median(&hit),
                hit_rate_range: range(&hit),
                computed_tokens: median(&computed),
                computed_tokens_range: range(&computed),
                goodput: median(&good),
                goodput_range: range(&good),
                sent_share: median(&col(|r| r.sent_share)),
                computed_vs_ideal: median(&vs_ideal),
                computed_vs_ideal_range: range(&vs_ideal),
                errors: of.iter().map(|r| r.errors).sum(),
            }
        })
        .collect()
}

/// A point whose sessions wait for their previous answers meets its SLO only
/// if the client sent at least this share of the offered rate: Poisson
/// sampling alone stays within it (about 2 standard deviations at 500
/// requests), a router whose answers come too late for the next turns does
/// not.
pub const MIN_SENT_SHARE: f64 = 0.9;

/// Whether a point meets `slo` (medians over seeds; a point with errors,
/// without figures, or whose offered rate was held back does not).
pub fn meets(p: &Point, slo: &Slo) -> bool {
    p.errors == 0
        && p.ttft_p90_ms.is_some_and(|t| t <= slo.ttft_p90_ms)
        && p.itl_p99_ms.is_some_and(|t| t <= slo.itl_p99_ms)
        && p.sent_share.is_none_or(|s| s >= MIN_SENT_SHARE)
}

/// The highest rate at which `router` meets `slo` at that rate and every
/// lower one measured; `None` if it misses at the lowest.
pub fn capacity(points: &[Point], router: &str, slo: &Slo) -> Option<f64> {
    let mut mine: Vec<&Point> = points.iter().filter(|p| p.router == router).collect();
    mine.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    let mut best = None;
    for p in mine {
        if !meets(p, slo) {
            break;
        }
        best = Some(p.rate);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(router: &str, rate: f64, seed: u64, ttft: f64, itl: f64) -> Run {
        Run {
            router: router.to_owned(),
            rate,
            seed,
            requests: 10,
            errors: 0,
            ttft_p50_ms: Some(ttft / 2.0),
            ttft_p90_ms: Some(ttft),
            ttft_p99_ms: Some(ttft * 2.0),
            itl_p50_ms: Some(itl / 2.0),
            itl_p99_ms: Some(itl),
            e2e_p50_ms: Some(ttft),
            hit_rate: Some(0.5),
            computed_tokens: 100 * seed,
            computed_per_engine: vec![],
            ideal_computed_tokens: None,
            preemptions: 0,
            recomputed_tokens: 0,
            placement_replay_vs_ideal: None,
            prefix_computes: None,
            requests_per_engine: vec![],
            goodput: 1.0,
            sent_share: None,
        }
    }

    #[test]
    fn medians_and_ranges_over_seeds() {
        let runs = vec![
            run("a", 1.0, 1, 100.0, 10.0),
            run("a", 1.0, 2, 300.0, 30.0),
            run("a", 1.0, 3, 200.0, 20.0),
        ];
        let p = &points(&runs)[0];
        assert_eq!(p.seeds, 3);
        assert_eq!(p.ttft_p90_ms, Some(200.0));
        assert_eq!(p.ttft_p90_range, Some([100.0, 300.0]));
        assert_eq!(p.computed_tokens, Some(200.0));
        assert_eq!(median(&[1.0, 2.0, 3.0, 10.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn capacity_is_the_last_rate_before_the_first_miss() {
        let slo = Slo {
            ttft_p90_ms: 250.0,
            itl_p99_ms: 50.0,
        };
        let runs = vec![
            run("a", 1.0, 1, 100.0, 10.0),
            run("a", 2.0, 1, 200.0, 10.0),
            run("a", 4.0, 1, 400.0, 10.0),
            // Meeting it again above a miss does not count.
            run("a", 8.0, 1, 100.0, 10.0),
            run("b", 1.0, 1, 100.0, 60.0),
        ];
        let pts = points(&runs);
        assert_eq!(capacity(&pts, "a", &slo), Some(2.0));
        assert_eq!(capacity(&pts, "b", &slo), None);
        assert_eq!(capacity(&pts, "c", &slo), None);
    }
}
