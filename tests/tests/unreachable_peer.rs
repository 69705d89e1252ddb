//! A request waiting for its response head on a peer that becomes
//! unreachable (docs/migration.md, "Non-streamed requests"; the long
//! partition in docs/robustness.md): when the fleet cuts the peer off (its
//! mesh stream fell silent past `mesh.stale_after`), the call is dropped and
//! the request goes whole to a pod that answers, instead of waiting out
//! `timeouts.first_byte` and failing with a 504. The peer here is a
//! listener that reads the request and never answers, as a pod across a
//! network partition does; the fleet's cut-off is what the mesh subscriber
//! calls on a silent stream.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::Duration;

use kvmesh_filters::sched::Role;
use kvmesh_proxy::config::Duration as CfgDuration;
use kvmesh_proxy::fleet::{EngineLoad, PodInfo};
use kvmesh_tests::client::{fetch, http1, post_json};
use kvmesh_tests::route::{config, filters_yaml, labels_of, metric, sim, MODEL};
use kvmesh_tests::sidecar::{start, wait_ready};
use serde_json::json;
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// Within the test client's wait for a head (`kvmesh_tests::client::WAIT`),
/// so that a request still waiting for x's head fails the test with the
/// sidecar's 504, and much longer than the local engine takes to answer.
const FIRST_BYTE: Duration = Duration::from_secs(8);

/// A "pod" that accepts, reads what comes and never answers; each
/// connection's first bytes are reported on the channel. The task ends with
/// the test's runtime.
async fn silent_pod() -> (SocketAddr, mpsc::Receiver<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let mut told = false;
                // Held open, answering nothing, until the sidecar drops it.
                while let Ok(n) = conn.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    if !told {
                        told = true;
                        let _ = tx.send(()).await;
                    }
                }
            });
        }
    });
    (addr, rx)
}

#[tokio::test]
async fn a_request_without_a_head_goes_elsewhere_when_its_peer_is_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let filters = dir.path().join("only-x.yaml");
    std::fs::write(
        &filters,
        filters_yaml(
            "  - type: label-selector-filter\n    parameters:\n      matchLabels: {pod: x}\n  - type: queue-scorer\n",
        ),
    )
    .unwrap();
    let engine = sim().await;
    let mut c = config(&engine, &[("pod", "a")], Some(&filters));
    c.timeouts.first_byte = CfgDuration::from_secs(FIRST_BYTE.as_secs());
    let a = start(c).await;
    wait_ready(&a).await;
    let (silent, mut heard) = silent_pod().await;
    let x = PodInfo {
        id: silent.to_string(),
        sidecar_addr: Some(silent),
        role: Role::Both,
        models: vec![MODEL.to_owned()],
        lora_adapters: vec![],
        labels: labels_of(&[("pod", "x")]),
    };

    let whole = json!({"model": MODEL, "prompt": "a short answer", "max_tokens": 6});
    let streamed =
        json!({"model": MODEL, "prompt": "a short stream", "max_tokens": 6, "stream": true});
    for (i, body) in [whole, streamed].into_iter().enumerate() {
        // The plan names x alone, which reads the request and never answers.
        a.fleet().upsert_peer(x.clone()).unwrap();
        a.fleet()
            .set_load(&x.id, EngineLoad::default(), tokio::time::Instant::now());
        let req = post_json(a.addr(), "/v1/completions", &body.to_string());
        let client = http1();
        let pending = tokio::spawn(async move { fetch(&client, req).await });
        tokio::time::timeout(Duration::from_secs(10), heard.recv())
            .await
            .expect("the request reached x")
            .expect("x listens");
        // x's mesh stream fell silent: the mesh cuts it off.
        assert!(a.fleet().cut_off_peer(&x.id));
        let r = pending.await.unwrap();
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        if body["stream"] == true {
            assert!(r.text().contains("data: [DONE]"), "{}", r.text());
        } else {
            assert_eq!(r.json()["usage"]["completion_tokens"], 6);
        }
        // The local engine (the last resort) got it whole.
        let sent: Vec<serde_json::Value> = engine
            .received_requests()
            .into_iter()
            .filter(|r| r.path.starts_with("/v1/"))
            .map(|r| serde_json::from_slice(&r.body).unwrap())
            .collect();
        assert_eq!(sent.len(), i + 1);
        assert_eq!(sent[i], body);
        let counted = metric(
            &a,
            "kvmesh_migrations_total{outcome=\"retried_unreachable\"}",
        )
        .await;
        assert_eq!(counted, Some((i + 1) as f64));
    }
    a.shutdown().await;
    engine.shutdown().await;
}
