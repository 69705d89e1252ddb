//! Each scripted fault does what a client would see from a failing engine.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvmesh_engine_sim::{Engine, SimConfig, SimHandle};
use serde_json::json;

async fn engine() -> SimHandle {
    Engine::start_local(SimConfig::new("sim").with_time_scale(100.0))
        .await
        .unwrap()
}

#[tokio::test]
async fn status_for_the_nth_request() {
    let e = engine().await;
    e.faults().fail_nth(2, 503);
    let body = completion("hello", 2);
    assert_eq!(post(e.addr(), "/v1/completions", &body).await.0, 200);
    let (s, err) = post(e.addr(), "/v1/completions", &body).await;
    assert_eq!(s, 503);
    assert_eq!(err["error"]["code"], 503);
    assert_eq!(post(e.addr(), "/v1/completions", &body).await.0, 200);
    // The same over the admin route, for the binary.
    let (s, _) = post(e.addr(), "/sim/faults", &json!({"fail_nth": [[1, 429]]})).await;
    assert_eq!(s, 200);
    assert_eq!(post(e.addr(), "/v1/completions", &body).await.0, 429);
    assert_eq!(post(e.addr(), "/v1/completions", &body).await.0, 200);
    e.shutdown().await;
}

#[tokio::test]
async fn delay_before_first_byte() {
    let e = engine().await;
    e.faults()
        .delay_first_byte(Some(Duration::from_millis(300)));
    let t = Instant::now();
    assert_eq!(
        post(e.addr(), "/v1/completions", &completion("slow", 1))
            .await
            .0,
        200
    );
    assert!(t.elapsed() >= Duration::from_millis(300));
    e.faults().clear();
    let t = Instant::now();
    assert_eq!(
        post(e.addr(), "/v1/completions", &completion("fast", 1))
            .await
            .0,
        200
    );
    assert!(t.elapsed() < Duration::from_millis(300));
    e.shutdown().await;
}

#[tokio::test]
async fn dies_mid_stream_after_k_chunks() {
    let e = engine().await;
    e.faults().die_after_chunks(Some(2));
    let body = json!({"model": "sim", "prompt": "stream", "max_tokens": 10, "stream": true});
    let r = try_request(e.addr(), "POST", "/v1/completions", Some(&body), &[]).await;
    assert!(r.is_err(), "the body must end abruptly, got {r:?}");
    e.faults().die_after_chunks(None);
    let (s, raw) = request(e.addr(), "POST", "/v1/completions", Some(&body)).await;
    assert_eq!(s, 200);
    assert_eq!(sse_events(&raw).last().unwrap(), "[DONE]");
    e.shutdown().await;
}

#[tokio::test]
async fn refuses_connections_until_told_otherwise() {
    let e = engine().await;
    e.faults().refuse_connections(true);
    assert!(try_request(e.addr(), "GET", "/health", None, &[])
        .await
        .is_err());
    e.faults().refuse_connections(false);
    assert_eq!(request(e.addr(), "GET", "/health", None).await.0, 200);
    e.shutdown().await;
}

#[tokio::test]
async fn restart_fails_running_requests_and_forgets_the_cache() {
    let e = Engine::start_local(SimConfig::new("sim").with_time_scale(2.0))
        .await
        .unwrap();
    let prompt = words("keep", 64);
    assert_eq!(
        post(e.addr(), "/v1/completions", &completion(&prompt, 1))
            .await
            .0,
        200
    );
    let (_, r) = post(e.addr(), "/v1/completions", &completion(&prompt, 1)).await;
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 64);
    let addr = e.addr();
    // ~500 tokens at ~9 ms each, at 2x: a couple of seconds of stream.
    let body = json!({"model": "sim", "prompt": "long answer", "max_tokens": 500, "stream": true});
    let running =
        tokio::spawn(async move { request(addr, "POST", "/v1/completions", Some(&body)).await });
    for _ in 0..500 {
        if e.stats().running == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(e.stats().running, 1);
    e.restart().await.unwrap();
    let (_, raw) = running.await.unwrap();
    let evs = sse_events(&raw);
    assert!(
        evs.iter().any(|v| v.get("error").is_some()),
        "the stream reports the failure: {evs:?}"
    );
    assert_eq!(e.stats().prefix_queries, 0, "metrics start over");
    let (_, r) = post(e.addr(), "/v1/completions", &completion(&prompt, 1)).await;
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    e.shutdown().await;
}

#[tokio::test]
async fn records_what_it_received() {
    let e = engine().await;
    let (s, _) = try_request(
        e.addr(),
        "POST",
        "/v1/completions",
        Some(&completion("hi", 1)),
        &[("x-request-id", "abc")],
    )
    .await
    .unwrap();
    assert_eq!(s, 200);
    let got = e.received_requests();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].path, "/v1/completions");
    assert_eq!(got[0].header("X-Request-Id"), Some("abc"));
    assert_eq!(got[0].json().unwrap()["prompt"], "hi");
    e.shutdown().await;
}
