//! Flow control end to end (`featureGates: [flowControl]`): while every pod
//! of a request's pool is saturated the sidecar holds it, shows it held
//! (metrics, `/debug/fleet`), and sends it, first come first served, as a
//! pod frees; a request held `defaultRequestTTL`, or past `maxRequests`,
//! is sent as it would be without flow control, and every one is served.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;

use kvmesh_engine_sim::{SimConfig, SimHandle};
use kvmesh_proxy::SidecarHandle;
use kvmesh_tests::client::{admin_get, fetch, http1, post_json};
use kvmesh_tests::route::{eventually, metric, sidecar, sim_with, MODEL};
use tokio::task::JoinHandle;

/// One sequence at a time, real time: a request of 60 tokens holds the
/// engine for about 0.4 s (Llama 3.1 8B on an H100) while the next ones
/// queue.
async fn one_at_a_time() -> SimHandle {
    sim_with(SimConfig::new(MODEL).with_max_num_seqs(1)).await
}

/// A pod with one request queued is saturated.
const QUEUE_OF_ONE: &str = "  saturationDetector:\n    queueDepthThreshold: 1\n";

/// A one-at-a-time engine, and a sidecar in front of it whose filter file
/// turns flow control on with `flow` under `flowControl:` (the file's
/// folder lives as long as the test holds it).
async fn start(flow: &str) -> (SimHandle, SidecarHandle, tempfile::TempDir) {
    let engine = one_at_a_time().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("filters.yaml");
    let text = format!(
        "apiVersion: kvmesh.dev/v1alpha1\nkind: EndpointPickerConfig\nfeatureGates: [flowControl]\nflowControl:\n{flow}"
    );
    std::fs::write(&path, text).unwrap();
    let proxy = sidecar(&engine, &[], Some(&path)).await;
    (engine, proxy, dir)
}

/// Sends request `n` (its prompt names it) for `tokens` tokens and
/// returns its status.
fn send(addr: SocketAddr, n: usize, tokens: u32) -> JoinHandle<u16> {
    tokio::spawn(async move {
        let body = format!(
            r#"{{"model":"{MODEL}","prompt":"flow control request {n}","max_tokens":{tokens}}}"#
        );
        fetch(&http1(), post_json(addr, "/v1/completions", &body))
            .await
            .status
            .as_u16()
    })
}

/// The requests the engine received, by the number in their prompt.
fn received_order(engine: &SimHandle) -> Vec<usize> {
    engine
        .received_requests()
        .iter()
        .filter(|r| r.path == "/v1/completions")
        .filter_map(|r| {
            let body = String::from_utf8_lossy(&r.body).into_owned();
            let at = body.find("flow control request ")? + "flow control request ".len();
            body[at..]
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

const HELD: &str = r#"kvmesh_flow_control_queue_size{pool="aggregated"}"#;

async fn engine_received(engine: &SimHandle, n: usize) {
    eventually("the engine received the request", || async {
        (received_order(engine).len() >= n).then_some(())
    })
    .await;
}

async fn held_now(proxy: &SidecarHandle, n: f64) {
    eventually("the sidecar holds the requests", || async {
        (metric(proxy, HELD).await == Some(n)).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_saturated_pool_holds_requests_and_sends_them_in_arrival_order_as_its_pod_frees() {
    let (engine, proxy, _dir) = start(QUEUE_OF_ONE).await;
    let addr = proxy.addr();
    let mut sent = vec![send(addr, 0, 60)];
    engine_received(&engine, 1).await;
    eventually("the scrape shows request 0 running", || async {
        let f = admin_get(proxy.admin_addr(), "/debug/fleet").await.json();
        (f["pods"][0]["load"]["running"] == 1).then_some(())
    })
    .await;
    // Nothing queues yet: request 1 goes to the engine, and waits there.
    sent.push(send(addr, 1, 60));
    engine_received(&engine, 2).await;
    // Now one queues: 2 and 3 are held, in the order they came.
    sent.push(send(addr, 2, 60));
    held_now(&proxy, 1.0).await;
    sent.push(send(addr, 3, 60));
    held_now(&proxy, 2.0).await;
    let f = admin_get(proxy.admin_addr(), "/debug/fleet").await.json();
    assert_eq!(f["pods"][0]["held"]["both"], 2, "{f}");
    assert!(received_order(&engine).len() <= 2, "held, not sent");
    for s in sent {
        assert_eq!(s.await.unwrap(), 200);
    }
    assert_eq!(received_order(&engine), vec![0, 1, 2, 3]);
    assert_eq!(metric(&proxy, HELD).await, Some(0.0));
    let room = r#"kvmesh_flow_control_sent_total{pool="aggregated",reason="room"}"#;
    assert_eq!(metric(&proxy, room).await, Some(2.0));
    assert_eq!(
        metric(&proxy, "kvmesh_flow_control_wait_seconds_count").await,
        Some(2.0)
    );
    let f = admin_get(proxy.admin_addr(), "/debug/fleet").await.json();
    assert_eq!(f["pods"][0]["held"]["both"], 0, "{f}");
    proxy.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test]
async fn a_request_held_its_ttl_or_past_max_requests_is_sent_at_once_and_served() {
    let flow = format!("  maxRequests: 1\n  defaultRequestTTL: 200ms\n{QUEUE_OF_ONE}");
    let (engine, proxy, _dir) = start(&flow).await;
    let addr = proxy.addr();
    // Request 0 holds the engine about a second: request 2's 200 ms run
    // out first.
    let mut sent = vec![send(addr, 0, 150)];
    engine_received(&engine, 1).await;
    sent.push(send(addr, 1, 150));
    // Request 1 waits in the engine (the scrape may not show 0 running
    // yet) or in the sidecar; either way the pod is saturated once both
    // are there.
    engine_received(&engine, 2).await;
    sent.push(send(addr, 2, 150));
    held_now(&proxy, 1.0).await;
    // One held is the most: request 3 goes at once.
    sent.push(send(addr, 3, 150));
    engine_received(&engine, 3).await;
    let full = r#"kvmesh_flow_control_sent_total{pool="aggregated",reason="full"}"#;
    assert_eq!(metric(&proxy, full).await, Some(1.0));
    for s in sent {
        assert_eq!(s.await.unwrap(), 200);
    }
    let ttl = r#"kvmesh_flow_control_sent_total{pool="aggregated",reason="ttl"}"#;
    assert_eq!(
        metric(&proxy, ttl).await,
        Some(1.0),
        "request 2 outwaited 200 ms"
    );
    assert_eq!(received_order(&engine).len(), 4);
    proxy.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test]
async fn a_client_that_leaves_while_held_leaves_the_line_and_reaches_no_engine() {
    let (engine, proxy, _dir) = start(QUEUE_OF_ONE).await;
    let addr = proxy.addr();
    let first = send(addr, 0, 150);
    engine_received(&engine, 1).await;
    let second = send(addr, 1, 150);
    engine_received(&engine, 2).await;
    let leaving = send(addr, 2, 150);
    held_now(&proxy, 1.0).await;
    // Request 1 may have been held a moment too (until a scrape showed
    // request 0 running): what was sent so far.
    let room = r#"kvmesh_flow_control_sent_total{pool="aggregated",reason="room"}"#;
    let before = metric(&proxy, room).await;
    // The client goes away: its connection closes with the request held.
    leaving.abort();
    held_now(&proxy, 0.0).await;
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(second.await.unwrap(), 200);
    assert_eq!(received_order(&engine), vec![0, 1], "request 2 never sent");
    assert_eq!(metric(&proxy, room).await, before);
    proxy.shutdown().await;
    engine.shutdown().await;
}
