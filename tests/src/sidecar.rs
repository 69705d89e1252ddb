//! Starting a sidecar in-process in front of a fake, on ports from the OS.

use std::net::SocketAddr;
use std::time::Duration;

use kvmesh_proxy::config::{Config, EngineUrl};
use kvmesh_proxy::{Sidecar, SidecarHandle};
use tokio::net::TcpListener;

use crate::client::admin_get;

/// A config for tests: loopback listeners, the given engine, short deadlines
/// that still leave a slow CI machine room.
pub fn test_config(engine: SocketAddr) -> Config {
    let mut c = Config::default();
    c.listeners.client = "127.0.0.1:0".parse().expect("addr");
    c.listeners.admin = "127.0.0.1:0".parse().expect("addr");
    c.engine.url = EngineUrl::parse(&format!("http://{engine}")).expect("engine url");
    c.engine.health_interval = kvmesh_proxy::config::Duration::from_millis(50);
    c.timeouts.shutdown_drain = kvmesh_proxy::config::Duration::from_secs(10);
    c
}

/// The Valkey index backend at `urls` with test timings: leases that lapse
/// and lookup caches that expire within a test, writes flushed at once.
pub fn fast_valkey(urls: Vec<String>) -> kvmesh_proxy::config::index::Valkey {
    use kvmesh_proxy::config::Duration as D;
    kvmesh_proxy::config::index::Valkey {
        urls,
        lookup_deadline: D::from_millis(200),
        cache_ttl: D::from_millis(20),
        lease_interval: D::from_millis(100),
        lease_ttl: D::from_millis(600),
        flush_interval: D::from_millis(5),
        ..Default::default()
    }
}

/// Starts a sidecar with `config` on `127.0.0.1:0` listeners.
pub async fn start(config: Config) -> SidecarHandle {
    let client = TcpListener::bind("127.0.0.1:0").await.expect("bind client");
    let admin = TcpListener::bind("127.0.0.1:0").await.expect("bind admin");
    Sidecar::start(config, client, admin)
        .await
        .expect("sidecar starts")
}

/// Starts a sidecar in front of `engine` with the test defaults.
pub async fn start_for(engine: SocketAddr) -> SidecarHandle {
    start(test_config(engine)).await
}

/// Waits (bounded) until the admin port says ready.
pub async fn wait_ready(h: &SidecarHandle) {
    for _ in 0..200 {
        if admin_get(h.admin_addr(), "/ready")
            .await
            .status
            .is_success()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("sidecar did not become ready within 5 s");
}

/// An address nothing listens on: bound by the OS, then released.
pub async fn refused_addr() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let a = l.local_addr().expect("addr");
    drop(l);
    a
}
