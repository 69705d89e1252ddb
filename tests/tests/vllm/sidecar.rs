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
        let yaml = format!(
            "engine:\n  url: {engine_url}\n  kind: vllm\n  health_interval: 200ms\nlogging:\n  level: warn\n{extra_yaml}"
        );
        let config = kvmesh_proxy::config::from_yaml_str(&yaml, "vllm_e2e proxy.yaml")
            .with_context(|| format!("sidecar config:\n{yaml}"))?;
        let client = TcpListener::bind("127.0.0.1:0").await?;
        let admin = TcpListener::bind("127.0.0.1:0").await?;
        let handle = Sidecar::start(config, client, admin)
            .await
            .context("starting the sidecar")?;
        Ok(SidecarUnderTest {
            url: format!("http://{}", handle.addr()),
            admin_url: format!("http://{}", handle.admin_addr()),
            handle,
        })
    }

    pub async fn shutdown(self) {
        self.handle.shutdown().await;
    }
}
