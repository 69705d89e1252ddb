//! Prefill/decode: NixlConnector-shaped `kv_transfer_params` round trip
//! between a prefill and a decode engine, the recompute fallback for unknown,
//! expired or unreachable parameters, and SGLang's bootstrap rendezvous; in
//! one process through the in-process shortcut, in one process over the side
//! channel (shortcut off), and between separate simulator processes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use kvmesh_engine_sim::{Engine, Flavor, Role, SimConfig, SimHandle, SimProcess};
use serde_json::{json, Value};

async fn pair(flavor: Flavor, hold_s: f64) -> (SimHandle, SimHandle) {
    pair_with(flavor, hold_s, true).await
}

/// A prefill and a decode engine; `shortcut` false makes the decode engine
/// fetch over the prefill engine's side channel, as across processes.
async fn pair_with(flavor: Flavor, hold_s: f64, shortcut: bool) -> (SimHandle, SimHandle) {
    let mut p = SimConfig::new("sim")
        .with_time_scale(100.0)
        .with_role(Role::Prefill)
        .with_flavor(flavor);
    p.pd_hold_timeout_s = hold_s;
    p.bootstrap_timeout_s = 20.0;
    let mut d = SimConfig::new("sim")
        .with_time_scale(100.0)
        .with_role(Role::Decode)
        .with_flavor(flavor)
        .with_pd_in_process(shortcut);
    d.bootstrap_timeout_s = 20.0;
    d.side_channel_timeout = Duration::from_millis(500);
    (
        Engine::start_local(p).await.unwrap(),
        Engine::start_local(d).await.unwrap(),
    )
}

fn prefill_body(prompt: &str) -> Value {
    json!({"model": "sim", "prompt": prompt, "max_tokens": 1, "stream": false,
           "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                                  "remote_block_ids": null, "remote_host": null, "remote_port": null}})
}

fn captured_params() -> Value {
    let text = std::fs::read_to_string(format!("{FIXTURES}/vllm-cpu/probe/pd_probe.txt")).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("PREFILL RESPONSE"))
        .unwrap();
    let json_start = line.find('{').unwrap();
    let v: Value = serde_json::from_str(&line[json_start..]).unwrap();
    v["kv_transfer_params"].clone()
}

async fn wait_until(mut f: impl FnMut() -> bool) -> bool {
    for _ in 0..500 {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    false
}

#[tokio::test]
async fn nixl_params_round_trip() {
    let (p, d) = pair(Flavor::Vllm, 480.0).await;
    let prompt = words("pd", 100); // 101 tokens: 7 blocks of 16
    let (s, pr) = post(p.addr(), "/v1/completions", &prefill_body(&prompt)).await;
    assert_eq!(s, 200);
    let params = pr["kv_transfer_params"].clone();
    assert_same_shape("kv_transfer_params", &params, &captured_params());
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["remote_engine_id"], p.engine_id());
    assert_eq!(params["remote_block_ids"][0].as_array().unwrap().len(), 7);
    assert_eq!(params["remote_num_tokens"], 101);
    assert_eq!(
        p.stats().held_transfers,
        1,
        "prefill holds the blocks for the decoder"
    );
    let mut body = completion(&prompt, 12);
    body["kv_transfer_params"] = params;
    let (s, dr) = post(d.addr(), "/v1/completions", &body).await;
    assert_eq!(s, 200);
    assert_eq!(dr["usage"]["completion_tokens"], 12);
    assert_eq!(dr["kv_transfer_params"], Value::Null);
    assert_eq!(d.stats().external_kv_tokens, 101);
    assert!(d
        .metrics_text()
        .contains("source=\"external_kv_transfer\"} 101.0"));
    assert!(d.metrics_text().contains("source=\"local_compute\"} 0.0"));
    assert!(
        wait_until(|| p.stats().held_transfers == 0).await,
        "the fetch frees the prefill's blocks"
    );
    // The same parameters cannot be fetched twice: the decoder recomputes.
    let (s, _) = post(d.addr(), "/v1/completions", &body).await;
    assert_eq!(s, 200);
    assert_eq!(d.stats().external_kv_tokens, 101);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn unknown_or_expired_params_recompute() {
    let (p, d) = pair(Flavor::Vllm, 0.5).await; // 0.5 s simulated = 5 ms real
    let prompt = words("exp", 60);
    let (_, pr) = post(p.addr(), "/v1/completions", &prefill_body(&prompt)).await;
    let params = pr["kv_transfer_params"].clone();
    assert!(
        wait_until(|| p.stats().held_transfers == 0).await,
        "a hold expires on its own"
    );
    let mut body = completion(&prompt, 4);
    body["kv_transfer_params"] = params.clone();
    assert_eq!(post(d.addr(), "/v1/completions", &body).await.0, 200);
    let mut bogus = params;
    bogus["remote_request_id"] = json!("cmpl-nope-0-00000000");
    body["kv_transfer_params"] = bogus;
    assert_eq!(post(d.addr(), "/v1/completions", &body).await.0, 200);
    body["kv_transfer_params"] = json!({"do_remote_prefill": true});
    assert_eq!(post(d.addr(), "/v1/completions", &body).await.0, 200);
    assert_eq!(d.stats().external_kv_tokens, 0, "every one was recomputed");
    assert_eq!(d.completed_requests().len(), 3);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn sglang_bootstrap_needs_both_halves() {
    let (p, d) = pair(Flavor::Sglang, 480.0).await;
    let prompt = words("sg", 50);
    let body = json!({"model": "sim", "prompt": prompt, "max_tokens": 8,
                      "bootstrap_host": "127.0.0.1", "bootstrap_port": p.addr().port(), "bootstrap_room": 4242});
    let (pa, da) = (p.addr(), d.addr());
    let (b1, b2) = (body.clone(), body.clone());
    let (pr, dr) = tokio::join!(
        post(pa, "/v1/completions", &b1),
        post(da, "/v1/completions", &b2)
    );
    assert_eq!(pr.0, 200);
    assert_eq!(
        pr.1["usage"]["completion_tokens"], 1,
        "prefill answers with one token"
    );
    assert_eq!(dr.0, 200);
    assert_eq!(dr.1["usage"]["completion_tokens"], 8);
    assert_eq!(d.stats().external_kv_tokens, 51);
    // A decode request without bootstrap fields is refused.
    assert_eq!(
        post(da, "/v1/completions", &completion(&prompt, 2)).await.0,
        400
    );
    d.shutdown().await;
    // A lone half times out like SGLang's KVTransferError: its prefill engine
    // answers bootstrap but never gets the prefill half of room 777.
    let mut cfg = SimConfig::new("sim")
        .with_time_scale(100.0)
        .with_role(Role::Decode)
        .with_flavor(Flavor::Sglang);
    cfg.bootstrap_timeout_s = 2.0;
    let lone = Engine::start_local(cfg).await.unwrap();
    let mut b = body;
    b["bootstrap_room"] = json!(777);
    let (s, err) = post(lone.addr(), "/v1/completions", &b).await;
    assert_eq!(s, 500);
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("KVTransferError(bootstrap_room=777): Request 777 timed out after 2.0s"),
        "{msg}"
    );
    // No bootstrap server at the address: the decode half fails at once.
    b["bootstrap_room"] = json!(778);
    b["bootstrap_port"] = json!(refused_port());
    let (s, err) = post(lone.addr(), "/v1/completions", &b).await;
    assert_eq!(s, 500);
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("KVTransferError(bootstrap_room=778): Could not fetch prefill parallel info"),
        "{msg}"
    );
    lone.shutdown().await;
    p.shutdown().await;
}

#[tokio::test]
async fn sglang_decode_half_streams_token_by_token() {
    let (p, d) = pair(Flavor::Sglang, 480.0).await;
    let body = json!({"model": "sim", "prompt": words("st", 40), "max_tokens": 6, "stream": true,
                      "stream_options": {"include_usage": true},
                      "bootstrap_host": "127.0.0.1", "bootstrap_port": p.addr().port(), "bootstrap_room": 99});
    let (pa, da) = (p.addr(), d.addr());
    let ((ps, _), (ds, db)) = tokio::join!(
        request(pa, "POST", "/v1/completions", Some(&body)),
        request(da, "POST", "/v1/completions", Some(&body))
    );
    assert_eq!((ps, ds), (200, 200));
    let events = sse_events(&db);
    let tokens = events
        .iter()
        .filter(|e| {
            e["choices"][0]["text"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
        })
        .count();
    assert_eq!(tokens, 6, "one chunk per token: {events:?}");
    assert_eq!(events.last(), Some(&Value::String("[DONE]".into())));
    let usage = events.iter().find(|e| e["usage"].is_object()).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    p.shutdown().await;
    d.shutdown().await;
}

/// A port nothing listens on.
fn refused_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// The value of one series in a `/metrics` text, by its exact name and labels.
fn series(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name_and_labels)?;
        rest.strip_prefix(' ')?.trim().parse().ok()
    })
}

/// Polls `GET path` on `addr` until `ok` holds for its JSON, for at most 5 s.
async fn eventually_json(
    addr: std::net::SocketAddr,
    path: &str,
    ok: impl Fn(&Value) -> bool,
) -> Value {
    let mut last = Value::Null;
    for _ in 0..250 {
        let (s, b) = request(addr, "GET", path, None).await;
        last = serde_json::from_slice(&b).unwrap_or(Value::Null);
        if s == 200 && ok(&last) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("GET {path} on {addr}: condition not met within 5 s; last {last}");
}

const EXTERNAL: &str = r#"vllm:prompt_tokens_by_source_total{engine="0",model_name="sim",source="external_kv_transfer"}"#;
const LOCAL: &str =
    r#"vllm:prompt_tokens_by_source_total{engine="0",model_name="sim",source="local_compute"}"#;
const FAILED: &str = r#"vllm:nixl_num_failed_transfers_total{engine="0",model_name="sim"}"#;

#[tokio::test]
async fn nixl_fetch_over_the_side_channel_frees_the_prefill() {
    let (p, d) = pair_with(Flavor::Vllm, 480.0, false).await;
    let prompt = words("side", 100); // 101 tokens
    let (s, pr) = post(p.addr(), "/v1/completions", &prefill_body(&prompt)).await;
    assert_eq!(s, 200);
    let params = pr["kv_transfer_params"].clone();
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(
        params["remote_port"],
        p.addr().port(),
        "the side channel is the prefill engine's HTTP port"
    );
    assert_eq!(p.stats().held_transfers, 1);
    assert!(p.stats().kv_usage > 0.0);
    let mut body = completion(&prompt, 12);
    body["kv_transfer_params"] = params;
    let (s, dr) = post(d.addr(), "/v1/completions", &body).await;
    assert_eq!(s, 200);
    assert_eq!(dr["usage"]["completion_tokens"], 12);
    let text = d.metrics_text();
    assert_eq!(series(&text, EXTERNAL), Some(101.0), "{text}");
    assert_eq!(series(&text, LOCAL), Some(0.0));
    assert_eq!(series(&text, FAILED), Some(0.0));
    let fetches: Vec<_> = p
        .received_requests()
        .into_iter()
        .filter(|r| r.path == "/kvmesh-sim/nixl/fetch")
        .collect();
    assert_eq!(
        fetches.len(),
        1,
        "the decode engine called the side channel"
    );
    assert!(
        wait_until(|| p.stats().held_transfers == 0 && p.stats().kv_usage == 0.0).await,
        "the fetch frees the prefill's blocks: {:?}",
        p.stats()
    );
    // Fetched once: the same parameters again are unknown, and recomputed.
    let (s, _) = post(d.addr(), "/v1/completions", &body).await;
    assert_eq!(s, 200);
    let text = d.metrics_text();
    assert_eq!(series(&text, EXTERNAL), Some(101.0));
    assert_eq!(series(&text, FAILED), Some(1.0));
    assert_eq!(d.stats().failed_kv_transfers, 1);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn an_unreachable_unknown_or_silent_remote_recomputes_and_is_counted() {
    let (p, d) = pair_with(Flavor::Vllm, 480.0, false).await;
    let prompt = words("gone", 60); // 61 tokens
    let (_, pr) = post(p.addr(), "/v1/completions", &prefill_body(&prompt)).await;
    let params = pr["kv_transfer_params"].clone();
    let mut body = completion(&prompt, 4);
    // Nothing listens at the side channel.
    let mut unreachable = params.clone();
    unreachable["remote_port"] = json!(refused_port());
    body["kv_transfer_params"] = unreachable;
    assert_eq!(post(d.addr(), "/v1/completions", &body).await.0, 200);
    // The right engine, but not the engine id it holds the transfer under.
    let mut unknown = params.clone();
    unknown["remote_engine_id"] = json!("not-this-engine");
    body["kv_transfer_params"] = unknown;
    assert_eq!(post(d.addr(), "/v1/completions", &body).await.0, 200);
    // A side channel that accepts and never answers: bounded by the deadline.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut hung = params.clone();
    hung["remote_port"] = json!(silent.local_addr().unwrap().port());
    body["kv_transfer_params"] = hung;
    let started = std::time::Instant::now();
    assert_eq!(post(d.addr(), "/v1/completions", &body).await.0, 200);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // Invalid parameters (no host, port, ids) recompute without a fetch: not a failed transfer.
    body["kv_transfer_params"] = json!({"do_remote_prefill": true});
    assert_eq!(post(d.addr(), "/v1/completions", &body).await.0, 200);
    let text = d.metrics_text();
    assert_eq!(
        series(&text, EXTERNAL),
        Some(0.0),
        "every one was recomputed"
    );
    assert_eq!(
        series(&text, LOCAL),
        Some(4.0 * 61.0 - d.stats().prefix_hits as f64)
    );
    assert_eq!(series(&text, FAILED), Some(3.0), "{text}");
    assert_eq!(d.stats().failed_kv_transfers, 3);
    assert_eq!(
        p.stats().held_transfers,
        1,
        "nothing fetched the real transfer"
    );
    drop(silent);
    p.shutdown().await;
    d.shutdown().await;
}

fn sim_bin() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_BIN_EXE_kvmesh-engine-sim"))
}

async fn sim_process(args: &[&str]) -> SimProcess {
    let mut all = vec!["--model", "sim", "--time-scale", "100"];
    all.extend_from_slice(args);
    SimProcess::spawn(sim_bin(), &all, Duration::from_secs(30))
        .await
        .unwrap()
}

#[tokio::test]
async fn nixl_between_two_processes() {
    let (p, d) = tokio::join!(
        sim_process(&["--role", "prefill"]),
        sim_process(&["--role", "decode"])
    );
    let prompt = words("proc", 100); // 101 tokens
    let (s, pr) = post(p.addr(), "/v1/completions", &prefill_body(&prompt)).await;
    assert_eq!(s, 200);
    let params = pr["kv_transfer_params"].clone();
    assert_eq!(params["remote_engine_id"], p.engine_id());
    assert_eq!(params["remote_port"], p.addr().port());
    eventually_json(p.addr(), "/sim/stats", |v| v["held_transfers"] == 1).await;
    let mut body = completion(&prompt, 8);
    body["kv_transfer_params"] = params;
    let (s, dr) = post(d.addr(), "/v1/completions", &body).await;
    assert_eq!(s, 200, "{dr}");
    assert_eq!(dr["usage"]["completion_tokens"], 8);
    let text = get_text(d.addr(), "/metrics").await;
    assert_eq!(series(&text, EXTERNAL), Some(101.0), "{text}");
    assert_eq!(series(&text, LOCAL), Some(0.0));
    eventually_json(p.addr(), "/sim/stats", |v| {
        v["held_transfers"] == 0 && v["kv_cache_usage"] == 0.0
    })
    .await;
    // A stopped prefill engine: the decode engine recomputes and counts it.
    let (_, pr) = post(
        p.addr(),
        "/v1/completions",
        &prefill_body(&words("late", 40)),
    )
    .await;
    body = completion(&words("late", 40), 2);
    body["kv_transfer_params"] = pr["kv_transfer_params"].clone();
    p.shutdown().await;
    assert_eq!(post(d.addr(), "/v1/completions", &body).await.0, 200);
    let text = get_text(d.addr(), "/metrics").await;
    assert_eq!(series(&text, EXTERNAL), Some(101.0));
    assert_eq!(series(&text, FAILED), Some(1.0), "{text}");
    d.shutdown().await;
}

#[tokio::test]
async fn sglang_between_two_processes() {
    let (p, d) = tokio::join!(
        sim_process(&["--flavor", "sglang", "--role", "prefill"]),
        sim_process(&["--flavor", "sglang", "--role", "decode"])
    );
    let prompt = words("sgp", 50); // 51 tokens
    let body = json!({"model": "sim", "prompt": prompt, "max_tokens": 8,
                      "bootstrap_host": "127.0.0.1", "bootstrap_port": p.addr().port(), "bootstrap_room": 99});
    let (pr, dr) = tokio::join!(
        post(p.addr(), "/v1/completions", &body),
        post(d.addr(), "/v1/completions", &body)
    );
    assert_eq!(pr.0, 200, "{}", pr.1);
    assert_eq!(pr.1["usage"]["completion_tokens"], 1);
    assert_eq!(dr.0, 200, "{}", dr.1);
    assert_eq!(dr.1["usage"]["completion_tokens"], 8);
    let stats = eventually_json(d.addr(), "/sim/stats", |_| true).await;
    assert_eq!(stats["external_kv_tokens"], 51, "{stats}");
    p.shutdown().await;
    d.shutdown().await;
}
