//! Two `/debug/stat` samples into one row per pod (rates over the time
//! between them), rendered as a table or as JSON for scripts.

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use super::{PodStats, Report};

/// One sample of the admin port and when it was taken.
#[derive(Debug, Clone)]
pub struct Sample {
    pub report: Report,
    pub at: tokio::time::Instant,
}

/// One pod (or a followed address that is not a pod yet) as `stat` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    pub pod: String,
    /// `prefill`, `decode`, `both`; empty for an address that is not a pod.
    pub role: String,
    pub models: Vec<String>,
    pub healthy: bool,
    pub waiting: u32,
    pub running: u32,
    pub kv_usage: f64,
    /// Prefix cache hit rate (hit tokens / queried tokens) over the window;
    /// over the pod's lifetime when it had no queries in the window.
    pub hit_rate: Option<f64>,
    /// Requests served per second over the window.
    pub requests_per_s: Option<f64>,
    pub pd_splits: u64,
    pub pd_failures: u64,
    /// `local`, `connected`, `stale`, `connecting`, `other_models`, `unfollowed`.
    pub mesh: String,
    /// Milliseconds since the pod's load was reported.
    pub staleness_ms: Option<u64>,
}

/// What `-o json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct Table {
    pub admin: String,
    pub local: String,
    pub window_s: Option<f64>,
    pub pods: Vec<Row>,
    /// The Valkey index, when the sidecar uses one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<super::IndexEntry>,
}

/// The rows of `cur`, with rates against `prev` (the same admin port, earlier).
pub fn table(admin: &str, prev: Option<&Sample>, cur: &Sample) -> Table {
    let window = prev
        .map(|p| cur.at.saturating_duration_since(p.at))
        .filter(|d| !d.is_zero());
    let before = |id: &str| -> Option<PodStats> {
        prev?
            .report
            .pods
            .iter()
            .find(|p| p.id == id)
            .map(|p| p.stats)
    };
    let mut pods: Vec<Row> = cur
        .report
        .pods
        .iter()
        .map(|p| {
            let old = before(&p.id);
            Row {
                pod: p.id.clone(),
                role: p.role.clone(),
                models: p.models.clone(),
                healthy: p.healthy,
                waiting: p.waiting,
                running: p.running,
                kv_usage: p.kv_usage,
                hit_rate: hit_rate(old, p.stats),
                requests_per_s: requests_per_s(old, p.stats, window),
                pd_splits: p.stats.pd_splits,
                pd_failures: p.stats.pd_failures,
                mesh: p.mesh.clone(),
                staleness_ms: p.load_age_ms,
            }
        })
        .collect();
    // Followed addresses with no pod in the fleet: connecting, other models.
    for e in &cur.report.peers {
        let known =
            e.id.as_ref()
                .is_some_and(|id| cur.report.pods.iter().any(|p| &p.id == id));
        if !known {
            pods.push(Row {
                pod: e
                    .id
                    .clone()
                    .unwrap_or_else(|| format!("mesh {}", e.mesh_addr)),
                role: String::new(),
                models: Vec::new(),
                healthy: false,
                waiting: 0,
                running: 0,
                kv_usage: 0.0,
                hit_rate: None,
                requests_per_s: None,
                pd_splits: 0,
                pd_failures: 0,
                mesh: e.state.clone(),
                staleness_ms: e.last_frame_ms,
            });
        }
    }
    Table {
        admin: admin.to_owned(),
        local: cur.report.local.clone(),
        window_s: window.map(|d| d.as_secs_f64()),
        pods,
        index: cur.report.index.clone(),
    }
}

/// Requests per second between two samples; `None` without an earlier one
/// or when the counter went back (the pod's sidecar restarted).
fn requests_per_s(old: Option<PodStats>, new: PodStats, window: Option<Duration>) -> Option<f64> {
    let (old, window) = (old?, window?);
    let n = new.requests.checked_sub(old.requests)?;
    Some(n as f64 / window.as_secs_f64())
}

fn hit_rate(old: Option<PodStats>, new: PodStats) -> Option<f64> {
    let ratio = |hits: u64, queries: u64| (queries > 0).then(|| hits as f64 / queries as f64);
    let windowed = old.and_then(|o| {
        let q = new.prefix_queries.checked_sub(o.prefix_queries)?;
        let h = new.prefix_hits.checked_sub(o.prefix_hits)?;
        ratio(h, q)
    });
    windowed
        .or_else(|| ratio(new.prefix_hits, new.prefix_queries))
        .map(|r| r.clamp(0.0, 1.0))
}

const HEADERS: [&str; 11] = [
    "POD", "ROLE", "MODEL", "WAIT/RUN", "KV", "HIT", "REQ/S", "P/D", "P/D FAIL", "MESH", "AGE",
];

/// The table as text: a header line, then one line per pod.
pub fn render(t: &Table) -> String {
    let pct = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{:.0}%", v * 100.0));
    let cells: Vec<[String; 11]> = t
        .pods
        .iter()
        .map(|r| {
            let is_pod = !r.role.is_empty();
            let dash = |s: String| if is_pod { s } else { "-".to_owned() };
            [
                r.pod.clone(),
                dash(r.role.clone()),
                dash(r.models.join(",")),
                dash(format!("{}/{}", r.waiting, r.running)),
                dash(pct(Some(r.kv_usage))),
                pct(r.hit_rate),
                r.requests_per_s
                    .map_or_else(|| "-".to_owned(), |v| format!("{v:.1}")),
                dash(r.pd_splits.to_string()),
                dash(r.pd_failures.to_string()),
                if r.healthy || !is_pod {
                    r.mesh.clone()
                } else {
                    format!("{} (unhealthy)", r.mesh)
                },
                r.staleness_ms.map_or_else(
                    || "-".to_owned(),
                    |ms| format!("{:.1}s", ms as f64 / 1000.0),
                ),
            ]
        })
        .collect();
    let mut widths = HEADERS.map(str::len);
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |row: &[String]| {
        let text: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", text.join("  ").trim_end());
    };
    line(&HEADERS.map(str::to_owned));
    for row in &cells {
        line(row);
    }
    if let Some(i) = &t.index {
        let state = if i.up {
            format!("up ({})", i.server)
        } else {
            "DOWN: routing on what this sidecar knows".to_owned()
        };
        let _ = writeln!(
            out,
            "\nindex: {} {state}; {} lookups answered, {} routed without one",
            i.backend, i.lookups, i.fallbacks
        );
    }
    out
}
