//! End-to-end suite against real, unmodified vLLM (the CPU build, serving tiny-llama on loopback).
//!
//! Every claim kvmesh makes about vLLM is checked here against vLLM itself. Engines are heavy, so each
//! test function starts its engines once and runs a group of cases in order, printing how long set-up
//! and each case took; groups never overlap (at most two engines at once). The first run installs vLLM
//! through `scripts/setup-vllm` (~4 GB, cached under `~/.cache/kvmesh`). See `docs/vllm-e2e.md`.
//!
//! `cargo test -p kvmesh-tests --test vllm_e2e` runs this suite alone; `./scripts/test` runs it with
//! everything else.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod vllm;

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvmesh_filters::prefix::hash::VllmCborHasher;

use vllm::engine::{Engine, EngineSpec, KvRole};
use vllm::events::EventTap;
use vllm::http::Http;
use vllm::recorder::{self, Recorder};
use vllm::report::Timings;
use vllm::sidecar::SidecarUnderTest;
use vllm::{
    case_dp, case_faults, case_fidelity, case_hashes, case_lora, case_mesh, case_migration,
    case_openai, case_pd, case_shapes, engines_lock,
};

/// KV-cache size of the single engine, in 32-token blocks (tiny-llama: 64 KiB per block).
const KV_BLOCKS: usize = 40;
const MAX_NUM_SEQS: usize = 4;

/// KV-cache size of each pair engine, in 32-token blocks: cases 2, 3 and 5 fit without evictions.
const PAIR_KV_BLOCKS: u64 = 128;

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

/// Two engines named `names` on cores 0 and 1, each publishing its KV events
/// to a port of its own from the OS; `spec` sets the rest. The specs, and
/// where each engine's events go.
fn two_with_events(
    names: [&'static str; 2],
    spec: impl Fn(EngineSpec) -> EngineSpec,
) -> Result<([EngineSpec; 2], [String; 2])> {
    let events = [
        format!("tcp://127.0.0.1:{}", vllm::free_port()?),
        format!("tcp://127.0.0.1:{}", vllm::free_port()?),
    ];
    let one = |i: usize| {
        spec(EngineSpec {
            kv_events_to: Some(events[i].clone()),
            ..EngineSpec::new(names[i], i as u32)
        })
    };
    Ok(([one(0), one(1)], events))
}

/// Group "single": one engine (core 0) with prefix caching, `sha256_cbor` block hashes, a fixed
/// `PYTHONHASHSEED` and KV events to our own SUB socket; one sidecar in front of it.
///
/// * case 1: the OpenAI Python client and raw bytes through the sidecar.
/// * case 4: Rust token ids equal vLLM's `/tokenize`, and Rust block hashes equal the ones vLLM
///   published (completion, `cache_salt`, chat).
/// * harness for case 2: a cache reset reaches the subscriber as `AllBlocksCleared`.
/// * case 6: the simulator's `vllm-cpu-tiny` profile, its TTFT costs calibrated on this engine in
///   this run (other prompts), and this engine agree on TTFT p50 and the prefix-cache hit rate of one
///   small workload, within 20%.
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
        kv_cache_bytes: KV_BLOCKS as u64 * 65_536,
        max_num_seqs: MAX_NUM_SEQS as u32,
        ..EngineSpec::new("solo", 0)
    };
    let engines = t.step("start vLLM (sha256_cbor, KV events)", || {
        Engine::start_all(&venv, work.path(), std::slice::from_ref(&spec))
    })?;
    let engine = &engines[0];
    let rt = runtime();
    let http = Http::default();
    let (recorder, sidecar) = t.step("start the sidecar (through a recording relay)", || {
        rt.block_on(async {
            let recorder = Recorder::start(&recorder::authority(&engine.base_url)?).await?;
            let sidecar = SidecarUnderTest::start(&recorder.url, "").await?;
            wait_ready(&http, &sidecar.admin_url).await?;
            anyhow::Ok((recorder, sidecar))
        })
    })?;

    t.step("case 1a: OpenAI Python client through the sidecar", || {
        case_openai::python_client(&venv, &engine.base_url, &sidecar.url)
    })?;
    t.step(
        "case 1b: response bytes through the sidecar equal vLLM's",
        || {
            rt.block_on(case_openai::raw_bytes(
                &http,
                &engine.base_url,
                &sidecar.url,
                &recorder,
            ))
        },
    )?;
    t.step("case 4: Rust token ids and sha256_cbor block hashes equal vLLM's", || {
        rt.block_on(async {
            let hasher = VllmCborHasher::new(Some(HASH_SEED));
            let tokenizer = case_hashes::rust_tokenizer()?;
            for probe in case_hashes::probes() {
                let theirs = case_hashes::vllm_tokens(&http, &engine.base_url, &probe).await?;
                let ours = case_hashes::rust_tokens(&tokenizer, &probe)?;
                anyhow::ensure!(
                    ours == theirs,
                    "{}: Rust token ids differ from vLLM's /tokenize\n rust: {ours:?}\n vllm: {theirs:?}",
                    probe.name
                );
                case_hashes::check_published(&http, &tap, &engine.base_url, &hasher, &probe, &ours).await?;
            }
            anyhow::Ok(())
        })
    })?;
    t.step(
        "case 2 (harness): reset_prefix_cache is published as AllBlocksCleared",
        || {
            rt.block_on(case_hashes::reset_is_published(
                &http,
                &tap,
                &engine.base_url,
            ))
        },
    )?;
    t.step(
        "case 6: fidelity, simulator (vllm-cpu-tiny calibrated here) vs real vLLM",
        || {
            rt.block_on(async {
                case_fidelity::check(&engine.base_url, KV_BLOCKS, MAX_NUM_SEQS).await
            })
        },
    )?;
    rt.block_on(sidecar.shutdown());
    Ok(())
}

/// Group "shapes" (issue 40, item 4): one engine serving the Qwen3-style fixture template (and
/// taking the Llama-3.1-style one per request), `sha256_cbor` hashes, KV events to one sidecar.
///
/// * case 8a: for every request shape of `tests/fixtures/chat-templates/shapes.json` (tools,
///   tool-call history, `enable_thinking: false`, `reasoning_effort`, documents,
///   `continue_final_message`, `/v1/responses` with input as a string and as items, with
///   instructions), kvmesh's token ids equal the prompt vLLM ran and its `/tokenize`, and vLLM
///   reported their blocks under the hashes kvmesh computes.
/// * case 8b: `/v1/responses` through the sidecar is tokenized, scheduled and its blocks indexed
///   under kvmesh's keys; an image and a `previous_response_id` are counted as keyed inexactly.
#[test]
fn vllm_shapes_group() -> Result<()> {
    let _one_group_at_a_time = engines_lock();
    let mut t = Timings::new("shapes");
    let venv = t.step("set-up: vLLM venv", vllm::setup::venv)?;
    let work = work_dir();
    let events = format!("tcp://127.0.0.1:{}", vllm::free_port()?);
    let spec = EngineSpec {
        sha256_cbor: true,
        python_hash_seed: Some(HASH_SEED.to_string()),
        kv_events_to: Some(events.clone()),
        // Every shape's blocks stay held (no eviction between a request and its check).
        kv_cache_bytes: 600 * 65_536,
        extra_args: case_shapes::engine_args(),
        ..EngineSpec::new("shapes", 0)
    };
    let engines = t.step(
        "start vLLM (fixture chat template, sha256_cbor, KV events)",
        || Engine::start_all(&venv, work.path(), std::slice::from_ref(&spec)),
    )?;
    let engine = &engines[0];
    let rt = runtime();
    let http = Http::default();
    let sidecar = t.step("start the sidecar (KV events, the served template)", || {
        rt.block_on(async {
            let dir = case_shapes::sidecar_model_dir(work.path())?;
            let yaml = case_shapes::sidecar_yaml(engine, &events, &dir)?;
            let s = SidecarUnderTest::from_yaml(yaml).await?;
            wait_ready(&http, &s.admin_url).await?;
            case_mesh::wait_events_flow(&http, engine, &s).await?;
            anyhow::Ok(s)
        })
    })?;
    t.step("case 8a: every request shape keyed as vLLM keys it", || {
        rt.block_on(async {
            let hasher = VllmCborHasher::new(Some(HASH_SEED));
            let n = case_shapes::every_shape(&http, engine, &hasher).await?;
            anyhow::ensure!(n >= 20, "only {n} shapes");
            anyhow::Ok(())
        })
    })?;
    t.step(
        "case 8b: /v1/responses routed KV-aware through the sidecar; inexact shapes counted",
        || rt.block_on(case_shapes::through_sidecar(&http, &sidecar)),
    )?;
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

/// Group "pair": two engines with `NixlConnector` (`kv_both`, cores 0 and 1, started one after the
/// other), each publishing KV events to its own sidecar (which binds the SUB socket), the sidecars
/// following each other through the mesh once case 3 joins them. Cases, in order (the fault case
/// last, since it kills both engines):
///
/// * P/D by hand (the harness under case 5): `kv_transfer_params` legs sent straight to the engines.
/// * case 2: each sidecar's prefix index holds exactly the blocks its engine reported; after
///   `POST /reset_prefix_cache` and one request, only that request's blocks.
/// * case 3: precise routing through the two meshed sidecars lands every repeat of a long system
///   prompt on the engine holding it; vLLM's `prefix_cache_hits_total` beats round robin.
/// * case 5: a decode-role sidecar in front of engine b splits a long prompt by itself: prefill on
///   engine a (a prefill-role sidecar, found through the mesh), KV over NIXL, decode on b; case 5b
///   the same for a `/v1/responses` request; case 5c: a prefill-role sidecar in front of engine a
///   splits one, its first decode pod refuses, and the decode leg re-sent to b's sidecar with the
///   same `kv_transfer_params` pulls a's KV over NIXL (issue 42).
/// * case 7: prefill engine down (fallback or clear error, per `pd.on_prefill_failure`), then the
///   decode engine killed mid-stream.
#[test]
fn vllm_pair_group() -> Result<()> {
    let _one_group_at_a_time = engines_lock();
    let mut t = Timings::new("pair");
    let venv = t.step("set-up: vLLM venv", vllm::setup::venv)?;
    let work = work_dir();
    let (specs, events) = two_with_events(["a", "b"], |s| EngineSpec {
        nixl: Some(KvRole::Both),
        kv_cache_bytes: PAIR_KV_BLOCKS * 65_536,
        ..s
    })?;
    let mut engines = t.step(
        "start two vLLM engines (NixlConnector kv_both, KV events)",
        || Engine::start_all(&venv, work.path(), &specs),
    )?;
    let rt = runtime();
    let http = Http::default();
    let tokenizer = case_hashes::rust_tokenizer()?;

    t.step(
        "P/D by hand: prefill on a, decode on b, KV over NIXL",
        || rt.block_on(vllm::case_pd::manual_pd(&http, &engines[0], &engines[1])),
    )?;

    let peers = [work.path().join("peers-a"), work.path().join("peers-b")];
    let [sa, sb] = t.step(
        "start a sidecar per engine (KV events, mesh not joined)",
        || {
            rt.block_on(async {
                let mut out = Vec::new();
                for i in 0..2 {
                    std::fs::write(&peers[i], "")?;
                    let yaml = case_mesh::pair_sidecar_yaml(&engines[i], &events[i], &peers[i])?;
                    let s = SidecarUnderTest::from_yaml(yaml).await?;
                    wait_ready(&http, &s.admin_url).await?;
                    out.push(s);
                }
                let [a, b]: [SidecarUnderTest; 2] = out
                    .try_into()
                    .map_err(|_| anyhow::anyhow!("two sidecars"))?;
                anyhow::Ok([a, b])
            })
        },
    )?;

    t.step(
        "case 2: each sidecar's prefix index = what its vLLM reported; reset clears it",
        || {
            rt.block_on(async {
                for (engine, sidecar) in engines.iter().zip([&sa, &sb]) {
                    case_mesh::wait_events_flow(&http, engine, sidecar).await?;
                    case_mesh::ingest(&http, &tokenizer, engine, sidecar).await?;
                }
                anyhow::Ok(())
            })
        },
    )?;
    t.step(
        "case 3: precise routing through two meshed sidecars vs round robin",
        || {
            rt.block_on(async {
                case_mesh::join([&sa, &sb], [&peers[0], &peers[1]]).await?;
                case_mesh::precise_routing(&http, &tokenizer, &engines, [&sa, &sb]).await
            })
        },
    )?;

    let filters = work.path().join("filters-pd.yaml");
    let pd_peers = work.path().join("peers-pd");
    let [prefill_side, decode_side, strict_side] = t.step(
        "start P/D sidecars (prefill on a; decode on b: aggregated and error fallback)",
        || {
            rt.block_on(async {
                std::fs::write(&filters, case_pd::PD_FILTERS)?;
                let p =
                    SidecarUnderTest::from_yaml(case_pd::prefill_sidecar_yaml(&engines[0])).await?;
                let mesh = p.handle().mesh_addr().context("mesh on")?;
                std::fs::write(&pd_peers, format!("{mesh}\n"))?;
                let d = SidecarUnderTest::from_yaml(case_pd::decode_sidecar_yaml(
                    &engines[1],
                    &filters,
                    &pd_peers,
                    "aggregated",
                ))
                .await?;
                let e = SidecarUnderTest::from_yaml(case_pd::decode_sidecar_yaml(
                    &engines[1],
                    &filters,
                    &pd_peers,
                    "error",
                ))
                .await?;
                for s in [&p, &d, &e] {
                    wait_ready(&http, &s.admin_url).await?;
                }
                for s in [&d, &e] {
                    wait_split(&http, s).await?;
                }
                anyhow::Ok([p, d, e])
            })
        },
    )?;
    t.step(
        "case 5: P/D through the sidecar (--pd-connector nixl), decided by its scheduler",
        || {
            rt.block_on(case_pd::through_sidecar(
                &http,
                &engines[0],
                &engines[1],
                &decode_side,
            ))
        },
    )?;
    t.step(
        "case 5b: /v1/responses P/D through the sidecar, decided by its scheduler",
        || {
            rt.block_on(case_pd::responses_through_sidecar(
                &http,
                &engines[0],
                &engines[1],
                &decode_side,
            ))
        },
    )?;
    t.step(
        "case 5c: a decode pod that fails before its first token: the leg re-sent to b pulls a's KV",
        || {
            rt.block_on(async {
                let splitter = SidecarUnderTest::from_yaml(
                    case_pd::splitting_prefill_sidecar_yaml(&engines[0], &filters),
                )
                .await?;
                wait_ready(&http, &splitter.admin_url).await?;
                let r = case_pd::decode_leg_resent(
                    &http,
                    &engines[0],
                    &engines[1],
                    &decode_side,
                    &splitter,
                )
                .await;
                splitter.shutdown().await;
                r
            })
        },
    )?;
    t.step(
        "case 7a: prefill engine killed: fallback (aggregated) or 502 (error)",
        || {
            rt.block_on(case_faults::prefill_down(
                &http,
                &mut engines[0],
                &decode_side,
                &strict_side,
            ))
        },
    )?;
    t.step(
        "case 7b: decode engine killed mid-stream: clean error, sidecar keeps serving",
        || {
            rt.block_on(case_faults::decode_killed_mid_stream(
                &http,
                &mut engines[1],
                &decode_side,
            ))
        },
    )?;
    rt.block_on(async {
        for s in [sa, sb, prefill_side, decode_side, strict_side] {
            s.shutdown().await;
        }
    });
    Ok(())
}

/// Group "migration" (issue 42): two engines (cores 0 and 1), each behind its sidecar, the sidecars
/// meshed; sidecar a's filter config keeps the client's requests on engine a.
///
/// * case 10: two uninterrupted greedy runs (one per engine) agree; then a completion stream
///   (`return_token_ids`), a chat stream and a `/v1/responses` stream through sidecar a, engine a
///   SIGKILLed after 8 events of each: all finish on engine b with the uninterrupted run's text
///   (and token ids), one `id`, `usage` counting the whole, and sidecar a counts three migrations.
#[test]
fn vllm_migration_group() -> Result<()> {
    let _one_group_at_a_time = engines_lock();
    let mut t = Timings::new("migration");
    let venv = t.step("set-up: vLLM venv", vllm::setup::venv)?;
    let work = work_dir();
    let spec = |name, cpu, interval: u32| EngineSpec {
        kv_cache_bytes: PAIR_KV_BLOCKS * 65_536,
        extra_args: vec!["--stream-interval".to_owned(), interval.to_string()],
        ..EngineSpec::new(name, cpu)
    };
    let mut engines = t.step("start two vLLM engines (a: --stream-interval 3)", || {
        Engine::start_all(&venv, work.path(), &[spec("a", 0, 3), spec("b", 1, 1)])
    })?;
    let rt = runtime();
    let http = Http::default();
    let peers = [work.path().join("peers-a"), work.path().join("peers-b")];
    let filters = work.path().join("filters-a.yaml");
    let [sa, sb] = t.step("start a sidecar per engine, meshed", || {
        rt.block_on(async {
            std::fs::write(&filters, case_migration::FILTERS_A)?;
            let mut out = Vec::new();
            for (i, label) in ["a", "b"].into_iter().enumerate() {
                std::fs::write(&peers[i], "")?;
                let f = (i == 0).then_some(filters.as_path());
                let yaml = case_migration::sidecar_yaml(&engines[i], label, &peers[i], f);
                let s = SidecarUnderTest::from_yaml(yaml).await?;
                wait_ready(&http, &s.admin_url).await?;
                out.push(s);
            }
            let [a, b]: [SidecarUnderTest; 2] = out
                .try_into()
                .map_err(|_| anyhow::anyhow!("two sidecars"))?;
            case_mesh::join([&a, &b], [&peers[0], &peers[1]]).await?;
            case_migration::wait_peer_healthy(&a, &b).await?;
            anyhow::Ok([a, b])
        })
    })?;
    t.step(
        "case 10: engine a SIGKILLed mid-stream: the streams go on on b, as an uninterrupted run",
        || rt.block_on(case_migration::killed_mid_stream(&http, &mut engines, &sa)),
    )?;
    rt.block_on(async {
        sa.shutdown().await;
        sb.shutdown().await;
    });
    Ok(())
}

/// Group "dp": one engine with `--data-parallel-size 2` (rank r on core r), both ranks' KV events
/// to one sidecar with `engine.data_parallel_size: 2`.
///
/// * case 8: each rank's blocks reach the sidecar under its rank, every batch carries its `dp_rank`;
///   through the sidecar a rank's prefix goes back to that rank (vLLM's per-rank request and
///   prefix-cache hit counters), and with rank 0 busy (seen in vLLM's `engine="0"` metrics) a fresh
///   prompt goes to rank 1 while rank 0's prefix stays on rank 0.
#[test]
fn vllm_dp_group() -> Result<()> {
    let _one_group_at_a_time = engines_lock();
    let mut t = Timings::new("dp");
    let venv = t.step("set-up: vLLM venv", vllm::setup::venv)?;
    let work = work_dir();
    let events = format!("tcp://127.0.0.1:{}", vllm::consecutive_ports(2)?);
    let spec = EngineSpec {
        data_parallel: 2,
        kv_cache_bytes: PAIR_KV_BLOCKS * 65_536,
        kv_events_to: Some(events.clone()),
        ..EngineSpec::new("dp", 0)
    };
    let engines = t.step("start vLLM --data-parallel-size 2 (KV events)", || {
        Engine::start_all(&venv, work.path(), std::slice::from_ref(&spec))
    })?;
    let rt = runtime();
    let http = Http::default();
    let sidecar = t.step("start the sidecar (data_parallel_size: 2)", || {
        rt.block_on(async {
            let s =
                SidecarUnderTest::from_yaml(case_dp::sidecar_yaml(&engines[0], &events)?).await?;
            wait_ready(&http, &s.admin_url).await?;
            anyhow::Ok(s)
        })
    })?;
    t.step(
        "case 8: data-parallel ranks: events, load and X-data-parallel-rank",
        || rt.block_on(case_dp::check(&http, &engines[0], &sidecar)),
    )?;
    rt.block_on(sidecar.shutdown());
    Ok(())
}

/// Group "lora": one engine with LoRA on and runtime adapter updates (`--enable-lora`,
/// `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`), sidecar B in front of it, sidecar A in front of a
/// simulated engine serving the same base model, the two meshed.
///
/// * case 9: an adapter written for tiny-llama, loaded on vLLM while everything runs, reaches A (B's
///   `/v1/models`, the mesh's `Adapters` frame); A's requests for it are served by vLLM (its greedy
///   text the base model's: `lora_B` is zero) and vLLM's `vllm:lora_requests_info` names it;
///   unloaded, it leaves A's view of B and A answers 404 for it.
#[test]
fn vllm_lora_group() -> Result<()> {
    let _one_group_at_a_time = engines_lock();
    let mut t = Timings::new("lora");
    let venv = t.step("set-up: vLLM venv", vllm::setup::venv)?;
    let work = work_dir();
    let adapter = t.step("write a LoRA adapter for tiny-llama", || {
        case_lora::write_adapter(&venv, work.path())
    })?;
    let spec = EngineSpec {
        extra_args: case_lora::engine_args(),
        env: case_lora::engine_env(),
        ..EngineSpec::new("lora", 0)
    };
    let engines = t.step("start vLLM --enable-lora (runtime updates on)", || {
        Engine::start_all(&venv, work.path(), std::slice::from_ref(&spec))
    })?;
    let rt = runtime();
    let http = Http::default();
    let peers = [work.path().join("peers-a"), work.path().join("peers-b")];
    let (sim, a, b) = t.step(
        "start a simulated engine and the two sidecars, meshed",
        || {
            rt.block_on(async {
                let sim = kvmesh_engine_sim::Engine::start_local(
                    kvmesh_engine_sim::SimConfig::new(vllm::MODEL).with_time_scale(10.0),
                )
                .await?;
                for p in &peers {
                    std::fs::write(p, "")?;
                }
                let sim_url = format!("http://{}", sim.addr());
                let a = SidecarUnderTest::from_yaml(case_lora::sidecar_yaml(&sim_url, &peers[0]))
                    .await?;
                let b = SidecarUnderTest::from_yaml(case_lora::sidecar_yaml(
                    &engines[0].base_url,
                    &peers[1],
                ))
                .await?;
                wait_ready(&http, &a.admin_url).await?;
                wait_ready(&http, &b.admin_url).await?;
                case_mesh::join([&a, &b], [&peers[0], &peers[1]]).await?;
                anyhow::Ok((sim, a, b))
            })
        },
    )?;
    t.step(
        "case 9: a LoRA adapter loaded and unloaded at run time, routed to through the mesh",
        || rt.block_on(case_lora::run(&http, &engines[0], &a, &b, &adapter)),
    )?;
    rt.block_on(async {
        a.shutdown().await;
        b.shutdown().await;
        sim.shutdown().await;
    });
    Ok(())
}

/// Group "pressure" (issue 40, item 3): two engines (cores 0 and 1) of 40 KV blocks each, KV
/// events to one sidecar each, the sidecars meshed; sequences of 11, 12 and 13 prefix groups that
/// need 1.5-1.8x the fleet's KV, sent one request at a time in a cycle (`case_cache_pressure`'s
/// module docs give the sizes).
///
/// * case 11: the same sequence (other prompts each time, caches reset between) by round-robin,
///   by SMG's cache_aware when installed, by kvmesh's built-in default and by kvmesh with
///   `eviction-cost-scorer` (`deploy/examples/filters-cache-pressure.yaml`); by vLLM's own
///   prefix-cache counters over cycles 2-4, the last hits at least 0.15 more of the prompt tokens
///   than round-robin, and more than SMG.
#[test]
fn vllm_pressure_group() -> Result<()> {
    use vllm::case_cache_pressure as pressure;
    let _one_group_at_a_time = engines_lock();
    let mut t = Timings::new("pressure");
    let venv = t.step("set-up: vLLM venv", vllm::setup::venv)?;
    let work = work_dir();
    let (specs, events) = two_with_events(["pressure-a", "pressure-b"], |s| EngineSpec {
        kv_cache_bytes: pressure::KV_BLOCKS * 65_536,
        ..s
    })?;
    let engines = t.step("start two vLLM engines (40 KV blocks, KV events)", || {
        Engine::start_all(&venv, work.path(), &specs)
    })?;
    let rt = runtime();
    let http = Http::default();
    let tokenizer = case_hashes::rust_tokenizer()?;
    let filters = work.path().join("filters.yaml");
    let peers = [work.path().join("peers-a"), work.path().join("peers-b")];
    let [sa, sb] = t.step("start a sidecar per engine (KV events), meshed", || {
        rt.block_on(async {
            std::fs::write(&filters, pressure::example("filters-default.yaml")?)?;
            let mut out = Vec::new();
            for i in 0..2 {
                std::fs::write(&peers[i], "")?;
                let yaml = pressure::sidecar_yaml(&engines[i], &events[i], &peers[i], &filters)?;
                let s = SidecarUnderTest::from_yaml(yaml).await?;
                wait_ready(&http, &s.admin_url).await?;
                case_mesh::wait_events_flow(&http, &engines[i], &s).await?;
                out.push(s);
            }
            let [a, b]: [SidecarUnderTest; 2] = out
                .try_into()
                .map_err(|_| anyhow::anyhow!("two sidecars"))?;
            case_mesh::join([&a, &b], [&peers[0], &peers[1]]).await?;
            anyhow::Ok([a, b])
        })
    })?;
    let rr = t.step("case 11a: round-robin", || {
        rt.block_on(pressure::round_robin(&http, &tokenizer, &engines))
    })?;
    let smg = t.step("case 11b: SMG cache_aware (when installed)", || {
        rt.block_on(pressure::smg(&http, &tokenizer, &engines))
    })?;
    let smg = match smg {
        Ok(figures) => Some(figures),
        Err(why) => {
            vllm::report::note(&format!("pressure: SMG not compared: {why}"));
            None
        }
    };
    let kvmesh = |name: &str, router| {
        rt.block_on(async {
            let yaml = pressure::example(name)?;
            pressure::kvmesh(
                &http,
                &tokenizer,
                &engines,
                [&sa, &sb],
                (&filters, &yaml),
                router,
            )
            .await
        })
    };
    t.step("case 11c: kvmesh, the built-in default", || {
        kvmesh("filters-default.yaml", "kvmesh-default")
    })?;
    let kvmesh = t.step(
        "case 11d: kvmesh with eviction-cost-scorer (filters-cache-pressure.yaml)",
        || kvmesh("filters-cache-pressure.yaml", "kvmesh-cache-pressure"),
    )?;
    t.step(
        "case 11: kvmesh's hit rate vs round-robin's and SMG's",
        || pressure::check(&rr, smg.as_ref(), &kvmesh),
    )?;
    rt.block_on(async {
        sa.shutdown().await;
        sb.shutdown().await;
    });
    Ok(())
}

/// Waits until `sidecar`'s scheduler would split a long prompt (its prefill peer is known, fresh
/// and healthy), asking its admin `POST /debug/route`, which sends nothing upstream.
async fn wait_split(http: &Http, sidecar: &SidecarUnderTest) -> Result<()> {
    let body = serde_json::json!({"model": vllm::MODEL, "prompt": vllm::long_prompt("probe", 300),
                                  "max_tokens": 4});
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    while Instant::now() < deadline {
        let reply = http
            .post_json(&format!("{}/debug/route", sidecar.admin_url), &body)
            .await?;
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&reply.body) {
            if v["decision"] == "disaggregated" {
                return Ok(());
            }
        }
        last = reply.text();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("the decode sidecar never decided to split a long prompt; last /debug/route: {last}")
}
