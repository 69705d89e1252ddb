//! The simulator as a child process, for tests whose engines must not share a
//! process (P/D across processes, one engine per container): started on a
//! port from the OS, ready once it answers with its own engine id, killed
//! when dropped.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvmesh_engine_sim::SimError> {
//! use std::path::Path;
//! use std::time::Duration;
//! use kvmesh_engine_sim::SimProcess;
//! let bin = Path::new("target/debug/kvmesh-engine-sim");
//! let sim = SimProcess::spawn(bin, &["--model", "tiny", "--role", "prefill"], Duration::from_secs(20)).await?;
//! println!("serving on {}", sim.base_url());
//! sim.shutdown().await;
//! # Ok(()) }
//! ```

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::pd::client;
use crate::SimError;

/// Tries at starting a child, each on a fresh port (another process may take
/// a port between the OS giving it out and the child binding it).
const ATTEMPTS: usize = 3;

/// How often readiness is probed.
const PROBE_EVERY: Duration = Duration::from_millis(20);

/// A running `kvmesh-engine-sim` child process.
#[derive(Debug)]
pub struct SimProcess {
    child: Child,
    addr: SocketAddr,
    engine_id: String,
}

impl SimProcess {
    /// Starts `bin` with `args` plus `--listen 127.0.0.1:PORT` (a port from
    /// the OS) and, unless `args` has one, a fresh `--engine-id`; returns once
    /// `GET /sim/stats` on that port answers with that engine id, so the
    /// engine reached is this child. At most `ready_within`, all attempts
    /// together.
    pub async fn spawn(
        bin: &Path,
        args: &[&str],
        ready_within: Duration,
    ) -> Result<Self, SimError> {
        let deadline = Instant::now() + ready_within;
        let mut last = SimError::Process("no attempt made".to_string());
        for _ in 0..ATTEMPTS {
            match Self::try_spawn(bin, args, deadline).await {
                Ok(p) => return Ok(p),
                Err(e) => last = e,
            }
            if Instant::now() >= deadline {
                break;
            }
        }
        Err(last)
    }

    async fn try_spawn(bin: &Path, args: &[&str], deadline: Instant) -> Result<Self, SimError> {
        let port = free_port()?;
        let given_id = args
            .iter()
            .position(|a| *a == "--engine-id")
            .and_then(|i| args.get(i + 1));
        let engine_id =
            given_id.map_or_else(|| uuid::Uuid::new_v4().to_string(), |s| s.to_string());
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        if given_id.is_none() {
            cmd.args(["--engine-id", &engine_id]);
        }
        let child = cmd
            .spawn()
            .map_err(|e| SimError::Process(format!("starting {}: {e}", bin.display())))?;
        let mut p = Self {
            child,
            addr: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
            engine_id,
        };
        p.wait_ready(deadline).await?;
        Ok(p)
    }

    async fn wait_ready(&mut self, deadline: Instant) -> Result<(), SimError> {
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(SimError::Process(format!(
                    "the simulator on port {} exited before it was ready: {status}",
                    self.addr.port()
                )));
            }
            let probe = Instant::now() + Duration::from_secs(1);
            let host = self.addr.ip().to_string();
            let reply =
                client::get_json(&host, self.addr.port(), "/sim/stats", probe.min(deadline)).await;
            if let Ok((200, v)) = reply {
                if v.get("engine_id").and_then(Value::as_str) == Some(self.engine_id.as_str()) {
                    return Ok(());
                }
            }
            if Instant::now() + PROBE_EVERY >= deadline {
                return Err(SimError::Process(format!(
                    "the simulator on port {} was not ready in time",
                    self.addr.port()
                )));
            }
            tokio::time::sleep(PROBE_EVERY).await;
        }
    }

    /// The HTTP address the child serves on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The child's NixlConnector engine id (`remote_engine_id`).
    pub fn engine_id(&self) -> &str {
        &self.engine_id
    }

    /// Kills the child and waits for it to exit.
    pub async fn shutdown(mut self) {
        let _ = self.child.kill().await;
    }
}

/// A port the OS had free a moment ago.
fn free_port() -> Result<u16, SimError> {
    let l = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(SimError::Io)?;
    Ok(l.local_addr().map_err(SimError::Io)?.port())
}
