//! Access logs (`logging.access_log: true`): one JSON line per request on the
//! `kvmesh::access` target, written when the response body ends (a stream's
//! last chunk, not its head), with the request id, the trace id of an incoming
//! `traceparent`, the route, the pod, TTFT, total time and status; none at all
//! with the key off.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use http_body_util::BodyExt;
use kvmesh_tests::access_lines::AccessLines;
use kvmesh_tests::client::{self, fetch, next_chunk, post_json, request, send};
use kvmesh_tests::fake_upstream::FakeUpstream;
use kvmesh_tests::sidecar::{start, test_config};
use serde_json::Value;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

#[tokio::test]
async fn a_request_writes_exactly_one_line_with_its_fields() {
    let lines = AccessLines::default();
    let _guard = lines.capture();
    let engine = kvmesh_tests::fake_vllm::start().await;
    let mut config = test_config(engine.addr());
    config.logging.access_log = true;
    let proxy = start(config).await;
    let id = proxy.fleet().local_id().to_owned();
    let c = client::http1();

    let traceparent = format!("00-{TRACE}-00f067aa0ba902b7-01");
    let req = request(
        "POST",
        proxy.addr(),
        "/v1/completions",
        r#"{"model":"m","prompt":"hello","max_tokens":2}"#,
        &[
            ("content-type", "application/json"),
            ("x-request-id", "req-1"),
            ("traceparent", &traceparent),
        ],
    );
    let r = fetch(&c, req).await;
    assert_eq!(r.status, 200);
    let got = lines.wait_for(1).await;
    assert_eq!(got.len(), 1, "{got:?}");
    let l = &got[0];
    assert_eq!(l["request_id"], "req-1");
    assert_eq!(l["trace_id"], TRACE);
    assert_eq!(l["method"], "POST");
    assert_eq!(l["route"], "/v1/completions");
    assert_eq!(l["model"], "m");
    assert_eq!(l["status"], 200);
    assert_eq!(l["pod"], id.as_str());
    assert_eq!(l["reason"], "scheduled");
    assert_eq!(l["attempts"], 1);
    assert_eq!(l["end"], "complete");
    assert_eq!(l["pd"], Value::Null);
    assert_eq!(l["rank"], Value::Null, "no data parallelism: {l}");
    assert!(l["ts"].as_str().unwrap().ends_with('Z'), "{l}");
    let (ttft, total) = (
        l["ttft_ms"].as_f64().unwrap(),
        l["total_ms"].as_f64().unwrap(),
    );
    assert!(0.0 < ttft && ttft <= total, "{l}");

    // An error answered by the sidecar itself: one line, its status, no pod.
    let r = fetch(&c, post_json(proxy.addr(), "/v1/completions", "{not json")).await;
    assert_eq!(r.status, 400);
    let got = lines.wait_for(2).await;
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[1]["status"], 400);
    assert_eq!(got[1]["pod"], Value::Null);
    assert_eq!(got[1]["trace_id"], Value::Null);
    assert_eq!(got[1]["end"], "complete");
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_stream_is_logged_when_its_body_ends_not_at_its_head() {
    let lines = AccessLines::default();
    let _guard = lines.capture();
    let (tx, engine) = FakeUpstream::scripted_stream().await;
    let mut config = test_config(engine.addr());
    config.logging.access_log = true;
    let proxy = start(config).await;
    let c = client::http1();
    let body = r#"{"model":"m","prompt":"hi","stream":true}"#;
    let mut resp = send(&c, post_json(proxy.addr(), "/v1/completions", body)).await;
    assert_eq!(resp.status(), 200);
    assert!(tx.send("data: {\"choices\":[{\"text\":\"a\"}]}\n\n").await);
    assert!(next_chunk(resp.body_mut()).await.is_some());
    // Head and first token out, body not finished: nothing written yet.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(lines.all().is_empty(), "{:?}", lines.all());
    assert!(tx.send("data: [DONE]\n\n").await);
    tx.finish();
    while let Some(f) = resp.body_mut().frame().await {
        f.unwrap();
    }
    let got = lines.wait_for(1).await;
    assert_eq!(got.len(), 1, "{got:?}");
    let l = &got[0];
    assert_eq!(l["end"], "complete");
    assert!(
        l["ttft_ms"].as_f64().unwrap() + 40.0 < l["total_ms"].as_f64().unwrap(),
        "{l}"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn off_by_default_no_line() {
    let lines = AccessLines::default();
    let _guard = lines.capture();
    let engine = kvmesh_tests::fake_vllm::start().await;
    let proxy = start(test_config(engine.addr())).await;
    let r = fetch(
        &client::http1(),
        post_json(
            proxy.addr(),
            "/v1/completions",
            r#"{"model":"m","prompt":"x"}"#,
        ),
    )
    .await;
    assert_eq!(r.status, 200);
    proxy.shutdown().await;
    assert!(lines.all().is_empty(), "{:?}", lines.all());
}

#[tokio::test]
async fn a_pd_split_logs_both_legs_and_its_outcome() {
    use kvmesh_engine_sim::{Flavor, Role as SimRole, SimConfig};
    let lines = AccessLines::default();
    let _guard = lines.capture();
    let engine = |role| {
        kvmesh_tests::route::sim_with(
            SimConfig::new(kvmesh_tests::route::MODEL)
                .with_time_scale(10.0)
                .with_role(role)
                .with_flavor(Flavor::Vllm),
        )
    };
    let prefill = engine(SimRole::Prefill).await;
    let decode = engine(SimRole::Decode).await;
    let mut c = kvmesh_tests::route::config(&decode, &[], None);
    c.pd.allowed_prefillers = vec![prefill.addr().to_string()];
    c.logging.access_log = true;
    let sidecar = start(c).await;
    let body = serde_json::json!({
        "model": kvmesh_tests::route::MODEL,
        "prompt": "the quick brown fox jumps over the lazy dog ".repeat(40),
        "max_tokens": 4,
    });
    let p = prefill.addr().to_string();
    let req = request(
        "POST",
        sidecar.addr(),
        "/v1/completions",
        body.to_string(),
        &[
            ("content-type", "application/json"),
            ("x-prefiller-host-port", &p),
        ],
    );
    let r = fetch(&client::http1(), req).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let got = lines.wait_for(1).await;
    assert_eq!(got.len(), 1, "{got:?}");
    let l = &got[0];
    assert_eq!(l["pd"], "disaggregated", "{l}");
    assert_eq!(l["prefill"], p.as_str(), "{l}");
    assert_eq!(l["decode"], sidecar.fleet().local_id(), "{l}");
    assert_eq!(l["status"], 200);
    sidecar.shutdown().await;
}

#[tokio::test]
async fn a_data_parallel_engine_logs_the_rank_the_request_was_sent_to() {
    use kvmesh_engine_sim::SimConfig;
    use kvmesh_tests::route::{config, sim_with, MODEL};
    let lines = AccessLines::default();
    let _guard = lines.capture();
    let engine = sim_with(SimConfig::new(MODEL).with_data_parallel_size(2)).await;
    let mut c = config(&engine, &[], None);
    c.engine.data_parallel_size = 2;
    c.logging.access_log = true;
    let sidecar = start(c).await;
    for i in 0..4 {
        let req = request(
            "POST",
            sidecar.addr(),
            "/v1/completions",
            format!(r#"{{"model":"{MODEL}","prompt":"request {i}","max_tokens":1}}"#),
            &[
                ("content-type", "application/json"),
                ("x-request-id", &format!("dp-{i}")),
            ],
        );
        assert_eq!(fetch(&client::http1(), req).await.status, 200);
    }
    let got = lines.wait_for(4).await;
    // The simulator records the requests of its rank 0 only: those carry
    // `X-data-parallel-rank: 0`; every other request went to rank 1.
    let on_rank0: std::collections::HashMap<String, String> = engine
        .received_requests()
        .iter()
        .filter(|r| r.path == "/v1/completions")
        .map(|r| {
            let rank = r.header("x-data-parallel-rank").expect("a rank named");
            (
                r.header("x-request-id").unwrap().to_owned(),
                rank.to_owned(),
            )
        })
        .collect();
    assert!(on_rank0.values().all(|r| r == "0"), "{on_rank0:?}");
    assert_eq!(got.len(), 4, "{got:?}");
    for l in &got {
        let id = l["request_id"].as_str().unwrap();
        let rank = if on_rank0.contains_key(id) { 0 } else { 1 };
        assert_eq!(l["rank"], rank, "{l}");
    }
    sidecar.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test]
async fn with_tracing_a_request_without_traceparent_logs_the_trace_the_sidecar_started() {
    let lines = AccessLines::default();
    let _guard = lines.capture();
    let collector = kvmesh_tests::otlp::Collector::start().await;
    let engine = kvmesh_tests::fake_vllm::start().await;
    let mut config = test_config(engine.addr());
    config.logging.access_log = true;
    config.tracing = Some(kvmesh_proxy::config::Tracing {
        otlp_endpoint: collector.endpoint().parse().unwrap(),
        protocol: kvmesh_proxy::config::OtlpProtocol::Http,
        sample_ratio: 1.0,
    });
    let proxy = start(config).await;
    let r = fetch(
        &client::http1(),
        post_json(
            proxy.addr(),
            "/v1/completions",
            r#"{"model":"m","prompt":"hi","max_tokens":2}"#,
        ),
    )
    .await;
    assert_eq!(r.status, 200);
    let got = lines.wait_for(1).await;
    proxy.shutdown().await;
    let spans = collector.spans();
    let root: Vec<_> = spans
        .iter()
        .filter(|s| s.name() == "kvmesh.request")
        .collect();
    assert_eq!(root.len(), 1, "{spans:?}");
    assert_eq!(root[0].parent_id(), "", "a new trace has no parent");
    assert_eq!(got[0]["trace_id"], root[0].trace_id().as_str());
}
