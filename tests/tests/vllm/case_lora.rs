//! Case 9: LoRA adapters loaded and unloaded while real vLLM runs (docs/filters.md, "LoRA adapters
//! loaded at run time").
//!
//! vLLM's CPU build serves LoRA (`--enable-lora`) for the fixture model, and with
//! `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` it loads one at run time. The adapter is written here for
//! tiny-llama: rank 8 on `q_proj` and `v_proj` of both layers, `lora_A` random, `lora_B` zero, so the
//! adapter's greedy output is the base model's, and a difference would mean the request ran elsewhere.
//! Sidecar B stands in front of vLLM; sidecar A in front of a simulated engine serving the same base
//! model (no adapter); the two are meshed. The adapter loaded on vLLM reaches A through B's
//! `/v1/models` poll and the mesh; A's requests for it are served by vLLM; unloaded, it leaves A's
//! view of B and a request for it is a 404 from A.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};

use super::engine::Engine;
use super::http::Http;
use super::report::note;
use super::setup::Venv;
use super::sidecar::SidecarUnderTest;
use super::{scrape, MODEL};

/// The adapter's name.
pub const ADAPTER: &str = "sql-lora";
/// How long a load or unload may take to reach the other sidecar (a 200 ms poll, the mesh tick).
const SPREAD_DEADLINE: Duration = Duration::from_secs(20);

/// The prompt of every request.
const PROMPT: &str = "select the rows where the id is seven";

const WRITE_ADAPTER: &str = r#"
import json, os, sys
import torch
from safetensors.torch import save_file

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
hidden, heads, head_dim, layers, rank = 128, 4, 32, 2, 8
config = {"base_model_name_or_path": "tiny-llama", "peft_type": "LORA", "task_type": "CAUSAL_LM",
          "r": rank, "lora_alpha": 16, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
          "target_modules": ["q_proj", "v_proj"], "inference_mode": True}
with open(os.path.join(out, "adapter_config.json"), "w") as f:
    json.dump(config, f)
g = torch.Generator().manual_seed(0)
weights = {}
for layer in range(layers):
    for proj in ("q_proj", "v_proj"):
        p = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
        weights[f"{p}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.01
        weights[f"{p}.lora_B.weight"] = torch.zeros(heads * head_dim, rank)
save_file(weights, os.path.join(out, "adapter_model.safetensors"))
"#;

/// `vllm serve` arguments: LoRA on, room for two adapters of rank 8.
pub fn engine_args() -> Vec<String> {
    ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
        .map(str::to_owned)
        .to_vec()
}

/// The engine's environment: the load and unload routes on.
pub fn engine_env() -> Vec<(String, String)> {
    vec![(
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING".to_owned(),
        "True".to_owned(),
    )]
}

/// Writes the adapter under `work` with the venv's torch and safetensors; returns its directory.
pub fn write_adapter(venv: &Venv, work: &Path) -> Result<PathBuf> {
    let dir = work.join(ADAPTER);
    let out = Command::new(&venv.python)
        .args(["-c", WRITE_ADAPTER])
        .arg(&dir)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .output()
        .context("running the venv's python")?;
    if !out.status.success() {
        bail!(
            "writing the adapter failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(dir)
}

/// `proxy.yaml` of a sidecar in front of `engine_url`, reading `/v1/models` every 200 ms, the mesh
/// on a port-0 listener following `peers_file`.
pub fn sidecar_yaml(engine_url: &str, peers_file: &Path) -> String {
    format!(
        "engine:\n  url: {engine_url}\n  kind: vllm\n  health_interval: 200ms\n  models_interval: 200ms\n\
         pod:\n  models: [{MODEL}]\n\
         mesh:\n  listen: 127.0.0.1:0\n  file: {peers}\n  refresh_interval: 100ms\n  stale_after: 5s\n\
         logging:\n  level: warn\n",
        peers = peers_file.display(),
    )
}

/// The case, with `a` in front of the simulated engine and `b` in front of `engine` (vLLM), joined.
pub async fn run(
    http: &Http,
    engine: &Engine,
    a: &SidecarUnderTest,
    b: &SidecarUnderTest,
    adapter: &Path,
) -> Result<()> {
    let complete = |model: &str| {
        let body = json!({"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0});
        let url = format!("{}/v1/completions", a.url);
        async move { http.post_json(&url, &body).await }
    };
    let before = complete(ADAPTER).await?;
    ensure!(
        before.status == 404,
        "before the load, a request for the adapter answered {}: {}",
        before.status,
        before.text()
    );

    let load = json!({"lora_name": ADAPTER, "lora_path": adapter.display().to_string()});
    let r = http
        .post_json(&format!("{}/v1/load_lora_adapter", engine.base_url), &load)
        .await?;
    ensure!(
        r.status.is_success(),
        "load_lora_adapter: {} {}",
        r.status,
        r.text()
    );
    let started = Instant::now();
    wait_adapter(a, b, true).await?;
    note(&format!(
        "lora: case 9: the adapter loaded on vLLM reached the other sidecar in {} ms",
        started.elapsed().as_millis()
    ));

    // The base model's greedy text, from vLLM itself (A may send a base request to the simulator).
    let base = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0});
    let base: Value = http
        .post_json(&format!("{}/v1/completions", engine.base_url), &base)
        .await?
        .json()?;
    for _ in 0..3 {
        let out: Value = complete(ADAPTER).await?.json()?;
        ensure!(
            out["model"] == ADAPTER,
            "answered as {} (want {ADAPTER}): {out}",
            out["model"]
        );
        let fingerprint = out["system_fingerprint"].as_str().unwrap_or_default();
        ensure!(
            !fingerprint.contains("sim"),
            "served by the simulator ({fingerprint}), not vLLM"
        );
        ensure!(
            out["choices"][0]["text"] == base["choices"][0]["text"],
            "the zero-B adapter's greedy text differs from the base model's: {} vs {}",
            out["choices"][0]["text"],
            base["choices"][0]["text"]
        );
    }
    let metrics = scrape(http, engine).await?;
    ensure!(
        metrics
            .lines()
            .any(|l| l.starts_with("vllm:lora_requests_info{")
                && l.contains(&format!("running_lora_adapters=\"{ADAPTER}\""))),
        "vLLM's vllm:lora_requests_info never named the adapter running"
    );

    let unload = json!({"lora_name": ADAPTER});
    let r = http
        .post_json(
            &format!("{}/v1/unload_lora_adapter", engine.base_url),
            &unload,
        )
        .await?;
    ensure!(
        r.status.is_success(),
        "unload_lora_adapter: {} {}",
        r.status,
        r.text()
    );
    let started = Instant::now();
    wait_adapter(a, b, false).await?;
    note(&format!(
        "lora: case 9: the unload reached the other sidecar in {} ms",
        started.elapsed().as_millis()
    ));
    let after = complete(ADAPTER).await?;
    ensure!(
        after.status == 404,
        "after the unload, a request for the adapter answered {}: {}",
        after.status,
        after.text()
    );
    Ok(())
}

/// Waits until `on` sees `pod` with the adapter loaded (`loaded`) or not.
async fn wait_adapter(on: &SidecarUnderTest, pod: &SidecarUnderTest, loaded: bool) -> Result<()> {
    let id = pod.pod_id();
    let end = Instant::now() + SPREAD_DEADLINE;
    loop {
        let now = tokio::time::Instant::now();
        let has = on
            .handle()
            .fleet()
            .snapshot(now)
            .into_iter()
            .find(|p| p.info.id == id)
            .is_some_and(|p| p.info.lora_adapters.iter().any(|n| n == ADAPTER));
        if has == loaded {
            return Ok(());
        }
        if Instant::now() >= end {
            bail!(
                "the adapter's {} did not reach the other sidecar within {SPREAD_DEADLINE:?}",
                if loaded { "load" } else { "unload" }
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
