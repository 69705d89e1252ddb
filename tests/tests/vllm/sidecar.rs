//! A kvmesh sidecar in front of a real engine, started in-process from the `kvmesh_proxy` library
//! exactly as the binary starts it: from `proxy.yaml` text, on listeners bound to port 0.

use anyhow::{Context, Result};
use kvmesh_proxy::{Sidecar, SidecarHandle};
use tokio::net::TcpListener;

/// A running sidecar; call [`SidecarUnderTest::shutdown`] at the end of the group (dropping the
/// runtime also stops it).
#[derive(Debug)]
pub struct SidecarUnderTest {
    /// `http://127.0.0.1:PORT`, the OpenAI port clients use.
    pub url: String,
    /// `http://127.0.0.1:PORT`, the admin port (`/metrics`, `/ready`).
    pub admin_url: String,
    handle: SidecarHandle,
}

impl SidecarUnderTest {
    /// Starts a sidecar for the vLLM engine at `engine_url`; `extra_yaml` adds top-level sections
    /// (later cases: KV events, mesh peers, P/D).
    pub async fn start(engine_url: &str, extra_yaml: &str) -> Result<SidecarUnderTest> {
        Self::from_yaml(format!(
            "engine:\n  url: {engine_url}\n  kind: vllm\n  health_interval: 200ms\nlogging:\n  level: warn\n{extra_yaml}"
        ))
        .await
    }

    /// Starts a sidecar from a whole `proxy.yaml` (its listeners are replaced by port-0 ones).
    pub async fn from_yaml(yaml: String) -> Result<SidecarUnderTest> {
        let config = kvmesh_proxy::config::from_yaml_str(&yaml, "vllm_e2e proxy.yaml")
            .with_context(|| format!("sidecar config:\n{yaml}"))?;
        // The sidecars' own logs, on stderr, only when asked for (`RUST_LOG=kvmesh_proxy=info`):
        // the test harness does not capture what `tracing` writes.
        if std::env::var_os("RUST_LOG").is_some() {
            kvmesh_proxy::logging::init(&config.logging);
        }
        let client = TcpListener::bind("127.0.0.1:0").await?;
        let admin = TcpListener::bind("127.0.0.1:0").await?;
        let handle = Sidecar::start(config, client, admin)
            .await
            .with_context(|| format!("starting the sidecar with:\n{yaml}"))?;
        Ok(SidecarUnderTest {
            url: format!("http://{}", handle.addr()),
            admin_url: format!("http://{}", handle.admin_addr()),
            handle,
        })
    }

    /// The running sidecar, for what only the library exposes (its prefix index, its fleet).
    pub fn handle(&self) -> &SidecarHandle {
        &self.handle
    }

    /// `host:port` of the client port, the sidecar's pod id in the fleet and the mesh.
    pub fn pod_id(&self) -> String {
        self.handle.addr().to_string()
    }

    pub async fn shutdown(self) {
        self.handle.shutdown().await;
    }
}
