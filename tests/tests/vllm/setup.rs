//! The set-up step: the vLLM venv made by `scripts/setup-vllm`, found or created on first use.
//!
//! The script is idempotent and checks the installed version, so the suite always runs it (once per
//! test binary): on a fresh machine that installs vLLM (~4 GB, the script says so on stderr), on a
//! prepared one it only confirms the venv. The suite never skips because vLLM is missing.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use super::repo_root;
use super::report::note;

/// The venv the suite runs vLLM and the OpenAI client from.
#[derive(Debug, Clone)]
pub struct Venv {
    /// `<venv>/bin/python`.
    pub python: PathBuf,
    /// `<venv>/bin/kvmesh-vllm`, the launcher for `vllm serve` written by the script.
    pub launcher: PathBuf,
}

static VENV: OnceLock<std::result::Result<Venv, String>> = OnceLock::new();

/// Runs `scripts/setup-vllm` once per process and returns the venv it reports.
pub fn venv() -> Result<Venv> {
    VENV.get_or_init(|| run_setup().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow::anyhow!("vLLM set-up failed: {e}"))
}

fn run_setup() -> Result<Venv> {
    let script = repo_root().join("scripts/setup-vllm");
    let started = Instant::now();
    // stderr is inherited on purpose: on a first run the script says it is downloading ~4 GB.
    let out = Command::new(&script)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!("{} exited with {}", script.display(), out.status);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let python = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map(|l| PathBuf::from(l.trim()))
        .context("setup-vllm printed no python path")?;
    let bin = python.parent().context("python path has no parent")?;
    let venv = Venv {
        launcher: bin.join("kvmesh-vllm"),
        python,
    };
    if !venv.python.is_file() || !venv.launcher.is_file() {
        bail!(
            "setup-vllm reported {} but it or the launcher is missing",
            venv.python.display()
        );
    }
    note(&format!(
        "set-up: vLLM venv ready ({}) in {:.1} s",
        venv.python.display(),
        started.elapsed().as_secs_f64()
    ));
    Ok(venv)
}
