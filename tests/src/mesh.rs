//! Helpers for the mesh suites (`tests/tests/mesh_*.rs`): simulated engines
//! publishing KV events, sidecars with the mesh on (port 0) following a peers
//! file, and waits on what the mesh converges to.

use std::net::SocketAddr;
use std::path::Path;

use kvmesh_engine_sim::{KvEventsConfig, SimConfig, SimHandle};
use kvmesh_proxy::config::{
    Config, Duration as CfgDuration, KvEvents, SocketMode, TokenizerChoice,
};
use kvmesh_proxy::{Sidecar, SidecarHandle};
use tokio::net::TcpListener;

use crate::route::{config, eventually, metric, sim_with, MODEL};

/// A simulated engine serving [`MODEL`] that publishes KV events on loopback.
pub async fn kv_sim() -> SimHandle {
    kv_sim_with(|c| c).await
}

/// [`kv_sim`] with its configuration changed by `adjust` first.
pub async fn kv_sim_with(adjust: impl FnOnce(SimConfig) -> SimConfig) -> SimHandle {
    let mut kv = KvEventsConfig::new("tcp://127.0.0.1:0");
    kv.bind = Some(true);
    kv.topic = format!("kv@sim@{MODEL}");
    sim_with(adjust(
        SimConfig::new(MODEL)
            .with_time_scale(20.0)
            .with_block_size(16)
            .with_kv_events(kv),
    ))
    .await
}

/// A sidecar config in front of `engine`: precise prefix routing from its KV
/// events (builtin tokenizer, as the simulator's), the mesh on `127.0.0.1:0`
/// following `peers_file`, short mesh timings.
pub fn mesh_config(engine: &SimHandle, peers_file: &Path) -> Config {
    let mut c = config(engine, &[], None);
    let kv = engine.kv_endpoints().expect("engine publishes KV events");
    c.engine.kv_events = Some(KvEvents {
        endpoint: kv.events.clone(),
        replay_endpoint: kv.replay.clone(),
        socket: SocketMode::Connect,
        ..KvEvents::default()
    });
    c.prefix.tokenizer = TokenizerChoice::Builtin;
    c.mesh.listen = Some("127.0.0.1:0".parse().expect("addr"));
    c.mesh.file = Some(peers_file.to_path_buf());
    c.mesh.refresh_interval = CfgDuration::from_millis(100);
    c.mesh.stale_after = CfgDuration::from_millis(1000);
    c.mesh.load_interval = CfgDuration::from_millis(100);
    c.mesh.reconnect_max = CfgDuration::from_millis(200);
    c
}

/// Starts a sidecar on the given client listener (or a fresh one).
pub async fn start_on(config: Config, client: Option<TcpListener>) -> SidecarHandle {
    let client = match client {
        Some(l) => l,
        None => TcpListener::bind("127.0.0.1:0").await.expect("bind client"),
    };
    let admin = TcpListener::bind("127.0.0.1:0").await.expect("bind admin");
    Sidecar::start(config, client, admin)
        .await
        .expect("sidecar starts")
}

/// Writes the peers file: one mesh address per line.
pub fn write_peers(path: &Path, addrs: &[SocketAddr]) {
    let text: String = addrs.iter().map(|a| format!("{a}\n")).collect();
    std::fs::write(path, text).expect("peers file written");
}

/// A shared-prefix completion body: a long system part per group, a short
/// question per user.
pub fn shared_prefix_body(group: usize, user: usize) -> String {
    let system: String = (0..120).map(|k| format!("group{group} rule{k} ")).collect();
    let prompt = format!("{system}question from user {user} of group {group}");
    serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}).to_string()
}

/// Waits until every sidecar's prefix index holds the same, non-zero number
/// of entries (every pod's blocks, as the mesh carries them).
pub async fn indexes_converged(sidecars: &[SidecarHandle]) {
    eventually("indexes converged", || async {
        let e: Vec<usize> = sidecars
            .iter()
            .map(|s| s.prefix().index().stats().entries)
            .collect();
        (e[0] > 0 && e.iter().all(|x| *x == e[0])).then_some(())
    })
    .await;
}

/// Requests the sidecars forwarded to a peer over the mesh, summed.
pub async fn forwarded(sidecars: &[SidecarHandle]) -> f64 {
    let mut n = 0.0;
    for s in sidecars {
        n += metric(s, r#"kvmesh_mesh_requests_total{served="forwarded"}"#)
            .await
            .unwrap_or(0.0);
    }
    n
}
