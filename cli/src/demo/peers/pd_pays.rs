//! Where P/D pays: a grid of long-prompt lengths and rates on the P/D
//! workload, each cell run aggregated (kvmesh's default on every pod) and
//! split (half the pods prefill, every long prompt disaggregated, the short
//! ones served whole on a decode pod) at equal pod count, and once more split
//! with kvmesh's P/D decider on (the built-in P/D
//! config, [`DECIDER`]: llm-d's `nonCachedTokens` 2048, what
//! `--pd-min-uncached-tokens 2048` in docs/pd.md sets, and kvmesh's
//! load-aware `batchStallTokens`). A cell says which option measured better,
//! what the decider chose (the share of requests it split) and whether that
//! was the better option.

use kvmesh_engine_sim::{LatencyProfile, StepLoad};
use serde::Serialize;

use super::sweep::{self, Point, Run, Slo};
use super::{pd_setup, progress_line, run_one, say, Bench, PeersOpts, Router};
use crate::demo::DemoError;

/// The decider's rule, as the table's "Decider:" line states it (the
/// decider entry of deploy/examples/filters-pd-disaggregated.yaml).
pub const DECIDER: &str = "prefix-based-pd-decider: split when the prompt is at least promptTokens 1024 \
     and its uncached part U on the chosen decode pod is at least nonCachedTokens 2048 (llm-d's rule), \
     or when U x the requests at that decode pod reaches batchStallTokens 14300 (kvmesh's load-aware \
     rule: each of them would sit through U x 0.07 ms of prefill; 14300 = the 1000 ms TTFT SLO / 0.07 ms \
     per token) (deploy/examples/filters-pd-disaggregated.yaml; --pd-min-uncached-tokens 2048)";

/// Goodput closer than this is a tie, settled by ITL p99.
const GOODPUT_TIE: f64 = 0.02;
/// ITL p99 within this ratio of the other option's is a tie too.
const ITL_TIE: f64 = 0.9;

/// The grid, as `--json` writes it under `pd_pays`.
#[derive(Debug, Clone, Serialize)]
pub struct PdPays {
    pub description: String,
    pub slo: Slo,
    /// The decider kvmesh ran with.
    pub decider: String,
    /// Prefill pods of the split fleet (the rest decode).
    pub prefill_pods: usize,
    pub seeds: Vec<u64>,
    pub cells: Vec<PdPaysCell>,
    /// Every run, with its cell's prompt length.
    pub runs: Vec<PdPaysRun>,
}

/// One prompt length at one rate.
#[derive(Debug, Clone, Serialize)]
pub struct PdPaysCell {
    /// Tokens of the long prompts (a quarter of the requests).
    pub prompt_tokens: usize,
    pub rate: f64,
    pub aggregated: Option<Measured>,
    /// Every long prompt split.
    pub pd: Option<Measured>,
    /// kvmesh with its decider on, on the split fleet.
    pub decider: Option<Measured>,
    /// Share of the requests the decider split (median over seeds).
    pub decider_split: Option<f64>,
    /// `pd` when it split at least half of the long prompts, else `aggregated`.
    pub decider_choice: Option<&'static str>,
    /// The option that measured better: the one that meets the SLO when the
    /// other does not, else higher goodput, then ITL p99 lower by 10%;
    /// `either` when neither is.
    pub better: Option<&'static str>,
    /// Whether the decider chose the better option (any choice is right
    /// when it is `either`).
    pub decider_right: Option<bool>,
    /// The long prompts' prefill as a share of the prefill pods' time when
    /// every one is split, from the GPU profile (the rate of long prompts
    /// times one's prefill, chunked as the engine runs it, over the prefill
    /// pods): above 1 they cannot keep up, and no choice per request on
    /// the split fleet can match an aggregated one, whose every pod prefills.
    pub prefill_load: f64,
}

/// What one option measured in a cell (medians over seeds).
#[derive(Debug, Clone, Serialize)]
pub struct Measured {
    pub goodput: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
    pub errors: u64,
}

/// A run of the grid.
#[derive(Debug, Clone, Serialize)]
pub struct PdPaysRun {
    pub prompt_tokens: usize,
    #[serde(flatten)]
    pub run: Run,
}

/// Runs the grid.
pub(super) async fn run(opts: &PeersOpts) -> Result<PdPays, DemoError> {
    let n = opts.requests.unwrap_or(if opts.quick { 60 } else { 80 });
    let lengths: Vec<usize> = opts.pd_pays_prompts.clone().unwrap_or(if opts.quick {
        vec![1000, 6000]
    } else {
        vec![1000, 3000, 6000]
    });
    // Full: a light and a heavy rate, to keep the full run near 40 minutes.
    let rates = opts.pd_pays_rates.clone().unwrap_or(if opts.quick {
        vec![16.0]
    } else {
        vec![8.0, 24.0]
    });
    let seeds: Vec<u64> = opts
        .seeds
        .iter()
        .copied()
        .take(if opts.quick { 1 } else { 2 })
        .collect();
    let prefill = opts.engines / 2;
    let routers = [
        Router::Aggregated,
        Router::KvmeshPdLong(prefill),
        Router::KvmeshPd(prefill),
    ];
    let slo = Slo {
        ttft_p90_ms: 1000.0,
        itl_p99_ms: 100.0,
    };
    let (spec, p) = pd_setup(opts.engines, n)?;
    let description = format!(
        "the pd-long-prompt workload with its long prompts {lengths:?} tokens long ({} out; short ones {} in, \
         {} out), at {rates:?} req/s; {} engines ({}, x{} time) aggregated, or {prefill} prefill + {} decode \
         with every long prompt split, or the same split fleet with kvmesh's decider; {n} requests per run",
        p.long_output,
        p.short_input,
        p.short_output,
        spec.engines,
        spec.profile.name,
        spec.time_scale,
        spec.engines - prefill,
    );
    let mut cells = Vec::new();
    let mut all = Vec::new();
    for &len in &lengths {
        let mut p = p.clone();
        p.long_input = len;
        let long_share = 1.0 / (1 + p.short_per_long) as f64;
        let bench = Bench {
            name: "pd-pays",
            description: String::new(),
            source: "",
            slo,
            pressure: None,
            spec: spec.clone(),
            rates: rates.clone(),
            routers: routers.to_vec(),
            build: Box::new(move |seed| p.build(seed)),
            ideal: None,
            lru_reference: false,
            prefix_words: None,
        };
        let mut runs = Vec::new();
        for &rate in &rates {
            for &router in &routers {
                for &seed in &seeds {
                    match run_one(opts, &bench, router, rate, seed, None).await? {
                        Ok(r) => {
                            say(opts, &progress_line(&format!("pd-pays {len}"), &r));
                            runs.push(r);
                        }
                        Err(why) => say(opts, &format!("[pd-pays {len}] {}: {why}", router.name())),
                    }
                }
            }
        }
        let points = sweep::points(&runs);
        let prefill_s = prefill_seconds(&spec.profile, len);
        for &rate in &rates {
            // The long prompts' prefill, all of it on the prefill pods.
            let load = rate * long_share * prefill_s / prefill.max(1) as f64;
            cells.push(cell(len, rate, &points, &runs, prefill, &slo, load));
        }
        all.extend(runs.into_iter().map(|run| PdPaysRun {
            prompt_tokens: len,
            run,
        }));
    }
    Ok(PdPays {
        description,
        slo,
        decider: DECIDER.to_owned(),
        prefill_pods: prefill,
        seeds,
        cells,
        runs: all,
    })
}

/// The grid as text: one row per cell.
pub fn table(out: &mut String, g: &PdPays) {
    use std::fmt::Write;
    let _ = writeln!(out, "\n== where P/D pays: {}", g.description);
    let _ = writeln!(
        out,
        "   decider: {}. Goodput (TTFT p90 / ITL p99 ms), medians over seeds {:?}.",
        g.decider, g.seeds
    );
    let _ = writeln!(
        out,
        "{:>7} {:>6} {:>22} {:>22} {:>22} {:>6} {:>10} {:>10} {:>6} {:>8}",
        "prompt",
        "rate/s",
        "aggregated",
        "P/D",
        "decider",
        "split",
        "chose",
        "better",
        "right",
        "prefill"
    );
    let m = |v: &Option<Measured>| {
        v.as_ref().map_or("-".to_owned(), |m| {
            let f = |x: Option<f64>| x.map_or("-".to_owned(), |x| format!("{x:.0}"));
            format!(
                "{:.2} ({}/{})",
                m.goodput.unwrap_or(0.0),
                f(m.ttft_p90_ms),
                f(m.itl_p99_ms)
            )
        })
    };
    for c in &g.cells {
        let _ = writeln!(
            out,
            "{:>7} {:>6} {:>22} {:>22} {:>22} {:>6} {:>10} {:>10} {:>6} {:>8.2}",
            c.prompt_tokens,
            c.rate,
            m(&c.aggregated),
            m(&c.pd),
            m(&c.decider),
            c.decider_split
                .map_or("-".to_owned(), |s| format!("{s:.2}")),
            c.decider_choice.unwrap_or("-"),
            c.better.unwrap_or("-"),
            c.decider_right
                .map_or("-", |r| if r { "yes" } else { "no" }),
            c.prefill_load,
        );
    }
}

/// The cell of `len`-token prompts at `rate`.
fn cell(
    len: usize,
    rate: f64,
    points: &[Point],
    runs: &[Run],
    prefill: usize,
    slo: &Slo,
    prefill_load: f64,
) -> PdPaysCell {
    let at = |r: Router| {
        points
            .iter()
            .find(|p| p.router == r.name() && p.rate == rate)
    };
    let measured = |p: &Point| Measured {
        goodput: p.goodput,
        ttft_p90_ms: p.ttft_p90_ms,
        itl_p99_ms: p.itl_p99_ms,
        errors: p.errors,
    };
    let (agg, pd, dec) = (
        at(Router::Aggregated),
        at(Router::KvmeshPdLong(prefill)),
        at(Router::KvmeshPd(prefill)),
    );
    // The decider's runs: requests its prefill pods served were split.
    let name = Router::KvmeshPd(prefill).name();
    let shares: Vec<f64> = runs
        .iter()
        .filter(|r| r.router == name && r.rate == rate && r.requests > 0)
        .map(|r| {
            let split: u64 = r.requests_per_engine.iter().take(prefill).sum();
            split as f64 / r.requests as f64
        })
        .collect();
    let split = sweep::median(&shares);
    // A quarter of the requests are long: it chose P/D when it split at
    // least half of them.
    let choice = split.map(|s| if s >= 0.125 { "pd" } else { "aggregated" });
    let better = agg.zip(pd).map(|(a, p)| better(a, p, slo));
    PdPaysCell {
        prompt_tokens: len,
        rate,
        aggregated: agg.map(measured),
        pd: pd.map(measured),
        decider: dec.map(measured),
        decider_split: split,
        decider_choice: choice,
        better,
        decider_right: choice.zip(better).map(|(c, b)| b == "either" || b == c),
        prefill_load,
    }
}

/// Seconds an engine of `profile` takes to prefill a `tokens`-token prompt
/// alone, in chunks of its `max_num_batched_tokens` as the simulator (and
/// vLLM's chunked prefill) runs it.
fn prefill_seconds(profile: &LatencyProfile, tokens: usize) -> f64 {
    let chunk = profile.max_num_batched_tokens.max(1);
    (0..tokens)
        .step_by(chunk)
        .map(|start| {
            let len = chunk.min(tokens - start);
            profile.step_seconds(&StepLoad::default().with_chunk(start, len))
        })
        .sum()
}

/// The better of aggregated and P/D. First the SLO, as capacity at SLO
/// judges it (TTFT p90 and ITL p99, [`sweep::meets`]): an option that meets
/// it beats one that does not. Goodput cannot stand in for that: it judges
/// each request by its mean gap, so a batch whose every request stalls now
/// and then (an ITL p99 far over the SLO) still counts as good. Then higher
/// goodput (failed requests count against it), then ITL p99 lower by at
/// least 10%.
fn better(agg: &Point, pd: &Point, slo: &Slo) -> &'static str {
    match (sweep::meets(agg, slo), sweep::meets(pd, slo)) {
        (true, false) => return "aggregated",
        (false, true) => return "pd",
        _ => {}
    }
    let g = |p: &Point| p.goodput.unwrap_or(0.0);
    if (g(agg) - g(pd)).abs() > GOODPUT_TIE {
        return if g(agg) > g(pd) { "aggregated" } else { "pd" };
    }
    match (agg.itl_p99_ms, pd.itl_p99_ms) {
        (Some(a), Some(p)) if p <= a * ITL_TIE => "pd",
        (Some(a), Some(p)) if a <= p * ITL_TIE => "aggregated",
        _ => "either",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(router: &str, goodput: f64, itl: f64) -> Point {
        Point {
            router: router.to_owned(),
            rate: 8.0,
            seeds: 1,
            ttft_p50_ms: None,
            ttft_p90_ms: Some(100.0),
            ttft_p90_range: None,
            ttft_p99_ms: None,
            itl_p50_ms: None,
            itl_p99_ms: Some(itl),
            itl_p99_range: None,
            e2e_p50_ms: None,
            hit_rate: None,
            hit_rate_range: None,
            computed_tokens: None,
            computed_tokens_range: None,
            goodput: Some(goodput),
            goodput_range: None,
            computed_vs_ideal: None,
            computed_vs_ideal_range: None,
            sent_share: None,
            errors: 0,
        }
    }

    #[test]
    fn prefill_time_follows_the_profile_chunk_by_chunk() {
        let p = LatencyProfile::load(super::super::PROFILE).expect("the peers profile");
        let chunk = p.max_num_batched_tokens;
        // One chunk is one step of the profile.
        let one = prefill_seconds(&p, chunk);
        assert!((one - p.step_seconds(&StepLoad::prefill(chunk))).abs() < 1e-12);
        // The second chunk attends to the first's context too: it costs more.
        assert!(prefill_seconds(&p, 2 * chunk) > 2.0 * one);
        assert!(prefill_seconds(&p, 6000) > prefill_seconds(&p, 3000));
    }

    #[test]
    fn the_decider_line_states_the_built_in_config() {
        let yaml = include_str!("../../../assets/deploy/examples/filters-pd-disaggregated.yaml");
        for (key, value) in [
            ("nonCachedTokens", "2048"),
            ("promptTokens", "1024"),
            ("batchStallTokens", "14300"),
        ] {
            assert!(yaml.contains(&format!("      {key}: {value}\n")), "{key}");
            assert!(DECIDER.contains(&format!("{key} {value}")), "{key}");
        }
    }

    const SLO: Slo = Slo {
        ttft_p90_ms: 1000.0,
        itl_p99_ms: 100.0,
    };

    #[test]
    fn goodput_decides_then_a_clear_itl_gap_then_it_is_a_tie() {
        let b = |ga, ia, gp, ip| better(&point("a", ga, ia), &point("p", gp, ip), &SLO);
        assert_eq!(b(1.0, 20.0, 0.9, 10.0), "aggregated");
        assert_eq!(b(0.8, 20.0, 0.95, 40.0), "pd");
        assert_eq!(b(1.0, 200.0, 0.99, 30.0), "pd");
        assert_eq!(b(1.0, 20.0, 1.0, 40.0), "aggregated");
        assert_eq!(b(1.0, 24.0, 1.0, 23.0), "either");
    }

    #[test]
    fn the_option_that_meets_the_slo_wins_over_more_goodput() {
        // Measured at 3000-token prompts, 24 req/s: aggregated kept its mean
        // gaps in the SLO (goodput 0.99) but stalled its batches (ITL p99
        // 236 ms against the 100 ms SLO); the split met both.
        let agg = Point {
            ttft_p90_ms: Some(499.0),
            ..point("a", 0.99, 236.0)
        };
        let pd = Point {
            ttft_p90_ms: Some(596.0),
            ..point("p", 0.96, 30.0)
        };
        assert_eq!(better(&agg, &pd, &SLO), "pd");
        assert_eq!(better(&pd, &agg, &SLO), "aggregated");
        // Both miss (TTFT over the SLO): goodput decides again.
        let slow = |g, itl| Point {
            ttft_p90_ms: Some(1528.0),
            ..point("x", g, itl)
        };
        assert_eq!(better(&slow(0.72, 472.0), &slow(0.86, 28.0), &SLO), "pd");
        assert_eq!(
            better(&slow(0.9, 472.0), &slow(0.7, 28.0), &SLO),
            "aggregated"
        );
        // A point with errors does not meet the SLO.
        let failed = Point {
            errors: 1,
            ..point("p", 1.0, 30.0)
        };
        assert_eq!(better(&point("a", 0.9, 80.0), &failed, &SLO), "aggregated");
    }
}
