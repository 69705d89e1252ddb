//! SMG (Shepherd Model Gateway, the Rust router that grew out of SGLang's
//! sgl-router), run as users run it: one central process in front of the
//! engines, `smg launch --policy POLICY --worker-urls URL...`, or in P/D
//! mode `smg launch --pd-disaggregation --prefill URL BOOTSTRAP_PORT ...
//! --decode URL ...` in front of SGLang engines.
//!
//! The binary is found at `$KVMESH_SMG`, then in the venv `scripts/setup-smg`
//! makes under `~/.cache/kvmesh/smg-venv`, then on `PATH`. Nothing here
//! installs it: a bench that cannot find it reports why and runs the rest.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as Hyper;
use hyper_util::rt::TokioExecutor;
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// Longest wait for SMG to answer a completion through every worker.
const READY_DEADLINE: Duration = Duration::from_secs(60);

/// The command that installs SMG for the bench.
pub const SETUP: &str = "./scripts/setup-smg";

/// Where SMG's `smg` executable is, or why it is not there.
pub fn find() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("KVMESH_SMG") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("KVMESH_SMG={} is not a file", p.display()))
        };
    }
    let cache = std::env::var_os("KVMESH_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/kvmesh")));
    if let Some(c) = cache {
        let p = c.join("smg-venv/bin/smg");
        if p.is_file() {
            return Ok(p);
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("smg");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    Err(format!(
        "smg 1.13 is not installed (run {SETUP}, or set KVMESH_SMG)"
    ))
}

/// A running SMG router; killed when dropped.
#[derive(Debug)]
pub struct Smg {
    child: Child,
    /// The router's base URL, where clients send requests.
    pub url: String,
    log: PathBuf,
}

impl Smg {
    /// Starts `smg launch` with `policy` (`cache_aware`, `round_robin`) in
    /// front of `workers` on free loopback ports, and waits until a
    /// completion for `model` goes through.
    pub async fn start(
        bin: &Path,
        policy: &str,
        workers: &[String],
        model: &str,
    ) -> Result<Smg, String> {
        let mut args = vec![
            "--policy".to_owned(),
            policy.to_owned(),
            "--worker-urls".to_owned(),
        ];
        args.extend(workers.iter().cloned());
        Smg::launch(bin, &args, workers.len(), model).await
    }

    /// Starts SMG's P/D mode (`--pd-disaggregation --prefill URL
    /// BOOTSTRAP_PORT ... --decode URL ...`) with `policy` for both pools, in
    /// front of SGLang engines: `prefill` are (URL, bootstrap port) pairs.
    pub async fn start_pd(
        bin: &Path,
        policy: &str,
        prefill: &[(String, u16)],
        decode: &[String],
        model: &str,
    ) -> Result<Smg, String> {
        let mut args = vec![
            "--pd-disaggregation".to_owned(),
            "--policy".to_owned(),
            policy.to_owned(),
        ];
        for (url, port) in prefill {
            args.extend(["--prefill".to_owned(), url.clone(), port.to_string()]);
        }
        for url in decode {
            args.extend(["--decode".to_owned(), url.clone()]);
        }
        Smg::launch(bin, &args, prefill.len() + decode.len(), model).await
    }

    /// `smg launch ARGS` on free loopback ports; ready once it has
    /// registered `workers` workers and routed a completion.
    async fn launch(
        bin: &Path,
        args: &[String],
        workers: usize,
        model: &str,
    ) -> Result<Smg, String> {
        let port = free_port()?;
        let metrics = free_port()?;
        let log =
            std::env::temp_dir().join(format!("kvmesh-smg-{}-{port}.log", std::process::id()));
        let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(bin);
        cmd.arg("launch")
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(args)
            .args(["--prometheus-port", &metrics.to_string()])
            .args(["--prometheus-host", "127.0.0.1"])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true);
        let child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
        let mut smg = Smg {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
        };
        if let Err(why) = smg.wait_ready(model, workers).await {
            smg.stop().await;
            return Err(why);
        }
        Ok(smg)
    }

    /// Waits until SMG has registered every worker (its `/readiness` counts
    /// only those registered so far, so the count is checked) and routes a
    /// completion.
    async fn wait_ready(&mut self, model: &str, workers: usize) -> Result<(), String> {
        let deadline = Instant::now() + READY_DEADLINE;
        let body = serde_json::json!({"model": model, "prompt": "ready", "max_tokens": 1});
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("smg exited with {status}: {}", self.tail()));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "smg did not route a request within {}s: {}",
                    READY_DEADLINE.as_secs(),
                    self.tail()
                ));
            }
            let registered = get_json(&format!("{}/readiness", self.url))
                .await
                .and_then(|v| {
                    let n = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
                    Some((n("healthy_workers")?, n("total_workers")?))
                });
            if registered == Some((workers as u64, workers as u64))
                && post_status(&format!("{}/v1/completions", self.url), &body).await == Some(200)
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The last lines of SMG's log, for error messages.
    fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().rev().take(3).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }

    /// Kills the router and removes its log.
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A free loopback port (bound, then released for the child to take).
fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

/// GETs a JSON document, within 5 s.
async fn get_json(url: &str) -> Option<serde_json::Value> {
    use http_body_util::BodyExt;
    let client: Hyper<HttpConnector, Full<Bytes>> =
        Hyper::builder(TokioExecutor::new()).build_http();
    let req = http::Request::get(url).body(Full::new(Bytes::new())).ok()?;
    let fetch = async {
        let r = client.request(req).await.ok()?;
        let body = r.into_body().collect().await.ok()?.to_bytes();
        serde_json::from_slice(&body).ok()
    };
    tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .ok()?
}

/// POSTs a JSON body and returns the status, within 5 s.
async fn post_status(url: &str, body: &serde_json::Value) -> Option<u16> {
    let client: Hyper<HttpConnector, Full<Bytes>> =
        Hyper::builder(TokioExecutor::new()).build_http();
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .ok()?;
    match tokio::time::timeout(Duration::from_secs(5), client.request(req)).await {
        Ok(Ok(r)) => Some(r.status().as_u16()),
        _ => None,
    }
}
