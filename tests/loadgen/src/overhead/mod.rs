//! Proxy overhead (issue 2's measurement): in one run, the fast fake engine
//! reached directly, through kvmesh (the `kvmesh-proxy` binary; a second
//! kvmesh leg, `kvmesh+otel`, has OTLP tracing configured at `sample_ratio:
//! 0`) and through nginx as a plain reverse proxy, for small non-streaming completions, for
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
//! Each case runs in several rounds, the legs taking turns within a round
//! (the order rotates from round to round), and every figure is the median
//! over rounds. On a shared machine a slow stretch then lands on one round
//! of one leg, not on a whole leg; the added p99 of a leg is taken within
//! each round (against that round's direct leg) before the median.
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
    /// nginx worker processes: one per core, as Debian's packaged nginx.conf
    /// (`worker_processes auto`). kvmesh runs as configured by default (one
    /// serving thread, `runtime.worker_threads`).
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
    /// Rounds each case's requests are split over (see the module docs).
    pub rounds: usize,
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
            small_requests: 60_000 / k,
            large_requests: 6_000 / k,
            large_bytes: 200_000,
            stream_requests: 5_000 / k,
            stream_chunks: 16,
            chunk_gap: Duration::from_millis(2),
            warmup: 500 / k,
            paced_requests: 10_000 / k,
            paced_fraction: 0.25,
            rounds: if quick { 1 } else { 3 },
            work_dir,
            progress: false,
        }
    }
}

/// One round of one leg (direct, kvmesh, nginx) on one case (small, 200KB,
/// stream, paced).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LegResult {
    pub case: String,
    pub leg: String,
    pub round: usize,
    pub summary: Summary,
    /// CPU time of the proxy process(es) per request, µs (`None` direct).
    pub cpu_us_per_req: Option<f64>,
}

/// One leg on one case: the median of each figure over its rounds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LegFigures {
    pub case: String,
    pub leg: String,
    pub rounds: usize,
    pub req_per_s: f64,
    pub e2e_p50_ms: Option<f64>,
    pub e2e_p99_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
    pub cpu_us_per_req: Option<f64>,
    /// This leg's p99 minus the direct leg's p99 of the same round, median
    /// over rounds, and its smallest and largest round (`None` for direct).
    pub added_p99_ms: Option<f64>,
    pub added_p99_range_ms: Option<(f64, f64)>,
    /// The same for the inter-token latency p99 (streams).
    pub added_itl_p99_ms: Option<f64>,
    /// Failed requests over all rounds.
    pub errors: u64,
}

/// Every round of every leg, the per-leg medians, and the legs that could
/// not run and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OverheadReport {
    pub rounds: Vec<LegResult>,
    pub legs: Vec<LegFigures>,
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
        Some(bin) => {
            let port = engine.addr().port();
            legs.push(start_kvmesh(cfg, &bin, port, &probe, Tracing::Off).await?);
            legs.push(start_kvmesh(cfg, &bin, port, &probe, Tracing::Unsampled).await?);
        }
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
        let closed = |part: &Workload| Load::closed(cfg.concurrency, part.len());
        results.extend(measure_case(cfg, case, &legs, workload, closed).await?);
    }
    // A rate every leg sustains with room: a fraction of the slowest leg's
    // closed-loop throughput on small requests.
    let slowest_small = figures(&results)
        .iter()
        .filter(|l| l.case == "small")
        .map(|l| l.req_per_s)
        .fold(f64::INFINITY, f64::min);
    if slowest_small.is_finite() && slowest_small > 0.0 {
        let rate = (slowest_small * cfg.paced_fraction).round().max(1.0);
        let paced = tiny(cfg.paced_requests, 3);
        let poisson = |part: &Workload| Load::poisson(rate, part.len());
        results.extend(measure_case(cfg, "paced", &legs, &paced, poisson).await?);
    }
    for (_, _, p) in legs {
        if let Some(p) = p {
            p.stop().await;
        }
    }
    engine.shutdown().await;
    Ok(OverheadReport {
        legs: figures(&results),
        rounds: results,
        skipped,
    })
}

/// One case on every leg: the workload split over `cfg.rounds` rounds, the
/// legs taking turns in each, in an order that rotates from round to round.
async fn measure_case(
    cfg: &OverheadConfig,
    case: &str,
    legs: &[(String, String, Option<Proc>)],
    workload: &Workload,
    load: impl Fn(&Workload) -> Load,
) -> Result<Vec<LegResult>, LoadgenError> {
    let parts = split(workload, cfg.rounds);
    let mut out = Vec::new();
    for (round, part) in parts.iter().enumerate() {
        for i in 0..legs.len() {
            let leg = &legs[(i + round) % legs.len()];
            out.push(measure_leg(cfg, case, leg, round, part, &load(part)).await?);
        }
    }
    Ok(out)
}

/// `w` in `rounds` parts whose sizes differ by at most one, in order (fewer
/// parts only when there are fewer requests than rounds).
fn split(w: &Workload, rounds: usize) -> Vec<Workload> {
    let n = w.requests.len();
    let rounds = rounds.clamp(1, n.max(1));
    (0..rounds)
        .map(|i| Workload {
            requests: w.requests[i * n / rounds..(i + 1) * n / rounds].to_vec(),
            ..w.clone()
        })
        .collect()
}

/// The median of each figure over the rounds of each (case, leg), in the
/// order the legs first appear.
pub fn figures(results: &[LegResult]) -> Vec<LegFigures> {
    let mut keys: Vec<(&str, &str)> = Vec::new();
    for r in results {
        if !keys.contains(&(r.case.as_str(), r.leg.as_str())) {
            keys.push((&r.case, &r.leg));
        }
    }
    let rounds_of = |case: &str, leg: &str| -> Vec<&LegResult> {
        results
            .iter()
            .filter(|r| r.case == case && r.leg == leg)
            .collect()
    };
    keys.into_iter()
        .map(|(case, leg)| {
            let mine = rounds_of(case, leg);
            let direct = rounds_of(case, "direct");
            let of = |f: fn(&LegResult) -> Option<f64>| median(mine.iter().filter_map(|r| f(r)));
            // Per round: this leg's figure minus the same round's direct one.
            let added = |f: fn(&Summary) -> Option<f64>| -> Vec<f64> {
                if leg == "direct" {
                    return Vec::new();
                }
                mine.iter()
                    .filter_map(|r| {
                        let d = direct.iter().find(|d| d.round == r.round)?;
                        Some(f(&r.summary)? - f(&d.summary)?)
                    })
                    .collect()
            };
            let added_p99 = added(|s| s.e2e_p99_ms);
            let range = added_p99.iter().fold(None, |acc: Option<(f64, f64)>, &v| {
                Some(acc.map_or((v, v), |(lo, hi)| (lo.min(v), hi.max(v))))
            });
            LegFigures {
                case: case.to_string(),
                leg: leg.to_string(),
                rounds: mine.len(),
                req_per_s: of(|r| Some(r.summary.req_per_s)).unwrap_or(0.0),
                e2e_p50_ms: of(|r| r.summary.e2e_p50_ms),
                e2e_p99_ms: of(|r| r.summary.e2e_p99_ms),
                itl_p99_ms: of(|r| r.summary.itl_p99_ms),
                cpu_us_per_req: of(|r| r.cpu_us_per_req),
                added_p99_ms: median(added_p99.iter().copied()),
                added_p99_range_ms: range,
                added_itl_p99_ms: median(added(|s| s.itl_p99_ms).into_iter()),
                errors: mine.iter().map(|r| r.summary.errors).sum(),
            }
        })
        .collect()
}

/// The median (the mean of the middle two for an even count); `None` when empty.
fn median(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.filter(|x| !x.is_nan()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => v.get(n / 2).copied(),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// The kvmesh legs: `kvmesh` as deployed by default (no `tracing` section),
/// and `kvmesh+otel` with OTLP tracing configured at `sample_ratio: 0`, so
/// every request (none carries a `traceparent`) gets its unsampled spans and
/// a `traceparent` of its own, and nothing is exported: what configuring
/// tracing costs a request that is not sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tracing {
    Off,
    Unsampled,
}

/// The leg name of the kvmesh run with tracing configured at ratio 0.
pub const KVMESH_OTEL: &str = "kvmesh+otel";

async fn start_kvmesh(
    cfg: &OverheadConfig,
    bin: &std::path::Path,
    engine_port: u16,
    probe: &Client,
    tracing: Tracing,
) -> Result<(String, String, Option<Proc>), LoadgenError> {
    let (listen, admin) = (free_port()?, free_port()?);
    let mut cmd = Command::new(bin);
    cmd.arg("run");
    let (name, log) = match tracing {
        Tracing::Off => ("kvmesh", "kvmesh.log"),
        Tracing::Unsampled => {
            // A collector address nothing listens on: at ratio 0 no span
            // is ever exported to it.
            let file = cfg.work_dir.join("kvmesh-otel.yaml");
            let text = format!(
                "tracing:\n  otlp_endpoint: http://127.0.0.1:{}\n  protocol: grpc\n  sample_ratio: 0.0\n",
                free_port()?
            );
            std::fs::write(&file, text).map_err(|source| LoadgenError::Io {
                path: file.clone(),
                source,
            })?;
            cmd.arg("--config").arg(&file);
            (KVMESH_OTEL, "kvmesh-otel.log")
        }
    };
    cmd.args(["--listen", &format!("127.0.0.1:{listen}")])
        .args(["--admin", &format!("127.0.0.1:{admin}")])
        .args(["--engine", &format!("http://127.0.0.1:{engine_port}")])
        // Per-request logging would measure the logger, not the proxy.
        .env("RUST_LOG", "warn");
    let mut p = Proc::spawn("kvmesh-proxy", cmd, &cfg.work_dir.join(log))?;
    p.wait_ready(
        probe,
        &format!("http://127.0.0.1:{admin}/ready"),
        Duration::from_secs(30),
    )
    .await?;
    Ok((name.into(), format!("http://127.0.0.1:{listen}"), Some(p)))
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

/// One round of one leg; the warm-up runs before a leg's first round only.
async fn measure_leg(
    cfg: &OverheadConfig,
    case: &str,
    (leg, url, proc_): &(String, String, Option<Proc>),
    round: usize,
    workload: &Workload,
    load: &Load,
) -> Result<LegResult, LoadgenError> {
    let proc_ = proc_.as_ref();
    let mut rc = RunConfig::new(&[url.to_string()], "fake")?;
    if round == 0 && cfg.warmup > 0 {
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
        round,
        summary,
        cpu_us_per_req,
    })
}

impl OverheadReport {
    fn get(&self, case: &str, leg: &str) -> Option<&LegFigures> {
        self.legs.iter().find(|l| l.case == case && l.leg == leg)
    }

    /// The legs as a [`Report`] (one workload per case, one policy per leg;
    /// ratios against `direct`) for JSON and PNG output. Each leg shows its
    /// round closest to the leg's median throughput.
    pub fn to_report(&self) -> Report {
        let mut r = Report::new("direct");
        for l in &self.legs {
            let typical = self
                .rounds
                .iter()
                .filter(|x| x.case == l.case && x.leg == l.leg)
                .min_by(|a, b| {
                    let off = |x: &LegResult| (x.summary.req_per_s - l.req_per_s).abs();
                    off(a).total_cmp(&off(b))
                });
            if let Some(x) = typical {
                let name = format!("overhead-{}", l.case);
                r.add_summary(&name, &l.leg, x.summary.clone(), Vec::new());
            }
        }
        r
    }

    /// The figures table (medians over rounds) and the ratios the targets
    /// are stated in.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let rounds = self.legs.iter().map(|l| l.rounds).max().unwrap_or(0);
        let _ = writeln!(out, "median of {rounds} round(s) per leg");
        let _ = writeln!(
            out,
            "{:<7} {:<11} {:>9} {:>8} {:>9} {:>9} {:>9} {:>10} {:>17} {:>6}",
            "case",
            "leg",
            "req/s",
            "p50 ms",
            "p99 ms",
            "itl p99",
            "cpu us/r",
            "+p99 ms",
            "+p99 range",
            "errors"
        );
        let opt = |v: Option<f64>, d: usize| v.map_or_else(|| "-".into(), |v| format!("{v:.d$}"));
        for l in &self.legs {
            let range = l
                .added_p99_range_ms
                .map_or_else(|| "-".into(), |(lo, hi)| format!("{lo:.3}..{hi:.3}"));
            let _ = writeln!(
                out,
                "{:<7} {:<11} {:>9.0} {:>8} {:>9} {:>9} {:>9} {:>10} {:>17} {:>6}",
                l.case,
                l.leg,
                l.req_per_s,
                opt(l.e2e_p50_ms, 3),
                opt(l.e2e_p99_ms, 3),
                opt(l.itl_p99_ms, 3),
                opt(l.cpu_us_per_req, 1),
                opt(l.added_p99_ms, 3),
                range,
                l.errors
            );
        }
        for case in ["small", "200KB", "stream", "paced"] {
            let (Some(k), Some(n)) = (self.get(case, "kvmesh"), self.get(case, "nginx")) else {
                continue;
            };
            let paced = case == "paced";
            let tput = k.req_per_s / n.req_per_s.max(f64::MIN_POSITIVE);
            let cpu = match (k.cpu_us_per_req, n.cpu_us_per_req) {
                (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                _ => None,
            };
            let throughput = if paced {
                format!("Poisson at {:.0} req/s on every leg", k.req_per_s)
            } else {
                format!("kvmesh/nginx throughput {tput:.2}x (target >= 0.60x)")
            };
            let _ = writeln!(
                out,
                "{case}: {throughput}, CPU/request {}x (target <= 1.5x, issue 20), \
                 added p99 kvmesh {} ms, nginx {} ms{}",
                opt(cpu, 2),
                opt(k.added_p99_ms, 3),
                opt(n.added_p99_ms, 3),
                if paced { " (target kvmesh < 1 ms)" } else { "" }
            );
        }
        for case in ["small", "200KB", "stream", "paced"] {
            let (Some(k), Some(t)) = (self.get(case, "kvmesh"), self.get(case, KVMESH_OTEL)) else {
                continue;
            };
            let cpu = match (t.cpu_us_per_req, k.cpu_us_per_req) {
                (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                _ => None,
            };
            let _ = writeln!(
                out,
                "{case}: tracing configured at sample_ratio 0 vs off: throughput {:.2}x, \
                 CPU/request {}x, added p99 {} ms vs {} ms",
                t.req_per_s / k.req_per_s.max(f64::MIN_POSITIVE),
                opt(cpu, 2),
                opt(t.added_p99_ms, 3),
                opt(k.added_p99_ms, 3),
            );
        }
        for s in &self.skipped {
            let _ = writeln!(out, "skipped {s}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(
        case: &str,
        leg: &str,
        round: usize,
        rps: f64,
        p99: f64,
        cpu: Option<f64>,
    ) -> LegResult {
        LegResult {
            case: case.into(),
            leg: leg.into(),
            round,
            summary: Summary {
                req_per_s: rps,
                e2e_p99_ms: Some(p99),
                ..Summary::default()
            },
            cpu_us_per_req: cpu,
        }
    }

    #[test]
    fn figures_are_medians_over_rounds_and_added_p99_is_taken_per_round() {
        let results = vec![
            round("small", "direct", 0, 100.0, 1.0, None),
            round("small", "kvmesh", 0, 50.0, 1.5, Some(80.0)),
            round("small", "direct", 1, 90.0, 4.0, None),
            round("small", "kvmesh", 1, 70.0, 4.2, Some(90.0)),
            // A slow stretch that hit only kvmesh's third round.
            round("small", "kvmesh", 2, 10.0, 20.0, Some(300.0)),
            round("small", "direct", 2, 95.0, 2.0, None),
        ];
        let f = figures(&results);
        assert_eq!(f.len(), 2);
        let (d, k) = (&f[0], &f[1]);
        assert_eq!((d.leg.as_str(), d.rounds, d.req_per_s), ("direct", 3, 95.0));
        assert_eq!((d.added_p99_ms, d.cpu_us_per_req), (None, None));
        assert_eq!(
            (k.leg.as_str(), k.req_per_s, k.cpu_us_per_req),
            ("kvmesh", 50.0, Some(90.0))
        );
        assert_eq!(k.e2e_p99_ms, Some(4.2));
        // Per round: 0.5, 0.2, 18.0; the median is 0.5, not 4.2 - 2.0.
        let added = k.added_p99_ms.unwrap_or(f64::NAN);
        assert!((added - 0.5).abs() < 1e-9, "{added}");
        let (lo, hi) = k.added_p99_range_ms.unwrap_or((f64::NAN, f64::NAN));
        assert!(
            (lo - 0.2).abs() < 1e-9 && (hi - 18.0).abs() < 1e-9,
            "{lo} {hi}"
        );
    }

    #[test]
    fn an_even_number_of_rounds_takes_the_mean_of_the_middle_two() {
        assert_eq!(median([4.0, 1.0, 3.0, 2.0].into_iter()), Some(2.5));
        assert_eq!(median(std::iter::empty()), None);
        assert_eq!(median([f64::NAN, 7.0].into_iter()), Some(7.0));
    }

    #[test]
    fn a_workload_splits_into_rounds_that_keep_every_request_in_order() {
        let w = tiny(10, 0);
        let parts = split(&w, 3);
        assert_eq!(
            parts.iter().map(Workload::len).collect::<Vec<_>>(),
            [3, 3, 4]
        );
        let nine = split(&tiny(9, 0), 4);
        assert_eq!(
            nine.iter().map(Workload::len).collect::<Vec<_>>(),
            [2, 2, 2, 3]
        );
        let again: Vec<_> = parts.iter().flat_map(|p| p.requests.iter()).collect();
        assert!(again.iter().zip(&w.requests).all(|(a, b)| a.user == b.user));
        assert_eq!(split(&w, 1).len(), 1);
        assert_eq!(split(&w, 0).len(), 1);
    }
}
