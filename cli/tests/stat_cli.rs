//! `kvmesh stat` as a user runs it: the built binary against a running
//! sidecar's admin port (table, `-o json`, `--watch`), and against a port
//! nothing listens on (exit code 1, the address named).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::Duration;

use kvmesh_engine_sim::{Engine, SimConfig};
use kvmesh_proxy::config::{Config, EngineUrl};
use kvmesh_proxy::{Sidecar, SidecarHandle};
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::process::Command;

fn stat(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvmesh"));
    c.arg("stat").args(args).env_remove("RUST_LOG");
    c.kill_on_drop(true);
    c
}

async fn sidecar() -> (kvmesh_engine_sim::SimHandle, SidecarHandle) {
    let engine = Engine::start_local(SimConfig::new("tiny").with_time_scale(10.0))
        .await
        .unwrap();
    let mut c = Config::default();
    c.engine.url = EngineUrl::parse(&format!("http://{}", engine.addr())).unwrap();
    c.engine.metrics_interval = kvmesh_proxy::config::Duration::from_millis(50);
    c.pod.models = vec!["tiny".to_owned()];
    let client = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let s = Sidecar::start(c, client, admin).await.unwrap();
    (engine, s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_prints_the_table_json_and_watches() {
    let (engine, s) = sidecar().await;
    let admin = s.admin_addr().to_string();
    let id = s.fleet().local_id().to_owned();

    let out = stat(&["--admin", &admin, "--window", "0.1"])
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(
        lines[0].starts_with("POD") && lines[0].contains("REQ/S"),
        "{text}"
    );
    assert!(
        lines[1].starts_with(&id) && lines[1].contains("local"),
        "{text}"
    );

    let out = stat(&["--admin", &admin, "--window", "0.1", "-o", "json"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["local"], id.as_str());
    assert_eq!(json["pods"][0]["mesh"], "local");
    assert_eq!(json["pods"][0]["requests_per_s"], 0.0);

    // --watch redraws until stopped: two screens, each cleared first.
    let mut child = stat(&["--admin", &admin, "--watch", "0.05"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    for _ in 0..100 {
        let n = tokio::time::timeout(Duration::from_secs(5), stdout.read(&mut buf))
            .await
            .expect("watch output within 5 s")
            .unwrap();
        assert!(n > 0, "watch ended early");
        seen.extend_from_slice(&buf[..n]);
        if String::from_utf8_lossy(&seen).matches("\x1b[2J").count() >= 2 {
            break;
        }
    }
    let screens = String::from_utf8_lossy(&seen);
    assert!(screens.matches("\x1b[2J\x1b[H").count() >= 2, "{screens}");
    assert!(
        screens.contains(&format!("kvmesh stat {admin}")),
        "{screens}"
    );
    child.kill().await.unwrap();

    s.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test]
async fn an_unreachable_admin_port_exits_1_naming_it() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let out = stat(&["--admin", &addr]).output().await.unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&addr) && err.contains("cannot reach the kvmesh admin port"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
}
