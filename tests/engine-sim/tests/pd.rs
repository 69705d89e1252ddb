//! Prefill/decode: NixlConnector-shaped `kv_transfer_params` round trip
//! between a prefill and a decode engine, the recompute fallback for unknown or
//! expired parameters, and SGLang's bootstrap rendezvous.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use kvmesh_engine_sim::{Engine, Flavor, Role, SimConfig, SimHandle};
use serde_json::{json, Value};

async fn pair(flavor: Flavor, hold_s: f64) -> (SimHandle, SimHandle) {
    let mut p = SimConfig::new("sim")
        .with_time_scale(100.0)
        .with_role(Role::Prefill)
        .with_flavor(flavor);
    p.pd_hold_timeout_s = hold_s;
    p.bootstrap_timeout_s = 20.0;
    let mut d = SimConfig::new("sim")
        .with_time_scale(100.0)
        .with_role(Role::Decode)
        .with_flavor(flavor);
    d.bootstrap_timeout_s = 20.0;
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
                      "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 4242});
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
    // A lone half times out like SGLang's KVTransferError.
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
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("KVTransferError(bootstrap_room=777)"));
    lone.shutdown().await;
    p.shutdown().await;
}
