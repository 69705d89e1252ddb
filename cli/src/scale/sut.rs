//! The sidecar under test: a real `kvmesh-proxy` process (its own CPU and
//! resident memory are what `kvmesh bench scale` reports), in front of a
//! fake engine, on the mesh or on Valkey; and the admin-port reads the
//! benchmark makes of it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use kvmesh_loadgen::client::{Client, ClientConfig};
use kvmesh_loadgen::overhead::procs::{cpu_of, free_port, Proc};
use serde_json::Value;

use super::emulate::MODEL;

/// Where the sidecar under test finds the fleet.
#[derive(Debug, Clone)]
pub enum Backend {
    /// Follows every address in the peers file.
    Mesh { peers_file: PathBuf },
    /// Uses the Valkey at these URLs.
    Valkey { urls: Vec<String> },
}

/// A running sidecar under test.
pub struct Sut {
    proc: Proc,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    http: HyperClient<HttpConnector, Full<Bytes>>,
}

/// The `kvmesh-proxy` binary: `--proxy`, else beside this binary, else on
/// PATH.
pub fn proxy_binary(given: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = given {
        return Ok(p.to_path_buf());
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("kvmesh-proxy")))
        .filter(|p| p.is_file());
    beside
        .or_else(|| kvmesh_loadgen::overhead::procs::find_binary(None, "kvmesh-proxy", &[]))
        .ok_or_else(|| {
            anyhow!(
                "no kvmesh-proxy binary beside this one or on PATH: build it with \
                 `cargo build --release -p kvmesh-proxy` (./scripts/bench-scale does), or pass --proxy"
            )
        })
}

impl Sut {
    /// Starts `binary` in front of `engine_url` with `backend`, on CPU `cpu`
    /// (`None`: any); waits until its admin port answers.
    pub async fn start(
        binary: &Path,
        work: &Path,
        name: &str,
        engine_url: &str,
        backend: &Backend,
        cpu: Option<usize>,
    ) -> Result<Sut> {
        let port = free_port()?;
        let admin_port = free_port()?;
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let admin: SocketAddr = format!("127.0.0.1:{admin_port}").parse()?;
        let index = match backend {
            Backend::Mesh { peers_file } => format!(
                "mesh:\n  listen: 127.0.0.1:0\n  file: {}\n  refresh_interval: 1s\n",
                peers_file.display()
            ),
            Backend::Valkey { urls } => format!(
                "index:\n  backend: valkey\n  valkey:\n    urls: [{}]\n",
                urls.iter()
                    .map(|u| format!("\"{u}\""))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let yaml = format!(
            "listeners:\n  client: {addr}\n  admin: {admin}\nengine:\n  url: {engine_url}\n\
             pod:\n  models: [{MODEL}]\nprefix:\n  tokenizer: builtin\nlogging:\n  level: warn\n{index}"
        );
        let config = work.join(format!("{name}.yaml"));
        std::fs::write(&config, yaml).with_context(|| config.display().to_string())?;
        let mut cmd = tokio::process::Command::new(binary);
        cmd.arg("run").arg("--config").arg(&config);
        let mut proc = Proc::spawn("kvmesh-proxy", cmd, &work.join(format!("{name}.log")))?;
        if let Some(c) = cpu {
            super::pin(proc.pid(), c);
        }
        let client = Client::new(ClientConfig::default());
        proc.wait_ready(
            &client,
            &format!("http://{admin}/health"),
            Duration::from_secs(20),
        )
        .await?;
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        let http = HyperClient::builder(TokioExecutor::new()).build(conn);
        Ok(Sut {
            proc,
            addr,
            admin,
            http,
        })
    }

    /// CPU seconds the process has used.
    pub fn cpu_seconds(&self) -> Result<f64> {
        Ok(cpu_of(self.proc.pid())?)
    }

    /// Resident memory, MB.
    pub fn rss_mb(&self) -> Result<f64> {
        let bytes = kvmesh_loadgen::valkey::rss_bytes(self.proc.pid())?;
        Ok(bytes as f64 / 1e6)
    }

    /// GET or POST on the admin port; the body as JSON.
    pub async fn admin_json(&self, path: &str, body: Option<String>) -> Result<Value> {
        let uri: http::Uri = format!("http://{}{path}", self.admin).parse()?;
        let req = match body {
            Some(b) => http::Request::post(uri)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(b)))?,
            None => http::Request::get(uri).body(Full::new(Bytes::new()))?,
        };
        let resp = tokio::time::timeout(Duration::from_secs(5), self.http.request(req))
            .await
            .context("admin port timed out")??;
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok(serde_json::from_slice(&bytes)?)
    }

    /// The Prometheus text of `/metrics`.
    pub async fn metrics(&self) -> Result<String> {
        let uri: http::Uri = format!("http://{}/metrics", self.admin).parse()?;
        let req = http::Request::get(uri).body(Full::new(Bytes::new()))?;
        let resp = tokio::time::timeout(Duration::from_secs(5), self.http.request(req))
            .await
            .context("admin port timed out")??;
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    pub async fn stop(self) {
        self.proc.stop().await;
    }
}

/// The cumulative buckets of histogram `name` (`le` upper bound, count).
pub fn buckets(metrics: &str, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{le=\"");
    let mut out = Vec::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix(&prefix) else {
            continue;
        };
        let Some((le, value)) = rest.split_once("\"} ") else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().unwrap_or(f64::NAN)
        };
        if let Ok(v) = value.trim().parse::<f64>() {
            out.push((le, v));
        }
    }
    out
}

/// Quantile `q` of the observations between two readings of the same
/// cumulative histogram, interpolated linearly inside its bucket.
pub fn quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> Option<f64> {
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|&(le, n)| {
            let was = before.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1);
            (le, n - was)
        })
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let want = q * total;
    let mut lower = (0.0, 0.0);
    for &(le, n) in &delta {
        if n >= want {
            if !le.is_finite() {
                return Some(lower.0);
            }
            let span = n - lower.1;
            let f = if span > 0.0 {
                (want - lower.1) / span
            } else {
                1.0
            };
            return Some(lower.0 + f * (le - lower.0));
        }
        lower = (le, n);
    }
    None
}

/// The value of an unlabelled or exactly-labelled series.
pub fn series(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        let (s, v) = l.rsplit_once(' ')?;
        (s == name).then(|| v.parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quantile_is_read_off_the_bucket_deltas() {
        let name = "x_seconds";
        let before = buckets("x_seconds_bucket{le=\"0.001\"} 10\nx_seconds_bucket{le=\"0.002\"} 10\nx_seconds_bucket{le=\"+Inf\"} 10\n", name);
        let after = buckets("x_seconds_bucket{le=\"0.001\"} 60\nx_seconds_bucket{le=\"0.002\"} 110\nx_seconds_bucket{le=\"+Inf\"} 110\n", name);
        // 100 new observations: 50 at or under 1 ms, 50 in (1, 2] ms.
        let p50 = quantile(&before, &after, 0.5).unwrap();
        assert!((p50 - 0.001).abs() < 1e-9, "{p50}");
        let p99 = quantile(&before, &after, 0.99).unwrap();
        assert!((p99 - 0.00198).abs() < 1e-6, "{p99}");
        assert_eq!(quantile(&after, &after, 0.5), None);
        assert_eq!(series("a 1\nb{c=\"d\"} 2.5\n", "b{c=\"d\"}"), Some(2.5));
    }
}
