//! W3C trace context through the mesh: a client's `traceparent` and
//! `tracestate` reach the engine unchanged, whether the request runs on the
//! local engine, crosses to a peer's sidecar first, or is split into prefill
//! and decode legs. These sidecars have no `tracing` section, so they record
//! no spans and must not invent parents: the engines' spans (vLLM
//! `--otlp-traces-endpoint`) join the client's trace directly under the
//! client's span. With `tracing` configured each call carries the sidecar's
//! own span instead: `trace_export.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::net::SocketAddr;

use kvmesh_engine_sim::{Flavor, ReceivedRequest, Role as SimRole, SimConfig, SimHandle};
use kvmesh_proxy::SidecarHandle;
use kvmesh_tests::client::{fetch, http1, request};
use kvmesh_tests::mesh::{
    forwarded, indexes_converged, kv_sim, mesh_config, shared_prefix_body, start_on, write_peers,
};
use kvmesh_tests::route::{config, eventually, sim_with, MODEL};
use kvmesh_tests::sidecar::start;

const TRACESTATE: &str = "vendor=abc,other=1";

fn traceparent(i: usize) -> String {
    format!("00-{:032x}-{:016x}-01", 0xabc0_0000 + i, 0x5150 + i)
}

async fn complete(addr: SocketAddr, body: &str, id: &str, tp: &str) {
    let req = request(
        "POST",
        addr,
        "/v1/completions",
        body.to_owned(),
        &[
            ("content-type", "application/json"),
            ("x-request-id", id),
            ("traceparent", tp),
            ("tracestate", TRACESTATE),
        ],
    );
    let r = fetch(&http1(), req).await;
    assert_eq!(r.status, 200, "{}", r.text());
}

fn inference(e: &SimHandle) -> Vec<ReceivedRequest> {
    let mut v = e.received_requests();
    v.retain(|r| r.path.starts_with("/v1/"));
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_context_reaches_the_engine_through_a_peer_sidecar() {
    let peers = tempfile::NamedTempFile::new().unwrap();
    let mut engines = Vec::new();
    let mut sidecars: Vec<SidecarHandle> = Vec::new();
    for _ in 0..2 {
        let e = kv_sim().await;
        sidecars.push(start_on(mesh_config(&e, peers.path()), None).await);
        engines.push(e);
    }
    let addrs: Vec<SocketAddr> = sidecars.iter().map(|s| s.mesh_addr().unwrap()).collect();
    write_peers(peers.path(), &addrs);
    for s in &sidecars {
        eventually("both pods known", || async {
            (s.fleet().snapshot(tokio::time::Instant::now()).len() == 2).then_some(())
        })
        .await;
    }
    // Prefixes land on some pod through either sidecar; sent again through
    // the other sidecar, those held by the far pod cross the mesh.
    let mut sent = HashMap::new();
    let mut i = 0;
    for round in 0..3 {
        for group in 0..6 {
            let via = sidecars[(round + group) % 2].addr();
            let (id, tp) = (format!("req-{i}"), traceparent(i));
            complete(via, &shared_prefix_body(group, round), &id, &tp).await;
            sent.insert(id, tp);
            i += 1;
        }
        indexes_converged(&sidecars).await;
    }
    assert!(
        forwarded(&sidecars).await > 0.0,
        "no request crossed the mesh"
    );
    let received: Vec<ReceivedRequest> = engines.iter().flat_map(inference).collect();
    assert_eq!(received.len(), sent.len());
    for r in &received {
        let id = r.header("x-request-id").unwrap();
        assert_eq!(r.header("traceparent"), Some(sent[id].as_str()), "{id}");
        assert_eq!(r.header("tracestate"), Some(TRACESTATE), "{id}");
    }
    for s in sidecars {
        s.shutdown().await;
    }
    for e in engines {
        e.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_pd_legs_carry_the_clients_trace_context() {
    let engine = |role| {
        sim_with(
            SimConfig::new(MODEL)
                .with_time_scale(10.0)
                .with_role(role)
                .with_flavor(Flavor::Vllm),
        )
    };
    let prefill = engine(SimRole::Prefill).await;
    let decode = engine(SimRole::Decode).await;
    let mut c = config(&decode, &[], None);
    c.pd.allowed_prefillers = vec![prefill.addr().to_string()];
    let sidecar = start(c).await;
    let body = serde_json::json!({
        "model": MODEL,
        "prompt": "the quick brown fox jumps over the lazy dog ".repeat(40),
        "max_tokens": 4,
    });
    let tp = traceparent(1);
    let p = prefill.addr().to_string();
    let req = request(
        "POST",
        sidecar.addr(),
        "/v1/completions",
        body.to_string(),
        &[
            ("content-type", "application/json"),
            ("x-prefiller-host-port", &p),
            ("traceparent", &tp),
            ("tracestate", TRACESTATE),
        ],
    );
    let r = fetch(&http1(), req).await;
    assert_eq!(r.status, 200, "{}", r.text());
    for (leg, e) in [("prefill", &prefill), ("decode", &decode)] {
        let got = inference(e);
        assert_eq!(got.len(), 1, "{leg}");
        assert_eq!(got[0].header("traceparent"), Some(tp.as_str()), "{leg}");
        assert_eq!(got[0].header("tracestate"), Some(TRACESTATE), "{leg}");
    }
    sidecar.shutdown().await;
}
