//! End-to-end suite against real, unmodified vLLM (the CPU build, serving tiny-llama on loopback).
//!
//! Every claim kvmesh makes about vLLM is checked here against vLLM itself. Engines are heavy, so each
//! test function starts its engines once and runs a group of cases in order, printing how long set-up
//! and each case took; groups never overlap (at most two engines at once). The first run installs vLLM
//! through `scripts/setup-vllm` (~4 GB, cached under `~/.cache/kvmesh`). See `docs/vllm-e2e.md`.
//!
//! `cargo test -p kvmesh-tests --test vllm_e2e` runs this suite alone.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod vllm;

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use kvmesh_filters::prefix::hash::VllmCborHasher;

use vllm::engine::{Engine, EngineSpec, KvRole};
use vllm::events::EventTap;
use vllm::http::Http;
use vllm::report::Timings;
use vllm::sidecar::SidecarUnderTest;
use vllm::{case_hashes, case_openai, engines_lock};

/// The `PYTHONHASHSEED` the single engine runs with, so its block hashes can be recomputed.
const HASH_SEED: &str = "1234";

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn work_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("kvmesh-vllm-e2e-")
        .tempdir()
        .expect("work dir")
}

/// Group "single": one engine (core 0) with prefix caching, `sha256_cbor` block hashes, a fixed
/// `PYTHONHASHSEED` and KV events to our own SUB socket; one sidecar in front of it.
///
/// * case 1: the OpenAI Python client and raw bytes through the sidecar.
/// * case 4: Rust block hashes equal the ones vLLM published (completion, `cache_salt`, chat).
#[test]
fn vllm_single_group() -> Result<()> {
    let _one_group_at_a_time = engines_lock();
    let mut t = Timings::new("single");
    let venv = t.step("set-up: vLLM venv", vllm::setup::venv)?;
    let work = work_dir();
    let tap = t.step("bind the KV-events SUB socket", || EventTap::bind(&venv))?;
    let spec = EngineSpec {
        sha256_cbor: true,
        python_hash_seed: Some(HASH_SEED.to_string()),
        kv_events_to: Some(tap.endpoint.clone()),
        ..EngineSpec::new("solo", 0)
    };
    let engines = t.step("start vLLM (sha256_cbor, KV events)", || {
        Engine::start_all(&venv, work.path(), std::slice::from_ref(&spec))
    })?;
    let engine = &engines[0];
    let rt = runtime();
    let http = Http::default();
    let sidecar = t.step("start the sidecar", || {
        rt.block_on(async {
            let sidecar = SidecarUnderTest::start(&engine.base_url, "").await?;
            wait_ready(&http, &sidecar.admin_url).await?;
            anyhow::Ok(sidecar)
        })
    })?;

    t.step("case 1a: OpenAI Python client through the sidecar", || {
        case_openai::python_client(&venv, &engine.base_url, &sidecar.url)
    })?;
    t.step("case 1b: response bytes through the sidecar equal vLLM's", || {
        rt.block_on(case_openai::raw_bytes(&http, &engine.base_url, &sidecar.url))
    })?;
    t.step("case 4: Rust sha256_cbor block hashes equal vLLM's KV events", || {
        rt.block_on(async {
            let hasher = VllmCborHasher::new(Some(HASH_SEED));
            for probe in case_hashes::probes() {
                let tokens = case_hashes::vllm_tokens(&http, &engine.base_url, &probe).await?;
                case_hashes::check_published(&http, &tap, &engine.base_url, &hasher, &probe, &tokens).await?;
            }
            anyhow::Ok(())
        })
    })?;
    rt.block_on(sidecar.shutdown());
    Ok(())
}

/// Waits until the sidecar's admin `/ready` says the engine is reachable.
async fn wait_ready(http: &Http, admin_url: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Ok(reply) = http.get(&format!("{admin_url}/ready")).await {
            if reply.status.is_success() {
                return Ok(());
            }
        }
        if Instant::now() >= deadline {
            bail!("the sidecar did not report ready within 15 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Group "pair": two engines with `NixlConnector` (`kv_both`, one core each), KV events on.
///
/// * P/D by hand (the harness for case 5): a prefill leg on one engine, the decode leg on the other
///   with the `kv_transfer_params` prefill returned; the decode engine's
///   `prompt_tokens_by_source_total{source="external_kv_transfer"}` grows by the prompt length and the
///   greedy output equals one engine serving the request alone.
#[test]
fn vllm_pair_group() -> Result<()> {
    let _one_group_at_a_time = engines_lock();
    let mut t = Timings::new("pair");
    let venv = t.step("set-up: vLLM venv", vllm::setup::venv)?;
    let work = work_dir();
    let specs = [
        EngineSpec {
            nixl: Some(KvRole::Both),
            kv_cache_bytes: 64 * 65_536,
            ..EngineSpec::new("a", 0)
        },
        EngineSpec {
            nixl: Some(KvRole::Both),
            kv_cache_bytes: 64 * 65_536,
            ..EngineSpec::new("b", 1)
        },
    ];
    let engines = t.step("start two vLLM engines (NixlConnector, kv_both)", || {
        Engine::start_all(&venv, work.path(), &specs)
    })?;
    let rt = runtime();
    let http = Http::default();
    let (prefill, decode) = (&engines[0], &engines[1]);

    t.step("P/D by hand: prefill on a, decode on b, KV over NIXL", || {
        rt.block_on(vllm::case_pd::manual_pd(&http, prefill, decode))
    })?;
    Ok(())
}
