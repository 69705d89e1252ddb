//! The peers benchmark as text (one table per workload, then each router's
//! capacity at SLO) and as PNG plots (TTFT p90 and ITL p99 against rate, one
//! line per router with its seed range shaded).

use std::fmt::Write;
use std::path::{Path, PathBuf};

use kvmesh_loadgen::report::sweep_plot::{self, Series};

use super::sweep::{self, Point};
use super::{PeersReport, WorkloadResult};
use crate::demo::DemoError;

fn ms(v: Option<f64>) -> String {
    v.map_or("-".to_owned(), |v| format!("{v:.0}"))
}

fn span(v: Option<[f64; 2]>, digits: usize) -> String {
    v.map_or(String::new(), |[lo, hi]| {
        format!(" ({lo:.digits$}-{hi:.digits$})")
    })
}

/// The whole report as text.
pub fn table(report: &PeersReport) -> String {
    let mut out = String::new();
    let load = |l: Option<[f64; 3]>| {
        l.map_or("n/a".to_owned(), |[a, b, c]| {
            format!("{a:.2} {b:.2} {c:.2}")
        })
    };
    let _ = writeln!(
        out,
        "kvmesh peers benchmark: {} engines ({}, x{} time), seeds {:?}; times in simulated ms; \
         load average {} before, {} after; {:.0} s wall",
        report.engines,
        report.profile,
        report.time_scale,
        report.seeds,
        load(report.load_before),
        load(report.load_after),
        report.wall_s,
    );
    for w in &report.workloads {
        workload(&mut out, w, report.probes);
    }
    if let Some(g) = &report.pd_pays {
        super::pd_pays::table(&mut out, g);
    }
    out
}

fn workload(out: &mut String, w: &WorkloadResult, probes: usize) {
    let _ = writeln!(out, "\n== {}: {}", w.name, w.description);
    if let Some(p) = w.pressure {
        let _ = writeln!(out, "   cache pressure (working set / fleet KV): {p:.2}");
    }
    let _ = writeln!(
        out,
        "   SLO: TTFT p90 <= {:.0} ms, ITL p99 <= {:.0} ms. Medians over seeds (min-max).",
        w.slo.ttft_p90_ms, w.slo.itl_p99_ms
    );
    let _ = writeln!(
        out,
        "{:<17} {:>6} {:>9} {:>22} {:>18} {:>16} {:>24} {:>8} {:>4}",
        "router",
        "rate/s",
        "ttft p50",
        "ttft p90",
        "itl p99",
        "hit rate",
        "computed tokens",
        "goodput",
        "err"
    );
    for p in &w.points {
        row(out, p);
    }
    for r in w.routers.iter().filter(|r| !r.available) {
        let _ = writeln!(
            out,
            "{:<17} not available: {}",
            r.name,
            r.reason.as_deref().unwrap_or("unknown")
        );
    }
    capacities(out, w, probes);
    if let Some(x) = w.itl_p99_ratio_at_aggregated_capacity {
        let _ = writeln!(
            out,
            "   best P/D split's ITL p99 / aggregated's, at aggregated's capacity: {x:.2}x"
        );
    }
}

/// Each router's capacity at SLO with the rate above it that missed and
/// the seeds' own capacities, then its worst computed-to-ideal ratio.
fn capacities(out: &mut String, w: &WorkloadResult, probes: usize) {
    let rate = |c: Option<f64>| c.map_or("none".to_owned(), |c| format!("{c}"));
    let _ = writeln!(
        out,
        "   capacity at SLO (req/s; the first miss above it in brackets, bisected toward 5% with up to \
         {probes} more rates; each seed's own in braces):"
    );
    for (name, cap) in &w.capacity_at_slo {
        let _ = write!(out, "     {name:<24} {:>6}", rate(*cap));
        if let Some(miss) = w.capacity_bracket.get(name) {
            let _ = write!(
                out,
                " [{}]",
                miss.map_or("no miss".to_owned(), |m| format!("< {m}"))
            );
            // Say where the client could not send the rate, and where that
            // alone made the miss (the latencies met the SLO): the
            // sessions' bound, not the router's.
            let at = miss.and_then(|m| w.points.iter().find(|p| p.router == *name && p.rate == m));
            if let Some((p, s)) = at.and_then(|p| Some((p, p.sent_share?))) {
                let unsent = sweep::Point {
                    sent_share: None,
                    ..p.clone()
                };
                if s < sweep::MIN_SENT_SHARE && sweep::meets(&unsent, &w.slo) {
                    let _ = write!(
                        out,
                        " (held back: {s:.2} of the rate sent, latencies within SLO)"
                    );
                } else if s < sweep::MIN_SENT_SHARE {
                    let _ = write!(out, " ({s:.2} of the rate sent)");
                }
            }
        }
        if let Some(seeds) = w.capacity_at_slo_seeds.get(name) {
            let each: Vec<String> = seeds.iter().map(|c| rate(*c)).collect();
            let _ = write!(out, " {{{}}}", each.join(", "));
        }
        let _ = writeln!(out);
    }
    if !w.computed_vs_ideal.is_empty() {
        let _ = write!(
            out,
            "   computed prompt tokens / ideal placement's, worst rate up to capacity:"
        );
        for (name, x) in &w.computed_vs_ideal {
            let _ = write!(out, " {name} {x:.2}x");
        }
        let _ = writeln!(out);
    }
    let reference = &w.lru_reference_vs_ideal;
    if let (Some(mid), Some([lo, hi])) = (sweep::median(reference), sweep::range(reference)) {
        let each: Vec<String> = reference.iter().map(|x| format!("{x:.2}")).collect();
        let _ = writeln!(
            out,
            "   reference: an online placement replayed one request at a time through the engines' LRU \
             caches computes {mid:.2}x the ideal's tokens ({lo:.2}-{hi:.2}; each seed's {}; \
             peers/lru_reference.rs)",
            each.join(", ")
        );
    }
}

fn row(out: &mut String, p: &Point) {
    let _ = writeln!(
        out,
        "{:<17} {:>6.1} {:>9} {:>22} {:>18} {:>16} {:>24} {:>8} {:>4}",
        p.router,
        p.rate,
        ms(p.ttft_p50_ms),
        format!("{}{}", ms(p.ttft_p90_ms), span(p.ttft_p90_range, 0)),
        format!("{}{}", ms(p.itl_p99_ms), span(p.itl_p99_range, 0)),
        format!(
            "{}{}",
            p.hit_rate.map_or("-".to_owned(), |h| format!("{h:.2}")),
            span(p.hit_rate_range, 2)
        ),
        format!(
            "{}{}",
            p.computed_tokens
                .map_or("-".to_owned(), |c| format!("{c:.0}")),
            span(p.computed_tokens_range, 0)
        ),
        p.goodput.map_or("-".to_owned(), |g| format!("{g:.2}")),
        p.errors,
    );
}

/// Writes `<workload>-ttft-p90.png` and `<workload>-itl-p99.png` into `dir`.
pub fn write_plots(report: &PeersReport, dir: &Path) -> Result<Vec<PathBuf>, DemoError> {
    let mut written = Vec::new();
    for w in &report.workloads {
        type Pick = fn(&Point) -> (Option<f64>, Option<[f64; 2]>);
        let figures: [(&str, &str, Pick); 2] = [
            ("ttft-p90", "TTFT p90 (simulated ms)", |p| {
                (p.ttft_p90_ms, p.ttft_p90_range)
            }),
            ("itl-p99", "ITL p99 (simulated ms)", |p| {
                (p.itl_p99_ms, p.itl_p99_range)
            }),
        ];
        for (file, label, pick) in figures {
            let series: Vec<Series> = w
                .routers
                .iter()
                .filter(|r| r.available)
                .map(|r| Series {
                    name: r.name.clone(),
                    points: w
                        .points
                        .iter()
                        .filter(|p| p.router == r.name)
                        .filter_map(|p| {
                            let (v, range) = pick(p);
                            let [lo, hi] = range.unwrap_or([v?, v?]);
                            Some((p.rate, v?, lo, hi))
                        })
                        .collect(),
                })
                .collect();
            let path = dir.join(format!("{}-{file}.png", w.name));
            let title = format!("{}: {label} against offered load", w.name);
            sweep_plot::write_png(&title, "offered load (simulated req/s)", &series, &path)
                .map_err(|e| DemoError::Config(e.to_string()))?;
            written.push(path);
        }
    }
    Ok(written)
}
