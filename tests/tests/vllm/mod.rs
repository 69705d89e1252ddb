//! Harness for the end-to-end suite against real, unmodified vLLM (CPU build, tiny-llama).
//!
//! * [`setup`]: finds the cached vLLM venv, running `scripts/setup-vllm` when it is missing, so the
//!   suite never skips silently.
//! * [`engine`]: starts `vllm serve` on loopback ports with the flags a case needs, waits for `/health`
//!   and always stops the whole process group.
//! * [`http`]: the few HTTP calls the cases make, each with a deadline.
//! * [`metrics`]: reads vLLM's Prometheus text.
//! * [`pyclient`]: runs the OpenAI Python client from the venv.
//! * [`report`]: prints how long set-up and each case took, visible even when output is captured.
//!
//! Engines are heavy (3-4.5 GB of RAM, ~35 s to start on one core): a test function starts them once
//! for a group of cases, and [`engines_lock`] keeps two groups from running at once, so no more than two
//! engines ever run together.

#![allow(dead_code)]

pub mod case_cache_pressure;
pub mod case_dp;
pub mod case_faults;
pub mod case_fidelity;
pub mod case_hashes;
pub mod case_lora;
pub mod case_mesh;
pub mod case_migration;
pub mod case_openai;
pub mod case_pd;
pub mod case_shapes;
pub mod engine;
pub mod events;
pub mod http;
pub mod metrics;
pub mod pyclient;
pub mod recorder;
pub mod report;
pub mod setup;
pub mod sidecar;

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

/// The name vLLM serves the model under, and the name clients send.
pub const MODEL: &str = "tiny-llama";

/// vLLM's prefix-cache block size used by every case (a multiple of 32, as the CPU backend requires).
pub const BLOCK_SIZE: usize = 32;

static ENGINES: Mutex<()> = Mutex::new(());

/// Serialises the test functions of this binary that start engines. A failed (panicked) group must not
/// stop the next one, so a poisoned lock is taken anyway.
pub fn engines_lock() -> MutexGuard<'static, ()> {
    ENGINES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The repository root (this crate lives in `<root>/tests`).
pub fn repo_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// The tiny-llama model directory, in the repository (tests/fixtures/README.md says where it came
/// from).
pub fn model_dir() -> PathBuf {
    repo_root().join("tests/fixtures/tiny-llama")
}

/// A loopback TCP port that was free a moment ago. vLLM takes a port number, not a socket, so there is
/// a small window in which another process can take it; [`engine::Engine::start`] retries once.
pub fn free_port() -> std::io::Result<u16> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    Ok(listener.local_addr()?.port())
}

/// The first of `n` consecutive loopback ports that were free a moment ago: vLLM puts a
/// data-parallel rank r's KV-event sockets on the configured port + r.
pub fn consecutive_ports(n: u32) -> anyhow::Result<u16> {
    for _ in 0..100 {
        let first = free_port()?;
        let rest = (1..n).all(|r| {
            u16::try_from(u32::from(first) + r)
                .is_ok_and(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        });
        if rest {
            return Ok(first);
        }
    }
    anyhow::bail!("no {n} consecutive free ports in 100 tries")
}

/// A prompt of `words` words of varied English text, starting with `[tag]` so that prompts with
/// different tags share no cached block.
pub fn long_prompt(tag: &str, words: usize) -> String {
    const TEXT: &str = "the sidecar routes every request to the pod that already holds its prefix and \
        has room for it while peers share what they know about load and cached blocks so that a fleet \
        of engines behaves like one cache with many doors and no central router to fail";
    let vocab: Vec<&str> = TEXT.split_whitespace().collect();
    let mut out = format!("[{tag}]");
    for i in 0..words {
        out.push(' ');
        out.push_str(vocab[(i * 7 + i / vocab.len()) % vocab.len()]);
    }
    out
}

/// The engine's Prometheus text. A 5xx is asked again, a few times: vLLM
/// with `--data-parallel-size 2` answered one `GET /metrics` of a CI run
/// with 500 between two that succeeded.
pub async fn scrape(http: &http::Http, engine: &engine::Engine) -> anyhow::Result<String> {
    const TRIES: u32 = 5;
    let url = format!("{}/metrics", engine.base_url);
    let mut attempt = 1;
    loop {
        let reply = http.get(&url).await?;
        if reply.status.is_success() {
            return Ok(reply.text());
        }
        if !reply.status.is_server_error() || attempt == TRIES {
            anyhow::bail!(
                "GET /metrics: HTTP {} (try {attempt} of {TRIES}): {}",
                reply.status,
                reply.text()
            );
        }
        attempt += 1;
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Why a sidecar may have applied none of its engine's KV events: its `kvmesh_kv_event*` series
/// (`kvmesh_kv_events_connected` 0: the SUB never opened; replays by outcome; silence checks) and
/// the end of the engine's log. For the error of a wait that gave up.
pub async fn kv_events_report(
    http: &http::Http,
    engine: &engine::Engine,
    sidecar: &sidecar::SidecarUnderTest,
) -> anyhow::Result<String> {
    let metrics = http
        .get(&format!("{}/metrics", sidecar.admin_url))
        .await?
        .text();
    let kv: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("kvmesh_kv_event"))
        .collect();
    Ok(format!(
        "sidecar: {kv:#?}\nengine log:\n{}",
        engine.log_tail(20)
    ))
}

/// A P/D prefill leg: posts `body` to `url` and returns the reply with the
/// `kv_transfer_params` it carries (`Null` when it carries none).
pub async fn prefill_leg(
    http: &http::Http,
    url: &str,
    body: &serde_json::Value,
) -> anyhow::Result<(serde_json::Value, serde_json::Value)> {
    let reply: serde_json::Value = http.post_json(url, body).await?.json()?;
    let params = reply
        .get("kv_transfer_params")
        .cloned()
        .unwrap_or(serde_json::Value::Null);
    Ok((reply, params))
}

/// One counter (summed over the series matching `labels`); an error when vLLM does not export it.
pub fn counter(text: &str, name: &str, labels: &[(&str, &str)]) -> anyhow::Result<f64> {
    use anyhow::Context;
    metrics::sum(text, name, labels).with_context(|| format!("vLLM exports no {name}{labels:?}"))
}
