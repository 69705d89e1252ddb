//! Routing end to end: every inference request is scheduled by the filter
//! config, the decision shows in metrics, the local engine's load is scraped,
//! unknown models get a clear error, `/debug/route` explains a decision, a
//! request the scheduler sends to a peer is served by the peer's engine, and
//! the autoscaling hook sizes each pool from the fleet's load.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvmesh_engine_sim::SimConfig;
use kvmesh_tests::client::{admin_get, fetch, http1, post_json, request};
use kvmesh_tests::route::{
    add_peer, eventually, filters_yaml, metric, only_pod, sidecar, sim, sim_with, MODEL,
};

const COMPLETION: &str = r#"{"model":"tiny","prompt":"hello there, how are you","max_tokens":4}"#;

#[tokio::test]
async fn every_inference_request_is_scheduled_and_its_decision_counted() {
    let engine = sim().await;
    let proxy = sidecar(&engine, &[], None).await;
    let c = http1();
    for _ in 0..3 {
        let r = fetch(&c, post_json(proxy.addr(), "/v1/completions", COMPLETION)).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let chat = r#"{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;
    let r = fetch(&c, post_json(proxy.addr(), "/v1/chat/completions", chat)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = fetch(&c, request("GET", proxy.addr(), "/v1/models", "", &[])).await;
    assert_eq!(r.status, 200);

    let scheduled = r#"kvmesh_routing_decisions_total{decision="local",reason="scheduled"}"#;
    assert_eq!(metric(&proxy, scheduled).await, Some(4.0));
    let passthrough = r#"kvmesh_routing_decisions_total{decision="local",reason="passthrough"}"#;
    assert_eq!(metric(&proxy, passthrough).await, Some(1.0));
    assert_eq!(
        metric(&proxy, "kvmesh_scheduling_latency_seconds_count").await,
        Some(4.0)
    );
    // The in-flight count towards the local pod went back to zero with each response.
    let fleet = admin_get(proxy.admin_addr(), "/debug/fleet").await.json();
    assert_eq!(fleet["pods"][0]["in_flight_local"], 0);
    proxy.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test]
async fn the_scraper_reads_the_engines_queue_kv_usage_and_block_size() {
    // One sequence at a time, slow decode: the second and third requests queue.
    let engine = sim_with(
        SimConfig::new(MODEL)
            .with_block_size(32)
            .with_max_num_seqs(1),
    )
    .await;
    let proxy = sidecar(&engine, &[], None).await;
    let addr = proxy.addr();
    let mut load = tokio::task::JoinSet::new();
    for _ in 0..3 {
        load.spawn(async move {
            let body = r#"{"model":"tiny","prompt":"a long enough prompt to fill a block or two of the cache","max_tokens":60}"#;
            fetch(&http1(), post_json(addr, "/v1/completions", body)).await.status
        });
    }
    let pod = eventually("the fleet shows the engine busy", || async {
        let f = admin_get(proxy.admin_addr(), "/debug/fleet").await.json();
        let pod = f["pods"][0].clone();
        let l = &pod["load"];
        let busy = l["waiting"].as_u64()? >= 1
            && l["running"].as_u64()? == 1
            && l["kv_usage"].as_f64()? > 0.0;
        busy.then_some(pod)
    })
    .await;
    assert_eq!(pod["load"]["block_size"], 32);
    assert!(pod["load_age_ms"].as_u64().unwrap() < 2000, "{pod}");
    assert_eq!(pod["healthy"], true);
    let f = admin_get(proxy.admin_addr(), "/debug/fleet").await.json();
    assert_eq!(f["block_size"], 32, "learned from vllm:cache_config_info");
    while let Some(status) = load.join_next().await {
        assert_eq!(status.unwrap(), 200);
    }
    // Idle again once the queue drained.
    eventually("the fleet shows the engine idle", || async {
        let f = admin_get(proxy.admin_addr(), "/debug/fleet").await.json();
        let l = &f["pods"][0]["load"];
        (l["waiting"] == 0 && l["running"] == 0).then_some(())
    })
    .await;
    proxy.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test]
async fn an_unknown_model_is_404_model_not_found_and_never_reaches_the_engine() {
    let engine = sim().await;
    let proxy = sidecar(&engine, &[], None).await;
    let body = r#"{"model":"gpt-17","prompt":"hi","max_tokens":2}"#;
    let r = fetch(&http1(), post_json(proxy.addr(), "/v1/completions", body)).await;
    assert_eq!(r.status, 404, "{}", r.text());
    let e = &r.json()["error"];
    assert_eq!(e["code"], "model_not_found");
    assert_eq!(e["type"], "invalid_request_error");
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains("gpt-17") && msg.contains(MODEL), "{msg}");
    assert!(engine
        .received_requests()
        .iter()
        .all(|r| !r.path.starts_with("/v1/")));
    let err = r#"kvmesh_routing_decisions_total{decision="error",reason="model_not_found"}"#;
    assert_eq!(metric(&proxy, err).await, Some(1.0));
    proxy.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test]
async fn debug_route_explains_a_decision_with_every_plugins_score_and_sends_nothing() {
    let (ea, eb) = (sim().await, sim().await);
    let a = sidecar(&ea, &[], None).await;
    let b = sidecar(&eb, &[], None).await;
    let peer = add_peer(&a, &b, &[]);
    let local = a.addr().to_string();
    let r = fetch(
        &http1(),
        request(
            "POST",
            a.admin_addr(),
            "/debug/route",
            COMPLETION,
            &[("x-session-id", "s-1")],
        ),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["filters"], "<builtin>");
    assert_eq!(v["request"]["session_key"], "s-1");
    let chosen = v["chosen"][0].as_str().unwrap().to_owned();
    assert!(chosen == local || chosen == peer, "{v}");
    let expected_decision = if chosen == local { "local" } else { "peer" };
    assert_eq!(v["decision"], expected_decision);
    // The other pod is the fallback.
    let other = if chosen == local { &peer } else { &local };
    assert_eq!(v["fallbacks"], serde_json::json!([other]));
    // Every scorer of the default profile rated both pods, and the totals add up.
    let scorers = [
        ("prefix-cache-scorer", 3.0),
        ("prefix-affinity-scorer", 2.0),
        ("active-request-scorer", 1.0),
        ("token-cost-scorer", 2.0),
    ];
    for pod in [&local, &peer] {
        let row = &v["scores"]["default"][pod.as_str()];
        let mut total = 0.0;
        for (s, w) in scorers {
            let score = row["scores"][s]
                .as_f64()
                .unwrap_or_else(|| panic!("{s} for {pod}: {v}"));
            assert!((0.0..=1.0).contains(&score));
            total += w * score;
        }
        assert!(
            (row["total"].as_f64().unwrap() - total).abs() < 1e-9,
            "{row}"
        );
    }
    assert_eq!(v["trace"]["profiles"][0]["picker"], "max-score-picker");
    // Explaining sent nothing upstream and is not a client request.
    for e in [&ea, &eb] {
        assert!(e
            .received_requests()
            .iter()
            .all(|r| !r.path.starts_with("/v1/")));
    }
    assert_eq!(
        metric(
            &a,
            r#"kvmesh_routing_decisions_total{decision="local",reason="scheduled"}"#
        )
        .await,
        None
    );
    // An unknown model is explained as the error a client would get.
    let r = fetch(
        &http1(),
        post_json(
            a.admin_addr(),
            "/debug/route",
            r#"{"model":"nope","messages":[]}"#,
        ),
    )
    .await;
    let v = r.json();
    assert_eq!(v["decision"], "error");
    assert_eq!(v["error"]["status"], 404);
    assert_eq!(v["trace"]["profiles"][0]["emptied_by"], "model-filter");
    for h in [a, b] {
        h.shutdown().await;
    }
    ea.shutdown().await;
    eb.shutdown().await;
}

#[tokio::test]
async fn a_request_scheduled_to_a_peer_is_forwarded_there_and_served_by_its_engine() {
    let (ea, eb) = (sim().await, sim().await);
    let dir = tempfile::tempdir().unwrap();
    let a = sidecar(&ea, &[("pod", "a")], Some(&only_pod(dir.path(), "b"))).await;
    let b = sidecar(&eb, &[("pod", "b")], None).await;
    let peer = add_peer(&a, &b, &[("pod", "b")]);

    let r = fetch(&http1(), post_json(a.addr(), "/v1/completions", COMPLETION)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["model"], MODEL);
    let served: Vec<_> = eb
        .received_requests()
        .into_iter()
        .filter(|r| r.path == "/v1/completions")
        .collect();
    assert_eq!(served.len(), 1, "B's engine served it");
    assert!(ea
        .received_requests()
        .iter()
        .all(|r| r.path != "/v1/completions"));
    // B's sidecar saw x-kvmesh-routed, served it locally without scheduling,
    // and did not pass the marker on to its engine.
    assert_eq!(served[0].header("x-kvmesh-routed"), None);
    let routed = r#"kvmesh_routing_decisions_total{decision="local",reason="routed_by_peer"}"#;
    assert_eq!(metric(&b, routed).await, Some(1.0));
    let to_peer = r#"kvmesh_routing_decisions_total{decision="peer",reason="scheduled"}"#;
    assert_eq!(metric(&a, to_peer).await, Some(1.0));
    // A counted the request towards B while it ran, and no longer does.
    let fleet = admin_get(a.admin_addr(), "/debug/fleet").await.json();
    let pods = fleet["pods"].as_array().unwrap();
    let b_pod = pods
        .iter()
        .find(|p| p["info"]["id"] == peer.as_str())
        .unwrap();
    assert_eq!(b_pod["in_flight_local"], 0);
    for h in [a, b] {
        h.shutdown().await;
    }
    ea.shutdown().await;
    eb.shutdown().await;
}

#[tokio::test]
async fn the_approximate_window_is_the_filter_configs_max_prefix_blocks_and_follows_a_reload() {
    let engine = sim().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("filters.yaml");
    let scorer = "  - type: prefix-cache-scorer\n  - type: max-score-picker\n";
    let producer = |n: u32| {
        filters_yaml(&format!(
            "  - type: approx-prefix-cache-producer\n    parameters:\n      \
             maxPrefixBlocksToMatch: {n}\n{scorer}"
        ))
    };
    std::fs::write(&file, producer(4)).unwrap();
    let proxy = sidecar(&engine, &[], Some(&file)).await;
    // 300 approximate blocks of 256 characters (no tokenizer: approximate mode).
    let body =
        serde_json::json!({"model": MODEL, "prompt": "w".repeat(256 * 300), "max_tokens": 1})
            .to_string();
    let blocks = || async {
        let r = fetch(
            &http1(),
            post_json(proxy.admin_addr(), "/debug/route", &body),
        )
        .await;
        r.json()["request"]["prompt_blocks"].as_u64()
    };
    assert_eq!(blocks().await, Some(4));
    std::fs::write(&file, producer(16)).unwrap();
    eventually("the reloaded window", || async {
        (blocks().await == Some(16)).then_some(())
    })
    .await;
    // No producer: llm-d's default window.
    std::fs::write(&file, filters_yaml(scorer)).unwrap();
    eventually("the default window", || async {
        (blocks().await == Some(256)).then_some(())
    })
    .await;
    proxy.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test]
async fn the_autoscaling_hook_sizes_each_pool_from_the_fleets_load() {
    use kvmesh_filters::sched::Role;
    use kvmesh_proxy::fleet::{EngineLoad, PodInfo};
    let engine = sim().await;
    // This pod serves both roles and is idle: the aggregated pool shrinks to its minimum.
    let s = sidecar(&engine, &[], None).await;
    eventually("the local load is scraped", || async {
        let pods = s.fleet().snapshot(tokio::time::Instant::now());
        pods.iter().all(|p| p.load_age_ms.is_some()).then_some(())
    })
    .await;
    // Peers with the loads their engines would report, as the mesh brings them.
    let peers = [
        (Role::Prefill, 6, 0.2),
        (Role::Prefill, 4, 0.2),
        (Role::Decode, 1, 0.9),
        (Role::Decode, 1, 0.9),
        (Role::Decode, 1, 0.9),
    ];
    for (i, (role, waiting, kv_usage)) in peers.into_iter().enumerate() {
        let addr: std::net::SocketAddr = format!("127.0.0.1:{}", 10_001 + i).parse().unwrap();
        let info = PodInfo {
            id: addr.to_string(),
            sidecar_addr: Some(addr),
            role,
            models: vec![MODEL.to_owned()],
            lora_adapters: vec![],
            labels: Default::default(),
        };
        s.fleet().upsert_peer(info).unwrap();
        let load = EngineLoad {
            waiting,
            kv_usage,
            ..EngineLoad::default()
        };
        s.fleet()
            .set_load(&addr.to_string(), load, tokio::time::Instant::now());
    }
    let a = admin_get(s.admin_addr(), "/autoscale").await;
    assert_eq!(a.status, 200);
    let a = a.json();
    // Prefill: 5 waiting per pod against a target of 2, so 2 pods become ceil(2 x 2.5) = 5.
    assert_eq!(a["prefill"]["pods"], 2);
    assert_eq!(a["prefill"]["desired"], 5, "{a}");
    assert_eq!(a["prefill"]["signal"], "waiting");
    // Decode: 90% KV usage against 75%, so 3 pods become ceil(3 x 1.2) = 4.
    assert_eq!(a["decode"]["desired"], 4, "{a}");
    assert_eq!(a["decode"]["signal"], "kv_usage");
    assert_eq!(a["aggregated"]["pods"], 1);
    assert_eq!(a["aggregated"]["desired"], 1, "{a}");
    // The same answer in Prometheus form, for an HPA through an adapter.
    let desired = r#"kvmesh_autoscale_desired_replicas{pool="decode"}"#;
    assert_eq!(metric(&s, desired).await, Some(4.0));
    s.shutdown().await;
    engine.shutdown().await;
}
