//! `kvmesh bench`: runs kvmesh-loadgen workloads against OpenAI-compatible
//! endpoints (`run`), measures proxy overhead against direct and nginx
//! (`overhead`), serves the fast fake engine (`fake-engine`), or sweeps kvmesh
//! against the routers users pick instead (`peers`). The logic lives in
//! `kvmesh_loadgen` and [`crate::demo::peers`]; this file only parses
//! arguments.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Subcommand, ValueEnum};
use kvmesh_loadgen::fake::{FastEngine, FastEngineConfig};
use kvmesh_loadgen::overhead::{self, OverheadConfig};
use kvmesh_loadgen::report::Report;
use kvmesh_loadgen::workload::{Size, Workload, WORKLOAD_NAMES};
use kvmesh_loadgen::{run, Load, RunConfig, Spread};

/// The `kvmesh bench` subcommands.
#[derive(Debug, Subcommand)]
pub enum BenchCmd {
    /// Run a workload against one or more base URLs and print a report.
    Run(RunArgs),
    /// Proxy overhead: the fast fake engine direct, through kvmesh, through nginx.
    Overhead(OverheadArgs),
    /// Serve the fast fake engine until interrupted.
    FakeEngine(FakeArgs),
    /// Soak: 1M requests through a sidecar (alone, with /metrics scrapes, in
    /// a mesh of 4 whose peers restart), its RSS and open fds sampled.
    Soak(SoakArgs),
    /// kvmesh against the routers users would pick instead (round-robin,
    /// SMG, llm-d's config), each on its own simulated fleet, swept over rates.
    Peers(PeersArgs),
    /// One real sidecar in front of an emulated fleet of 32 to 1000 pods, on
    /// the full mesh and on Valkey: its CPU, memory, decision latency and
    /// the index's freshness; what one Valkey core takes; the sizing rule.
    Scale(ScaleArgs),
    /// The autoscaling hook in a closed loop: a fleet that starts and stops
    /// simulated pods on each policy's answer under a trace-shaped rate;
    /// fixed fleets, a queue HPA and kvmesh's hook side by side.
    Autoscale(AutoscaleArgs),
}

#[derive(Debug, clap::Args)]
pub struct AutoscaleArgs {
    /// The CI size: one seed, under 10 minutes on 2 cores.
    #[arg(long)]
    quick: bool,
    /// How many times faster than Kubernetes' and KEDA's clocks (pod start
    /// 30 s, polling 15 s, scale-down window 300 s) the run goes, the trace
    /// twice that (default 5; 1 is real clocks and takes hours).
    #[arg(long)]
    compression: Option<u32>,
    /// Seeds (default 1,2,3; 1 with --quick).
    #[arg(long, value_delimiter = ',')]
    seeds: Vec<u64>,
    /// Fleets: aggregated, pd (default both).
    #[arg(long, value_delimiter = ',')]
    fleets: Vec<String>,
    /// Policies: fixed-peak, fixed-mean, queue-hpa, kvmesh-queue, kvmesh-slo (default: these five); the bounds clairvoyant (the model at the highest rate a start-up ahead, read off the trace) and reactive-bound (the model at the rate now, known the moment it changes).
    #[arg(long, value_delimiter = ',')]
    policies: Vec<String>,
    /// Simulated seconds per wall second.
    #[arg(long)]
    time_scale: Option<f64>,
    /// Requests per second at the trace's mean rate.
    #[arg(long)]
    base_rate: Option<f64>,
    /// kvmesh-slo's `autoscale.slo.headroom`: pools sized for this many times the measured rate (default 1); the bounds size for this many times the trace's.
    #[arg(long)]
    slo_headroom: Option<f64>,
    /// The share of requests, in percent, kvmesh-slo sizes to meet the TTFT target: 90, 95 or 99 (`autoscale.slo.ttft_p90` ...; default 99, the share the attainment target asks for); the fixed fleets are sized for it too.
    #[arg(long)]
    slo_percentile: Option<u32>,
    /// The sidecars hold requests while every pod of their pool is saturated (filter config `featureGates: [flowControl]`, llm-d's thresholds), under every policy.
    #[arg(long)]
    flow_control: bool,
    /// Write the report as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write pods and TTFT p90 against time as PNGs (NAME-FLEET-pods.png, NAME-FLEET-ttft.png).
    #[arg(long)]
    png: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct ScaleArgs {
    /// The CI size: one round, short phases, under 10 minutes on 2 cores.
    #[arg(long)]
    quick: bool,
    /// Fleet sizes (default 32,128,512,1000).
    #[arg(long, value_delimiter = ',')]
    pods: Vec<usize>,
    /// The largest fleet run on the mesh (default 128 with --quick, else 512).
    #[arg(long)]
    mesh_max: Option<usize>,
    /// Rounds per point (default 1 with --quick, else 3).
    #[arg(long)]
    rounds: Option<usize>,
    /// kvmesh-proxy binary (default: next to this binary, then PATH).
    #[arg(long)]
    proxy: Option<PathBuf>,
    /// Write the report as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write per-sidecar CPU and RSS against pods as PNGs (NAME-cpu.png, NAME-rss.png).
    #[arg(long)]
    png: Option<PathBuf>,
    /// Where the sidecars' configs and logs go (default: a temporary directory).
    #[arg(long)]
    work_dir: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct PeersArgs {
    /// The small size: fewer rates, requests and probes (about 18 minutes on 2 cores since bisection and the kv-admission workload; the CI test runs a smaller sweep).
    #[arg(long)]
    quick: bool,
    /// Seeds; every point runs once per seed (default 1,2,3; 1,2 with --quick).
    #[arg(long, value_delimiter = ',')]
    seeds: Vec<u64>,
    /// Engines per fleet.
    #[arg(long, default_value_t = 4)]
    engines: usize,
    /// Shared-prefix and multi-turn routers to run (default: all).
    #[arg(long, value_delimiter = ',')]
    routers: Vec<String>,
    /// Skip the P/D workload.
    #[arg(long)]
    no_pd: bool,
    /// Skip the shared-prefix workload.
    #[arg(long)]
    no_shared_prefix: bool,
    /// Skip the multi-turn chat workload.
    #[arg(long)]
    no_chat: bool,
    /// Skip the KV-admission workload.
    #[arg(long)]
    no_kv_admission: bool,
    /// Skip the where-P/D-pays grid.
    #[arg(long)]
    no_pd_pays: bool,
    /// Shared-prefix and multi-turn rates to sweep (simulated req/s), instead of the defaults.
    #[arg(long, value_delimiter = ',')]
    rates: Vec<f64>,
    /// Requests per run, instead of the default.
    #[arg(long)]
    requests: Option<usize>,
    /// Long-prompt lengths of the where-P/D-pays grid (tokens), instead of the defaults.
    #[arg(long, value_delimiter = ',')]
    pd_pays_prompts: Vec<usize>,
    /// Rates of the where-P/D-pays grid (simulated req/s), instead of the defaults.
    #[arg(long, value_delimiter = ',')]
    pd_pays_rates: Vec<f64>,
    /// Rates bisection may add per router and workload to find its capacity
    /// at SLO within 5% (default 3, 1 with --quick; 0: the grid alone).
    #[arg(long)]
    probes: Option<usize>,
    /// A filters.yaml to run as `kvmesh` instead of the built-in default.
    #[arg(long)]
    kvmesh_filters: Option<PathBuf>,
    /// Write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the TTFT p90 and ITL p99 plots (PNG) into this directory.
    #[arg(long)]
    png_dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum SpreadArg {
    RoundRobin,
    Sticky,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Base URL of a target (repeat for several; requests are spread over them).
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    /// shared-prefix, multi-turn, pd, long-body or tiny.
    #[arg(long, default_value = "shared-prefix")]
    workload: String,
    /// small (CI) or full (the field's parameters).
    #[arg(long, default_value = "small")]
    size: String,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, value_enum, default_value = "round-robin")]
    spread: SpreadArg,
    /// The `model` field of each request.
    #[arg(long, default_value = "kvmesh-sim")]
    model: String,
    /// Name of this set-up in the report.
    #[arg(long, default_value = "run")]
    policy: String,
    /// Poisson rates (req/s), one stage each; replaces the workload's load.
    #[arg(long, value_delimiter = ',')]
    rate: Vec<f64>,
    /// Closed-loop concurrencies, one stage each; replaces the workload's load.
    #[arg(long, value_delimiter = ',', conflicts_with = "rate")]
    concurrency: Vec<usize>,
    /// Requests per stage (with --rate/--concurrency; default: the workload's size).
    #[arg(long)]
    requests: Option<usize>,
    /// Seconds per stage at most.
    #[arg(long)]
    stage_secs: Option<f64>,
    /// Write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the TTFT/ITL plot here.
    #[arg(long)]
    png: Option<PathBuf>,
    /// Also write every request record as JSON here.
    #[arg(long)]
    records: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct OverheadArgs {
    /// kvmesh-proxy binary (default: next to this binary, then PATH).
    #[arg(long)]
    proxy: Option<PathBuf>,
    /// nginx binary (default: PATH, then /usr/sbin).
    #[arg(long)]
    nginx: Option<PathBuf>,
    /// A tenth of the requests.
    #[arg(long)]
    quick: bool,
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Directory for the children's configs and logs (default: a temp dir).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    #[arg(long)]
    json: Option<PathBuf>,
    #[arg(long)]
    png: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct FakeArgs {
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    #[arg(long, default_value_t = 8)]
    chunks: u32,
    #[arg(long, default_value_t = 0)]
    first_token_ms: u64,
    #[arg(long, default_value_t = 0)]
    chunk_ms: u64,
}

#[derive(Debug, clap::Args)]
pub struct SoakArgs {
    /// kvmesh-proxy binary (default: next to this binary, then PATH).
    #[arg(long)]
    proxy: Option<PathBuf>,
    /// 20k requests after a warm-up of at most 10k, instead of 1M after at most 500k.
    #[arg(long)]
    quick: bool,
    /// Requests after the warm-up, instead of the size's.
    #[arg(long)]
    requests: Option<usize>,
    /// Modes to run: single, scrapes, mesh.
    #[arg(long, value_delimiter = ',', default_value = "single,scrapes,mesh")]
    modes: Vec<String>,
    /// Fail (exit 1) when RSS or fds grow by this many percent or more.
    #[arg(long, default_value_t = 5.0)]
    max_growth_pct: f64,
    /// Directory for the children's logs (default: a temp dir).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Runs one `kvmesh bench` subcommand on a fresh runtime.
pub fn main(cmd: BenchCmd) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    rt.block_on(async move {
        match cmd {
            BenchCmd::Run(a) => run_cmd(a).await,
            BenchCmd::Overhead(a) => overhead_cmd(a).await,
            BenchCmd::FakeEngine(a) => fake_cmd(a).await,
            BenchCmd::Soak(a) => soak_cmd(a).await,
            BenchCmd::Peers(a) => peers_cmd(a).await,
            BenchCmd::Scale(a) => scale_cmd(a).await,
            BenchCmd::Autoscale(a) => autoscale_cmd(a).await,
        }
    })
}

fn load_from(a: &RunArgs, default: Load) -> Load {
    let stage = a.stage_secs.map(Duration::from_secs_f64);
    let n = a.requests;
    let load = if !a.rate.is_empty() {
        let mut l = Load::poisson_ladder(
            &a.rate
                .iter()
                .map(|&r| (r, Duration::MAX))
                .collect::<Vec<_>>(),
        );
        for s in &mut l.stages {
            s.max_duration = stage;
            s.max_requests = n.or(stage.is_none().then_some(100));
        }
        l
    } else if !a.concurrency.is_empty() {
        let mut l = Load::closed_ladder(
            &a.concurrency
                .iter()
                .map(|&c| (c, n.unwrap_or(100)))
                .collect::<Vec<_>>(),
        );
        for s in &mut l.stages {
            s.max_duration = stage;
        }
        l
    } else {
        match stage {
            Some(d) => default.with_stage_duration(d),
            None => default,
        }
    };
    load
}

async fn run_cmd(a: RunArgs) -> Result<()> {
    let Some(size) = Size::parse(&a.size) else {
        bail!("--size must be small or full")
    };
    let (workload, default_load) = Workload::named(&a.workload, size, a.seed)
        .with_context(|| format!("workloads: {}", WORKLOAD_NAMES.join(", ")))?;
    let load = load_from(&a, default_load);
    let mut cfg = RunConfig::new(&a.urls, &a.model)?;
    cfg.seed = a.seed;
    cfg.progress = std::io::stderr().is_terminal();
    cfg.spread = match a.spread {
        SpreadArg::RoundRobin => Spread::RoundRobin,
        SpreadArg::Sticky => Spread::StickyUser,
    };
    let result = run(&cfg, &workload, &load).await?;
    let mut report = Report::new(&a.policy);
    report.add(&workload.name, &a.policy, &result);
    print!("{}", report.table());
    if let Some(p) = &a.json {
        report.write_json(p)?;
    }
    if let Some(p) = &a.png {
        report.write_png(p)?;
    }
    if let Some(p) = &a.records {
        std::fs::write(p, serde_json::to_vec(&result.records)?)
            .with_context(|| p.display().to_string())?;
    }
    Ok(())
}

async fn overhead_cmd(a: OverheadArgs) -> Result<()> {
    let tmp;
    let work_dir = match a.work_dir {
        Some(d) => {
            std::fs::create_dir_all(&d)?;
            // nginx resolves its paths against its own prefix: make them absolute.
            std::fs::canonicalize(&d).with_context(|| d.display().to_string())?
        }
        None => {
            tmp = std::env::temp_dir().join(format!("kvmesh-bench-{}", std::process::id()));
            std::fs::create_dir_all(&tmp)?;
            tmp
        }
    };
    let mut cfg = OverheadConfig::sized(a.quick, work_dir.clone());
    cfg.concurrency = a.concurrency;
    cfg.nginx_bin = a.nginx;
    cfg.progress = std::io::stderr().is_terminal();
    cfg.proxy_bin = a.proxy.or_else(|| {
        let exe = std::env::current_exe().ok()?;
        let beside = exe.parent()?.join("kvmesh-proxy");
        beside.is_file().then_some(beside)
    });
    let report = overhead::measure(&cfg).await?;
    print!("{}", report.text());
    eprintln!("logs and configs: {}", work_dir.display());
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&report)?)
            .with_context(|| p.display().to_string())?;
    }
    if let Some(p) = &a.png {
        report.to_report().write_png(p)?;
    }
    Ok(())
}

async fn scale_cmd(a: ScaleArgs) -> Result<()> {
    use crate::scale::{self, ScaleOpts};
    let work_dir = a.work_dir.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("kvmesh-scale-{}", std::process::id()))
    });
    let mut opts = ScaleOpts::new(a.quick, work_dir.clone());
    if !a.pods.is_empty() {
        opts.pods = a.pods;
    }
    if let Some(m) = a.mesh_max {
        opts.mesh_max = m;
    }
    if let Some(r) = a.rounds {
        opts.rounds = r.max(1);
    }
    opts.proxy = a.proxy;
    let report = scale::run(&opts).await?;
    print!("{}", report.text());
    eprintln!("configs and logs: {}", work_dir.display());
    write_outputs(&report, a.json.as_deref(), a.png.as_deref(), |p| {
        report.write_pngs(p)
    })
}

/// Writes `report` as JSON to `json` and its plots (`pngs`, given `png`)
/// where they were asked for.
fn write_outputs(
    report: &impl serde::Serialize,
    json: Option<&std::path::Path>,
    png: Option<&std::path::Path>,
    pngs: impl FnOnce(&std::path::Path) -> Result<Vec<PathBuf>>,
) -> Result<()> {
    if let Some(p) = json {
        std::fs::write(p, serde_json::to_vec_pretty(report)?)
            .with_context(|| p.display().to_string())?;
    }
    if let Some(p) = png {
        for f in pngs(p)? {
            eprintln!("wrote {}", f.display());
        }
    }
    Ok(())
}

async fn autoscale_cmd(a: AutoscaleArgs) -> Result<()> {
    use crate::autoscale::policy::ScalePolicy;
    use crate::autoscale::{self, AutoscaleOpts, FleetKind};
    let mut opts = AutoscaleOpts::new(a.quick);
    opts.progress =
        std::io::stderr().is_terminal() || std::env::var_os("KVMESH_PROGRESS").is_some();
    if !a.seeds.is_empty() {
        opts.seeds = a.seeds;
    }
    if !a.fleets.is_empty() {
        opts.fleets = a
            .fleets
            .iter()
            .map(|f| match f.as_str() {
                "aggregated" => Ok(FleetKind::Aggregated),
                "pd" => Ok(FleetKind::Pd),
                other => bail!("unknown fleet {other:?} (expected aggregated or pd)"),
            })
            .collect::<Result<_>>()?;
    }
    if !a.policies.is_empty() {
        opts.policies = a
            .policies
            .iter()
            .map(|p| {
                ScalePolicy::parse(p).with_context(|| {
                    format!("unknown policy {p:?} (expected fixed-peak, fixed-mean, queue-hpa, kvmesh-queue, kvmesh-slo, clairvoyant or reactive-bound)")
                })
            })
            .collect::<Result<_>>()?;
    }
    if let Some(k) = a.compression {
        if k == 0 {
            bail!("--compression must be at least 1");
        }
        opts.timing = autoscale::Timing::compressed(k);
    }
    if let Some(t) = a.time_scale {
        if !(t.is_finite() && t > 0.0) {
            bail!("--time-scale must be a positive number, not {t}");
        }
        opts.time_scale = t;
    }
    if let Some(r) = a.base_rate {
        if !(r.is_finite() && r > 0.0) {
            bail!("--base-rate must be a positive number, not {r}");
        }
        opts.base_rate = r;
    }
    opts.flow_control = a.flow_control;
    if let Some(h) = a.slo_headroom {
        if !(1.0..=10.0).contains(&h) {
            bail!("--slo-headroom must be from 1 to 10, not {h}");
        }
        opts.slo_headroom = h;
    }
    if let Some(p) = a.slo_percentile {
        opts.slo_ttft_quantile = match p {
            90 => 0.9,
            95 => 0.95,
            99 => 0.99,
            _ => bail!("--slo-percentile must be 90, 95 or 99, not {p}"),
        };
    }
    let report = autoscale::run(&opts).await?;
    print!("{}", report.text());
    write_outputs(&report, a.json.as_deref(), a.png.as_deref(), |p| {
        report.write_pngs(p)
    })
}

async fn fake_cmd(a: FakeArgs) -> Result<()> {
    let cfg = FastEngineConfig {
        chunks: a.chunks,
        first_token_delay: Duration::from_millis(a.first_token_ms),
        chunk_delay: Duration::from_millis(a.chunk_ms),
        cached_tokens: 0,
    };
    let engine = FastEngine::bind(&a.listen, cfg).await?;
    println!("fake engine on {}", engine.url());
    tokio::signal::ctrl_c().await?;
    engine.shutdown().await;
    Ok(())
}

async fn soak_cmd(a: SoakArgs) -> Result<()> {
    use kvmesh_loadgen::soak::{self, SoakConfig, SoakMode};
    let proxy = a
        .proxy
        .or_else(|| {
            let exe = std::env::current_exe().ok()?;
            let beside = exe.parent()?.join("kvmesh-proxy");
            beside.is_file().then_some(beside)
        })
        .or_else(|| kvmesh_loadgen::overhead::procs::find_binary(None, "kvmesh-proxy", &[]))
        .context("no kvmesh-proxy binary (pass --proxy)")?;
    let work_dir = a.work_dir.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("kvmesh-soak-{}", std::process::id()))
    });
    let mut cfg = SoakConfig::sized(a.quick, proxy, work_dir.clone());
    if let Some(n) = a.requests {
        cfg.requests = n;
    }
    let modes = a
        .modes
        .iter()
        .map(|m| SoakMode::parse(m).with_context(|| format!("unknown mode {m:?}")))
        .collect::<Result<Vec<_>>>()?;
    let report = soak::soak(&cfg, &modes).await?;
    print!("{}", report.text());
    eprintln!("logs: {}", work_dir.display());
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&report)?)
            .with_context(|| p.display().to_string())?;
    }
    let over: Vec<&str> = report
        .runs
        .iter()
        .filter(|r| !r.within(a.max_growth_pct))
        .map(|r| r.mode.name())
        .collect();
    if !over.is_empty() {
        bail!(
            "RSS or fds grew by {}% or more in: {}",
            a.max_growth_pct,
            over.join(", ")
        );
    }
    Ok(())
}

async fn peers_cmd(a: PeersArgs) -> Result<()> {
    use crate::demo::peers::{self, PeersOpts, Router};
    let mut opts = PeersOpts::new(a.quick);
    if !a.seeds.is_empty() {
        opts.seeds = a.seeds;
    }
    opts.engines = a.engines;
    opts.pd = !a.no_pd;
    opts.chat = !a.no_chat;
    opts.kv_admission = !a.no_kv_admission;
    opts.pd_pays = !a.no_pd_pays;
    opts.progress = true;
    opts.rates = (!a.rates.is_empty()).then_some(a.rates);
    opts.requests = a.requests;
    if let Some(n) = a.probes {
        opts.probes = n;
    }
    opts.pd_pays_prompts = (!a.pd_pays_prompts.is_empty()).then_some(a.pd_pays_prompts);
    opts.pd_pays_rates = (!a.pd_pays_rates.is_empty()).then_some(a.pd_pays_rates);
    opts.shared_prefix = !a.no_shared_prefix;
    if !a.routers.is_empty() {
        opts.routers = a
            .routers
            .iter()
            .map(|n| {
                Router::SHARED_PREFIX
                    .into_iter()
                    .find(|r| r.name() == *n)
                    .with_context(|| format!("unknown router {n:?}"))
            })
            .collect::<Result<_>>()?;
    }
    if let Some(p) = &a.kvmesh_filters {
        let text = std::fs::read_to_string(p).with_context(|| p.display().to_string())?;
        opts.kvmesh_filters = Some(kvmesh_filters::sched::FilterConfig::from_yaml(
            &text,
            &p.display().to_string(),
        )?);
    }
    let report = peers::run(&opts).await?;
    print!("{}", peers::table(&report));
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&report)?)
            .with_context(|| p.display().to_string())?;
    }
    if let Some(dir) = &a.png_dir {
        std::fs::create_dir_all(dir)?;
        for path in peers::write_plots(&report, dir)? {
            eprintln!("wrote {}", path.display());
        }
    }
    Ok(())
}
