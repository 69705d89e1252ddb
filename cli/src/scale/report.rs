//! `kvmesh bench scale`'s report: one row per (mode, pods) with medians
//! over rounds and their min-max ranges, the Valkey saturation figures and
//! the sizing rule they give; as a table, JSON and two PNGs (CPU and RSS
//! against the fleet size).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;
use kvmesh_loadgen::report::sweep_plot::{self, Series};
use serde::Serialize;

use super::ingest::Saturation;
use super::{Sample, ScaleOpts};

/// A measured figure: the median over rounds and the range.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    fn of(values: &[f64]) -> Option<Spread> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(Spread {
            median: median_sorted(&v),
            min: v[0],
            max: v[v.len() - 1],
        })
    }
}

fn median_sorted(v: &[f64]) -> f64 {
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The `q` quantile of `values` (nearest rank), `None` when empty.
pub fn percentile(values: &[f64], q: f64) -> Option<f64> {
    let mut v: Vec<f64> = values.to_vec();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

/// One (mode, pods) row: the contract's fields are medians; `*_range`
/// give the rounds' min and max.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub mode: String,
    pub pods: usize,
    pub idle_cpu_ms_per_s: f64,
    pub load_cpu_ms_per_s: f64,
    pub rss_mb: f64,
    pub decision_p50_ms: Option<f64>,
    pub decision_p99_ms: Option<f64>,
    pub freshness_p50_ms: Option<f64>,
    pub freshness_p99_ms: Option<f64>,
    pub requests: usize,
    pub failed: usize,
    pub forwarded_share: f64,
    pub valkey_bytes_per_block: Option<f64>,
    pub valkey_cpu_us_per_block: Option<f64>,
    /// Emulated pods that registered again, summed over the rounds.
    pub reregistrations: Option<u64>,
    pub emulator_cpu_ms_per_s: f64,
    pub rounds: usize,
    pub idle_cpu_ms_per_s_range: [f64; 2],
    pub load_cpu_ms_per_s_range: [f64; 2],
    pub rss_mb_range: [f64; 2],
    pub decision_p99_ms_range: Option<[f64; 2]>,
    pub freshness_p99_ms_range: Option<[f64; 2]>,
}

/// What a 1000-pod fleet needs, from the saturation figures.
#[derive(Debug, Clone, Serialize)]
pub struct Sizing {
    pub pods: usize,
    /// The GPU profile whose peak prefill sets a busy pod's store rate.
    pub profile: String,
    /// Blocks a busy pod stores a second (its peak prefill, 16 tokens a block).
    pub blocks_stored_per_pod_per_s: f64,
    /// Block changes a second across the fleet (each stored block is
    /// removed again at steady state).
    pub fleet_changes_per_s: f64,
    /// Routing decisions a second across the fleet assumed.
    pub fleet_lookups_per_s: f64,
    /// Valkey cores that load takes, and the primaries to run at 70% of a
    /// core each.
    pub cores: f64,
    pub primaries: usize,
    pub rule: String,
}

/// See the module docs.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleReport {
    pub rows: Vec<Row>,
    /// How each hash tag would spread the workloads' keys over 3 primaries.
    pub hash_tags: Vec<super::tags::TagSpread>,
    pub saturation: Option<Saturation>,
    pub sizing: Option<Sizing>,
    pub settings: Settings,
    /// /proc/loadavg at the start and the end.
    pub load_average: Vec<[f64; 3]>,
    #[serde(skip)]
    samples: BTreeMap<(String, usize), Vec<Sample>>,
}

/// The run's parameters, in the report.
#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    pub rounds: usize,
    pub idle_s: f64,
    pub load_s: f64,
    pub requests_per_s: f64,
    pub groups: usize,
    pub blocks_per_pod: usize,
    pub churn_blocks_per_pod_per_s: f64,
    pub mesh_max_pods: usize,
}

impl ScaleReport {
    pub fn new(o: &ScaleOpts) -> Self {
        Self {
            rows: Vec::new(),
            hash_tags: Vec::new(),
            saturation: None,
            sizing: None,
            settings: Settings {
                rounds: o.rounds,
                idle_s: o.idle.as_secs_f64(),
                load_s: o.load.as_secs_f64(),
                requests_per_s: o.rate,
                groups: o.blocks.groups,
                blocks_per_pod: o.blocks.per_pod,
                churn_blocks_per_pod_per_s: o.blocks.churn_per_pod,
                mesh_max_pods: o.mesh_max,
            },
            load_average: Vec::new(),
            samples: BTreeMap::new(),
        }
    }

    pub fn add(&mut self, mode: &str, pods: usize, s: Sample) {
        self.samples
            .entry((mode.to_owned(), pods))
            .or_default()
            .push(s);
    }

    /// Rows from the samples, and the sizing rule from the saturation.
    pub fn finish(&mut self) {
        self.rows = self
            .samples
            .iter()
            .map(|((mode, pods), s)| row(mode, *pods, s))
            .collect();
        self.rows
            .sort_by(|a, b| a.pods.cmp(&b.pods).then(a.mode.cmp(&b.mode)));
        self.sizing = self.saturation.as_ref().and_then(sizing);
    }

    /// The table printed at the end of a run.
    pub fn text(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "{:<7} {:>5} {:>10} {:>10} {:>8} {:>11} {:>11} {:>12} {:>9} {:>10}\n",
            "mode",
            "pods",
            "idle ms/s",
            "load ms/s",
            "RSS MB",
            "dec p50 ms",
            "dec p99 ms",
            "fresh p99 ms",
            "failed",
            "B/block"
        ));
        let f = |v: Option<f64>| v.map_or("-".to_owned(), |x| format!("{x:.2}"));
        for r in &self.rows {
            out.push_str(&format!(
                "{:<7} {:>5} {:>10.2} {:>10.2} {:>8.1} {:>11} {:>11} {:>12} {:>9} {:>10}\n",
                r.mode,
                r.pods,
                r.idle_cpu_ms_per_s,
                r.load_cpu_ms_per_s,
                r.rss_mb,
                f(r.decision_p50_ms),
                f(r.decision_p99_ms),
                f(r.freshness_p99_ms),
                format!("{}/{}", r.failed, r.requests),
                r.valkey_bytes_per_block
                    .map_or("-".to_owned(), |b| format!("{b:.0}")),
            ));
        }
        if let Some(s) = &self.saturation {
            out.push_str(&format!(
                "valkey, one core: {:.0} block changes/s ({:.2} us each), {:.0} lookups/s at {} pods ({:.1} us each; {} pods registered again meanwhile)\n",
                s.blocks_per_core_s, s.cpu_us_per_block, s.lookups_per_core_s, s.lookup_pods, s.cpu_us_per_lookup, s.lookup_reregistrations
            ));
        }
        for t in &self.hash_tags {
            out.push_str(&format!(
                "hash tags, {}: {} anchors over {} requests, the hottest {:.0}%; busiest of 3 primaries {:.0}% per anchor, {:.0}% per pod stripe\n",
                t.workload,
                t.anchors,
                t.requests,
                t.hottest_anchor_share * 100.0,
                t.per_anchor_busiest_primary * 100.0,
                t.per_pod_stripe_busiest_primary * 100.0
            ));
        }
        if let Some(z) = &self.sizing {
            out.push_str(&format!("sizing: {}\n", z.rule));
        }
        out.push_str(&format!(
            "load average (1/5/15 min) at start and end: {:?}\n",
            self.load_average
        ));
        out
    }

    /// Per-sidecar CPU (idle and load) and RSS against pods: `<stem>-cpu.png`
    /// and `<stem>-rss.png` beside `path`.
    pub fn write_pngs(&self, path: &Path) -> Result<Vec<std::path::PathBuf>> {
        let stem = path.with_extension("");
        let cpu = stem.with_file_name(format!(
            "{}-cpu.png",
            stem.file_name().and_then(|s| s.to_str()).unwrap_or("scale")
        ));
        let rss = stem.with_file_name(format!(
            "{}-rss.png",
            stem.file_name().and_then(|s| s.to_str()).unwrap_or("scale")
        ));
        let line = |mode: &str, what: &str, pick: fn(&Row) -> (f64, [f64; 2])| Series {
            name: format!("{mode} {what}"),
            points: self
                .rows
                .iter()
                .filter(|r| r.mode == mode)
                .map(|r| {
                    let (m, [lo, hi]) = pick(r);
                    (r.pods as f64, m, lo, hi)
                })
                .collect(),
        };
        let idle: fn(&Row) -> (f64, [f64; 2]) =
            |r| (r.idle_cpu_ms_per_s, r.idle_cpu_ms_per_s_range);
        let load: fn(&Row) -> (f64, [f64; 2]) =
            |r| (r.load_cpu_ms_per_s, r.load_cpu_ms_per_s_range);
        let mem: fn(&Row) -> (f64, [f64; 2]) = |r| (r.rss_mb, r.rss_mb_range);
        sweep_plot::write_png(
            "Per-sidecar CPU (ms per s) against fleet size",
            "pods",
            &[
                line("mesh", "idle", idle),
                line("valkey", "idle", idle),
                line("mesh", "load", load),
                line("valkey", "load", load),
            ],
            &cpu,
        )?;
        sweep_plot::write_png(
            "Per-sidecar resident memory (MB) against fleet size",
            "pods",
            &[line("mesh", "RSS", mem), line("valkey", "RSS", mem)],
            &rss,
        )?;
        Ok(vec![cpu, rss])
    }
}

fn row(mode: &str, pods: usize, s: &[Sample]) -> Row {
    let spread = |f: fn(&Sample) -> f64| Spread::of(&s.iter().map(f).collect::<Vec<_>>());
    let opt =
        |f: fn(&Sample) -> Option<f64>| Spread::of(&s.iter().filter_map(f).collect::<Vec<_>>());
    let med = |x: Option<Spread>| x.map_or(f64::NAN, |x| x.median);
    let range = |x: Option<Spread>| x.map_or([f64::NAN; 2], |x| [x.min, x.max]);
    let idle = spread(|x| x.idle_cpu_ms_per_s);
    let load = spread(|x| x.load_cpu_ms_per_s);
    let rss = spread(|x| x.rss_mb);
    let p99 = opt(|x| x.decision_p99_ms);
    let fresh = opt(|x| x.freshness_p99_ms);
    Row {
        mode: mode.to_owned(),
        pods,
        idle_cpu_ms_per_s: med(idle),
        load_cpu_ms_per_s: med(load),
        rss_mb: med(rss),
        decision_p50_ms: opt(|x| x.decision_p50_ms).map(|x| x.median),
        decision_p99_ms: p99.map(|x| x.median),
        freshness_p50_ms: opt(|x| x.freshness_p50_ms).map(|x| x.median),
        freshness_p99_ms: fresh.map(|x| x.median),
        requests: s.iter().map(|x| x.requests).sum(),
        failed: s.iter().map(|x| x.failed).sum(),
        forwarded_share: med(spread(|x| x.forwarded_share)),
        valkey_bytes_per_block: opt(|x| x.valkey_bytes_per_block).map(|x| x.median),
        valkey_cpu_us_per_block: opt(|x| x.valkey_cpu_us_per_block).map(|x| x.median),
        reregistrations: s.iter().map(|x| x.reregistrations).sum(),
        emulator_cpu_ms_per_s: med(spread(|x| x.emulator_cpu_ms_per_s)),
        rounds: s.len(),
        idle_cpu_ms_per_s_range: range(idle),
        load_cpu_ms_per_s_range: range(load),
        rss_mb_range: range(rss),
        decision_p99_ms_range: p99.map(|x| [x.min, x.max]),
        freshness_p99_ms_range: fresh.map(|x| [x.min, x.max]),
    }
}

/// The GPU profile a busy pod's store rate comes from.
const PROFILE: &str = "gpu:qwen3-32b@h100x2";
/// Routing decisions a second per pod assumed in the sizing: the shared-prefix
/// workload's capacity at SLO on this profile was 60 req/s for 4 pods
/// (docs/benchmarks.md, `kvmesh bench peers`), so 15 per pod.
const LOOKUPS_PER_POD_S: f64 = 15.0;
/// A primary is planned at this share of its core.
const CORE_BUDGET: f64 = 0.7;

fn sizing(s: &Saturation) -> Option<Sizing> {
    let profile = kvmesh_engine_sim::LatencyProfile::load(PROFILE).ok()?;
    let pods = 1000usize;
    let per_pod = 1000.0 / profile.prefill_ms_per_token.max(1e-9) / 16.0;
    let changes = 2.0 * per_pod * pods as f64;
    let lookups = LOOKUPS_PER_POD_S * pods as f64;
    let cores = (changes * s.cpu_us_per_block + lookups * s.cpu_us_per_lookup) / 1e6;
    let primaries = (cores / CORE_BUDGET).ceil().max(1.0) as usize;
    Some(Sizing {
        pods,
        profile: PROFILE.to_owned(),
        blocks_stored_per_pod_per_s: per_pod,
        fleet_changes_per_s: changes,
        fleet_lookups_per_s: lookups,
        cores,
        primaries,
        rule: format!(
            "a {pods}-pod fleet of {PROFILE} pods at peak prefill changes {changes:.0} blocks/s \
             ({per_pod:.0} stored per pod, each removed again) and routes {lookups:.0} requests/s: \
             {:.2} Valkey cores at {:.2} us per change and {:.1} us per lookup, so {primaries} \
             primaries at {:.0}% of a core each (stripes = primaries, index.valkey.cluster: true)",
            cores,
            s.cpu_us_per_block,
            s.cpu_us_per_lookup,
            CORE_BUDGET * 100.0
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_medians_with_ranges_and_percentiles_are_nearest_rank() {
        let o = ScaleOpts::new(true, std::env::temp_dir());
        let mut r = ScaleReport::new(&o);
        for cpu in [3.0, 1.0, 2.0] {
            r.add(
                "valkey",
                1000,
                Sample {
                    idle_cpu_ms_per_s: cpu,
                    decision_p99_ms: Some(cpu / 2.0),
                    ..Sample::default()
                },
            );
        }
        r.finish();
        let row = &r.rows[0];
        assert_eq!(row.idle_cpu_ms_per_s, 2.0);
        assert_eq!(row.idle_cpu_ms_per_s_range, [1.0, 3.0]);
        assert_eq!(row.decision_p99_ms, Some(1.0));
        assert_eq!(row.rounds, 3);
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.99), Some(99.0));
        assert_eq!(percentile(&v, 0.5), Some(50.0));
        assert_eq!(percentile(&[], 0.5), None);
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["rows"][0]["mode"], "valkey");
        assert_eq!(json["rows"][0]["pods"], 1000);
    }
}
