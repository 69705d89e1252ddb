//! LoRA adapters loaded and unloaded at run time answer as vLLM 0.32 does
//! (`tests/fixtures/vllm-cpu/lora/`): the load and unload routes, the
//! adapter's model card, requests run with it, and `vllm:lora_requests_info`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use kvmesh_engine_sim::{Engine, SimConfig};
use serde_json::{json, Value};

fn lora_series(metrics: &str) -> Vec<&str> {
    metrics
        .lines()
        .filter(|l| l.starts_with("vllm:lora_requests_info{"))
        .collect()
}

#[tokio::test]
async fn an_adapter_loaded_at_run_time_serves_until_unloaded() {
    let e = Engine::start_local(
        SimConfig::new("tiny-llama")
            .with_time_scale(100.0)
            .with_max_loras(2),
    )
    .await
    .unwrap();
    let path = std::env::temp_dir().to_string_lossy().into_owned();
    let load = json!({"lora_name": "sql-lora", "lora_path": path});
    let (s, body) = request(e.addr(), "POST", "/v1/load_lora_adapter", Some(&load)).await;
    assert_eq!(
        (s, &body[..]),
        (
            200,
            &b"Success: LoRA adapter 'sql-lora' added successfully."[..]
        )
    );
    let (s, again) = post(e.addr(), "/v1/load_lora_adapter", &load).await;
    assert_eq!(
        (s, again["error"]["type"].as_str()),
        (400, Some("InvalidUserInput"))
    );

    // The adapter's card has the real one's keys, its parent the base model.
    let models: Value = serde_json::from_str(&get_text(e.addr(), "/v1/models").await).unwrap();
    let real: Value =
        serde_json::from_str(&capture_body("vllm-cpu/lora/models-loaded.json")).unwrap();
    assert_same_shape("models", &models, &real);
    assert_eq!(models["data"][1]["id"], "sql-lora");
    assert_eq!(models["data"][1]["parent"], "tiny-llama");

    let mut req = completion("one two three four", 3);
    req["model"] = json!("sql-lora");
    let (s, out) = post(e.addr(), "/v1/completions", &req).await;
    assert_eq!((s, out["model"].as_str()), (200, Some("sql-lora")));
    let metrics = get_text(e.addr(), "/metrics").await;
    let series = lora_series(&metrics);
    assert!(
        series
            .iter()
            .any(|l| l.contains("running_lora_adapters=\"sql-lora\"")),
        "{series:?}"
    );
    // Idle again: the newest series names no adapter, as vLLM's does.
    let newest = series
        .iter()
        .max_by(|a, b| {
            let t = |l: &str| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap();
            t(a).total_cmp(&t(b))
        })
        .unwrap();
    assert!(newest.contains("running_lora_adapters=\"\""), "{newest}");

    let unload = json!({"lora_name": "sql-lora"});
    let (s, _) = request(e.addr(), "POST", "/v1/unload_lora_adapter", Some(&unload)).await;
    assert_eq!(s, 200);
    let (s, gone) = post(e.addr(), "/v1/unload_lora_adapter", &unload).await;
    assert_eq!(
        (s, gone["error"]["type"].as_str()),
        (404, Some("NotFoundError"))
    );
    let (s, _) = post(e.addr(), "/v1/completions", &req).await;
    assert_eq!(s, 404);
    let models: Value = serde_json::from_str(&get_text(e.addr(), "/v1/models").await).unwrap();
    assert_eq!(models["data"].as_array().unwrap().len(), 1);
    e.shutdown().await;
}

#[tokio::test]
async fn without_lora_there_are_no_adapter_routes_and_no_gauge() {
    let e = Engine::start_local(SimConfig::new("tiny-llama").with_time_scale(100.0))
        .await
        .unwrap();
    let load = json!({"lora_name": "a", "lora_path": "/"});
    let (s, _) = post(e.addr(), "/v1/load_lora_adapter", &load).await;
    assert_eq!(s, 404);
    assert!(!get_text(e.addr(), "/metrics")
        .await
        .contains("vllm:lora_requests_info"));
    e.shutdown().await;
}
