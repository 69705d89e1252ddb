//! The peers benchmark: kvmesh beside the routers users would pick instead,
//! each in front of its own fresh fleet of simulated engines, in one run.
//!
//! * `round-robin`: what a Kubernetes Service does (the client spreads over
//!   the engines directly).
//! * `smg-cache-aware`, `smg-round-robin`: SMG 1.13, one central process
//!   ([`smg`]); unavailable, with the reason, when it is not installed.
//! * `kvmesh-approx`, `kvmesh`: one sidecar per engine, meshed, clients spread
//!   over the sidecars as behind a Service; approximate (no tokenizer, no KV
//!   events) and precise (KV events) prefix knowledge.
//! * `llm-d`: llm-d's default precise-prefix scheduling (its scorers and
//!   published weights) written as a kvmesh filter config, run on kvmesh.
//!
//! For P/D, the same pods run aggregated (`aggregated`: kvmesh's default) and
//! split (`kvmesh-pd-P:D`) at several prefill:decode ratios; on SGLang-flavoured
//! pods, SMG's P/D (`smg-pd-Np`) beside kvmesh's `sglang` connector
//! (`kvmesh-pd-Np-sglang`). [`pd_pays`] maps where P/D pays and whether
//! kvmesh's decider chooses it there.
//!
//! Every (router, rate) point runs once per seed on a fresh fleet; figures are
//! medians over seeds with their min-max range ([`sweep`]), in simulated time.

pub mod capacity;
pub mod chat;
pub mod kv_bound;
pub mod lru_reference;
pub mod pd_pays;
pub mod prefix_computes;
pub mod smg;
pub mod sweep;
mod table;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use kvmesh_engine_sim::{Engine, Flavor, LatencyProfile, SimHandle, SimStats};
use kvmesh_filters::sched::{FilterConfig, Role};
use kvmesh_loadgen::workload::{PdParams, PressureParams, Prompt};
use kvmesh_loadgen::{runner, Load, Workload};
use serde::Serialize;

use super::fleet::{self, DemoFleet, FleetSpec};
use super::policy::Policy;
use super::{report, DemoError};
use sweep::{Point, Run, Slo};
pub use table::{table, write_plots};

/// One router (or serving set-up) of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Router {
    RoundRobin,
    SmgCacheAware,
    SmgRoundRobin,
    KvmeshApprox,
    Kvmesh,
    /// kvmesh's default with the index on Valkey (`index.backend: valkey`)
    /// instead of the full mesh.
    KvmeshValkey,
    LlmD,
    /// kvmesh's default on aggregated pods (the P/D baseline).
    Aggregated,
    /// kvmesh P/D with this many prefill pods (the rest decode).
    KvmeshPd(usize),
    /// kvmesh P/D with this many prefill pods on the fleet's GPUs and the
    /// decode pods on [`DECODE_GPU_PROFILE`]'s (heterogeneous pools:
    /// compute-bound prefill where FLOPs are, memory-bound decode where HBM
    /// bandwidth is).
    KvmeshPdHetero(usize),
    /// kvmesh P/D with this many prefill pods, every prompt of 512 tokens
    /// or more split (the P/D option of [`pd_pays`]: every long prompt).
    KvmeshPdLong(usize),
    /// kvmesh P/D on SGLang engines (the `sglang` connector), every request
    /// split: an SGLang decode server refuses a request without bootstrap
    /// fields, so a request the decider would keep whole cannot run there.
    KvmeshPdSglang(usize),
    /// SMG 1.13's P/D (`cache_aware` for both pools) on SGLang engines.
    SmgPd(usize),
}

impl Router {
    /// The shared-prefix routers, in table order.
    pub const SHARED_PREFIX: [Router; 7] = [
        Router::RoundRobin,
        Router::SmgRoundRobin,
        Router::SmgCacheAware,
        Router::KvmeshApprox,
        Router::LlmD,
        Router::Kvmesh,
        Router::KvmeshValkey,
    ];

    /// Its name in tables and JSON.
    pub fn name(self) -> String {
        match self {
            Router::RoundRobin => "round-robin".into(),
            Router::SmgCacheAware => "smg-cache-aware".into(),
            Router::SmgRoundRobin => "smg-round-robin".into(),
            Router::KvmeshApprox => "kvmesh-approx".into(),
            Router::Kvmesh => "kvmesh".into(),
            Router::KvmeshValkey => "kvmesh-valkey".into(),
            Router::LlmD => "llm-d".into(),
            Router::Aggregated => "aggregated".into(),
            Router::KvmeshPd(p) => format!("kvmesh-pd-{p}p"),
            Router::KvmeshPdHetero(p) => format!("kvmesh-pd-{p}p-h200-decode"),
            Router::KvmeshPdLong(p) => format!("kvmesh-pd-{p}p-long"),
            Router::KvmeshPdSglang(p) => format!("kvmesh-pd-{p}p-sglang"),
            Router::SmgPd(p) => format!("smg-pd-{p}p"),
        }
    }

    /// The SMG policy it runs, if it is SMG.
    fn smg_policy(self) -> Option<&'static str> {
        match self {
            Router::SmgCacheAware | Router::SmgPd(_) => Some("cache_aware"),
            Router::SmgRoundRobin => Some("round_robin"),
            _ => None,
        }
    }

    /// The kvmesh policy (prefix source and fleet split) and filter config it
    /// runs, if it runs on kvmesh sidecars.
    fn kvmesh(self) -> Option<Result<(Policy, FilterConfig), DemoError>> {
        let policy = match self {
            Router::KvmeshApprox => Policy::ApproxPrefix,
            Router::Kvmesh | Router::KvmeshValkey | Router::Aggregated => Policy::Kvmesh,
            Router::LlmD => Policy::LlmD,
            Router::KvmeshPd(_) | Router::KvmeshPdHetero(_) => Policy::Pd,
            Router::KvmeshPdLong(_) => {
                let decider = "  - type: prefix-based-pd-decider\n    parameters:\n      nonCachedTokens: 512\n      promptTokens: 512\n";
                return Some(pd_filters_with(decider, PREFIX_BASED).map(|f| (Policy::Pd, f)));
            }
            Router::KvmeshPdSglang(_) => {
                let decider = "  - type: always-disagg-pd-decider\n";
                return Some(pd_filters_with(decider, ALWAYS).map(|f| (Policy::Pd, f)));
            }
            _ => return None,
        };
        Some(
            policy
                .filter_config()
                .map(|f| (policy, f))
                .map_err(|e| DemoError::Config(e.to_string())),
        )
    }
}

const PREFIX_BASED: &str = "prefix-based-pd-decider";
const ALWAYS: &str = "always-disagg-pd-decider";

/// The built-in P/D filter config with its decider plugin replaced by
/// `decider` (a YAML plugin entry of type `kind`).
fn pd_filters_with(decider: &str, kind: &str) -> Result<FilterConfig, DemoError> {
    let pd = Policy::Pd;
    let text = include_str!("../../../assets/deploy/examples/filters-pd-disaggregated.yaml");
    let builtin = "  - type: prefix-based-pd-decider\n    parameters:\n      nonCachedTokens: 2048\n      promptTokens: 1024\n      batchStallTokens: 14300\n";
    if !text.contains(builtin) {
        return Err(DemoError::Config(format!(
            "{} no longer has the decider the benchmark replaces",
            pd.source()
        )));
    }
    let text = text.replace(builtin, decider).replace(
        &format!("prefill: {PREFIX_BASED}"),
        &format!("prefill: {kind}"),
    );
    FilterConfig::from_yaml(&text, pd.source()).map_err(|e| DemoError::Config(e.to_string()))
}

/// What to run.
#[derive(Debug, Clone)]
pub struct PeersOpts {
    /// The CI size: fewer rates and requests (under 10 minutes on 2 cores).
    pub quick: bool,
    /// One run per seed at every point.
    pub seeds: Vec<u64>,
    /// Engines per fleet.
    pub engines: usize,
    /// Routers on the shared-prefix and multi-turn workloads.
    pub routers: Vec<Router>,
    /// Run the shared-prefix workload.
    pub shared_prefix: bool,
    /// Run the P/D workload too.
    pub pd: bool,
    /// Run the multi-turn chat workload (with the shared-prefix routers).
    pub chat: bool,
    /// Run the KV-admission workload (with the shared-prefix routers).
    pub kv_admission: bool,
    /// Run the where-P/D-pays grid.
    pub pd_pays: bool,
    /// Replaces kvmesh's filter config (to try a change against the peers).
    pub kvmesh_filters: Option<FilterConfig>,
    /// Replaces the shared-prefix and multi-turn workloads' rates
    /// (simulated req/s).
    pub rates: Option<Vec<f64>>,
    /// Replaces the requests per run (multi-turn: sessions x turns).
    pub requests: Option<usize>,
    /// Replaces the where-P/D-pays grid's long-prompt lengths (tokens).
    pub pd_pays_prompts: Option<Vec<usize>>,
    /// Replaces the where-P/D-pays grid's rates (simulated req/s).
    pub pd_pays_rates: Option<Vec<f64>>,
    /// Rates bisection may add per router and workload (0: the grid alone).
    pub probes: usize,
    /// A progress line per run on stderr.
    pub progress: bool,
}

impl PeersOpts {
    /// Every router and workload, 3 seeds (2 quick), 4 engines.
    pub fn new(quick: bool) -> Self {
        PeersOpts {
            quick,
            // Quick: two seeds, to stay under 10 minutes on 2 cores.
            seeds: if quick { vec![1, 2] } else { vec![1, 2, 3] },
            engines: 4,
            routers: Router::SHARED_PREFIX.to_vec(),
            shared_prefix: true,
            pd: true,
            chat: true,
            kv_admission: true,
            pd_pays: true,
            kvmesh_filters: None,
            rates: None,
            requests: None,
            pd_pays_prompts: None,
            pd_pays_rates: None,
            probes: if quick {
                capacity::QUICK_PROBES
            } else {
                capacity::MAX_PROBES
            },
            progress: false,
        }
    }
}

/// The whole benchmark, as `--json` writes it.
#[derive(Debug, Clone, Serialize)]
pub struct PeersReport {
    pub workloads: Vec<WorkloadResult>,
    /// The latency profile the engines imitate.
    pub profile: String,
    /// Simulated seconds per wall second.
    pub time_scale: f64,
    pub engines: usize,
    pub seeds: Vec<u64>,
    /// Bisection closes a capacity's bracket when its first miss is within
    /// this share above it ([`capacity::TOLERANCE`]).
    pub capacity_tolerance: f64,
    /// Rates bisection could add per router and workload.
    pub probes: usize,
    /// `/proc/loadavg` (1, 5, 15 minutes) before and after.
    pub load_before: Option<[f64; 3]>,
    pub load_after: Option<[f64; 3]>,
    pub wall_s: f64,
    /// Where P/D pays, and what kvmesh's decider chooses there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pd_pays: Option<pd_pays::PdPays>,
}

/// One workload: its set-up, every router's points and capacity at SLO.
#[derive(Debug, Clone, Serialize)]
pub struct WorkloadResult {
    pub name: String,
    pub description: String,
    /// Where its parameters come from.
    pub source: String,
    pub slo: Slo,
    /// Working set over the fleet's KV capacity, where it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pressure: Option<f64>,
    /// Offered loads, simulated requests per second.
    pub rates: Vec<f64>,
    pub routers: Vec<RouterStatus>,
    /// Highest rate meeting the SLO at it and every lower rate measured, per
    /// router (`null`: not even the lowest), bisected ([`capacity`]).
    pub capacity_at_slo: BTreeMap<String, Option<f64>>,
    /// The lowest measured rate above the capacity, which misses the SLO,
    /// per router that ran (`null`: none did): the capacity lies below it.
    pub capacity_bracket: BTreeMap<String, Option<f64>>,
    /// Each seed's own capacity at the rates measured, in the order of
    /// `seeds`, per router that ran.
    pub capacity_at_slo_seeds: BTreeMap<String, Vec<Option<f64>>>,
    /// The largest ratio of computed prompt tokens to the ideal placement's
    /// (medians over seeds) at the rates up to the router's capacity (at the
    /// lowest rate where it has none), per router that ran.
    pub computed_vs_ideal: BTreeMap<String, f64>,
    /// What an online placement makes the engines' LRU caches compute, one
    /// request at a time, over the ideal placement's, per seed in the order
    /// of `seeds` ([`lru_reference`]): a reference for `computed_vs_ideal`
    /// on engines that evict by recency.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub lru_reference_vs_ideal: Vec<f64>,
    /// P/D only: kvmesh P/D's best ITL p99 over aggregated's, at the highest
    /// rate where aggregated meets its TTFT SLO.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub itl_p99_ratio_at_aggregated_capacity: Option<f64>,
    pub points: Vec<Point>,
    /// Every run, for per-pod figures.
    pub runs: Vec<Run>,
}

/// Whether a router ran.
#[derive(Debug, Clone, Serialize)]
pub struct RouterStatus {
    pub name: String,
    pub available: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Builds a workload from a seed.
type BuildFn = Box<dyn Fn(u64) -> Workload + Send + Sync>;
/// The prompt tokens an ideal placement computes for a built workload.
type IdealFn = Box<dyn Fn(&Workload) -> u64 + Send + Sync>;

/// A workload as the benchmark runs it.
struct Bench {
    name: &'static str,
    description: String,
    source: &'static str,
    slo: Slo,
    pressure: Option<f64>,
    spec: FleetSpec,
    rates: Vec<f64>,
    routers: Vec<Router>,
    build: BuildFn,
    /// Prompt tokens an ideal placement computes for a built workload.
    ideal: Option<IdealFn>,
    /// Whether to replay each seed's workload through the fleet's LRU
    /// caches ([`lru_reference`]): workloads of text prompts with an ideal.
    lru_reference: bool,
    /// Words of the group prefix every request opens with, where requests
    /// do (the shared-prefix workloads): each run then sorts its requests
    /// by what their prefix cost ([`prefix_computes`]).
    prefix_words: Option<usize>,
}

/// Requests per run.
fn requests(opts: &PeersOpts) -> usize {
    opts.requests.unwrap_or(if opts.quick { 150 } else { 400 })
}

/// The engines of every fleet: Qwen3-32B on two H100s (tensor parallel 2),
/// the hardware of llm-d's precise prefix-cache benchmark
/// (docs/field-benchmarks.md P1), in real time.
pub fn peers_spec(engines: usize) -> Result<FleetSpec, DemoError> {
    let mut spec = FleetSpec::demo(engines);
    spec.profile = LatencyProfile::load(PROFILE)?;
    spec.time_scale = TIME_SCALE;
    spec.max_num_seqs = 128;
    Ok(spec)
}

/// The GPU profile the fleets imitate.
pub const PROFILE: &str = "gpu:qwen3-32b@h100x2";
/// The decode pods' GPUs in the heterogeneous P/D fleet: the same model on
/// two H200s, the H100's compute with 1.43x its HBM bandwidth (4.8 against
/// 3.35 TB/s), which is what a decode step is bound by.
pub const DECODE_GPU_PROFILE: &str = "gpu:qwen3-32b@h200x2";
/// Simulated seconds per wall second: 1, so that the routers' own CPU time
/// counts as it would beside a GPU (a scale multiplies it).
pub const TIME_SCALE: f64 = 1.0;

/// The shared-prefix-under-pressure fleet and workload: 16 groups per pod
/// of a 768-token system prompt, whose working set needs 1.5x the fleet's
/// KV (each pod keeps about 7 of them beside its running requests).
pub fn pressure_setup(
    engines: usize,
    requests: usize,
) -> Result<(FleetSpec, PressureParams), DemoError> {
    let mut spec = peers_spec(engines)?;
    spec.num_blocks = 512;
    let p = PressureParams {
        groups: 16 * engines,
        requests,
        zipf_s: 0.8,
        system_tokens: 768,
        question_tokens: 128,
        output_tokens: 32,
    };
    Ok((spec, p))
}

/// The P/D fleet and workload: a quarter of the requests are 3000-token
/// prompts among short chat turns, every answer 150 tokens.
pub fn pd_setup(engines: usize, requests: usize) -> Result<(FleetSpec, PdParams), DemoError> {
    let mut spec = peers_spec(engines)?;
    spec.num_blocks = 4096;
    let p = PdParams {
        long_requests: requests / 4,
        long_input: 3000,
        long_output: 150,
        short_per_long: 3,
        short_input: 100,
        short_output: 150,
    };
    Ok((spec, p))
}

fn shared_prefix_pressure(opts: &PeersOpts) -> Result<Bench, DemoError> {
    let fleet = pressure_setup(opts.engines, requests(opts))?;
    let rates = opts.rates.clone().unwrap_or_else(|| {
        // Quick: bisection's one probe lands at 45 where 60 misses (today's
        // grid there), above 60 where nothing does.
        if opts.quick {
            vec![30.0, 60.0]
        } else {
            vec![20.0, 40.0, 60.0, 80.0]
        }
    });
    Ok(pressure_bench(
        "shared-prefix-pressure",
        "llm-d precise prefix-cache benchmark (docs/field-benchmarks.md P1: 150 groups x 5 users, \
         6000-token prefix + 1200-token question, 1000-token answers, cache demand above one pod), \
         scaled to 4 simulated engines; Zipf popularity as in web-cache traces (Breslau et al. 1999, s 0.64-0.83)",
        String::new(),
        fleet,
        rates,
        opts.routers.clone(),
    ))
}

/// A workload of [`PressureParams`] on `fleet` (the shared-prefix and the
/// KV-admission workloads): its description from the parameters, then
/// `note`; the SLO both are judged by; the ideal placement's tokens.
fn pressure_bench(
    name: &'static str,
    source: &'static str,
    note: String,
    fleet: (FleetSpec, PressureParams),
    rates: Vec<f64>,
    routers: Vec<Router>,
) -> Bench {
    let (spec, p) = fleet;
    let pressure = p.pressure(spec.engines, spec.num_blocks, spec.block_size);
    Bench {
        name,
        description: format!(
            "{} groups (Zipf s={}) of a {}-token system prompt, {}-token questions, {}-token answers; \
             {} engines of {} blocks of {} tokens ({}, x{} time){note}; {} requests per run",
            p.groups,
            p.zipf_s,
            p.system_tokens,
            p.question_tokens,
            p.output_tokens,
            spec.engines,
            spec.num_blocks,
            spec.block_size,
            spec.profile.name,
            spec.time_scale,
            p.requests,
        ),
        source,
        slo: Slo {
            ttft_p90_ms: 1000.0,
            itl_p99_ms: 200.0,
        },
        pressure: Some(pressure),
        spec,
        rates,
        routers,
        build: Box::new({
            let p = p.clone();
            move |seed| p.build(seed)
        }),
        prefix_words: Some(p.system_tokens),
        ideal: Some(Box::new(move |w| p.ideal_computed_tokens(w))),
        lru_reference: true,
    }
}

/// The routers a quick run of a second shared-prefix workload keeps: those
/// its targets compare (`also` besides round-robin, SMG cache_aware and
/// kvmesh); a full run keeps every one asked for.
fn quick_routers(opts: &PeersOpts, also: &[Router]) -> Vec<Router> {
    opts.routers
        .iter()
        .copied()
        .filter(|r| {
            !opts.quick
                || matches!(
                    r,
                    Router::RoundRobin | Router::SmgCacheAware | Router::Kvmesh
                )
                || also.contains(r)
        })
        .collect()
}

fn pd_long_prompt(opts: &PeersOpts) -> Result<Bench, DemoError> {
    let n = opts.requests.unwrap_or(if opts.quick { 100 } else { 200 });
    let (spec, p) = pd_setup(opts.engines, n)?;
    let rates = if opts.quick {
        vec![8.0, 16.0]
    } else {
        vec![8.0, 16.0, 24.0]
    };
    // Quick: the even split only; full: every prefill:decode split.
    let mut routers = vec![Router::Aggregated];
    if opts.quick {
        routers.push(Router::KvmeshPd(opts.engines / 2));
    } else {
        routers.extend((1..opts.engines).map(Router::KvmeshPd));
        routers.push(Router::KvmeshPdHetero(opts.engines / 2));
    }
    // SGLang-flavoured pods at the even split: SMG's P/D beside kvmesh's
    // `sglang` connector.
    routers.push(Router::SmgPd(opts.engines / 2));
    routers.push(Router::KvmeshPdSglang(opts.engines / 2));
    Ok(Bench {
        name: "pd-long-prompt",
        description: format!(
            "a quarter of the requests long ({} tokens in, {} out) among short ones ({} in, {} out); \
             {} engines ({}, x{} time), aggregated or split P:D; {} requests per run{}",
            p.long_input,
            p.long_output,
            p.short_input,
            p.short_output,
            spec.engines,
            spec.profile.name,
            spec.time_scale,
            n,
            if opts.quick {
                String::new()
            } else {
                format!(
                    "; heterogeneous pools (`-h200-decode`): the same split with the decode pods on \
                     {DECODE_GPU_PROFILE}, prefill on the fleet's H100s"
                )
            },
        ),
        source: "llm-d P/D disaggregation guide (docs/field-benchmarks.md P5: ISL 5000 / OSL 250, \
                 prefill and decode pools at equal GPU count), \
                 scaled to 4 simulated engines with short chat requests decoding beside the long prompts",
        slo: Slo {
            ttft_p90_ms: 1000.0,
            itl_p99_ms: 100.0,
        },
        pressure: None,
        spec,
        rates,
        routers,
        build: Box::new(move |seed| p.build(seed)),
        // No prompt shares a prefix: ideally each is computed once.
        ideal: Some(Box::new(|w| {
            w.requests.iter().map(|r| r.prompt_words() as u64).sum()
        })),
        lru_reference: false,
        prefix_words: None,
    })
}

/// Runs every workload under every router at every rate and seed.
pub async fn run(opts: &PeersOpts) -> Result<PeersReport, DemoError> {
    let started = Instant::now();
    let load_before = loadavg();
    let mut benches = Vec::new();
    if opts.shared_prefix && !opts.routers.is_empty() {
        benches.push(shared_prefix_pressure(opts)?);
    }
    if opts.chat && !opts.routers.is_empty() {
        benches.push(chat::multi_turn_chat(opts)?);
    }
    if opts.kv_admission && !opts.routers.is_empty() {
        benches.push(kv_bound::kv_admission(opts)?);
    }
    if opts.pd {
        benches.push(pd_long_prompt(opts)?);
    }
    let smg_bin = smg::find();
    let mut workloads = Vec::new();
    for b in &benches {
        workloads.push(measure(opts, b, &smg_bin).await?);
    }
    let pd_pays = if opts.pd_pays {
        Some(pd_pays::run(opts).await?)
    } else {
        None
    };
    Ok(PeersReport {
        pd_pays,
        workloads,
        profile: PROFILE.to_owned(),
        time_scale: TIME_SCALE,
        engines: opts.engines,
        seeds: opts.seeds.clone(),
        capacity_tolerance: capacity::TOLERANCE,
        probes: opts.probes,
        load_before,
        load_after: loadavg(),
        wall_s: started.elapsed().as_secs_f64(),
    })
}

/// One workload under each of its routers: the grid's rates, then up to
/// `opts.probes` more per router by bisection ([`capacity`]).
async fn measure(
    opts: &PeersOpts,
    b: &Bench,
    smg_bin: &Result<std::path::PathBuf, String>,
) -> Result<WorkloadResult, DemoError> {
    let mut runs = Vec::new();
    let mut status: Vec<RouterStatus> = Vec::new();
    for &router in &b.routers {
        let name = router.name();
        let mut reason = match (router.smg_policy(), smg_bin) {
            (Some(_), Err(why)) => Some(why.clone()),
            _ => None,
        };
        let mut probes = 0;
        for &rate in &b.rates {
            if reason.is_some() {
                break;
            }
            reason = run_rate(opts, b, router, rate, smg_bin, &mut runs).await?;
        }
        while reason.is_none() && probes < opts.probes {
            let mine: Vec<Run> = runs.iter().filter(|r| r.router == name).cloned().collect();
            let Some(rate) = capacity::next_probe(&sweep::points(&mine), &name, &b.slo) else {
                break;
            };
            say(
                opts,
                &format!("[{}] {name}: bisecting at {rate} req/s", b.name),
            );
            reason = run_rate(opts, b, router, rate, smg_bin, &mut runs).await?;
            probes += 1;
        }
        status.push(RouterStatus {
            name,
            available: reason.is_none(),
            reason,
        });
    }
    let points = sweep::points(&runs);
    let ran = || {
        status
            .iter()
            .filter(|s| s.available)
            .map(|s| s.name.clone())
    };
    let capacity_at_slo: BTreeMap<String, Option<f64>> = status
        .iter()
        .map(|s| (s.name.clone(), sweep::capacity(&points, &s.name, &b.slo)))
        .collect();
    let computed_vs_ideal = ran()
        .filter_map(|n| {
            let cap = capacity_at_slo.get(&n).copied().flatten();
            capacity::computed_vs_ideal(&points, &n, cap).map(|x| (n, x))
        })
        .collect();
    let itl_ratio = (b.name == "pd-long-prompt")
        .then(|| pd_itl_ratio(&points, &b.slo))
        .flatten();
    Ok(WorkloadResult {
        name: b.name.to_owned(),
        description: b.description.clone(),
        source: b.source.to_owned(),
        slo: b.slo,
        pressure: b.pressure,
        rates: b.rates.clone(),
        capacity_bracket: ran()
            .map(|n| {
                let [_, miss] = capacity::bracket(&points, &n, &b.slo);
                (n, miss)
            })
            .collect(),
        capacity_at_slo_seeds: ran()
            .map(|n| {
                let caps = capacity::per_seed(&runs, &n, &opts.seeds, &b.slo);
                (n, caps)
            })
            .collect(),
        routers: status,
        capacity_at_slo,
        computed_vs_ideal,
        lru_reference_vs_ideal: lru_reference_vs_ideal(b, &opts.seeds),
        itl_p99_ratio_at_aggregated_capacity: itl_ratio,
        points,
        runs,
    })
}

/// [`Run::prefix_computes`]: each served request's group (its first block of
/// words), the pod it reached and what it found cached, sorted by what its
/// `prefix_words`-word prefix cost.
fn prefix_computes_of(
    workload: &Workload,
    placed: &[Option<usize>],
    records: &[kvmesh_loadgen::RequestRecord],
    prefix_words: usize,
    block_size: usize,
) -> prefix_computes::PrefixComputes {
    let groups: Vec<u64> = workload
        .requests
        .iter()
        .map(|r| match &r.prompt {
            Prompt::Text(t) => {
                let head: Vec<&str> = t.split_whitespace().take(block_size).collect();
                xxhash_rust::xxh3::xxh3_64(head.join(" ").as_bytes())
            }
            Prompt::Messages(_) => 0,
        })
        .collect();
    let served: Vec<prefix_computes::Served> = records
        .iter()
        .filter(|r| r.is_ok())
        .filter_map(|r| {
            Some(prefix_computes::Served {
                index: r.index,
                pod: placed.get(r.index).copied().flatten()?,
                cached: r.cached_tokens?,
            })
        })
        .collect();
    prefix_computes::classify(&groups, &served, prefix_words as u64, block_size as u64)
}

/// [`WorkloadResult::lru_reference_vs_ideal`]: each seed's workload replayed
/// through the fleet's LRU caches, over its ideal placement's tokens.
fn lru_reference_vs_ideal(b: &Bench, seeds: &[u64]) -> Vec<f64> {
    let Some(ideal) = b.ideal.as_ref().filter(|_| b.lru_reference) else {
        return Vec::new();
    };
    seeds
        .iter()
        .filter_map(|&seed| {
            let w = (b.build)(seed);
            let reference = lru_reference::online_lru_tokens(
                &w,
                b.spec.engines,
                b.spec.num_blocks,
                b.spec.block_size,
            );
            let ideal = ideal(&w);
            (ideal > 0).then(|| reference as f64 / ideal as f64)
        })
        .collect()
}

/// One router at one rate, once per seed, each run added to `runs`; the
/// reason the router cannot run here, if it cannot.
async fn run_rate(
    opts: &PeersOpts,
    b: &Bench,
    router: Router,
    rate: f64,
    smg_bin: &Result<std::path::PathBuf, String>,
    runs: &mut Vec<Run>,
) -> Result<Option<String>, DemoError> {
    for &seed in &opts.seeds {
        match run_one(opts, b, router, rate, seed, smg_bin.as_ref().ok()).await? {
            Ok(r) => {
                say(opts, &progress_line(b.name, &r));
                runs.push(r);
            }
            Err(why) => {
                say(
                    opts,
                    &format!("[{}] {}: unavailable: {why}", b.name, router.name()),
                );
                return Ok(Some(why));
            }
        }
    }
    Ok(None)
}

/// The best kvmesh P/D split's ITL p99 over aggregated's, at the highest
/// rate where aggregated keeps its TTFT p90 within the SLO.
fn pd_itl_ratio(points: &[Point], slo: &Slo) -> Option<f64> {
    let rate = points
        .iter()
        .filter(|p| p.router == "aggregated")
        .filter(|p| p.errors == 0 && p.ttft_p90_ms.is_some_and(|t| t <= slo.ttft_p90_ms))
        .map(|p| p.rate)
        .reduce(f64::max)?;
    let at = |p: &&Point| p.rate == rate;
    let agg = points
        .iter()
        .filter(at)
        .find(|p| p.router == "aggregated")?
        .itl_p99_ms?;
    let best = points
        .iter()
        .filter(at)
        // The same pods only: the heterogeneous fleet has other GPUs.
        .filter(|p| p.router.starts_with("kvmesh-pd") && !p.router.ends_with("-decode"))
        .filter(|p| p.errors == 0)
        .filter_map(|p| p.itl_p99_ms)
        .reduce(f64::min)?;
    (agg > 0.0).then(|| best / agg)
}

/// The engines (and what fronts them) of one run.
enum Stand {
    Kvmesh(DemoFleet),
    Bare {
        engines: Vec<SimHandle>,
        smg: Option<smg::Smg>,
    },
}

impl Stand {
    fn urls(&self) -> Vec<String> {
        match self {
            Stand::Kvmesh(f) => f.urls(),
            Stand::Bare { smg: Some(s), .. } => vec![s.url.clone()],
            Stand::Bare { engines, .. } => engines.iter().map(SimHandle::base_url).collect(),
        }
    }

    fn stats(&self) -> Vec<SimStats> {
        self.engines().into_iter().map(SimHandle::stats).collect()
    }

    /// The engines, in pod order.
    fn engines(&self) -> Vec<&SimHandle> {
        match self {
            Stand::Kvmesh(f) => f.pods.iter().map(|p| &p.engine).collect(),
            Stand::Bare { engines, .. } => engines.iter().collect(),
        }
    }

    /// The engine each request of `workload` reached, in the workload's
    /// order, found by its prompt text in the engines' logs of what they
    /// received; `None` where none logged it (or its prompt is not text).
    fn placements(&self, workload: &Workload) -> Vec<Option<usize>> {
        let index: HashMap<&str, usize> = workload
            .requests
            .iter()
            .enumerate()
            .filter_map(|(n, r)| match &r.prompt {
                Prompt::Text(t) => Some((t.as_ref(), n)),
                Prompt::Messages(_) => None,
            })
            .collect();
        let mut placed = vec![None; workload.requests.len()];
        for (pod, engine) in self.engines().into_iter().enumerate() {
            for r in engine.received_requests() {
                let Some(body) = r.json() else {
                    continue;
                };
                if let Some(&n) = body["prompt"].as_str().and_then(|p| index.get(p)) {
                    placed[n].get_or_insert(pod);
                }
            }
        }
        placed
    }

    /// Requests each engine completed.
    fn served(&self) -> Vec<u64> {
        self.engines()
            .into_iter()
            .map(|e| e.completed_requests().len() as u64)
            .collect()
    }

    async fn shutdown(self) {
        match self {
            Stand::Kvmesh(f) => f.shutdown().await,
            Stand::Bare { engines, smg } => {
                if let Some(s) = smg {
                    s.stop().await;
                }
                for e in engines {
                    e.shutdown().await;
                }
            }
        }
    }
}

/// Starts what `router` needs on a fresh fleet. The inner error says the
/// router cannot run here.
async fn stand_up(
    opts: &PeersOpts,
    b: &Bench,
    router: Router,
    smg_bin: Option<&std::path::PathBuf>,
) -> Result<Result<Stand, String>, DemoError> {
    if let Some(kv) = router.kvmesh() {
        let (policy, mut filters) = kv?;
        if let (Router::Kvmesh | Router::KvmeshValkey | Router::Aggregated, Some(f)) =
            (router, &opts.kvmesh_filters)
        {
            filters = f.clone();
        }
        let mut spec = b.spec.clone();
        match router {
            Router::KvmeshPd(p) | Router::KvmeshPdLong(p) => spec.prefill_pods = Some(p),
            Router::KvmeshPdSglang(p) => {
                spec.prefill_pods = Some(p);
                spec.flavor = Flavor::Sglang;
            }
            Router::KvmeshPdHetero(p) => {
                spec.prefill_pods = Some(p);
                spec.decode_profile = Some(Box::new(LatencyProfile::load(DECODE_GPU_PROFILE)?));
            }
            _ => {}
        }
        if router == Router::KvmeshValkey {
            let server = match kvmesh_loadgen::valkey::ValkeyServer::start().await {
                Ok(s) => s,
                Err(e) => return Ok(Err(format!("no valkey server: {e}"))),
            };
            spec.valkey = Some(vec![server.url()]);
            let mut f = fleet::start_with(&spec, policy, &filters).await?;
            f.valkey_server = Some(Box::new(server));
            return Ok(Ok(Stand::Kvmesh(f)));
        }
        return Ok(Ok(Stand::Kvmesh(
            fleet::start_with(&spec, policy, &filters).await?,
        )));
    }
    let prefill = match router {
        Router::SmgPd(p) => p,
        _ => 0,
    };
    let engines = if prefill > 0 {
        let mut spec = b.spec.clone();
        spec.flavor = Flavor::Sglang;
        split_engines(&spec, prefill).await?
    } else {
        bare_engines(&b.spec).await?
    };
    let smg = match (router.smg_policy(), smg_bin) {
        (Some(policy), Some(bin)) => {
            let urls: Vec<String> = engines.iter().map(SimHandle::base_url).collect();
            let started = if prefill > 0 {
                // An SGLang prefill engine serves bootstrap on its HTTP port.
                let pre: Vec<(String, u16)> = engines[..prefill]
                    .iter()
                    .map(|e| (e.base_url(), e.addr().port()))
                    .collect();
                smg::Smg::start_pd(bin, policy, &pre, &urls[prefill..], &b.spec.model).await
            } else {
                smg::Smg::start(bin, policy, &urls, &b.spec.model).await
            };
            match started {
                Ok(s) => Some(s),
                Err(why) => {
                    for e in engines {
                        e.shutdown().await;
                    }
                    return Ok(Err(why));
                }
            }
        }
        (Some(_), None) => return Ok(Err("smg is not installed".to_owned())),
        (None, _) => None,
    };
    Ok(Ok(Stand::Bare { engines, smg }))
}

/// `spec.engines` aggregated engines with no sidecar (what a router outside
/// the pods fronts).
pub async fn bare_engines(spec: &FleetSpec) -> Result<Vec<SimHandle>, DemoError> {
    let mut engines = Vec::with_capacity(spec.engines);
    for _ in 0..spec.engines {
        engines.push(Engine::start_local(spec.sim_config(Role::Both)).await?);
    }
    Ok(engines)
}

/// `spec.engines` engines with no sidecar, the first `prefill` of them
/// prefill engines and the rest decode (what SMG's P/D fronts).
async fn split_engines(spec: &FleetSpec, prefill: usize) -> Result<Vec<SimHandle>, DemoError> {
    let mut engines = Vec::with_capacity(spec.engines);
    for i in 0..spec.engines {
        let role = if i < prefill {
            Role::Prefill
        } else {
            Role::Decode
        };
        engines.push(Engine::start_local(spec.sim_config(role)).await?);
    }
    Ok(engines)
}

/// One router, one rate, one seed, on a fresh fleet.
async fn run_one(
    opts: &PeersOpts,
    b: &Bench,
    router: Router,
    rate: f64,
    seed: u64,
    smg_bin: Option<&std::path::PathBuf>,
) -> Result<Result<Run, String>, DemoError> {
    let stand = match stand_up(opts, b, router, smg_bin).await? {
        Ok(s) => s,
        Err(why) => return Ok(Err(why)),
    };
    let workload = (b.build)(seed);
    let outcome = drive(&stand, b, &workload, rate, seed).await;
    let stats = stand.stats();
    let served = stand.served();
    let ideal = b.ideal.as_ref().map(|f| f(&workload));
    let placed = if b.lru_reference || b.prefix_words.is_some() {
        stand.placements(&workload)
    } else {
        Vec::new()
    };
    let placement_replay_vs_ideal = ideal.filter(|&i| b.lru_reference && i > 0).map(|i| {
        let spec = &b.spec;
        let tokens = lru_reference::placed_lru_tokens(
            &workload,
            &placed,
            spec.engines,
            spec.num_blocks,
            spec.block_size,
        );
        tokens as f64 / i as f64
    });
    stand.shutdown().await;
    let result = outcome?;
    let scale = b.spec.time_scale;
    let summary = report::to_simulated(&result.summary(), scale);
    report_failures(&router.name(), rate, seed, &result.records);
    let goodput = goodput(&result.records, &b.slo, scale);
    let prefix_computes = b.prefix_words.map(|words| {
        prefix_computes_of(
            &workload,
            &placed,
            &result.records,
            words,
            b.spec.block_size,
        )
    });
    let sent_share = workload
        .ordered_per_user
        .then(|| sent_rate(&result.records, scale))
        .flatten()
        .map(|sent| sent / rate);
    let recomputed: Vec<u64> = stats
        .iter()
        .map(|s| s.preempted_queries.saturating_sub(s.preempted_hits))
        .collect();
    let computed: Vec<u64> = stats
        .iter()
        .zip(&recomputed)
        .map(|(s, again)| {
            s.prefix_queries
                .saturating_sub(s.prefix_hits)
                .saturating_sub(s.external_kv_tokens)
                + again
        })
        .collect();
    let (queries, hits) = stats.iter().fold((0, 0), |(q, h), s| {
        (q + s.prefix_queries, h + s.prefix_hits)
    });
    Ok(Ok(Run {
        router: router.name(),
        rate,
        seed,
        requests: summary.requests,
        errors: summary.errors,
        ttft_p50_ms: summary.ttft_p50_ms,
        ttft_p90_ms: summary.ttft_p90_ms,
        ttft_p99_ms: summary.ttft_p99_ms,
        itl_p50_ms: summary.itl_p50_ms,
        itl_p99_ms: summary.itl_p99_ms,
        e2e_p50_ms: summary.e2e_p50_ms,
        hit_rate: (queries > 0).then(|| hits as f64 / queries as f64),
        computed_tokens: computed.iter().sum(),
        preemptions: stats.iter().map(|s| s.preemptions).sum(),
        recomputed_tokens: recomputed.iter().sum(),
        ideal_computed_tokens: ideal,
        placement_replay_vs_ideal,
        prefix_computes,
        computed_per_engine: computed,
        requests_per_engine: served,
        goodput,
        sent_share,
    }))
}

/// The rate requests were sent at, in simulated requests per second: the
/// sends after the first over the time from the first to the last.
fn sent_rate(records: &[kvmesh_loadgen::RequestRecord], scale: f64) -> Option<f64> {
    let first = records.iter().map(|r| r.start).min()?;
    let last = records.iter().map(|r| r.start).max()?;
    let span = (last - first).as_secs_f64() * scale;
    (records.len() > 1 && span > 0.0).then(|| (records.len() - 1) as f64 / span)
}

/// Sends the workload as a Poisson process at `rate` simulated requests per
/// second, spread over the stand's URLs in turn.
async fn drive(
    stand: &Stand,
    b: &Bench,
    workload: &Workload,
    rate: f64,
    seed: u64,
) -> Result<runner::RunResult, DemoError> {
    let cfg = super::run_config(&stand.urls(), &b.spec.model, seed)?;
    let load = Load::poisson(rate * b.spec.time_scale, workload.len());
    Ok(runner::run(&cfg, workload, &load).await?)
}

/// Says on stderr why a run's failed requests failed (up to three distinct
/// reasons, with how many had each), so a run with errors can be read.
fn report_failures(router: &str, rate: f64, seed: u64, records: &[kvmesh_loadgen::RequestRecord]) {
    let mut why: Vec<(String, usize)> = Vec::new();
    for r in records.iter().filter(|r| !r.is_ok()) {
        let text = match (&r.status, &r.error) {
            (Some(s), Some(e)) => format!("HTTP {s}: {e}"),
            (Some(s), None) => format!("HTTP {s}"),
            (None, Some(e)) => e.clone(),
            (None, None) => "no status".to_owned(),
        };
        match why.iter_mut().find(|(t, _)| *t == text) {
            Some((_, n)) => *n += 1,
            None => why.push((text, 1)),
        }
    }
    for (text, n) in why.iter().take(3) {
        eprintln!("  {router} rate {rate} seed {seed}: {n} failed: {text}");
    }
}

/// The share of requests that completed within the SLO: TTFT within the
/// TTFT target and mean inter-token gap within the ITL target.
fn goodput(records: &[kvmesh_loadgen::RequestRecord], slo: &Slo, scale: f64) -> f64 {
    if records.is_empty() {
        return 0.0;
    }
    let good = records
        .iter()
        .filter(|r| r.is_ok())
        .filter(|r| {
            let ttft = r.ttft.map(|d| d.as_secs_f64() * 1000.0 * scale);
            let itl = if r.itl.is_empty() {
                0.0
            } else {
                r.itl.iter().map(Duration::as_secs_f64).sum::<f64>() * 1000.0 * scale
                    / r.itl.len() as f64
            };
            ttft.is_some_and(|t| t <= slo.ttft_p90_ms) && itl <= slo.itl_p99_ms
        })
        .count();
    good as f64 / records.len() as f64
}

fn progress_line(workload: &str, r: &Run) -> String {
    let f = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.0}"));
    format!(
        "[{workload}] {:<16} rate {:>5.1} seed {}: ttft p90 {} ms, itl p99 {} ms, hit {:.2}, computed {} tokens {:?} (ideal {}), served {:?}, preemptions {} ({} tokens computed again), errors {}{}{}{}",
        r.router,
        r.rate,
        r.seed,
        f(r.ttft_p90_ms),
        f(r.itl_p99_ms),
        r.hit_rate.unwrap_or(0.0),
        r.computed_tokens,
        r.computed_per_engine,
        r.ideal_computed_tokens.map_or("-".to_owned(), |t| t.to_string()),
        r.requests_per_engine,
        r.preemptions,
        r.recomputed_tokens,
        r.errors,
        r.placement_replay_vs_ideal.map_or(String::new(), |x| format!(
            ", its placement replayed one request at a time {x:.2}x the ideal"
        )),
        r.prefix_computes.as_ref().map_or(String::new(), |c| format!(
            ", prefix computed: {} first, {} moved, {} again ({} hits)",
            c.first, c.moved, c.again, c.hit
        )),
        r.sent_share
            .map_or(String::new(), |s| format!(", sent {s:.2} of the rate")),
    )
}

fn say(opts: &PeersOpts, line: &str) {
    if opts.progress {
        eprintln!("{line}");
    }
}

/// `/proc/loadavg`'s three averages, where there is one.
pub fn loadavg() -> Option<[f64; 3]> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut it = text.split_whitespace().map(|v| v.parse::<f64>().ok());
    Some([it.next()??, it.next()??, it.next()??])
}
