//! The demo and the policy-comparison harness: the same workload, the same
//! seed, a fresh simulated fleet per routing set-up, and a table of what each
//! set-up did to TTFT, inter-token latency, throughput and the prefix-cache
//! hit rate.
//!
//! [`fleet::start`] brings up N simulated engines with a sidecar each, all
//! running one [`Policy`]; [`run`] drives the shared-prefix workload under
//! every policy and the long-prompt workload with and without P/D, and
//! returns a [`DemoReport`]. `kvmesh-proxy demo` is a thin shell over it.
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

use kvmesh_loadgen::workload::{PdParams, SharedPrefixParams};
use kvmesh_loadgen::{runner, Client, ClientConfig, Load, RunConfig, Spread, Workload};

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
                Policy::Kvmesh,
            ],
            long_prompt_policies: vec![Policy::RoundRobin, Policy::Kvmesh, Policy::Pd],
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

/// Arrival rate in requests per wall second (× time scale per simulated second).
const SHARED_PREFIX_RATE: f64 = 20.0;
const LONG_PROMPT_RATE: f64 = 16.0;

fn shared_prefix(opts: &DemoOpts) -> DemoWorkload {
    let p = SharedPrefixParams {
        groups: if opts.quick { 8 } else { 16 },
        users_per_group: if opts.quick { 6 } else { 8 },
        system_tokens: 600,
        question_tokens: 60,
        output_tokens: 32,
    };
    let spec = FleetSpec::demo(opts.engines);
    let n = p.groups * p.users_per_group;
    DemoWorkload {
        name: "shared-prefix",
        description: format!(
            "{n} requests: {} groups x {} users, {}-token shared system prompt, {}-token question, \
             {}-token answer; Poisson {:.1} req/s; {} engines of {} KV blocks",
            p.groups,
            p.users_per_group,
            p.system_tokens,
            p.question_tokens,
            p.output_tokens,
            SHARED_PREFIX_RATE / spec.time_scale,
            spec.engines,
            spec.num_blocks,
        ),
        workload: p.build(opts.seed),
        load: Load::poisson(SHARED_PREFIX_RATE, n),
        spec,
    }
}

fn long_prompt(opts: &DemoOpts) -> DemoWorkload {
    let p = PdParams {
        long_requests: if opts.quick { 6 } else { 16 },
        // Above the P/D example's 2048 uncached tokens, so P/D engages.
        long_input: 2500,
        long_output: 50,
        short_per_long: 3,
        short_input: 32,
        short_output: 64,
    };
    let mut spec = FleetSpec::demo(opts.engines);
    // Room for several long prompts at once: this workload is about prefill
    // stalling decodes, not about cache placement.
    spec.num_blocks = 1024;
    let n = p.long_requests * (1 + p.short_per_long);
    let mut workload = p.build(opts.seed);
    workload.name = "long-prompt".to_owned();
    DemoWorkload {
        name: "long-prompt",
        description: format!(
            "{n} requests: {} long ({} tokens in, {} out) among {} short ({} in, {} out); \
             Poisson {:.1} req/s; P/D splits the {} engines into prefill and decode halves",
            p.long_requests,
            p.long_input,
            p.long_output,
            p.long_requests * p.short_per_long,
            p.short_input,
            p.short_output,
            LONG_PROMPT_RATE / spec.time_scale,
            spec.engines,
        ),
        workload,
        load: Load::poisson(LONG_PROMPT_RATE, n),
        spec,
    }
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
    let mut plan = vec![(shared_prefix(opts), opts.shared_prefix_policies.clone())];
    if !opts.long_prompt_policies.is_empty() {
        plan.push((long_prompt(opts), opts.long_prompt_policies.clone()));
    }
    let spec = FleetSpec::demo(opts.engines);
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
    let outcome = drive(opts, wl, policy, &fleet).await;
    stop.cancel();
    let autoscale_peak = match sampler {
        Some(task) => task.await.unwrap_or_default(),
        None => BTreeMap::new(),
    };
    let prefill_requests = fleet.prefill_requests();
    fleet.shutdown().await;
    let result = match outcome? {
        Ok(result) => result,
        Err(why) => return Ok(PolicyReport::unavailable(policy.name(), why)),
    };
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
    fleet: std::sync::Arc<crate::fleet::Fleet>,
    stop: tokio_util::sync::CancellationToken,
) -> BTreeMap<String, report::PoolPeak> {
    let cfg = crate::config::Autoscale::default();
    let mut peak: BTreeMap<String, report::PoolPeak> = BTreeMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return peak,
            _ = tick.tick() => {}
        }
        let pods = fleet.snapshot(tokio::time::Instant::now());
        for (pool, a) in crate::autoscale::answer(&cfg, &pods) {
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

/// Probes (for P/D) and runs the workload. The inner error is a reason the
/// policy is unavailable in this build; the outer one a failure of the demo.
async fn drive(
    opts: &DemoOpts,
    wl: &DemoWorkload,
    policy: Policy,
    fleet: &DemoFleet,
) -> Result<Result<runner::RunResult, String>, DemoError> {
    let urls = fleet.urls();
    let mut cfg = RunConfig::new(&urls, &wl.spec.model)?;
    cfg.spread = Spread::RoundRobin;
    cfg.seed = opts.seed;
    cfg.progress = opts.progress;
    cfg.client = ClientConfig {
        request_timeout: Duration::from_secs(120),
        idle_timeout: Duration::from_secs(30),
        ..ClientConfig::default()
    };
    if policy.disaggregated() {
        if let Err(why) = probe(&cfg, &wl.workload).await {
            say(
                opts,
                &format!("[{}] {policy}: not available: {why}", wl.name),
            );
            return Ok(Err(why));
        }
    }
    Ok(Ok(runner::run(&cfg, &wl.workload, &wl.load).await?))
}

/// Sends the workload's longest request once; an error says the set-up does
/// not work in this build (P/D before its stage exists answers 501).
async fn probe(cfg: &RunConfig, workload: &Workload) -> Result<(), String> {
    let Some(req) = workload.requests.iter().max_by_key(|r| r.prompt_words()) else {
        return Ok(());
    };
    let target = cfg.targets.first().ok_or("no sidecar")?;
    let uri = target.uri(req.path()).map_err(|e| e.to_string())?;
    let body = req.body(&cfg.model).map_err(|e| e.to_string())?;
    let rec = Client::new(cfg.client.clone())
        .send(uri, body, req.stream)
        .await;
    if rec.is_ok() {
        Ok(())
    } else {
        Err(match (rec.status, rec.error) {
            (Some(s), Some(e)) => format!("HTTP {s}: {e}"),
            (Some(s), None) => format!("HTTP {s}"),
            (None, Some(e)) => e,
            (None, None) => "the request failed".to_owned(),
        })
    }
}

/// What `kvmesh-proxy demo` prints on stdout: the table, or the JSON.
pub fn render(report: &DemoReport, json: bool) -> String {
    if json {
        format!("{}\n", report.to_json())
    } else {
        report.table()
    }
}
