//! Proxy overhead (issue 2's measurement): in one run, the fast fake engine
//! reached directly, through kvmesh (the `kvmesh-proxy` binary) and through
//! nginx as a plain reverse proxy, for small non-streaming completions, for
//! 200 KB bodies and for small streams: requests/s, latency percentiles and
//! CPU microseconds per request of each proxy, with the ratios the targets
//! are stated in (kvmesh ≥ 0.6× nginx's throughput, ≤ 2× its CPU per
//! request, < 1 ms added p99).
//!
//! Closed-loop legs saturate a small machine (load generator, engine and
//! proxy share its cores), so their p99 mostly shows the throughput a proxy
//! costs. The `paced` case measures the latency a proxy adds when it is not
//! the bottleneck: small requests arriving as a Poisson process at a quarter
//! of the slowest leg's measured throughput.
//!
//! A leg whose binary is missing is skipped with the reason, so the bench
//! runs (direct only, or direct + nginx) wherever it is.

pub mod procs;

use std::fmt::Write;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::process::Command;

use crate::client::{Client, ClientConfig};
use crate::error::LoadgenError;
use crate::fake::{FastEngine, FastEngineConfig};
use crate::load::Load;
use crate::report::Report;
use crate::runner::{run, RunConfig};
use crate::stats::Summary;
use crate::workload::{tiny, LongBodyParams, Workload};
use procs::{find_binary, free_port, nginx_conf, Proc};

/// What to measure and with which binaries.
#[derive(Debug, Clone)]
pub struct OverheadConfig {
    /// `kvmesh-proxy`; `None`: not measured.
    pub proxy_bin: Option<PathBuf>,
    /// `nginx`; `None`: not measured.
    pub nginx_bin: Option<PathBuf>,
    /// nginx worker processes (kvmesh's runtime uses every core).
    pub nginx_workers: usize,
    pub concurrency: usize,
    pub small_requests: usize,
    pub large_requests: usize,
    pub large_bytes: usize,
    pub stream_requests: usize,
    /// Content chunks per streamed answer, and the engine's gap between them
    /// (an engine decodes a token every few ms; chunks that arrive back to
    /// back would measure write coalescing, not relaying).
    pub stream_chunks: u32,
    pub chunk_gap: Duration,
    /// Requests sent before each measured leg (connections, caches).
    pub warmup: usize,
    /// Requests of the `paced` case, and its rate as a fraction of the
    /// slowest leg's closed-loop throughput on small requests.
    pub paced_requests: usize,
    pub paced_fraction: f64,
    /// Where configs and logs of the children go.
    pub work_dir: PathBuf,
    pub progress: bool,
}

impl OverheadConfig {
    /// The default sizes (a few seconds per leg on 2 cores), or a tenth of
    /// them with `quick`.
    pub fn sized(quick: bool, work_dir: PathBuf) -> OverheadConfig {
        let k = if quick { 10 } else { 1 };
        OverheadConfig {
            proxy_bin: None,
            nginx_bin: None,
            nginx_workers: std::thread::available_parallelism().map_or(2, |n| n.get()),
            concurrency: 32,
            small_requests: 20_000 / k,
            large_requests: 2_000 / k,
            large_bytes: 200_000,
            stream_requests: 5_000 / k,
            stream_chunks: 16,
            chunk_gap: Duration::from_millis(2),
            warmup: 500 / k,
            paced_requests: 10_000 / k,
            paced_fraction: 0.25,
            work_dir,
            progress: false,
        }
    }
}

/// One leg (direct, kvmesh, nginx) on one case (small, 200KB, stream, paced).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LegResult {
    pub case: String,
    pub leg: String,
    pub summary: Summary,
    /// CPU time of the proxy process(es) per request, µs (`None` direct).
    pub cpu_us_per_req: Option<f64>,
}

/// All legs, plus the legs that could not run and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OverheadReport {
    pub legs: Vec<LegResult>,
    pub skipped: Vec<String>,
}

/// Runs every case on every available leg.
pub async fn measure(cfg: &OverheadConfig) -> Result<OverheadReport, LoadgenError> {
    let engine = FastEngine::bind(
        "127.0.0.1:0",
        FastEngineConfig {
            chunks: cfg.stream_chunks,
            chunk_delay: cfg.chunk_gap,
            ..FastEngineConfig::default()
        },
    )
    .await?;
    let probe = Client::new(ClientConfig::default());
    let mut skipped = Vec::new();
    // Each leg: name, base URL, the process whose CPU is charged.
    let mut legs: Vec<(String, String, Option<Proc>)> = vec![("direct".into(), engine.url(), None)];
    match find_binary(cfg.proxy_bin.as_deref(), "kvmesh-proxy", &[]) {
        Some(bin) => legs.push(start_kvmesh(cfg, &bin, engine.addr().port(), &probe).await?),
        None => skipped.push("kvmesh: no kvmesh-proxy binary (pass --proxy)".into()),
    }
    let sbin = std::path::Path::new("/usr/sbin");
    match find_binary(cfg.nginx_bin.as_deref(), "nginx", &[sbin]) {
        Some(bin) => legs.push(start_nginx(cfg, &bin, engine.addr().port(), &probe).await?),
        None => skipped.push("nginx: not installed (scripts/bench-overhead installs it)".into()),
    }
    let large = LongBodyParams {
        prompt_bytes: cfg.large_bytes,
        output_tokens: 8,
        concurrency: vec![cfg.concurrency],
        requests_per_stage: cfg.large_requests,
        distinct_prompts: 8,
        stream: false,
    }
    .build(1);
    let mut stream = tiny(cfg.stream_requests, 2);
    for r in &mut stream.requests {
        r.stream = true;
        r.max_tokens = cfg.stream_chunks;
    }
    stream.name = "stream".into();
    let cases: [(&str, Workload); 3] = [
        ("small", tiny(cfg.small_requests, 0)),
        ("200KB", large),
        ("stream", stream),
    ];
    let mut results = Vec::new();
    for (case, workload) in &cases {
        for (leg, url, proc_) in &legs {
            let load = Load::closed(cfg.concurrency, workload.len());
            results.push(measure_leg(cfg, case, leg, url, proc_.as_ref(), workload, &load).await?);
        }
    }
    // A rate every leg sustains with room: a fraction of the slowest leg's
    // closed-loop throughput on small requests.
    let slowest_small = results
        .iter()
        .filter(|l| l.case == "small")
        .map(|l| l.summary.req_per_s)
        .fold(f64::INFINITY, f64::min);
    if slowest_small.is_finite() && slowest_small > 0.0 {
        let rate = (slowest_small * cfg.paced_fraction).round().max(1.0);
        let paced = tiny(cfg.paced_requests, 3);
        let load = Load::poisson(rate, paced.len());
        for (leg, url, proc_) in &legs {
            results.push(measure_leg(cfg, "paced", leg, url, proc_.as_ref(), &paced, &load).await?);
        }
    }
    for (_, _, p) in legs {
        if let Some(p) = p {
            p.stop().await;
        }
    }
    engine.shutdown().await;
    Ok(OverheadReport {
        legs: results,
        skipped,
    })
}

async fn start_kvmesh(
    cfg: &OverheadConfig,
    bin: &std::path::Path,
    engine_port: u16,
    probe: &Client,
) -> Result<(String, String, Option<Proc>), LoadgenError> {
    let (listen, admin) = (free_port()?, free_port()?);
    let mut cmd = Command::new(bin);
    cmd.arg("run")
        .args(["--listen", &format!("127.0.0.1:{listen}")])
        .args(["--admin", &format!("127.0.0.1:{admin}")])
        .args(["--engine", &format!("http://127.0.0.1:{engine_port}")])
        // Per-request logging would measure the logger, not the proxy.
        .env("RUST_LOG", "warn");
    let mut p = Proc::spawn("kvmesh-proxy", cmd, &cfg.work_dir.join("kvmesh.log"))?;
    p.wait_ready(
        probe,
        &format!("http://127.0.0.1:{admin}/ready"),
        Duration::from_secs(30),
    )
    .await?;
    Ok((
        "kvmesh".into(),
        format!("http://127.0.0.1:{listen}"),
        Some(p),
    ))
}

async fn start_nginx(
    cfg: &OverheadConfig,
    bin: &std::path::Path,
    engine_port: u16,
    probe: &Client,
) -> Result<(String, String, Option<Proc>), LoadgenError> {
    let listen = free_port()?;
    let dir = &cfg.work_dir;
    let conf = dir.join("nginx.conf");
    let text = nginx_conf(dir, listen, engine_port, cfg.nginx_workers);
    std::fs::write(&conf, text).map_err(|source| LoadgenError::Io {
        path: conf.clone(),
        source,
    })?;
    let mut cmd = Command::new(bin);
    cmd.arg("-p").arg(dir).arg("-c").arg(&conf);
    cmd.arg("-e")
        .arg(dir.join("nginx-error.log"))
        .args(["-g", "daemon off;"]);
    let mut p = Proc::spawn("nginx", cmd, &dir.join("nginx.log"))?;
    p.wait_ready(
        probe,
        &format!("http://127.0.0.1:{listen}/v1/models"),
        Duration::from_secs(15),
    )
    .await?;
    Ok((
        "nginx".into(),
        format!("http://127.0.0.1:{listen}"),
        Some(p),
    ))
}

async fn measure_leg(
    cfg: &OverheadConfig,
    case: &str,
    leg: &str,
    url: &str,
    proc_: Option<&Proc>,
    workload: &Workload,
    load: &Load,
) -> Result<LegResult, LoadgenError> {
    let mut rc = RunConfig::new(&[url.to_string()], "fake")?;
    if cfg.warmup > 0 {
        run(&rc, workload, &Load::closed(cfg.concurrency, cfg.warmup)).await?;
    }
    rc.progress = cfg.progress;
    let before = proc_.map(Proc::cpu_seconds).transpose()?;
    let res = run(&rc, workload, load).await?;
    let after = proc_.map(Proc::cpu_seconds).transpose()?;
    let summary = res.summary();
    let cpu_us_per_req = match (before, after) {
        (Some(b), Some(a)) if summary.requests > 0 => Some((a - b) * 1e6 / summary.requests as f64),
        _ => None,
    };
    Ok(LegResult {
        case: case.to_string(),
        leg: leg.to_string(),
        summary,
        cpu_us_per_req,
    })
}

impl OverheadReport {
    fn get(&self, case: &str, leg: &str) -> Option<&LegResult> {
        self.legs.iter().find(|l| l.case == case && l.leg == leg)
    }

    /// The legs as a [`Report`] (one workload per case, one policy per leg;
    /// ratios against `direct`) for JSON and PNG output.
    pub fn to_report(&self) -> Report {
        let mut r = Report::new("direct");
        for l in &self.legs {
            r.add_summary(
                &format!("overhead-{}", l.case),
                &l.leg,
                l.summary.clone(),
                Vec::new(),
            );
        }
        r
    }

    /// The figures table and the ratios the targets are stated in.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<7} {:<7} {:>9} {:>8} {:>9} {:>9} {:>9} {:>10} {:>6}",
            "case", "leg", "req/s", "p50 ms", "p99 ms", "itl p99", "cpu us/r", "+p99 ms", "errors"
        );
        let opt = |v: Option<f64>, d: usize| v.map_or_else(|| "-".into(), |v| format!("{v:.d$}"));
        for l in &self.legs {
            let direct = self.get(&l.case, "direct");
            let added = match (
                l.summary.e2e_p99_ms,
                direct.and_then(|d| d.summary.e2e_p99_ms),
            ) {
                (Some(a), Some(b)) if l.leg != "direct" => Some(a - b),
                _ => None,
            };
            let _ = writeln!(
                out,
                "{:<7} {:<7} {:>9.0} {:>8} {:>9} {:>9} {:>9} {:>10} {:>6}",
                l.case,
                l.leg,
                l.summary.req_per_s,
                opt(l.summary.e2e_p50_ms, 3),
                opt(l.summary.e2e_p99_ms, 3),
                opt(l.summary.itl_p99_ms, 3),
                opt(l.cpu_us_per_req, 1),
                opt(added, 3),
                l.summary.errors
            );
        }
        for case in ["small", "200KB", "stream", "paced"] {
            let (Some(k), Some(n)) = (self.get(case, "kvmesh"), self.get(case, "nginx")) else {
                continue;
            };
            let paced = case == "paced";
            let tput = k.summary.req_per_s / n.summary.req_per_s.max(f64::MIN_POSITIVE);
            let cpu = match (k.cpu_us_per_req, n.cpu_us_per_req) {
                (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                _ => None,
            };
            let added = |l: &LegResult| match (
                l.summary.e2e_p99_ms,
                self.get(case, "direct")?.summary.e2e_p99_ms,
            ) {
                (Some(a), Some(b)) => Some(a - b),
                _ => None,
            };
            let throughput = if paced {
                format!("Poisson at {:.0} req/s on every leg", k.summary.req_per_s)
            } else {
                format!("kvmesh/nginx throughput {tput:.2}x (target >= 0.60x)")
            };
            let _ = writeln!(
                out,
                "{case}: {throughput}, CPU/request {}x (target <= 2x), \
                 added p99 kvmesh {} ms, nginx {} ms{}",
                opt(cpu, 2),
                opt(added(k), 3),
                opt(added(n), 3),
                if paced { " (target kvmesh < 1 ms)" } else { "" }
            );
        }
        for s in &self.skipped {
            let _ = writeln!(out, "skipped {s}");
        }
        out
    }
}
