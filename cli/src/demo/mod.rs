//! The demo and the policy-comparison harness: the same workload, the same
//! seed, a fresh simulated fleet per routing set-up, and a table of what each
//! set-up did to TTFT, inter-token latency, throughput and the prefix-cache
//! hit rate.
//!
//! [`fleet::start`] brings up N simulated engines with a sidecar each, all
//! running one [`Policy`]; [`run`] drives the shared-prefix workload under
//! every policy and the long-prompt workload with and without P/D, and
//! returns a [`DemoReport`]. `kvmesh demo` is a thin shell over it.
//!
//! Times are simulated: the engines run `time_scale` simulated seconds per
//! wall second, so the client's wall-clock measurements are multiplied by it
//! and read as "on a GPU like the profile" (the sidecar's own overhead is
//! scaled too, which only overstates it).

pub mod fleet;
pub mod peers;
pub mod policy;
pub mod report;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvmesh_loadgen::{runner, ClientConfig, Load, RunConfig, Spread, Workload};

pub use fleet::{DemoFleet, FleetSpec};
pub use policy::Policy;
pub use report::{DemoReport, PolicyReport, WorkloadReport};

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("demo configuration: {0}")]
    Config(String),
    #[error("engine simulator: {0}")]
    Engine(#[from] kvmesh_engine_sim::SimError),
    #[error("sidecar: {0}")]
    Sidecar(String),
    #[error("sidecar {0} did not become ready")]
    NotReady(String),
    #[error("load generator: {0}")]
    Load(#[from] kvmesh_loadgen::LoadgenError),
    #[error("I/O: {0}")]
    Io(#[source] std::io::Error),
}

/// What to run.
#[derive(Debug, Clone)]
pub struct DemoOpts {
    /// The CI size (~20-30 s on 2 cores) instead of the full one (< 2 min).
    pub quick: bool,
    /// Seeds every workload and arrival process: same seed, same requests.
    pub seed: u64,
    /// Engines (and sidecars) per fleet.
    pub engines: usize,
    /// Policies compared on the shared-prefix workload, in table order.
    pub shared_prefix_policies: Vec<Policy>,
    /// Policies compared on the long-prompt workload (empty: skip it).
    pub long_prompt_policies: Vec<Policy>,
    /// Add an SMG 1.13 `cache_aware` row to shared prefix where SMG is
    /// installed (a row saying how to install it otherwise).
    pub smg: bool,
    /// Print what starts and a progress line on stderr.
    pub progress: bool,
}

impl DemoOpts {
    /// Every policy on shared prefix; round-robin, kvmesh and P/D on long
    /// prompts; 4 engines.
    pub fn new(quick: bool) -> Self {
        Self {
            quick,
            seed: 7,
            engines: 4,
            shared_prefix_policies: vec![
                Policy::RoundRobin,
                Policy::LeastQueue,
                Policy::ApproxPrefix,
                Policy::LlmD,
                Policy::Kvmesh,
            ],
            long_prompt_policies: vec![Policy::RoundRobin, Policy::Kvmesh, Policy::Pd],
            smg: true,
            progress: false,
        }
    }
}

/// One workload as the demo runs it: requests, load and fleet shape.
struct DemoWorkload {
    name: &'static str,
    description: String,
    workload: Workload,
    load: Load,
    spec: FleetSpec,
}

/// Where routing decides: past round-robin's capacity on the pressured
/// fleet, within kvmesh's (`kvmesh bench peers`, docs/benchmarks.md), in
/// simulated requests per second.
const SHARED_PREFIX_RATE: f64 = 40.0;
/// Where P/D pays: long prefills stall aggregated decodes often enough to
/// show in their ITL p99 (`kvmesh bench peers`), simulated requests per second.
const LONG_PROMPT_RATE: f64 = 16.0;

fn shared_prefix(opts: &DemoOpts) -> Result<DemoWorkload, DemoError> {
    let n = if opts.quick { 120 } else { 240 };
    let (spec, p) = peers::pressure_setup(opts.engines, n)?;
    let pressure = p.pressure(spec.engines, spec.num_blocks, spec.block_size);
    Ok(DemoWorkload {
        name: "shared-prefix",
        description: format!(
            "{n} requests from {} groups (Zipf s={}) of a {}-token system prompt, {}-token question, \
             {}-token answer; Poisson {SHARED_PREFIX_RATE} req/s; {} engines of {} KV blocks \
             (the groups' prompts need {pressure:.1}x the fleet's KV)",
            p.groups,
            p.zipf_s,
            p.system_tokens,
            p.question_tokens,
            p.output_tokens,
            spec.engines,
            spec.num_blocks,
        ),
        workload: p.build(opts.seed),
        load: Load::poisson(SHARED_PREFIX_RATE * spec.time_scale, n),
        spec,
    })
}

fn long_prompt(opts: &DemoOpts) -> Result<DemoWorkload, DemoError> {
    let n = if opts.quick { 80 } else { 160 };
    let (spec, p) = peers::pd_setup(opts.engines, n)?;
    let mut workload = p.build(opts.seed);
    workload.name = "long-prompt".to_owned();
    Ok(DemoWorkload {
        name: "long-prompt",
        description: format!(
            "{n} requests: {} long ({} tokens in, {} out) among {} short ({} in, {} out); \
             Poisson {LONG_PROMPT_RATE} req/s; P/D splits the {} engines into prefill and decode halves",
            p.long_requests,
            p.long_input,
            p.long_output,
            p.long_requests * p.short_per_long,
            p.short_input,
            p.short_output,
            spec.engines,
        ),
        workload,
        load: Load::poisson(LONG_PROMPT_RATE * spec.time_scale, n),
        spec,
    })
}

fn say(opts: &DemoOpts, line: &str) {
    if opts.progress {
        eprintln!("{line}");
    }
}

/// Runs every workload under every policy of `opts`, each on a fresh fleet
/// (fresh caches, same seed), and reports in simulated time.
pub async fn run(opts: &DemoOpts) -> Result<DemoReport, DemoError> {
    let started = Instant::now();
    let mut plan = vec![(shared_prefix(opts)?, opts.shared_prefix_policies.clone())];
    if !opts.long_prompt_policies.is_empty() {
        plan.push((long_prompt(opts)?, opts.long_prompt_policies.clone()));
    }
    let spec = peers::peers_spec(opts.engines)?;
    let mut workloads = Vec::new();
    for (wl, policies) in &plan {
        let mut report = WorkloadReport {
            name: wl.name.to_owned(),
            description: wl.description.clone(),
            baseline: Policy::RoundRobin.name().to_owned(),
            policies: Vec::new(),
        };
        for &policy in policies {
            say(
                opts,
                &format!(
                    "[{}] {policy}: starting {} simulated engines ({}, x{} time) with a kvmesh sidecar each, {} requests",
                    wl.name,
                    wl.spec.engines,
                    wl.spec.profile.name,
                    wl.spec.time_scale,
                    wl.workload.len(),
                ),
            );
            report.policies.push(run_policy(opts, wl, policy).await?);
        }
        if wl.name == "shared-prefix" && opts.smg {
            report.policies.push(run_smg(opts, wl).await?);
        }
        report.compute_ratios();
        workloads.push(report);
    }
    Ok(DemoReport {
        workloads,
        time_unit: format!(
            "simulated milliseconds (engines imitate the {} profile at {}x real time; wall time x {})",
            spec.profile.name, spec.time_scale, spec.time_scale
        ),
        time_scale: spec.time_scale,
        profile: spec.profile.name.clone(),
        engines: spec.engines,
        seed: opts.seed,
        wall_s: started.elapsed().as_secs_f64(),
    })
}

/// One policy on one workload: a fresh fleet, the run, the fleet stopped.
async fn run_policy(
    opts: &DemoOpts,
    wl: &DemoWorkload,
    policy: Policy,
) -> Result<PolicyReport, DemoError> {
    let fleet = fleet::start(&wl.spec, policy).await?;
    if fleet.discovery == fleet::Discovery::Direct {
        say(
            opts,
            &format!(
                "[{}] {policy}: the mesh did not connect; peers registered directly",
                wl.name
            ),
        );
    }
    let stop = tokio_util::sync::CancellationToken::new();
    let sampler = fleet
        .pods
        .first()
        .map(|p| tokio::spawn(sample_autoscale(p.sidecar.fleet().clone(), stop.clone())));
    let outcome = drive_urls(opts, wl, &fleet.urls()).await;
    stop.cancel();
    let autoscale_peak = match sampler {
        Some(task) => task.await.unwrap_or_default(),
        None => BTreeMap::new(),
    };
    let prefill_requests = fleet.prefill_requests();
    fleet.shutdown().await;
    let result = outcome?;
    let summary = report::to_simulated(&result.summary(), wl.spec.time_scale);
    let mut note = None;
    if summary.errors > 0 {
        let first = result
            .records
            .iter()
            .find_map(|r| r.error.clone())
            .unwrap_or_default();
        note = Some(format!(
            "{} requests failed; first: {first}",
            summary.errors
        ));
    }
    if policy.disaggregated() && prefill_requests == 0 {
        note = Some("no request reached a prefill pod: P/D never engaged".to_owned());
    }
    let mut report = PolicyReport::ran(policy.name(), summary, note);
    report.autoscale_peak = autoscale_peak;
    Ok(report)
}

/// The autoscaling hook's answer (default targets) for the fleet as `fleet`
/// sees it, every 100 ms until `stop`: per pool with pods, its largest size
/// and the most pods asked for.
async fn sample_autoscale(
    fleet: std::sync::Arc<kvmesh_proxy::fleet::Fleet>,
    stop: tokio_util::sync::CancellationToken,
) -> BTreeMap<String, report::PoolPeak> {
    let cfg = kvmesh_proxy::config::Autoscale::default();
    let mut peak: BTreeMap<String, report::PoolPeak> = BTreeMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return peak,
            _ = tick.tick() => {}
        }
        let pods = fleet.snapshot(tokio::time::Instant::now());
        for (pool, a) in kvmesh_proxy::autoscale::answer(&cfg, &pods) {
            if a.pods == 0 {
                continue;
            }
            let p = peak.entry(pool.to_owned()).or_insert(report::PoolPeak {
                pods: a.pods,
                desired: a.desired,
            });
            p.pods = p.pods.max(a.pods);
            p.desired = p.desired.max(a.desired);
        }
    }
}

/// The SMG row: SMG 1.13 `cache_aware` in front of a fresh fleet of bare
/// engines, the same workload and load; unavailable, with the command that
/// installs it, when SMG is not found. The demo installs nothing.
async fn run_smg(opts: &DemoOpts, wl: &DemoWorkload) -> Result<PolicyReport, DemoError> {
    const NAME: &str = "smg-cache-aware";
    let bin = match peers::smg::find() {
        Ok(bin) => bin,
        Err(why) => return Ok(PolicyReport::unavailable(NAME, why)),
    };
    say(
        opts,
        &format!(
            "[{}] {NAME}: SMG 1.13 in front of {} bare engines",
            wl.name, wl.spec.engines
        ),
    );
    let engines = peers::bare_engines(&wl.spec).await?;
    let urls: Vec<String> = engines
        .iter()
        .map(kvmesh_engine_sim::SimHandle::base_url)
        .collect();
    let result = match peers::smg::Smg::start(&bin, "cache_aware", &urls, &wl.spec.model).await {
        Ok(smg) => {
            let result = drive_urls(opts, wl, std::slice::from_ref(&smg.url)).await;
            smg.stop().await;
            Ok(result)
        }
        Err(why) => Err(why),
    };
    for e in engines {
        e.shutdown().await;
    }
    let result = match result {
        Ok(r) => r,
        Err(why) => return Ok(PolicyReport::unavailable(NAME, why)),
    };
    let summary = report::to_simulated(&result?.summary(), wl.spec.time_scale);
    Ok(PolicyReport::ran(NAME, summary, None))
}

/// How the demo and the peers bench send a workload: to `urls` in turn (as
/// clients behind a Service), arrivals seeded by `seed`, with deadlines a
/// saturated simulated fleet still meets.
pub(crate) fn run_config(urls: &[String], model: &str, seed: u64) -> Result<RunConfig, DemoError> {
    let mut cfg = RunConfig::new(urls, model)?;
    cfg.spread = Spread::RoundRobin;
    cfg.seed = seed;
    cfg.client = ClientConfig {
        request_timeout: Duration::from_secs(120),
        idle_timeout: Duration::from_secs(30),
        ..ClientConfig::default()
    };
    Ok(cfg)
}

/// Runs the workload against `urls`, spread in turn.
async fn drive_urls(
    opts: &DemoOpts,
    wl: &DemoWorkload,
    urls: &[String],
) -> Result<runner::RunResult, DemoError> {
    let mut cfg = run_config(urls, &wl.spec.model, opts.seed)?;
    cfg.progress = opts.progress;
    Ok(runner::run(&cfg, &wl.workload, &wl.load).await?)
}

/// What `kvmesh demo` prints on stdout: the table, or the JSON.
pub fn render(report: &DemoReport, json: bool) -> String {
    if json {
        format!("{}\n", report.to_json())
    } else {
        report.table()
    }
}
