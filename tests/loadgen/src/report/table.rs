//! The text table: one block per workload, one row per policy (and, for
//! multi-stage loads, one indented row per stage), with ratios of TTFT and
//! throughput to the baseline policy (`1.00x` is the baseline itself; a
//! TTFT ratio below 1 and a throughput ratio above 1 are better).

use std::fmt::Write;

use super::{ratio, Report};
use crate::stats::Summary;

const HEADERS: [&str; 13] = [
    "policy", "reqs", "err", "ttft p50", "ttft p90", "ttft p99", "itl p50", "itl p99", "e2e p50",
    "tok/s", "hit", "ttft50 x", "tok/s x",
];

fn ms(v: Option<f64>) -> String {
    v.map_or_else(
        || "-".into(),
        |v| {
            if v >= 100.0 {
                format!("{v:.0}")
            } else {
                format!("{v:.2}")
            }
        },
    )
}

fn times(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.2}x"))
}

fn row(name: &str, s: &Summary, base: Option<&Summary>) -> Vec<String> {
    vec![
        name.to_string(),
        s.requests.to_string(),
        s.errors.to_string(),
        ms(s.ttft_p50_ms),
        ms(s.ttft_p90_ms),
        ms(s.ttft_p99_ms),
        ms(s.itl_p50_ms),
        ms(s.itl_p99_ms),
        ms(s.e2e_p50_ms),
        format!("{:.1}", s.throughput_tok_s),
        s.hit_rate
            .map_or_else(|| "-".into(), |h| format!("{:.0}%", h * 100.0)),
        times(base.and_then(|b| ratio(s.ttft_p50_ms, b.ttft_p50_ms))),
        times(base.and_then(|b| ratio(Some(s.throughput_tok_s), Some(b.throughput_tok_s)))),
    ]
}

/// Renders `report` (latencies in ms).
pub fn render(report: &Report) -> String {
    let mut out = String::new();
    for w in &report.workloads {
        let base = w.baseline(&report.baseline);
        let mut rows = vec![HEADERS.iter().map(|h| h.to_string()).collect::<Vec<_>>()];
        for p in &w.policies {
            rows.push(row(&p.policy, &p.summary, base.map(|b| &b.summary)));
            if p.stages.len() > 1 {
                for (i, st) in p.stages.iter().enumerate() {
                    let bst = base.and_then(|b| b.stages.get(i)).map(|b| &b.summary);
                    rows.push(row(&format!("  @{}", st.label), &st.summary, bst));
                }
            }
        }
        let widths: Vec<usize> = (0..HEADERS.len())
            .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
            .collect();
        let base_name = base.map_or("-", |b| b.policy.as_str());
        let _ = writeln!(out, "== {} (latency ms; ratios vs {base_name})", w.name);
        for r in &rows {
            let mut line = String::new();
            for (c, cell) in r.iter().enumerate() {
                if c == 0 {
                    let _ = write!(line, "{cell:<w$}", w = widths[c]);
                } else {
                    let _ = write!(line, "  {cell:>w$}", w = widths[c]);
                }
            }
            let _ = writeln!(out, "{}", line.trim_end());
        }
    }
    out
}
