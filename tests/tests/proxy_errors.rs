//! Every failure gets an OpenAI-style error with the right status, or, once a
//! stream has started, a final SSE error event and a clean end. Never a hang.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use bytes::Bytes;
use kvmesh_proxy::config::{ByteSize, Duration as CfgDuration};
use kvmesh_tests::client::{self, fetch, next_chunk, post_json, request, send, Whole};
use kvmesh_tests::fake_upstream::{FakeUpstream, Reply};
use kvmesh_tests::sidecar::{refused_addr, start, start_for, test_config};

const STREAM_BODY: &str = r#"{"model":"m","prompt":"p","stream":true}"#;

fn assert_error(r: &Whole, status: u16, kind: &str, code: &str) {
    assert_eq!(r.status, status, "{}", r.text());
    assert_eq!(r.headers["content-type"], "application/json");
    let v = r.json();
    assert_eq!(v["error"]["type"], kind, "{v}");
    assert_eq!(v["error"]["code"], code, "{v}");
    assert!(!v["error"]["message"].as_str().unwrap().is_empty());
}

#[tokio::test]
async fn malformed_json_is_400_and_never_reaches_the_engine() {
    let engine = kvmesh_tests::fake_vllm::start().await;
    let proxy = start_for(engine.addr()).await;
    let c = client::http1();
    let r = fetch(
        &c,
        post_json(
            proxy.addr(),
            "/v1/chat/completions",
            r#"{"model": "m", "messages": ["#,
        ),
    )
    .await;
    assert_error(&r, 400, "invalid_request_error", "malformed_json");
    // A field of the wrong type is the client's error too.
    let r = fetch(
        &c,
        post_json(
            proxy.addr(),
            "/v1/completions",
            r#"{"model":"m","prompt":"p","stream":"yes"}"#,
        ),
    )
    .await;
    assert_error(&r, 400, "invalid_request_error", "malformed_json");
    assert!(engine.calls().is_empty());
    proxy.shutdown().await;
}

#[tokio::test]
async fn body_over_the_limit_is_413() {
    let engine = kvmesh_tests::fake_vllm::start().await;
    let mut config = test_config(engine.addr());
    config.limits.max_body_bytes = ByteSize(64);
    let proxy = start(config).await;
    let big = format!(r#"{{"model":"m","prompt":"{}"}}"#, "x".repeat(100));
    let r = fetch(
        &client::http1(),
        post_json(proxy.addr(), "/v1/completions", &big),
    )
    .await;
    assert_error(&r, 413, "invalid_request_error", "body_too_large");
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("64 bytes"));
    // Under the limit still works.
    let r = fetch(
        &client::http1(),
        post_json(
            proxy.addr(),
            "/v1/completions",
            r#"{"model":"m","max_tokens":1}"#,
        ),
    )
    .await;
    assert_eq!(r.status, 200);
    proxy.shutdown().await;
}

#[tokio::test]
async fn wrong_method_on_inference_route_is_405() {
    let engine = kvmesh_tests::fake_vllm::start().await;
    let proxy = start_for(engine.addr()).await;
    let r = fetch(
        &client::http1(),
        request(
            "GET",
            proxy.addr(),
            "/v1/chat/completions",
            Bytes::new(),
            &[],
        ),
    )
    .await;
    assert_error(&r, 405, "invalid_request_error", "method_not_allowed");
    assert_eq!(r.headers["allow"], "POST");
    let r = fetch(
        &client::http1(),
        request("DELETE", proxy.addr(), "/v1/models", Bytes::new(), &[]),
    )
    .await;
    assert_error(&r, 405, "invalid_request_error", "method_not_allowed");
    assert!(engine.calls().is_empty());
    proxy.shutdown().await;
}

#[tokio::test]
async fn engine_refusing_connections_is_502() {
    let proxy = start_for(refused_addr().await).await;
    let r = fetch(
        &client::http1(),
        post_json(proxy.addr(), "/v1/completions", STREAM_BODY),
    )
    .await;
    assert_error(&r, 502, "upstream_error", "upstream_unavailable");
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("refused"));
    proxy.shutdown().await;
}

#[tokio::test]
async fn engine_silent_before_first_byte_is_504() {
    let engine = FakeUpstream::builder()
        .route("/v1/completions", |_| Reply::Hang)
        .start()
        .await;
    let mut config = test_config(engine.addr());
    config.timeouts.first_byte = CfgDuration::from_millis(300);
    let proxy = start(config).await;
    let started = std::time::Instant::now();
    let r = fetch(
        &client::http1(),
        post_json(proxy.addr(), "/v1/completions", STREAM_BODY),
    )
    .await;
    assert_error(&r, 504, "upstream_error", "upstream_timeout");
    assert!(started.elapsed() >= Duration::from_millis(300));
    proxy.shutdown().await;
}

/// Reads the rest of a failed stream: the error event, then `[DONE]`, then a clean end.
async fn read_error_tail(body: &mut hyper::body::Incoming) -> serde_json::Value {
    let mut rest = Vec::new();
    while let Some(c) = next_chunk(body).await {
        rest.extend_from_slice(&c);
    }
    let text = String::from_utf8(rest).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 2, "{text:?}");
    assert_eq!(events[1], "data: [DONE]");
    serde_json::from_str(events[0].strip_prefix("data: ").unwrap()).unwrap()
}

#[tokio::test]
async fn engine_silent_mid_stream_ends_with_an_error_event() {
    let (tx, engine) = FakeUpstream::scripted_stream().await;
    let mut config = test_config(engine.addr());
    config.timeouts.stream_idle = CfgDuration::from_millis(300);
    let proxy = start(config).await;
    let resp = send(
        &client::http1(),
        post_json(proxy.addr(), "/v1/completions", STREAM_BODY),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    assert!(tx.send("data: {\"n\":1}\n\n").await);
    assert_eq!(next_chunk(&mut body).await.unwrap(), "data: {\"n\":1}\n\n");
    let err = read_error_tail(&mut body).await;
    assert_eq!(err["error"]["code"], "stream_idle_timeout");
    assert_eq!(err["error"]["type"], "upstream_error");
    proxy.shutdown().await;
}

#[tokio::test]
async fn engine_dying_mid_stream_ends_with_an_error_event() {
    // Without migration, bytes go out as they come: half an event, then the
    // engine dies, and the error must still parse on its own. With it (the
    // default), only whole events go out, and a stream with no other pod to
    // go on on ends the same way (tests/migration.rs has the pods).
    for max_migrations in [0, 3] {
        let (tx, engine) = FakeUpstream::scripted_stream().await;
        let mut config = test_config(engine.addr());
        config.migration.max_migrations = max_migrations;
        let proxy = start(config).await;
        let resp = send(
            &client::http1(),
            post_json(proxy.addr(), "/v1/completions", STREAM_BODY),
        )
        .await;
        let mut body = resp.into_body();
        assert!(tx.send("data: {\"n\":1}\n\ndata: {\"trunc").await);
        let first = next_chunk(&mut body).await.unwrap();
        match max_migrations {
            0 => assert_eq!(first, "data: {\"n\":1}\n\ndata: {\"trunc"),
            _ => assert_eq!(first, "data: {\"n\":1}\n\n"),
        }
        tx.fail().await;
        let err = read_error_tail(&mut body).await;
        assert_eq!(err["error"]["code"], "upstream_died");
        proxy.shutdown().await;
    }
}

#[tokio::test]
async fn client_disconnect_cancels_the_upstream_request() {
    let (mut tx, engine) = FakeUpstream::scripted_stream().await;
    let proxy = start_for(engine.addr()).await;
    let c = client::http1();
    let resp = send(&c, post_json(proxy.addr(), "/v1/completions", STREAM_BODY)).await;
    let mut body = resp.into_body();
    assert!(tx.send("data: {\"n\":1}\n\n").await);
    assert!(next_chunk(&mut body).await.is_some());
    drop(body);
    drop(c);
    assert!(
        tx.body_dropped(Duration::from_secs(5), b"data: {\"n\":0}\n\n")
            .await,
        "the engine kept streaming to a client that left"
    );
    proxy.shutdown().await;
}
