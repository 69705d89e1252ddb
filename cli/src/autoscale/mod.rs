//! `kvmesh bench autoscale`: the autoscaling hook in a closed loop. A fleet of
//! simulated engine pods with their sidecars serves a rate that moves like a
//! production trace's ([`trace`]); a controller polls each policy's trigger
//! the way KEDA does and applies the HorizontalPodAutoscaler's arithmetic
//! ([`policy`]); pods start after a model-load delay and drain before they
//! go ([`fleet`]). Every policy runs the same arrivals on a fresh fleet:
//!
//! - `fixed-peak` and `fixed-mean`: fleets sized for the trace's peak and
//!   mean rate (by the SLO model of `kvmesh_proxy::autoscale::slo`, so the
//!   fixed fleets also check that model);
//! - `queue-hpa`: KEDA on `vllm:num_requests_waiting`, 5 per replica;
//! - `kvmesh-queue` and `kvmesh-slo`: KEDA's metrics-api scaler on any
//!   sidecar's `/autoscale`, without and with `autoscale.slo`.
//!
//! The report gives, per policy, the share of requests within the SLO, the
//! share of trace minutes in which it held, the pod-seconds paid, the scale
//! actions, the time to recover after the burst, and the requests lost;
//! medians over seeds with min-max ranges (docs/autoscaling.md reads a run).

pub mod fleet;
pub mod policy;
pub mod report;
pub mod trace;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use kvmesh_engine_sim::{Flavor, LatencyProfile};
use kvmesh_filters::sched::Role;
use kvmesh_loadgen::client::{Client, ClientConfig};
use kvmesh_loadgen::workload::text;
use kvmesh_proxy::autoscale::rates::Workload;
use kvmesh_proxy::autoscale::slo::{self, Targets};
use kvmesh_proxy::config::autoscale::{PodProfile, Slo};
use kvmesh_proxy::config::{self, Config};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;

use crate::demo::fleet::FleetSpec;
use crate::demo::Policy;
use fleet::{Clock, ElasticFleet, PodTemplate};
use policy::{Hpa, ScalePolicy};
pub use report::AutoscaleReport;
use trace::{Arrival, Schedule, Sizes};

/// The fleets compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FleetKind {
    /// Every pod prefills and decodes; the conversation trace's sizes.
    Aggregated,
    /// Prefill and decode pools (kvmesh's P/D); the code trace's sizes.
    Pd,
}

impl FleetKind {
    pub fn name(self) -> &'static str {
        match self {
            FleetKind::Aggregated => "aggregated",
            FleetKind::Pd => "pd",
        }
    }

    /// The pools, with their names in the hook's answer.
    pub fn pools(self) -> &'static [(&'static str, Role)] {
        match self {
            FleetKind::Aggregated => &[("aggregated", Role::Both)],
            FleetKind::Pd => &[("prefill", Role::Prefill), ("decode", Role::Decode)],
        }
    }

    /// The SLO the fleet is held to (simulated ms): TTFT p90 and ITL p99.
    /// The aggregated fleet's is the peers benchmark's (docs/benchmarks.md);
    /// the P/D fleet's long code prompts take ~0.7 s to prefill at their
    /// 90th percentile (5194 tokens) alone, so its TTFT target is 2 s, and
    /// its decode pods, free of prefill, are held to 100 ms.
    pub fn slo(self) -> (f64, f64) {
        match self {
            FleetKind::Aggregated => (1000.0, 200.0),
            FleetKind::Pd => (2000.0, 100.0),
        }
    }

    /// The engines' chunked-prefill budget (vLLM `--max-num-batched-tokens`)
    /// of a pod in `role`: 512 where prefill shares the GPU with decodes (as
    /// vLLM's docs advise for an ITL target, so a prompt stalls them a short
    /// chunk at a time), vLLM's H100 default of 8192 on prefill pods.
    pub fn chunk_budget(role: Role) -> usize {
        match role {
            Role::Prefill => 8192,
            Role::Decode | Role::Both => 512,
        }
    }

    fn sizes(self) -> Sizes {
        match self {
            FleetKind::Aggregated => trace::CONV_SIZES,
            FleetKind::Pd => trace::CODE_SIZES,
        }
    }
}

/// The control loop's clocks, in simulated time.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Timing {
    /// One trace minute.
    pub minute: Duration,
    /// A pod's model load before it serves.
    pub startup: Duration,
    /// KEDA's polling interval.
    pub poll: Duration,
    /// The HPA's scale-down stabilisation window: KEDA's default, which
    /// the queue policies run with.
    pub stabilization: Duration,
    /// The window the shipped ScaledObjects set for the SLO hook's triggers
    /// (`deploy/autoscaling/`), which `kvmesh-slo` runs with: the hook
    /// stabilises scale-down itself (docs/autoscaling.md).
    pub hook_stabilization: Duration,
    /// The hook's rate window and sampling interval.
    pub hook_window: Duration,
    pub hook_sample: Duration,
    /// A leaving pod's preStop wait.
    pub pre_stop: Duration,
}

impl Timing {
    /// Kubernetes' and KEDA's defaults, the trace replayed twice as fast as
    /// it was recorded: a trace minute is 30 s; pods load for 30 s; KEDA
    /// polls every 15 s; the HPA waits 300 s before scaling down.
    pub fn real() -> Self {
        Self {
            minute: Duration::from_secs(30),
            startup: Duration::from_secs(30),
            poll: Duration::from_secs(15),
            stabilization: Duration::from_secs(300),
            hook_stabilization: shipped_scale_down_window(),
            hook_window: Duration::from_secs(60),
            hook_sample: Duration::from_secs(5),
            pre_stop: Duration::from_secs(5),
        }
    }

    /// Every clock of [`Timing::real`] `k` times faster, the trace `2k`
    /// times faster than recorded: the same race between the load and the
    /// scaler, in `k` times less time.
    pub fn compressed(k: u32) -> Self {
        let f = Self::real();
        let k = k.max(1);
        Self {
            minute: f.minute / k,
            startup: f.startup / k,
            poll: f.poll / k,
            stabilization: f.stabilization / k,
            hook_stabilization: f.hook_stabilization / k,
            hook_window: f.hook_window / k,
            hook_sample: f.hook_sample / k,
            pre_stop: f.pre_stop / k,
        }
    }
}

/// The scale-down stabilisation window of the shipped ScaledObjects for
/// the hook (`behavior.scaleDown.stabilizationWindowSeconds`, the largest
/// they set; KEDA's 300 s default where they set none).
pub fn shipped_scale_down_window() -> Duration {
    let yaml = include_str!("../../assets/deploy/autoscaling/keda-scaledobjects.yaml");
    let secs = yaml
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| l.split("stabilizationWindowSeconds:").nth(1))
        .filter_map(|v| {
            let digits: String = v.trim().chars().take_while(char::is_ascii_digit).collect();
            digits.parse::<u64>().ok()
        })
        .max()
        .unwrap_or(300);
    Duration::from_secs(secs)
}

/// How many times faster than Kubernetes' clocks a run goes by default.
pub const DEFAULT_COMPRESSION: u32 = 5;

/// What one run compares.
#[derive(Debug, Clone)]
pub struct AutoscaleOpts {
    pub quick: bool,
    pub seeds: Vec<u64>,
    pub fleets: Vec<FleetKind>,
    pub policies: Vec<ScalePolicy>,
    /// Simulated seconds per wall second.
    pub time_scale: f64,
    pub timing: Timing,
    /// Requests per second at the trace's mean rate, per fleet.
    pub base_rate: f64,
    /// The GPU profile every pod runs (`gpu:MODEL@GPU`).
    pub profile: String,
    pub max_pods_per_pool: u32,
    /// `kvmesh-slo`'s `autoscale.slo.headroom`; the bounds (`clairvoyant`,
    /// `reactive-bound`) size for this many times the trace's rate.
    pub slo_headroom: f64,
    /// The share of requests `kvmesh-slo` sizes to meet the TTFT target
    /// (`autoscale.slo.ttft_p90`, `_p95` or `_p99`); the fixed fleets, the
    /// reactive ones' starting size, the bounds and the model's line use
    /// it too.
    pub slo_ttft_quantile: f64,
    /// The sidecars hold requests while their pool is saturated
    /// (`featureGates: [flowControl]` with llm-d's thresholds), under every
    /// policy.
    pub flow_control: bool,
    pub progress: bool,
}

impl AutoscaleOpts {
    /// Three seeds, or `quick`'s one (under 10 minutes on 2 cores); every
    /// clock five times faster than Kubernetes' (what fits this machine).
    pub fn new(quick: bool) -> Self {
        Self {
            quick,
            seeds: if quick { vec![1] } else { vec![1, 2, 3] },
            fleets: vec![FleetKind::Aggregated, FleetKind::Pd],
            policies: ScalePolicy::ALL.to_vec(),
            time_scale: 10.0,
            timing: Timing::compressed(DEFAULT_COMPRESSION),
            base_rate: 3.0,
            profile: "gpu:qwen3-32b@h100".to_owned(),
            max_pods_per_pool: 12,
            slo_headroom: 1.0,
            // Issue 41's target: 99% of requests within the TTFT target.
            slo_ttft_quantile: 0.99,
            flow_control: false,
            progress: false,
        }
    }

    fn schedule(&self) -> Schedule {
        Schedule {
            base: self.base_rate,
            minute: self.timing.minute,
        }
    }
}

/// One policy on one fleet with one seed.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyRun {
    pub policy: ScalePolicy,
    pub seed: u64,
    pub requests: usize,
    /// Share of requests with TTFT and their own ITL p99 within the SLO.
    pub slo_attainment: f64,
    /// Share of trace minutes whose requests met TTFT p90 and ITL p99.
    pub minutes_within_slo: f64,
    /// Simulated GPU-pod seconds, from each pod's request to its stop.
    pub pod_seconds: f64,
    pub scale_actions: usize,
    /// Simulated seconds from the burst's start until TTFT p90 held again.
    pub recovery_s: f64,
    /// Requests that failed (an error status, or a broken stream).
    pub lost: usize,
    /// Requests past the TTFT target, and past the ITL target (a request
    /// can be both).
    pub ttft_misses: usize,
    pub itl_misses: usize,
    /// Over every request: TTFT p90 and ITL p99 (every gap), ms.
    pub ttft_p90_ms: f64,
    pub itl_p99_ms: f64,
    /// Pods asked for and ready at each control tick, with the TTFT p90 of
    /// the requests sent since the previous tick: (s, replicas, ready, ttft ms).
    pub series: Vec<(f64, u32, u32, f64)>,
    /// Pod starts that failed (the harness, not the policy).
    pub failed_starts: usize,
    /// Up to five distinct reasons requests were lost.
    pub errors: Vec<String>,
    /// Per trace minute, the requests sent in it that missed the SLO (or
    /// failed): where the attainment went.
    pub misses_per_minute: Vec<u32>,
    /// The most pods each pool was asked to run.
    pub pool_max: std::collections::BTreeMap<String, u32>,
    /// Simulated seconds from the trace's start to the last response's end.
    pub elapsed_s: f64,
    /// The latest the load generator sent a request past its arrival time,
    /// simulated seconds (above a fraction of a second, this machine could
    /// not keep the pace and the figures are not to be trusted).
    pub harness_lag_s: f64,
}

/// Runs every fleet, seed and policy.
pub async fn run(opts: &AutoscaleOpts) -> Result<AutoscaleReport> {
    if opts.seeds.is_empty() || opts.policies.is_empty() || opts.fleets.is_empty() {
        bail!("nothing to run: give at least one seed, policy and fleet");
    }
    let profile = LatencyProfile::load(&opts.profile)
        .map_err(|e| anyhow::anyhow!("profile {}: {e}", opts.profile))?;
    let mut report = AutoscaleReport::new(opts, &profile);
    for &fleet in &opts.fleets {
        let mut runs = Vec::new();
        for &seed in &opts.seeds {
            for &policy in &opts.policies {
                if opts.progress {
                    eprintln!(
                        "autoscale: {} fleet, {}, seed {seed}",
                        fleet.name(),
                        policy.name()
                    );
                }
                let r = run_one(opts, &profile, fleet, policy, seed)
                    .await
                    .with_context(|| format!("{} {} seed {seed}", fleet.name(), policy.name()))?;
                if opts.progress {
                    eprintln!(
                        "  attainment {:.4} (TTFT misses {}, ITL misses {}; TTFT p90 {:.0} ms, ITL p99 {:.0} ms), pod-s {:.0}, actions {}, lost {}; ran {:.0} s, lag {:.2} s",
                        r.slo_attainment, r.ttft_misses, r.itl_misses, r.ttft_p90_ms, r.itl_p99_ms, r.pod_seconds, r.scale_actions, r.lost, r.elapsed_s, r.harness_lag_s
                    );
                    for e in &r.errors {
                        eprintln!("  lost: {e}");
                    }
                    let misses: Vec<String> = r
                        .misses_per_minute
                        .iter()
                        .enumerate()
                        .filter(|(_, n)| **n > 0)
                        .map(|(m, n)| format!("{m}:{n}"))
                        .collect();
                    eprintln!("  misses by trace minute: {}", misses.join(" "));
                }
                runs.push(r);
            }
        }
        report.add_fleet(fleet, runs, ideal_pods(opts, &profile, fleet));
    }
    Ok(report)
}

/// The SLO model's sizes for one fleet's pools: requests shaped like the
/// trace's (their moments drawn once), the TTFT target held by the run's
/// percentile (a fleet sized for the peak is sized for the share the hook
/// is).
struct ModelSizes<'a> {
    opts: &'a AutoscaleOpts,
    profile: &'a LatencyProfile,
    fleet: FleetKind,
    /// The mean prompt, its mean square and the mean output.
    moments: (f64, f64, f64),
}

impl<'a> ModelSizes<'a> {
    fn new(opts: &'a AutoscaleOpts, profile: &'a LatencyProfile, fleet: FleetKind) -> Self {
        Self {
            opts,
            profile,
            fleet,
            moments: trace_moments(opts, fleet),
        }
    }

    /// The pods `role`'s pool needs at `rate`.
    fn pods(&self, role: Role, rate: f64) -> u32 {
        let (prompt, prompt_sq, output) = self.moments;
        let prompt_sq = Some(prompt_sq);
        let w = match role {
            // A prefill pod computes every prompt and streams one token.
            Role::Prefill => Workload {
                arrival_rate: rate,
                prompt_tokens: prompt,
                uncached_tokens: prompt,
                output_tokens: 1.0,
                prompt_tokens_sq: prompt_sq,
                window_s: 60.0,
            },
            // A decode pod receives the prompt's KV and generates.
            Role::Decode => Workload {
                arrival_rate: rate,
                prompt_tokens: prompt,
                uncached_tokens: 0.0,
                output_tokens: output,
                prompt_tokens_sq: prompt_sq,
                window_s: 60.0,
            },
            Role::Both => Workload {
                arrival_rate: rate,
                prompt_tokens: prompt,
                uncached_tokens: prompt,
                output_tokens: output,
                prompt_tokens_sq: prompt_sq,
                window_s: 60.0,
            },
        };
        let (ttft, itl) = self.fleet.slo();
        let targets = Targets {
            ttft_ms: ttft,
            ttft_quantile: self.opts.slo_ttft_quantile,
            itl_p99_ms: itl,
            kv_usage: config::Autoscale::default().target_kv_usage.get(),
        };
        let pod = pod_profile(&role_profile(self.profile, role), 1.0);
        slo::pods_needed(&pod, &targets, &w, self.opts.max_pods_per_pool).0
    }
}

/// The pods the hook's model asks for at each trace minute's scheduled
/// rate, summed over the fleet's pools, as (simulated second the minute
/// starts, pods): a fleet that followed the trace exactly, with no start-up,
/// no stabilisation and no noise in its rate.
fn ideal_pods(opts: &AutoscaleOpts, profile: &LatencyProfile, kind: FleetKind) -> Vec<(f64, u32)> {
    let s = opts.schedule();
    let minute = s.minute.as_secs_f64();
    let sizes = ModelSizes::new(opts, profile, kind);
    (0..trace::CONV_MINUTES.len())
        .map(|m| {
            let at = m as f64 * minute;
            let rate = s.rate_at(at);
            let pods = kind
                .pools()
                .iter()
                .map(|&(_, role)| sizes.pods(role, rate))
                .sum();
            (at, pods)
        })
        .collect()
}

/// The mean prompt, its mean square and the mean output of the requests
/// the fleet is sent (drawn as the run draws them, clipped to the context),
/// over enough draws that the moments are the trace's.
fn trace_moments(opts: &AutoscaleOpts, fleet: FleetKind) -> (f64, f64, f64) {
    let many = Schedule {
        base: 50.0,
        minute: opts.timing.minute,
    };
    let a = many.arrivals(&fleet.sizes(), MAX_MODEL_LEN, 0);
    let n = a.len().max(1) as f64;
    let mean = |f: &dyn Fn(&Arrival) -> f64| a.iter().map(f).sum::<f64>() / n;
    (
        mean(&|r| f64::from(r.prompt_tokens)),
        mean(&|r| f64::from(r.prompt_tokens).powi(2)),
        mean(&|r| f64::from(r.output_tokens)),
    )
}

/// The engines' context (prompt and output), which the trace's sizes are
/// clipped to.
const MAX_MODEL_LEN: u32 = 8192;

/// The GPU profile with the chunked-prefill budget of a pod in `role`.
fn role_profile(p: &LatencyProfile, role: Role) -> LatencyProfile {
    LatencyProfile {
        max_num_batched_tokens: FleetKind::chunk_budget(role),
        ..p.clone()
    }
}

/// The hook's view of a pod: the engine's costs in the sidecar's (wall)
/// milliseconds, `scale` simulated ms per wall ms.
fn pod_profile(p: &LatencyProfile, scale: f64) -> PodProfile {
    PodProfile {
        step_base_ms: p.step_base_ms / scale,
        prefill_ms_per_token: p.prefill_ms_per_token / scale,
        prefill_ms_per_token_kctx: p.prefill_ms_per_token_kctx / scale,
        decode_ms_per_seq: p.decode_ms_per_seq / scale,
        decode_ms_per_kctx: p.decode_ms_per_kctx / scale,
        kv_cache_tokens: p.kv_cache_tokens.unwrap_or(65_536) as u64,
        max_num_seqs: p.max_num_seqs.unwrap_or(256) as u32,
        max_num_batched_tokens: p.max_num_batched_tokens as u32,
    }
}

fn wall_ms(sim: f64, scale: f64) -> config::Duration {
    config::Duration::from_millis((sim / scale).round().max(1.0) as u64)
}

/// The sidecars' config on top of the fleet's: the hook (with the SLO for
/// `kvmesh-slo`, its clocks in wall time), pools up to the policy's bound,
/// a drain long enough for a generation to finish.
fn edit_config(
    opts: &AutoscaleOpts,
    profile: &LatencyProfile,
    kind: FleetKind,
    policy: ScalePolicy,
) -> impl Fn(&mut Config) + Send + Sync + 'static {
    let scale = opts.time_scale;
    let t = opts.timing;
    let max = opts.max_pods_per_pool;
    let (ttft, itl) = kind.slo();
    let first = if kind == FleetKind::Pd {
        Role::Prefill
    } else {
        Role::Both
    };
    let ttft = Some(wall_ms(ttft, scale));
    let q = opts.slo_ttft_quantile;
    let slo = (policy == ScalePolicy::KvmeshSlo).then(|| Slo {
        ttft_p90: ttft.filter(|_| q == 0.9),
        ttft_p95: ttft.filter(|_| q == 0.95),
        ttft_p99: ttft.filter(|_| q == 0.99),
        itl_p99: wall_ms(itl, scale),
        window: wall_ms(t.hook_window.as_secs_f64() * 1000.0, scale),
        sample_interval: wall_ms(t.hook_sample.as_secs_f64() * 1000.0, scale),
        headroom: opts.slo_headroom,
        pod: pod_profile(&role_profile(profile, first), scale),
        decode_pod: (kind == FleetKind::Pd)
            .then(|| pod_profile(&role_profile(profile, Role::Decode), scale)),
    });
    move |c: &mut Config| {
        c.autoscale.max_replicas = max;
        c.autoscale.slo = slo.clone();
        // Loads older than a few scrapes are stale (wall time).
        c.autoscale.max_load_age = config::Duration::from_secs(2);
        // Ten simulated minutes: every generation finishes.
        c.timeouts.shutdown_drain = wall_ms(600_000.0, scale);
    }
}

/// The sidecars' filters: kvmesh's default, or on the P/D fleet the P/D
/// example with every request split (`promptTokens` and `nonCachedTokens` 1),
/// so the prefill pool prefills every prompt and the decode pool decodes
/// every answer, as a fully disaggregated deployment runs. With
/// `flow_control`, its gate on at llm-d's thresholds.
fn filters(kind: FleetKind, flow_control: bool) -> Result<kvmesh_filters::sched::FilterConfig> {
    let mut cfg = filters_of(kind)?;
    if flow_control {
        cfg.feature_gates
            .push(kvmesh_filters::sched::config::flow::GATE.to_owned());
        cfg.flow_control = Some(Default::default());
    }
    Ok(cfg)
}

fn filters_of(kind: FleetKind) -> Result<kvmesh_filters::sched::FilterConfig> {
    let policy = match kind {
        FleetKind::Aggregated => return Ok(Policy::Kvmesh.filter_config()?),
        FleetKind::Pd => Policy::Pd,
    };
    let text = include_str!("../../assets/deploy/examples/filters-pd-disaggregated.yaml");
    let split_all = text
        .replace("nonCachedTokens: 2048", "nonCachedTokens: 1")
        .replace("promptTokens: 1024", "promptTokens: 1");
    if split_all == text {
        bail!("the P/D example's decider thresholds moved; update the autoscale bench");
    }
    Ok(kvmesh_filters::sched::FilterConfig::from_yaml(
        &split_all,
        policy.source(),
    )?)
}

/// The fleet shape every pod shares (decode pods with their own budget).
fn fleet_spec(opts: &AutoscaleOpts, profile: &LatencyProfile, kind: FleetKind) -> FleetSpec {
    let kv_tokens = profile.kv_cache_tokens.unwrap_or(65_536);
    let first = if kind == FleetKind::Pd {
        Role::Prefill
    } else {
        Role::Both
    };
    FleetSpec {
        engines: 1,
        model: "autoscale-model".to_owned(),
        time_scale: opts.time_scale,
        profile: role_profile(profile, first),
        decode_profile: Some(Box::new(role_profile(profile, Role::Decode))),
        block_size: 16,
        num_blocks: kv_tokens / 16,
        max_num_seqs: profile.max_num_seqs.unwrap_or(256),
        kv_events: true,
        prefill_pods: None,
        flavor: Flavor::Vllm,
        valkey: None,
    }
}

/// One request's outcome, in simulated time.
#[derive(Debug, Clone)]
struct Outcome {
    sent_s: f64,
    /// How late it was sent, and when its response ended (simulated s).
    late_s: f64,
    done_s: f64,
    ttft_ms: Option<f64>,
    /// The request's own ITL p99 (ms); `None` with fewer than two tokens.
    itl_p99_ms: Option<f64>,
    gaps_ms: Vec<f64>,
    ok: bool,
    error: Option<String>,
}

async fn run_one(
    opts: &AutoscaleOpts,
    profile: &LatencyProfile,
    kind: FleetKind,
    policy: ScalePolicy,
    seed: u64,
) -> Result<PolicyRun> {
    let schedule = opts.schedule();
    let (peak, mean) = schedule.peak_and_mean();
    let spec = fleet_spec(opts, profile, kind);
    let template = PodTemplate {
        spec,
        policy: match kind {
            FleetKind::Aggregated => Policy::Kvmesh,
            FleetKind::Pd => Policy::Pd,
        },
        filters: filters(kind, opts.flow_control)?,
        edit: Arc::new(edit_config(opts, profile, kind, policy)),
        startup: opts.timing.startup,
        pre_stop: opts.timing.pre_stop,
    };
    let mut clock = Clock {
        t0: tokio::time::Instant::now(),
        scale: opts.time_scale,
    };
    let mut fleet = ElasticFleet::new(template, clock).context("fleet")?;
    let sizes = ModelSizes::new(opts, profile, kind);
    // The fixed fleets hold their size; the reactive ones start at the mean's.
    let mut hpas = Vec::new();
    for &(_, role) in kind.pools() {
        let at = if policy == ScalePolicy::FixedPeak {
            peak
        } else {
            mean
        };
        let n = sizes.pods(role, at);
        fleet.start_warm(role, n as usize);
        // The queue policies keep KEDA's default; the SLO hook's triggers
        // run with the window the shipped ScaledObjects set.
        let hold = match policy {
            ScalePolicy::KvmeshSlo => opts.timing.hook_stabilization.as_secs_f64(),
            ScalePolicy::Clairvoyant | ScalePolicy::ReactiveBound => 0.0,
            _ => opts.timing.stabilization.as_secs_f64(),
        };
        hpas.push(Hpa::new(1, opts.max_pods_per_pool, hold, n));
    }
    let want: usize = kind.pools().iter().map(|&(_, r)| fleet.replicas(r)).sum();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while fleet.all_ready().count() < want {
        if tokio::time::Instant::now() > deadline {
            bail!("the starting fleet was not ready within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        fleet.promote().await;
    }
    // Every sidecar routes among the whole fleet before the trace starts
    // (they started together, so none had a peer to wait for).
    loop {
        let now = tokio::time::Instant::now();
        if fleet
            .all_ready()
            .all(|p| p.sidecar.fleet().snapshot(now).len() >= want)
        {
            break;
        }
        if now > deadline {
            bail!("the starting fleet's mesh did not connect within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The trace starts now.
    clock.t0 = tokio::time::Instant::now();
    fleet.set_clock(clock);
    let arrivals = schedule.arrivals(&kind.sizes(), MAX_MODEL_LEN, seed);
    let outcomes = Arc::new(std::sync::Mutex::new(Vec::with_capacity(arrivals.len())));
    let load = tokio::spawn(drive(
        arrivals.clone(),
        fleet.endpoints(),
        clock,
        outcomes.clone(),
        seed,
    ));
    let end_s = schedule.duration().as_secs_f64();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<Bytes>>();
    let mut actions = 0usize;
    let mut series = Vec::new();
    let mut next_poll = 0.0f64;
    let mut last_tick = 0.0f64;
    let tick = clock.wall(Duration::from_millis(500));
    let poll_s = opts.timing.poll.as_secs_f64();
    let mut which = 0usize;
    let mut pool_max: std::collections::BTreeMap<String, u32> = kind
        .pools()
        .iter()
        .map(|&(pool, role)| (pool.to_owned(), fleet.replicas(role) as u32))
        .collect();
    while clock.now_s() < end_s {
        tokio::time::sleep(tick).await;
        fleet.promote().await;
        let now = clock.now_s();
        if now < next_poll {
            continue;
        }
        next_poll = now + poll_s;
        let mut replicas = 0u32;
        let mut ready = 0u32;
        for (i, &(pool, role)) in kind.pools().iter().enumerate() {
            let current = fleet.replicas(role) as u32;
            if policy.reactive() {
                let wanted = match policy {
                    ScalePolicy::QueueHpa => {
                        let waiting: usize =
                            fleet.ready(role).map(|p| p.engine.stats().waiting).sum();
                        waiting as f64 / 5.0
                    }
                    ScalePolicy::Clairvoyant | ScalePolicy::ReactiveBound => {
                        // The pods asked for now serve a start-up (and at
                        // most a poll) later: clairvoyant sizes for the
                        // highest rate until then, the reactive bound for
                        // the rate now.
                        let ahead = (opts.timing.startup + opts.timing.poll).as_secs_f64();
                        let rate = if policy == ScalePolicy::Clairvoyant {
                            schedule.highest_rate(now, now + ahead)
                        } else {
                            schedule.rate_at(now)
                        };
                        f64::from(sizes.pods(role, rate * opts.slo_headroom))
                    }
                    _ => {
                        // KEDA reaches one sidecar through the Service.
                        let admins: Vec<_> =
                            fleet.all_ready().map(|p| p.sidecar.admin_addr()).collect();
                        which += 1;
                        match admins.get(which % admins.len().max(1)) {
                            Some(a) => hook_desired(&client, *a, pool)
                                .await
                                .unwrap_or(f64::from(current)),
                            None => f64::from(current),
                        }
                    }
                };
                let n = hpas[i].decide(now, current, wanted);
                if n != current {
                    actions += 1;
                    fleet.scale(role, n as usize);
                }
            }
            let now_replicas = fleet.replicas(role) as u32;
            let m = pool_max.entry(pool.to_owned()).or_default();
            *m = (*m).max(now_replicas);
            replicas += now_replicas;
            ready += fleet.ready(role).count() as u32;
        }
        let ttft = {
            let o = outcomes.lock().unwrap_or_else(|p| p.into_inner());
            let mut v: Vec<f64> = o
                .iter()
                .filter(|x: &&Outcome| x.sent_s >= last_tick && x.sent_s < now)
                .filter_map(|x| x.ttft_ms)
                .collect();
            quantile(&mut v, 0.9)
        };
        last_tick = now;
        series.push((now, replicas, ready, ttft));
    }
    // The trace is over: wait for what is in flight (bounded by the client's timeout).
    load.await.context("load driver")?;
    let failed_starts = fleet.failed_starts;
    let bills = fleet.shutdown(f64::INFINITY).await;
    let pod_seconds: f64 = bills.iter().map(|b| (b.to_s - b.from_s).max(0.0)).sum();
    let outcomes = Arc::try_unwrap(outcomes)
        .map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()))
        .unwrap_or_default();
    let mut run = judge(
        opts,
        kind,
        policy,
        seed,
        &outcomes,
        pod_seconds,
        actions,
        series,
        failed_starts,
    );
    run.pool_max = pool_max;
    Ok(run)
}

/// Asks a sidecar's hook how many pods `pool` should run.
async fn hook_desired(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Empty<Bytes>,
    >,
    admin: std::net::SocketAddr,
    pool: &str,
) -> Option<f64> {
    use http_body_util::BodyExt;
    let uri: http::Uri = format!("http://{admin}/autoscale").parse().ok()?;
    let resp = tokio::time::timeout(Duration::from_secs(2), client.get(uri))
        .await
        .ok()?
        .ok()?;
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
    if std::env::var_os("KVMESH_AUTOSCALE_DEBUG").is_some() {
        eprintln!("{admin} {pool} {}", v[pool]);
    }
    v[pool]["desired"].as_f64()
}

/// Sends every arrival at its time to the Service's endpoints in turn.
async fn drive(
    arrivals: Vec<Arrival>,
    endpoints: fleet::Endpoints,
    clock: Clock,
    out: Arc<std::sync::Mutex<Vec<Outcome>>>,
    seed: u64,
) {
    // A request still unanswered ten simulated minutes after it was sent
    // (the longest generation takes under two) counts as lost.
    let client = Arc::new(Client::new(ClientConfig {
        request_timeout: clock.wall(Duration::from_secs(600)),
        idle_timeout: clock.wall(Duration::from_secs(120)),
        ..ClientConfig::default()
    }));
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    for a in arrivals {
        tokio::time::sleep_until(clock.at(a.at_s)).await;
        let body = request_body(&mut rng, &a);
        let uri = {
            let eps = endpoints.read().unwrap_or_else(|p| p.into_inner());
            if eps.is_empty() {
                None
            } else {
                Some(eps[next.fetch_add(1, Ordering::Relaxed) % eps.len()].clone())
            }
        };
        let (client, out) = (client.clone(), out.clone());
        let at_s = a.at_s;
        tasks.spawn(async move {
            let sent_s = clock.now_s();
            let late_s = (sent_s - at_s).max(0.0);
            let outcome = match uri {
                None => Outcome {
                    sent_s,
                    late_s,
                    done_s: sent_s,
                    ttft_ms: None,
                    itl_p99_ms: None,
                    gaps_ms: Vec::new(),
                    ok: false,
                    error: Some("no ready pod in the Service".to_owned()),
                },
                Some(uri) => {
                    let r = client.send(uri, body, true).await;
                    let ms = |d: Duration| d.as_secs_f64() * 1000.0 * clock.scale;
                    let mut gaps: Vec<f64> = r.itl.iter().map(|d| ms(*d)).collect();
                    let itl_p99_ms = (!gaps.is_empty()).then(|| quantile(&mut gaps.clone(), 0.99));
                    gaps.shrink_to_fit();
                    Outcome {
                        sent_s,
                        late_s,
                        done_s: clock.now_s(),
                        ttft_ms: r.ttft.map(ms),
                        itl_p99_ms,
                        gaps_ms: gaps,
                        ok: r.is_ok(),
                        error: r
                            .error
                            .clone()
                            .or_else(|| (!r.is_ok()).then(|| format!("status {:?}", r.status))),
                    }
                }
            };
            out.lock().unwrap_or_else(|p| p.into_inner()).push(outcome);
        });
    }
    while tasks.join_next().await.is_some() {}
}

fn request_body(rng: &mut StdRng, a: &Arrival) -> Bytes {
    let body = serde_json::json!({
        "model": "autoscale-model",
        "prompt": text::words(rng, a.prompt_tokens as usize),
        "max_tokens": a.output_tokens,
        "ignore_eos": true,
        "temperature": 0.0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    Bytes::from(body.to_string())
}

/// The `q` quantile (nearest rank) of `v`; NaN when empty.
fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

#[allow(clippy::too_many_arguments)]
fn judge(
    opts: &AutoscaleOpts,
    kind: FleetKind,
    policy: ScalePolicy,
    seed: u64,
    outcomes: &[Outcome],
    pod_seconds: f64,
    scale_actions: usize,
    series: Vec<(f64, u32, u32, f64)>,
    failed_starts: usize,
) -> PolicyRun {
    let (ttft_t, itl_t) = kind.slo();
    let within = |o: &Outcome| {
        o.ok && o.ttft_ms.is_some_and(|t| t <= ttft_t) && o.itl_p99_ms.is_none_or(|i| i <= itl_t)
    };
    let n = outcomes.len();
    let good = outcomes.iter().filter(|o| within(o)).count();
    let lost = outcomes.iter().filter(|o| !o.ok).count();
    let ttft_misses = outcomes
        .iter()
        .filter(|o| o.ok && o.ttft_ms.is_none_or(|t| t > ttft_t))
        .count();
    let itl_misses = outcomes
        .iter()
        .filter(|o| o.ok && o.itl_p99_ms.is_some_and(|i| i > itl_t))
        .count();
    let mut all_ttft: Vec<f64> = outcomes.iter().filter_map(|o| o.ttft_ms).collect();
    let mut all_gaps: Vec<f64> = outcomes
        .iter()
        .flat_map(|o| o.gaps_ms.iter().copied())
        .collect();
    // Per trace minute: TTFT p90 and ITL p99 over the requests sent in it.
    let minute = opts.timing.minute.as_secs_f64();
    let minutes = trace::CONV_MINUTES.len();
    let mut held = 0usize;
    let mut violated = vec![false; minutes];
    let mut misses_per_minute = vec![0u32; minutes];
    for (m, v) in violated.iter_mut().enumerate() {
        let (a, b) = (m as f64 * minute, (m + 1) as f64 * minute);
        let of: Vec<&Outcome> = outcomes
            .iter()
            .filter(|o| o.sent_s >= a && o.sent_s < b)
            .collect();
        misses_per_minute[m] = of.iter().filter(|o| !within(o)).count() as u32;
        let mut ttft: Vec<f64> = of
            .iter()
            .map(|o| {
                if o.ok {
                    o.ttft_ms.unwrap_or(f64::INFINITY)
                } else {
                    f64::INFINITY
                }
            })
            .collect();
        let mut gaps: Vec<f64> = of.iter().flat_map(|o| o.gaps_ms.iter().copied()).collect();
        let ok = of.is_empty()
            || (quantile(&mut ttft, 0.9) <= ttft_t
                && (gaps.is_empty() || quantile(&mut gaps, 0.99) <= itl_t));
        *v = !ok;
        held += usize::from(ok);
    }
    // Recovery: from the burst's start to the end of the last minute after
    // it (within four minutes past its end) that missed the SLO.
    let (b0, b1, _) = trace::BURST;
    let last_bad = (b0..(b1 + 4).min(minutes)).rev().find(|&m| violated[m]);
    let recovery_s = last_bad.map_or(0.0, |m| (m + 1 - b0) as f64 * minute);
    PolicyRun {
        policy,
        seed,
        requests: n,
        slo_attainment: if n == 0 { 0.0 } else { good as f64 / n as f64 },
        minutes_within_slo: held as f64 / minutes as f64,
        pod_seconds,
        scale_actions,
        recovery_s,
        lost,
        ttft_misses,
        itl_misses,
        ttft_p90_ms: quantile(&mut all_ttft, 0.9),
        itl_p99_ms: quantile(&mut all_gaps, 0.99),
        series,
        failed_starts,
        pool_max: Default::default(),
        errors: {
            let mut e: Vec<String> = outcomes.iter().filter_map(|o| o.error.clone()).collect();
            e.sort();
            e.dedup();
            e.truncate(5);
            e
        },
        misses_per_minute,
        elapsed_s: outcomes.iter().map(|o| o.done_s).fold(0.0, f64::max),
        harness_lag_s: outcomes.iter().map(|o| o.late_s).fold(0.0, f64::max),
    }
}
