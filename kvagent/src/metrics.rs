//! Prometheus metrics and the admin HTTP responder (`GET /metrics`, `GET /healthz`).
//!
//! The responder is a tiny HTTP/1.1 server: one request per connection, a 5 s deadline to read
//! the request head (at most 8 KiB), `Connection: close`. It is enough for a Prometheus scrape and
//! a kubelet probe and keeps hyper out of the agent.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::ErrorCode;
use crate::planner::Path;

/// Labels: the transfer path.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PathLabel {
    /// Path name.
    pub path: String,
}

/// Labels: a plan choice.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PlanLabel {
    /// Path name.
    pub path: String,
    /// Reason phrase.
    pub reason: String,
}

/// Labels: failure cause and direction.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailLabel {
    /// Error code.
    pub cause: String,
    /// `send` or `receive` or `local`.
    pub side: String,
}

/// Labels: why a transfer planned for RDMA went over TCP.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FallbackLabel {
    /// A fixed reason (`endpoint`, `peer_declined`, `bad_target`, `connect`, `write`).
    pub reason: String,
}

type HistFamily = Family<PathLabel, Histogram, fn() -> Histogram>;

/// The agent's metrics.
pub struct Metrics {
    registry: Registry,
    bytes: Family<PathLabel, Counter>,
    transfers: Family<PathLabel, Counter>,
    plans: Family<PlanLabel, Counter>,
    failures: Family<FailLabel, Counter>,
    latency: HistFamily,
    throughput: HistFamily,
    registered: Gauge,
    leases: Gauge,
    rdma_available: Gauge,
    rdma_fallbacks: Family<FallbackLabel, Counter>,
}

fn latency_hist() -> Histogram {
    Histogram::new(exponential_buckets(0.0001, 2.0, 20))
}

fn throughput_hist() -> Histogram {
    Histogram::new(exponential_buckets(1e6, 2.0, 16))
}

impl Metrics {
    /// Build and register every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kvagent");
        let bytes = Family::<PathLabel, Counter>::default();
        let transfers = Family::<PathLabel, Counter>::default();
        let plans = Family::<PlanLabel, Counter>::default();
        let failures = Family::<FailLabel, Counter>::default();
        let latency: HistFamily = Family::new_with_constructor(latency_hist);
        let throughput: HistFamily = Family::new_with_constructor(throughput_hist);
        let registered = Gauge::default();
        let leases = Gauge::default();
        let rdma_available = Gauge::default();
        let rdma_fallbacks: Family<FallbackLabel, Counter> = Family::default();
        registry.register(
            "rdma_available",
            "1 when this agent opened an RDMA device and announces RDMA",
            rdma_available.clone(),
        );
        registry.register(
            "rdma_fallbacks",
            "Transfers planned for RDMA that went over TCP, by reason",
            rdma_fallbacks.clone(),
        );
        registry.register(
            "transfer_bytes",
            "Bytes moved by completed transfers, by path",
            bytes.clone(),
        );
        registry.register(
            "transfers",
            "Completed transfers, by path",
            transfers.clone(),
        );
        registry.register(
            "plans",
            "Planner choices, by path and reason",
            plans.clone(),
        );
        registry.register(
            "failures",
            "Failed transfers and calls, by cause and side",
            failures.clone(),
        );
        registry.register(
            "transfer_latency_seconds",
            "Transfer latency, post to completion",
            latency.clone(),
        );
        registry.register(
            "transfer_throughput_bytes_per_second",
            "Per-transfer throughput",
            throughput.clone(),
        );
        registry.register(
            "registered_memory_bytes",
            "Bytes of registered regions",
            registered.clone(),
        );
        registry.register("leases", "Leases holding blocks", leases.clone());
        Self {
            registry,
            bytes,
            transfers,
            plans,
            failures,
            latency,
            throughput,
            registered,
            leases,
            rdma_available,
            rdma_fallbacks,
        }
    }

    /// Whether RDMA is up on this agent.
    pub fn set_rdma_available(&self, up: bool) {
        self.rdma_available.set(i64::from(up));
    }

    /// Count a transfer planned for RDMA that went over TCP.
    pub fn rdma_fallback(&self, reason: &str) {
        self.rdma_fallbacks
            .get_or_create(&FallbackLabel {
                reason: reason.into(),
            })
            .inc();
    }

    /// Count a planner choice.
    pub fn plan(&self, path: Path, reason: &str) {
        self.plans
            .get_or_create(&PlanLabel {
                path: path.as_str().into(),
                reason: reason.into(),
            })
            .inc();
    }

    /// Record a completed transfer.
    pub fn transfer_done(&self, path: Path, bytes: u64, elapsed: Duration) {
        let l = PathLabel {
            path: path.as_str().into(),
        };
        self.bytes.get_or_create(&l).inc_by(bytes);
        self.transfers.get_or_create(&l).inc();
        let secs = elapsed.as_secs_f64();
        self.latency.get_or_create(&l).observe(secs);
        if secs > 0.0 {
            self.throughput
                .get_or_create(&l)
                .observe(bytes as f64 / secs);
        }
    }

    /// Count a failure.
    pub fn failure(&self, cause: ErrorCode, side: &str) {
        self.failures
            .get_or_create(&FailLabel {
                cause: cause.as_str().into(),
                side: side.into(),
            })
            .inc();
    }

    /// Set the registered-memory and lease gauges.
    pub fn set_usage(&self, registered_bytes: u64, leases: usize) {
        self.registered
            .set(i64::try_from(registered_bytes).unwrap_or(i64::MAX));
        self.leases.set(i64::try_from(leases).unwrap_or(i64::MAX));
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Serve `/metrics` and `/healthz` until `stop`.
pub async fn serve_admin(
    listener: TcpListener,
    metrics: std::sync::Arc<Metrics>,
    stop: CancellationToken,
    tasks: TaskTracker,
) {
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        let Ok((mut sock, _)) = accepted else {
            continue;
        };
        let metrics = std::sync::Arc::clone(&metrics);
        tasks.spawn(async move {
            let mut head = Vec::with_capacity(1024);
            let mut buf = [0u8; 1024];
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
                    let n = sock.read(&mut buf).await?;
                    if n == 0 {
                        break;
                    }
                    head.extend_from_slice(&buf[..n]);
                }
                Ok::<_, std::io::Error>(())
            })
            .await;
            if !matches!(read, Ok(Ok(()))) {
                return;
            }
            let line = head.split(|b| *b == b'\r').next().unwrap_or_default();
            let line = String::from_utf8_lossy(line);
            let (status, ctype, body) = match line.split_whitespace().take(2).collect::<Vec<_>>()[..] {
                ["GET", "/metrics"] => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", metrics.render()),
                ["GET", "/healthz"] => ("200 OK", "text/plain", "ok\n".to_string()),
                _ => ("404 Not Found", "text/plain", "not found\n".to_string()),
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = tokio::time::timeout(Duration::from_secs(5), sock.write_all(resp.as_bytes())).await;
        });
    }
}
