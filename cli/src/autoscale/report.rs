//! The closed loop's report: per fleet and policy, medians over seeds with
//! min-max ranges, as text, as JSON (`{"runs": [{"fleet", "policies":
//! [{"policy", "slo_attainment", "pod_seconds", "scale_actions", "lost",
//! ...}]}]}`), and as plots of pods and TTFT p90 against time.

use std::path::{Path, PathBuf};

use anyhow::Result;
use kvmesh_engine_sim::LatencyProfile;
use kvmesh_loadgen::report::sweep_plot::{self, Series};
use serde::Serialize;

use super::policy::ScalePolicy;
use super::{AutoscaleOpts, FleetKind, PolicyRun, Timing};

/// See the module docs.
#[derive(Debug, Clone, Serialize)]
pub struct AutoscaleReport {
    pub setup: Setup,
    pub runs: Vec<FleetRuns>,
}

/// What the run was: the SLO, the pods, the clocks, the load.
#[derive(Debug, Clone, Serialize)]
pub struct Setup {
    pub quick: bool,
    pub seeds: Vec<u64>,
    pub profile: String,
    pub time_scale: f64,
    pub timing: Timing,
    pub base_rate: f64,
    pub kv_cache_tokens: Option<usize>,
    /// `kvmesh-slo`'s `autoscale.slo.headroom`.
    pub slo_headroom: f64,
    /// The share of requests `kvmesh-slo` sizes to meet the TTFT target.
    pub slo_ttft_quantile: f64,
    /// The sidecars ran flow control (`--flow-control`).
    pub flow_control: bool,
}

/// One fleet's policies.
#[derive(Debug, Clone, Serialize)]
pub struct FleetRuns {
    pub fleet: FleetKind,
    pub trace: String,
    /// The SLO (simulated ms).
    pub ttft_p90_ms: f64,
    pub itl_p99_ms: f64,
    pub policies: Vec<PolicySummary>,
    /// The hook's model at each trace minute's rate, (simulated second, pods
    /// over the pools): the fleet that follows the trace exactly.
    pub ideal_pods: Vec<(f64, u32)>,
    /// Its pod-seconds, and over fixed-peak's.
    pub ideal_pod_seconds: f64,
    pub ideal_vs_peak: Option<f64>,
}

/// One policy over every seed: medians, with `[min, max]` ranges.
#[derive(Debug, Clone, Serialize)]
pub struct PolicySummary {
    pub policy: ScalePolicy,
    pub slo_attainment: f64,
    pub slo_attainment_range: [f64; 2],
    pub minutes_within_slo: f64,
    pub pod_seconds: f64,
    pub pod_seconds_range: [f64; 2],
    /// Pod-seconds over the fixed-peak fleet's (when it ran).
    pub pod_seconds_vs_peak: Option<f64>,
    pub scale_actions: usize,
    pub recovery_s: f64,
    /// Requests lost, summed over seeds (the target is 0).
    pub lost: usize,
    pub requests: usize,
    pub failed_starts: usize,
    pub seeds: Vec<PolicyRun>,
}

impl AutoscaleReport {
    pub fn new(opts: &AutoscaleOpts, profile: &LatencyProfile) -> Self {
        Self {
            setup: Setup {
                quick: opts.quick,
                seeds: opts.seeds.clone(),
                profile: opts.profile.clone(),
                time_scale: opts.time_scale,
                timing: opts.timing,
                base_rate: opts.base_rate,
                kv_cache_tokens: profile.kv_cache_tokens,
                slo_headroom: opts.slo_headroom,
                slo_ttft_quantile: opts.slo_ttft_quantile,
                flow_control: opts.flow_control,
            },
            runs: Vec::new(),
        }
    }

    pub fn add_fleet(
        &mut self,
        fleet: FleetKind,
        runs: Vec<PolicyRun>,
        ideal_pods: Vec<(f64, u32)>,
    ) {
        let mut policies: Vec<PolicySummary> = Vec::new();
        for p in ScalePolicy::KNOWN {
            let of: Vec<PolicyRun> = runs.iter().filter(|r| r.policy == p).cloned().collect();
            if of.is_empty() {
                continue;
            }
            let med = |f: fn(&PolicyRun) -> f64| median(of.iter().map(f).collect());
            let range = |f: fn(&PolicyRun) -> f64| {
                let v: Vec<f64> = of.iter().map(f).collect();
                [
                    v.iter().copied().fold(f64::INFINITY, f64::min),
                    v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                ]
            };
            policies.push(PolicySummary {
                policy: p,
                slo_attainment: med(|r| r.slo_attainment),
                slo_attainment_range: range(|r| r.slo_attainment),
                minutes_within_slo: med(|r| r.minutes_within_slo),
                pod_seconds: med(|r| r.pod_seconds),
                pod_seconds_range: range(|r| r.pod_seconds),
                pod_seconds_vs_peak: None,
                scale_actions: med(|r| r.scale_actions as f64).round() as usize,
                recovery_s: med(|r| r.recovery_s),
                lost: of.iter().map(|r| r.lost).sum(),
                requests: of.iter().map(|r| r.requests).sum(),
                failed_starts: of.iter().map(|r| r.failed_starts).sum(),
                seeds: of,
            });
        }
        let peak = policies
            .iter()
            .find(|p| p.policy == ScalePolicy::FixedPeak)
            .map(|p| p.pod_seconds);
        for p in &mut policies {
            p.pod_seconds_vs_peak = peak.filter(|&x| x > 0.0).map(|x| p.pod_seconds / x);
        }
        let minute = self.setup.timing.minute.as_secs_f64();
        let ideal_pod_seconds: f64 = ideal_pods.iter().map(|(_, n)| f64::from(*n) * minute).sum();
        self.runs.push(FleetRuns {
            fleet,
            ttft_p90_ms: fleet.slo().0,
            itl_p99_ms: fleet.slo().1,
            trace: format!(
                "azure-2023-conv rate shape with a 3x burst; sizes {}",
                match fleet {
                    FleetKind::Aggregated => super::trace::CONV_SIZES.name,
                    FleetKind::Pd => super::trace::CODE_SIZES.name,
                }
            ),
            policies,
            ideal_vs_peak: peak.filter(|&x| x > 0.0).map(|x| ideal_pod_seconds / x),
            ideal_pods,
            ideal_pod_seconds,
        });
    }

    /// A table per fleet.
    pub fn text(&self) -> String {
        let s = &self.setup;
        let mut out = format!(
            "kvmesh bench autoscale{}: {} pods, time scale {}x, base rate {} req/s, seeds {:?}{}\n",
            if s.quick { " --quick" } else { "" },
            s.profile,
            s.time_scale,
            s.base_rate,
            s.seeds,
            if s.slo_headroom == 1.0 {
                String::new()
            } else {
                format!(", headroom {}x (kvmesh-slo and the bounds)", s.slo_headroom)
            } + &format!(
                ", every fleet sized for TTFT p{:.0}{}",
                s.slo_ttft_quantile * 100.0,
                if s.flow_control {
                    ", sidecars with flow control"
                } else {
                    ""
                }
            )
        );
        for f in &self.runs {
            out.push_str(&format!(
                "\n{} fleet ({}); SLO TTFT p90 <= {} ms, ITL p99 <= {} ms\n",
                f.fleet.name(),
                f.trace,
                f.ttft_p90_ms,
                f.itl_p99_ms
            ));
            out.push_str("| policy | SLO attainment | minutes within SLO | pod-seconds (vs fixed-peak) | scale actions | recovery after burst (s) | lost |\n|---|---|---|---|---|---|---|\n");
            for p in &f.policies {
                out.push_str(&format!(
                    "| {} | {:.4} [{:.4}-{:.4}] | {:.2} | {:.0} [{:.0}-{:.0}] ({}) | {} | {:.0} | {} |\n",
                    p.policy.name(),
                    p.slo_attainment,
                    p.slo_attainment_range[0],
                    p.slo_attainment_range[1],
                    p.minutes_within_slo,
                    p.pod_seconds,
                    p.pod_seconds_range[0],
                    p.pod_seconds_range[1],
                    p.pod_seconds_vs_peak
                        .map_or("-".to_owned(), |r| format!("{r:.2}x")),
                    p.scale_actions,
                    p.recovery_s,
                    p.lost,
                ));
            }
            out.push_str(&format!(
                "the hook's model at each minute's rate (no start-up, no stabilisation): {:.0} pod-s ({})\n",
                f.ideal_pod_seconds,
                f.ideal_vs_peak
                    .map_or("-".to_owned(), |r| format!("{r:.2}x fixed-peak")),
            ));
        }
        out
    }

    /// Pods and TTFT p90 against time, one line per policy (the first
    /// seed), two PNGs per fleet: `STEM-FLEET-pods.png`, `STEM-FLEET-ttft.png`.
    pub fn write_pngs(&self, path: &Path) -> Result<Vec<PathBuf>> {
        let stem = path.with_extension("");
        let base = stem
            .file_name()
            .and_then(|s| s.to_str())
            .unwrap_or("autoscale")
            .to_owned();
        let mut written = Vec::new();
        let seed = self.setup.seeds.first().copied().unwrap_or_default();
        for f in &self.runs {
            let lines = |pick: fn(&(f64, u32, u32, f64)) -> f64| -> Vec<Series> {
                f.policies
                    .iter()
                    .filter_map(|p| {
                        let run = p.seeds.first()?;
                        Some(Series {
                            name: p.policy.name().to_owned(),
                            points: run
                                .series
                                .iter()
                                .filter(|s| pick(s).is_finite())
                                .map(|s| (s.0, pick(s), pick(s), pick(s)))
                                .collect(),
                        })
                    })
                    .collect()
            };
            let pods = stem.with_file_name(format!("{base}-{}-pods.png", f.fleet.name()));
            let mut pod_lines = lines(|s| f64::from(s.1));
            // The model at the trace's rate, as steps.
            let steps: Vec<(f64, f64, f64, f64)> = f
                .ideal_pods
                .iter()
                .zip(f.ideal_pods.iter().skip(1).map(|p| p.0).chain([f64::NAN]))
                .flat_map(|(&(t, n), next)| {
                    let n = f64::from(n);
                    let end = if next.is_finite() {
                        next
                    } else {
                        t + self.setup.timing.minute.as_secs_f64()
                    };
                    [(t, n, n, n), (end, n, n, n)]
                })
                .collect();
            pod_lines.push(Series {
                name: "model at the trace's rate".to_owned(),
                points: steps,
            });
            sweep_plot::write_png(
                &format!(
                    "{} fleet: pods asked for, against time (seed {})",
                    f.fleet.name(),
                    seed
                ),
                "simulated seconds",
                &pod_lines,
                &pods,
            )?;
            let ttft = stem.with_file_name(format!("{base}-{}-ttft.png", f.fleet.name()));
            sweep_plot::write_png(
                &format!(
                    "{} fleet: TTFT p90 (ms) of each poll's requests, against time (seed {})",
                    f.fleet.name(),
                    seed
                ),
                "simulated seconds",
                &lines(|s| s.3),
                &ttft,
            )?;
            written.push(pods);
            written.push(ttft);
        }
        Ok(written)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
