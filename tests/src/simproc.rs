//! Simulated engines as separate processes, one per engine as in a real
//! deployment: the `kvmesh-engine-sim` binary run through
//! [`kvmesh_engine_sim::SimProcess`] (a port from the OS, ready when it
//! answers with its own engine id, killed when dropped).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kvmesh_engine_sim::SimProcess;

use crate::route::MODEL;

/// How long building the binary may take before the test gives up.
const BUILD_WITHIN: Duration = Duration::from_secs(900);

/// The `kvmesh-engine-sim` binary beside this test's own (`target/debug`).
pub fn engine_sim_bin() -> PathBuf {
    workspace_bin("kvmesh-engine-sim", "kvmesh-engine-sim")
}

/// A binary of this workspace beside this test's own, brought up to date:
/// cargo builds a dependency's library for an integration test, not its
/// binaries, so `cargo build -p PACKAGE --bin BIN` runs here (a no-op when
/// the binary is current), in the test's profile.
pub fn workspace_bin(package: &str, bin: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary sits in target/<profile>/deps");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .args(["build", "-q", "-p", package, "--bin", bin])
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    if dir.file_name().is_some_and(|n| n == "release") {
        build.arg("--release");
    }
    let mut child = build.spawn().expect("cargo runs");
    let deadline = Instant::now() + BUILD_WITHIN;
    let status = loop {
        if let Some(status) = child.try_wait().expect("cargo build status") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "building {bin} took over {BUILD_WITHIN:?}; \
                 build it first (cargo build -p {package}) and rerun"
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "cargo build -p {package} failed");
    let path = dir.join(bin);
    assert!(path.is_file(), "{} missing after the build", path.display());
    path
}

/// A `kvmesh-engine-sim` process serving [`MODEL`] ten times faster than real
/// time, with `args` added (`--role prefill`, `--flavor sglang`, ...).
pub async fn sim_process(bin: &Path, args: &[&str]) -> SimProcess {
    let mut all = vec!["--model", MODEL, "--time-scale", "10"];
    all.extend_from_slice(args);
    SimProcess::spawn(bin, &all, Duration::from_secs(30))
        .await
        .expect("simulator process starts")
}
