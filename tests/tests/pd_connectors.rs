//! P/D through the sidecar against simulated engines in prefill and decode
//! roles: the two legs carry exactly the fields each protocol needs (asserted
//! on what the engines received), streaming works through the split, and
//! every failure rule holds (retry, fallback to aggregated, recompute, error,
//! cancellation), for vLLM's NixlConnector protocol, SGLang's, and llm-d's
//! `x-prefiller-host-port` entry point; and P/D between simulator processes,
//! each behind its own sidecar.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use kvmesh_engine_sim::{Flavor, ReceivedRequest, Role as SimRole, SimConfig, SimHandle};
use kvmesh_filters::sched::Role;
use kvmesh_proxy::config::{Config, Duration as CfgDuration, OnPrefillFailure, PdConnector};
use kvmesh_proxy::fleet::{EngineLoad, PodInfo};
use kvmesh_proxy::SidecarHandle;
use kvmesh_tests::client::{admin_get, fetch, http1, next_chunk, post_json, request, send};
use kvmesh_tests::fake_upstream::{FakeUpstream, Reply};
use kvmesh_tests::route::{config, eventually, metric, sim_with, MODEL};
use kvmesh_tests::sidecar::{start, test_config, wait_ready};
use kvmesh_tests::simproc::{engine_sim_bin, sim_process};
use serde_json::{json, Value};

const PREFILLER: &str = "x-prefiller-host-port";

async fn engine(role: SimRole, flavor: Flavor) -> SimHandle {
    sim_with(
        SimConfig::new(MODEL)
            .with_time_scale(10.0)
            .with_role(role)
            .with_flavor(flavor),
    )
    .await
}

async fn decode_sidecar(decode: &SimHandle, tune: impl FnOnce(&mut Config)) -> SidecarHandle {
    let mut c = config(decode, &[], None);
    c.pd.retry_backoff = CfgDuration::from_millis(5);
    tune(&mut c);
    start(c).await
}

/// A decode sidecar that accepts the engine at `prefill` (outside its
/// fleet) as llm-d's prefiller: allow-listed, as such an engine must be.
async fn llmd_sidecar(
    decode: &SimHandle,
    prefill: std::net::SocketAddr,
    tune: impl FnOnce(&mut Config),
) -> SidecarHandle {
    let allowed = prefill.to_string();
    decode_sidecar(decode, move |c| {
        c.pd.allowed_prefillers = vec![allowed];
        tune(c);
    })
    .await
}

/// The inference requests an engine received (health and metrics polls left out).
fn inference(engine: &SimHandle) -> Vec<ReceivedRequest> {
    engine
        .received_requests()
        .into_iter()
        .filter(|r| r.path.starts_with("/v1/"))
        .collect()
}

fn long_prompt() -> String {
    "the quick brown fox jumps over the lazy dog ".repeat(40)
}

async fn completion(
    sidecar: &SidecarHandle,
    body: Value,
    headers: &[(&str, &str)],
) -> kvmesh_tests::client::Whole {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    let req = request(
        "POST",
        sidecar.addr(),
        "/v1/completions",
        body.to_string(),
        &h,
    );
    fetch(&http1(), req).await
}

/// Makes the pod whose sidecar is at `addr` known to `sidecar`'s fleet, as the mesh would.
fn add_peer(sidecar: &SidecarHandle, addr: std::net::SocketAddr, role: Role, load: EngineLoad) {
    let id = addr.to_string();
    sidecar
        .fleet()
        .upsert_peer(PodInfo {
            id: id.clone(),
            sidecar_addr: Some(addr),
            role,
            models: vec![MODEL.to_owned()],
            lora_adapters: vec![],
            labels: Default::default(),
        })
        .unwrap();
    sidecar
        .fleet()
        .set_load(&id, load, tokio::time::Instant::now());
}

/// Sends `sidecar` a prompt over the built-in filter config's 1024-token
/// minimum for a split; checks it was answered and that `prefill` received
/// exactly one prefill leg. The prompt and that leg.
async fn split_long_prompt(
    sidecar: &SidecarHandle,
    prefill: &SimHandle,
) -> (String, ReceivedRequest) {
    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(130);
    let long = completion(
        sidecar,
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 4}),
        &[],
    )
    .await;
    assert_eq!(long.status, 200, "{}", long.text());
    let mut p_reqs = inference(prefill);
    assert_eq!(
        p_reqs.len(),
        1,
        "one prefill leg reached the prefill engine"
    );
    let leg = p_reqs.remove(0);
    assert_eq!(
        leg.json().unwrap()["kv_transfer_params"]["do_remote_decode"],
        true
    );
    (prompt, leg)
}

fn external_tokens(engine: &SimHandle) -> u64 {
    engine.stats().external_kv_tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_legs_carry_exactly_the_protocol_fields() {
    let prefill = engine(SimRole::Prefill, Flavor::Vllm).await;
    let decode = engine(SimRole::Decode, Flavor::Vllm).await;
    let sidecar = llmd_sidecar(&decode, prefill.addr(), |_| {}).await;
    let p = prefill.addr().to_string();
    let body = json!({"model": MODEL, "prompt": long_prompt(), "max_tokens": 8, "min_tokens": 2, "temperature": 0});
    let resp = completion(
        &sidecar,
        body.clone(),
        &[(PREFILLER, &p), ("x-request-id", "pd-req-1")],
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let out = resp.json();
    assert_eq!(out["usage"]["completion_tokens"], 8);

    let p_reqs = inference(&prefill);
    assert_eq!(p_reqs.len(), 1);
    let pb = p_reqs[0].json().unwrap();
    assert_eq!(pb["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!(pb["kv_transfer_params"]["do_remote_prefill"], false);
    assert_eq!(pb["stream"], false);
    assert_eq!(pb["max_tokens"], 1);
    assert_eq!(pb["min_tokens"], 1);
    assert_eq!(pb["prompt"], body["prompt"]);
    assert_eq!(
        p_reqs[0].header(PREFILLER),
        None,
        "the header never reaches an engine"
    );

    let d_reqs = inference(&decode);
    assert_eq!(d_reqs.len(), 1);
    let db = d_reqs[0].json().unwrap();
    let params = &db["kv_transfer_params"];
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["remote_engine_id"], json!(prefill.engine_id()));
    assert!(params["remote_block_ids"].is_array(), "{params}");
    assert_eq!(db["max_tokens"], 8, "decode gets the client's limits");
    assert_eq!(db["min_tokens"], 2);
    assert_eq!(d_reqs[0].header(PREFILLER), None);
    // One request id on both legs.
    assert_eq!(p_reqs[0].header("x-request-id"), Some("pd-req-1"));
    assert_eq!(d_reqs[0].header("x-request-id"), Some("pd-req-1"));
    // The decode engine really took the prompt's KV from the prefill engine.
    assert!(external_tokens(&decode) > 0);
    assert_eq!(
        metric(
            &sidecar,
            r#"kvmesh_pd_requests_total{connector="nixl",outcome="disaggregated"}"#
        )
        .await,
        Some(1.0)
    );
    // The EPP decided: the sidecar neither tokenized nor scheduled it, and
    // counts it under its own reason.
    assert_eq!(
        metric(
            &sidecar,
            r#"kvmesh_routing_decisions_total{decision="disaggregated",reason="prefiller_header"}"#
        )
        .await,
        Some(1.0)
    );
    assert_eq!(
        metric(&sidecar, "kvmesh_scheduling_latency_seconds_count").await,
        Some(0.0),
        "no scheduling cycle ran"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_chat_through_pd_keeps_the_clients_stream() {
    let prefill = engine(SimRole::Prefill, Flavor::Vllm).await;
    let decode = engine(SimRole::Decode, Flavor::Vllm).await;
    let sidecar = llmd_sidecar(&decode, prefill.addr(), |_| {}).await;
    let p = prefill.addr().to_string();
    let body = json!({
        "model": MODEL, "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 6,
        "messages": [{"role": "system", "content": long_prompt()}, {"role": "user", "content": "hi"}],
    });
    let req = request(
        "POST",
        sidecar.addr(),
        "/v1/chat/completions",
        body.to_string(),
        &[("content-type", "application/json"), (PREFILLER, &p)],
    );
    let mut resp = send(&http1(), req).await;
    assert_eq!(resp.status(), 200);
    let mut text = String::new();
    while let Some(chunk) = next_chunk(resp.body_mut()).await {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(text.contains("\"usage\""));
    let pb = inference(&prefill)[0].json().unwrap();
    assert_eq!(pb["stream"], false);
    assert!(pb.get("stream_options").is_none());
    let db = inference(&decode)[0].json().unwrap();
    assert_eq!(db["stream"], true);
    assert_eq!(db["stream_options"]["include_usage"], true);
    assert!(external_tokens(&decode) > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_prefill_is_retried_then_served_aggregated() {
    let prefill = engine(SimRole::Prefill, Flavor::Vllm).await;
    prefill.faults().fail_all(Some(503));
    let decode = engine(SimRole::Decode, Flavor::Vllm).await;
    let sidecar = llmd_sidecar(&decode, prefill.addr(), |c| c.pd.prefill_retries = 2).await;
    let p = prefill.addr().to_string();
    let resp = completion(
        &sidecar,
        json!({"model": MODEL, "prompt": long_prompt(), "max_tokens": 4}),
        &[(PREFILLER, &p)],
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(inference(&prefill).len(), 3, "one attempt and two retries");
    let db = inference(&decode)[0].json().unwrap();
    assert!(
        db.get("kv_transfer_params").is_none(),
        "decode computes the prompt itself"
    );
    assert_eq!(external_tokens(&decode), 0);
    assert_eq!(
        metric(&sidecar, "kvmesh_pd_prefill_retries_total").await,
        Some(2.0)
    );
    assert_eq!(
        metric(
            &sidecar,
            r#"kvmesh_pd_requests_total{connector="nixl",outcome="fallback_aggregated"}"#
        )
        .await,
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_prefill_is_not_retried_and_fails_when_configured_to() {
    let prefill = engine(SimRole::Prefill, Flavor::Vllm).await;
    prefill.faults().fail_all(Some(400));
    let decode = engine(SimRole::Decode, Flavor::Vllm).await;
    let sidecar = llmd_sidecar(&decode, prefill.addr(), |c| {
        c.pd.on_prefill_failure = OnPrefillFailure::Error
    })
    .await;
    let p = prefill.addr().to_string();
    let resp = completion(
        &sidecar,
        json!({"model": MODEL, "prompt": "x", "max_tokens": 4}),
        &[(PREFILLER, &p)],
    )
    .await;
    assert_eq!(resp.status, 400, "{}", resp.text());
    assert_eq!(resp.json()["error"]["code"], "prefill_rejected");
    assert_eq!(inference(&prefill).len(), 1, "a 400 is not retryable");
    assert!(inference(&decode).is_empty(), "decode never started");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_without_transfer_params_lets_decode_recompute() {
    // An aggregated engine answers the prefill leg but, like a vLLM without a
    // KV connector, returns no kv_transfer_params.
    let prefill = FakeUpstream::builder()
        .route("/v1/completions", |_| {
            Reply::json(
                200,
                r#"{"id":"x","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":"length"}]}"#,
            )
        })
        .start()
        .await;
    let decode = engine(SimRole::Decode, Flavor::Vllm).await;
    let sidecar = llmd_sidecar(&decode, prefill.addr(), |_| {}).await;
    let p = prefill.addr().to_string();
    let resp = completion(
        &sidecar,
        json!({"model": MODEL, "prompt": long_prompt(), "max_tokens": 3}),
        &[(PREFILLER, &p)],
    )
    .await;
    assert_eq!(resp.status, 200);
    assert!(inference(&decode)[0]
        .json()
        .unwrap()
        .get("kv_transfer_params")
        .is_none());
    assert_eq!(
        metric(
            &sidecar,
            r#"kvmesh_pd_requests_total{connector="nixl",outcome="recompute"}"#
        )
        .await,
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_cancels_the_decode_leg() {
    let prefill = engine(SimRole::Prefill, Flavor::Vllm).await;
    let decode = engine(SimRole::Decode, Flavor::Vllm).await;
    let sidecar = llmd_sidecar(&decode, prefill.addr(), |_| {}).await;
    let p = prefill.addr().to_string();
    let body = json!({"model": MODEL, "prompt": long_prompt(), "max_tokens": 4000, "stream": true, "ignore_eos": true});
    let req = request(
        "POST",
        sidecar.addr(),
        "/v1/completions",
        body.to_string(),
        &[("content-type", "application/json"), (PREFILLER, &p)],
    );
    let mut resp = send(&http1(), req).await;
    assert!(
        next_chunk(resp.body_mut()).await.is_some(),
        "decoding started"
    );
    assert_eq!(decode.stats().running, 1);
    drop(resp);
    eventually("the decode engine dropped the cancelled request", || {
        let running = decode.stats().running;
        async move { (running == 0).then_some(()) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_gets_one_body_with_bootstrap_fields_on_both_pods() {
    let prefill = engine(SimRole::Prefill, Flavor::Sglang).await;
    let decode = engine(SimRole::Decode, Flavor::Sglang).await;
    let sidecar = llmd_sidecar(&decode, prefill.addr(), |c| {
        c.pd.connector = PdConnector::Sglang;
        c.engine.kind = kvmesh_proxy::config::EngineKind::Sglang;
        c.pd.sglang_bootstrap_port = prefill.addr().port();
    })
    .await;
    let p = prefill.addr().to_string();
    let resp = completion(
        &sidecar,
        json!({"model": MODEL, "prompt": long_prompt(), "max_tokens": 5}),
        &[(PREFILLER, &p)],
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(
        resp.json()["usage"]["completion_tokens"],
        5,
        "the decode response is returned"
    );
    let (pb, db) = (
        inference(&prefill)[0].json().unwrap(),
        inference(&decode)[0].json().unwrap(),
    );
    assert_eq!(pb, db, "the same body goes to both pods");
    assert_eq!(pb["bootstrap_host"], "127.0.0.1");
    assert_eq!(pb["bootstrap_port"], json!(prefill.addr().port()));
    let room = pb["bootstrap_room"].as_u64().unwrap();
    assert!(room < 1 << 63);
    assert_eq!(
        metric(
            &sidecar,
            r#"kvmesh_pd_requests_total{connector="sglang",outcome="disaggregated"}"#
        )
        .await,
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_prefill_failure_fails_the_request_at_once() {
    let prefill = engine(SimRole::Prefill, Flavor::Sglang).await;
    prefill.faults().fail_all(Some(500));
    let decode = engine(SimRole::Decode, Flavor::Sglang).await;
    let sidecar = llmd_sidecar(&decode, prefill.addr(), |c| {
        c.pd.connector = PdConnector::Sglang
    })
    .await;
    let p = prefill.addr().to_string();
    let started = std::time::Instant::now();
    let resp = completion(
        &sidecar,
        json!({"model": MODEL, "prompt": "p", "max_tokens": 5}),
        &[(PREFILLER, &p)],
    )
    .await;
    assert_eq!(resp.status, 502, "{}", resp.text());
    assert_eq!(resp.json()["error"]["code"], "prefill_failed");
    // The decode half (waiting for its KV) was dropped, not awaited to its timeout.
    assert!(started.elapsed() < Duration::from_secs(20));
    eventually("the decode half is gone", || {
        let running = decode.stats().running + decode.stats().waiting;
        async move { (running == 0).then_some(()) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefiller_outside_the_allow_list_is_refused() {
    let decode = engine(SimRole::Decode, Flavor::Vllm).await;
    let sidecar = decode_sidecar(&decode, |c| {
        c.pd.allowed_prefillers = vec!["10.1.2.3:8000".to_owned()]
    })
    .await;
    let resp = completion(
        &sidecar,
        json!({"model": MODEL, "prompt": "p"}),
        &[(PREFILLER, "127.0.0.1:9")],
    )
    .await;
    assert_eq!(resp.status, 403);
    assert_eq!(resp.json()["error"]["code"], "prefiller_not_allowed");
    assert!(inference(&decode).is_empty());
}

/// A prefill engine behind its own sidecar, known as a peer to the sidecar
/// of a decode engine that schedules splits itself (`--role decode
/// --pd-min-uncached-tokens 64`: no filter file at all), both engines of
/// `flavor` and the decode sidecar tuned by `tune` (its connector). The
/// prefill and decode engines, the prefill sidecar, and the decode sidecar.
async fn scheduled_split(
    flavor: Flavor,
    tune: impl FnOnce(&mut Config, &SimHandle),
) -> (SimHandle, SimHandle, SidecarHandle, SidecarHandle) {
    let prefill = engine(SimRole::Prefill, flavor).await;
    let decode = engine(SimRole::Decode, flavor).await;
    let prefill_sidecar = start(config(&prefill, &[], None)).await;
    let sidecar = decode_sidecar(&decode, |c| {
        c.pod.role = Role::Decode;
        c.pd.min_uncached_tokens = Some(64);
        tune(c, &prefill);
    })
    .await;
    add_peer(
        &sidecar,
        prefill_sidecar.addr(),
        Role::Prefill,
        EngineLoad::default(),
    );
    (prefill, decode, prefill_sidecar, sidecar)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_splits_a_long_prompt_across_a_prefill_peer_and_the_local_decode_pod() {
    let (prefill, decode, _prefill_sidecar, sidecar) =
        scheduled_split(Flavor::Vllm, |_, _| {}).await;

    // A short prompt stays aggregated on the decode pod ...
    let short = completion(
        &sidecar,
        json!({"model": MODEL, "prompt": "hello there", "max_tokens": 2}),
        &[],
    )
    .await;
    assert_eq!(short.status, 200, "{}", short.text());
    assert!(inference(&prefill).is_empty());
    // ... a long one is split: prefill on the peer, decode here.
    let (_, prefill_leg) = split_long_prompt(&sidecar, &prefill).await;
    assert_eq!(
        prefill_leg.header("x-kvmesh-routed"),
        None,
        "the peer's sidecar ran it locally"
    );
    let last = inference(&decode).pop().unwrap().json().unwrap();
    assert_eq!(
        last["kv_transfer_params"]["remote_engine_id"],
        json!(prefill.engine_id())
    );
    assert!(external_tokens(&decode) > 0);
    assert_eq!(
        metric(
            &sidecar,
            r#"kvmesh_routing_decisions_total{decision="disaggregated",reason="scheduled"}"#
        )
        .await,
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_leg_counts_towards_the_prefill_pod_while_it_runs() {
    prefill_leg_is_counted(Flavor::Vllm, |_, _| {}).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_prefill_leg_counts_towards_the_prefill_pod_while_it_runs() {
    prefill_leg_is_counted(Flavor::Sglang, |c, prefill| {
        c.pd.connector = PdConnector::Sglang;
        c.engine.kind = kvmesh_proxy::config::EngineKind::Sglang;
        c.pd.sglang_bootstrap_port = prefill.addr().port();
    })
    .await;
}

/// The schedulers pick prefill pods by the requests at them and by the
/// prompt tokens waiting there: a leg the decode sidecar has sent counts
/// there, both (and is what it publishes to the mesh), beside the request's
/// count at its decode pod, which computes none of the prompt.
async fn prefill_leg_is_counted(flavor: Flavor, tune: impl FnOnce(&mut Config, &SimHandle)) {
    let (prefill, _decode, prefill_sidecar, sidecar) = scheduled_split(flavor, tune).await;
    let prefill_id = prefill_sidecar.addr().to_string();
    let decode_id = sidecar.fleet().local_id().to_owned();
    let counts = |s: &SidecarHandle| s.fleet().published_in_flight();
    prefill
        .faults()
        .delay_first_byte(Some(Duration::from_secs(2)));
    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(130);
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4});
    let split = {
        let req = post_json(sidecar.addr(), "/v1/completions", &body.to_string());
        tokio::spawn(async move { fetch(&http1(), req).await.status })
    };
    eventually("the prefill leg is counted at the prefill pod", || async {
        (counts(&sidecar).get(&prefill_id) == Some(&1)).then_some(())
    })
    .await;
    assert_eq!(
        counts(&sidecar).get(&decode_id),
        Some(&1),
        "and the request at its decode pod"
    );
    let tokens = sidecar.fleet().published_prefill();
    let at_prefill = tokens.get(&prefill_id).copied().unwrap_or(0);
    assert!(
        at_prefill > 1000,
        "the cold prompt's tokens wait at the prefill pod: {tokens:?}"
    );
    assert_eq!(
        tokens.get(&decode_id).copied().unwrap_or(0),
        0,
        "{tokens:?}"
    );
    // The prefill pod's sidecar runs the leg it was sent without publishing
    // it again: the mesh counts it once.
    let own = prefill_sidecar.fleet().local_id().to_owned();
    assert_eq!(counts(&prefill_sidecar).get(&own), None);
    assert_eq!(split.await.unwrap(), 200);
    eventually("nothing is counted once it ends", || async {
        counts(&sidecar).is_empty().then_some(())
    })
    .await;
    assert!(
        sidecar
            .fleet()
            .published_prefill()
            .values()
            .all(|&t| t == 0),
        "the prompt was prefilled"
    );
    assert_eq!(inference(&prefill).len(), 1, "one prefill leg");
}

/// A split made by a sidecar fronting a prefill engine, whose decode pods are peers: `failing`
/// (idle, so the scheduler prefers it) and a busier spare engine that serves both roles, behind
/// its own sidecar. The prefill engine, the spare engine, the sidecar and the spare's sidecar.
async fn split_with_a_failing_decode_pod(
    failing: std::net::SocketAddr,
    tune: impl FnOnce(&mut Config),
) -> (SimHandle, SimHandle, SidecarHandle, SidecarHandle) {
    let prefill = engine(SimRole::Prefill, Flavor::Vllm).await;
    let spare = engine(SimRole::Both, Flavor::Vllm).await;
    let spare_sidecar = start(config(&spare, &[], None)).await;
    let sidecar = decode_sidecar(&prefill, |c| {
        c.pod.role = Role::Prefill;
        c.pd.min_uncached_tokens = Some(64);
        tune(c);
    })
    .await;
    add_peer(&sidecar, failing, Role::Decode, EngineLoad::default());
    let busier = EngineLoad {
        waiting: 2,
        running: 6,
        kv_usage: 0.4,
        ..EngineLoad::default()
    };
    add_peer(&sidecar, spare_sidecar.addr(), Role::Both, busier);
    (prefill, spare, sidecar, spare_sidecar)
}

async fn pd_outcome(sidecar: &SidecarHandle, outcome: &str) -> Option<f64> {
    metric(
        sidecar,
        &format!(r#"kvmesh_pd_requests_total{{connector="nixl",outcome="{outcome}"}}"#),
    )
    .await
}

// On one thread: the access lines are captured on the test's thread.
#[tokio::test]
async fn a_decode_pod_that_refuses_gets_its_decode_leg_resent_to_the_next_pod() {
    let lines = kvmesh_tests::access_lines::AccessLines::default();
    let _guard = lines.capture();
    // The first decode pod's sidecar refuses connections: nothing reached it.
    let refusing = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let (prefill, spare, sidecar, _spare_sidecar) =
        split_with_a_failing_decode_pod(refusing, |c| c.logging.access_log = true).await;

    // The split was made and its prefill leg ran once ...
    let (prompt, _) = split_long_prompt(&sidecar, &prefill).await;
    // ... and the spare pod got the decode leg, with the prefill's parameters: it fetched the
    // prompt's KV from the prefill engine instead of computing it.
    let s_reqs = inference(&spare);
    assert_eq!(s_reqs.len(), 1, "{s_reqs:?}");
    let served = s_reqs[0].json().unwrap();
    assert_eq!(
        served["kv_transfer_params"]["remote_engine_id"],
        json!(prefill.engine_id()),
        "{served}"
    );
    assert_eq!(served["prompt"], json!(prompt));
    assert!(external_tokens(&spare) > 0);
    assert_eq!(pd_outcome(&sidecar, "decode_resent").await, Some(1.0));
    assert_eq!(pd_outcome(&sidecar, "decode_refused").await, Some(0.0));
    let line = eventually("the split's access line", || async {
        lines.all().into_iter().find(|l| l["pd"].is_string())
    })
    .await;
    assert_eq!(line["pd"], "decode_resent", "{line}");
}

/// A decode pod whose engine answers 503 (after `delay`) to everything, behind its own sidecar:
/// the engine and the sidecar.
async fn failing_decode_pod(delay: Option<Duration>) -> (SimHandle, SidecarHandle) {
    let engine = engine(SimRole::Decode, Flavor::Vllm).await;
    engine.faults().fail_all(Some(503));
    engine.faults().delay_first_byte(delay);
    let sidecar = start(config(&engine, &[], None)).await;
    (engine, sidecar)
}

/// The failed decode engine and the spare each got one decode leg, the same one: the prefill's
/// `kv_transfer_params` and all.
fn same_decode_leg(failing: &SimHandle, spare: &SimHandle) {
    let (first, second) = (inference(failing), inference(spare));
    assert_eq!((first.len(), second.len()), (1, 1), "{first:?} {second:?}");
    let (first, second) = (first[0].json().unwrap(), second[0].json().unwrap());
    assert_eq!(
        first["kv_transfer_params"]["do_remote_prefill"],
        json!(true),
        "{first}"
    );
    assert_eq!(first, second, "the decode leg was sent again as it was");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_engine_that_fails_before_its_first_token_is_resent_the_same_kv_transfer_params() {
    let (failing, failing_sidecar) = failing_decode_pod(None).await;
    let (prefill, spare, sidecar, _spare_sidecar) =
        split_with_a_failing_decode_pod(failing_sidecar.addr(), |_| {}).await;

    split_long_prompt(&sidecar, &prefill).await;
    // The prefill engine was not called again (split_long_prompt counts its legs).
    same_decode_leg(&failing, &spare);
    assert!(external_tokens(&spare) > 0, "the spare fetched the KV");
    assert_eq!(pd_outcome(&sidecar, "decode_resent").await, Some(1.0));
    assert_eq!(pd_outcome(&sidecar, "disaggregated").await, Some(0.0));
}

/// The decode pod's head came (vLLM sends a stream's head at once), then its engine died before
/// any token, as one dying while it fetches the prompt's KV would: the stream goes on with the
/// same decode leg, `kv_transfer_params` and all, on the next pod, and the client reads one
/// stream. (The simulated engine had read the blocks before it died, so the prefill engine had
/// released them and the spare computes the prompt, as vLLM does with
/// `kv_load_failure_policy: recompute`; a vLLM decode that dies before its read ends leaves
/// them held for the next one until the lease passes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_stream_that_breaks_before_its_first_token_is_resent_the_same_kv_transfer_params()
{
    let failing = engine(SimRole::Decode, Flavor::Vllm).await;
    failing.faults().die_after_chunks(Some(0));
    let failing_sidecar = start(config(&failing, &[], None)).await;
    let (prefill, spare, sidecar, _spare_sidecar) =
        split_with_a_failing_decode_pod(failing_sidecar.addr(), |_| {}).await;

    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(130);
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": true});
    let resp = completion(&sidecar, body, &[]).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let text = resp.text();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(!text.contains("\"error\""), "{text}");
    assert_eq!(inference(&prefill).len(), 1, "one prefill leg");
    same_decode_leg(&failing, &spare);
    let resent = r#"kvmesh_migrations_total{outcome="kv_resent"}"#;
    assert_eq!(metric(&sidecar, resent).await, Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_decode_leg_answered_500_has_the_request_recomputed_whole() {
    // The first decode pod fails; the one the leg is re-sent to answers 500, as vLLM answers a
    // request whose KV it could not load (`kv_load_failure_policy: fail`).
    let (failing, failing_sidecar) = failing_decode_pod(None).await;
    let kv_gone = engine(SimRole::Decode, Flavor::Vllm).await;
    kv_gone.faults().fail_all(Some(500));
    let kv_gone_sidecar = start(config(&kv_gone, &[], None)).await;
    let (prefill, spare, sidecar, _spare_sidecar) =
        split_with_a_failing_decode_pod(failing_sidecar.addr(), |_| {}).await;
    // Less loaded than the spare, more than the first: the re-send's pod.
    let some = EngineLoad {
        running: 2,
        kv_usage: 0.1,
        ..EngineLoad::default()
    };
    add_peer(&sidecar, kv_gone_sidecar.addr(), Role::Decode, some);

    let (prompt, _) = split_long_prompt(&sidecar, &prefill).await;
    let (first, resent) = (inference(&failing), inference(&kv_gone));
    assert_eq!((first.len(), resent.len()), (1, 1), "{resent:?}");
    assert_eq!(first[0].json().unwrap(), resent[0].json().unwrap());
    // Then served whole, its prompt computed again, without the parameters.
    let s_reqs = inference(&spare);
    assert_eq!(s_reqs.len(), 1, "{s_reqs:?}");
    let served = s_reqs[0].json().unwrap();
    assert!(served.get("kv_transfer_params").is_none(), "{served}");
    assert_eq!(served["prompt"], json!(prompt));
    assert_eq!(pd_outcome(&sidecar, "decode_kv_gone").await, Some(1.0));
    assert_eq!(pd_outcome(&sidecar, "decode_resent").await, Some(0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_pod_that_fails_after_the_lease_has_the_request_recomputed_whole() {
    // The decode engine answers 503 only after the prefill pod's lease passed.
    let (failing, failing_sidecar) = failing_decode_pod(Some(Duration::from_millis(400))).await;
    let (prefill, spare, sidecar, _spare_sidecar) =
        split_with_a_failing_decode_pod(failing_sidecar.addr(), |c| {
            c.migration.pd_kv_lease = CfgDuration::from_millis(100);
        })
        .await;

    let (prompt, _) = split_long_prompt(&sidecar, &prefill).await;
    assert_eq!(inference(&failing).len(), 1);
    // The spare served the request whole, its prompt computed there, and no new prefill leg
    // was made (split_long_prompt counts them).
    let s_reqs = inference(&spare);
    assert_eq!(s_reqs.len(), 1, "{s_reqs:?}");
    let served = s_reqs[0].json().unwrap();
    assert!(served.get("kv_transfer_params").is_none(), "{served}");
    assert_eq!(served["prompt"], json!(prompt));
    assert_eq!(external_tokens(&spare), 0);
    assert_eq!(
        pd_outcome(&sidecar, "decode_lease_expired").await,
        Some(1.0)
    );
    assert_eq!(pd_outcome(&sidecar, "decode_resent").await, Some(0.0));
    assert_eq!(
        metric(
            &sidecar,
            r#"kvmesh_pd_abandoned_transfers_total{connector="nixl"}"#
        )
        .await,
        Some(1.0)
    );
}

/// The value of one series in an engine's `/metrics` text.
fn engine_series(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(series)?;
        rest.strip_prefix(' ')?.trim().parse().ok()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_between_simulator_processes_each_behind_a_sidecar() {
    // Issue 17's scenario, with one engine per process as in a deployment: the
    // KV handoff goes over the prefill engine's side channel, not a shared map.
    let bin = engine_sim_bin();
    let (prefill, decode) = tokio::join!(
        sim_process(&bin, &["--role", "prefill"]),
        sim_process(&bin, &["--role", "decode"])
    );
    let mut pc = test_config(prefill.addr());
    pc.pod.models = vec![MODEL.to_owned()];
    pc.pod.role = Role::Prefill;
    let prefill_sidecar = start(pc).await;
    // `--role decode --pd-connector nixl --pd-min-uncached-tokens 256`.
    let mut dc = test_config(decode.addr());
    dc.pod.models = vec![MODEL.to_owned()];
    dc.pod.role = Role::Decode;
    dc.pd.connector = PdConnector::Nixl;
    dc.pd.min_uncached_tokens = Some(256);
    let sidecar = start(dc).await;
    add_peer(
        &sidecar,
        prefill_sidecar.addr(),
        Role::Prefill,
        EngineLoad::default(),
    );

    wait_ready(&prefill_sidecar).await;
    wait_ready(&sidecar).await;
    // Over the built-in P/D config's 1024-token prompt minimum (`promptTokens`).
    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(150);
    let resp = completion(
        &sidecar,
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 4}),
        &[],
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let prompt_tokens = resp.json()["usage"]["prompt_tokens"].as_f64().unwrap();
    assert!(prompt_tokens > 1024.0, "{prompt_tokens}");
    assert_eq!(
        metric(
            &sidecar,
            r#"kvmesh_pd_requests_total{connector="nixl",outcome="disaggregated"}"#
        )
        .await,
        Some(1.0)
    );

    // The decode engine received the whole prompt's KV and computed none of it.
    let text = admin_get(decode.addr(), "/metrics").await.text();
    let by_source = |source: &str| {
        engine_series(
            &text,
            &format!(
                r#"vllm:prompt_tokens_by_source_total{{engine="0",model_name="{MODEL}",source="{source}"}}"#
            ),
        )
    };
    assert_eq!(
        by_source("external_kv_transfer"),
        Some(prompt_tokens),
        "{text}"
    );
    assert_eq!(by_source("local_compute"), Some(0.0));
    // The prefill engine holds nothing once its decode has fetched.
    eventually("the prefill engine freed the fetched blocks", || {
        let addr = prefill.addr();
        async move {
            let stats = admin_get(addr, "/sim/stats").await.json();
            (stats["held_transfers"] == 0 && stats["kv_cache_usage"] == 0.0).then_some(())
        }
    })
    .await;
}
