//! The test venv's Python: `$KVMESH_PYTHON` when set (the README's test
//! command sets it), else `scripts/setup-python` runs once and its venv under
//! `${KVMESH_CACHE:-~/.cache/kvmesh}` is used.

use std::path::PathBuf;

/// The interpreter with the test venv's packages (openai, pyzmq, the
/// manifest validators).
pub fn interpreter() -> PathBuf {
    if let Ok(p) = std::env::var("KVMESH_PYTHON") {
        if !p.is_empty() {
            return PathBuf::from(p);
        }
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let status = std::process::Command::new(root.join("scripts/setup-python"))
        .status()
        .expect("run scripts/setup-python");
    assert!(status.success(), "scripts/setup-python failed");
    let cache = std::env::var("KVMESH_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").expect("HOME")).join(".cache/kvmesh")
        });
    cache.join("venv/bin/python")
}
