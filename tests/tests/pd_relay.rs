//! No open relay through llm-d's `x-prefiller-host-port`: the header is
//! followed only to a pod the fleet knows (its prefill leg then goes through
//! that pod's sidecar) or to `pd.allowed_prefillers`; anything else gets 403
//! before any connection is made, which a listener at the named address
//! checks by seeing none.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{SocketAddr, TcpListener};

use kvmesh_engine_sim::{Role as SimRole, SimHandle};
use kvmesh_filters::sched::Role;
use kvmesh_proxy::fleet::PodInfo;
use kvmesh_proxy::SidecarHandle;
use kvmesh_tests::client::{fetch, http1, request, Whole};
use kvmesh_tests::route::{config, pd_sim, MODEL};
use kvmesh_tests::sidecar::start;
use serde_json::json;

const PREFILLER: &str = "x-prefiller-host-port";

async fn completion(sidecar: &SidecarHandle, prefiller: &str) -> Whole {
    let body = json!({"model": MODEL, "prompt": "the quick brown fox ".repeat(20), "max_tokens": 4, "temperature": 0});
    let req = request(
        "POST",
        sidecar.addr(),
        "/v1/completions",
        body.to_string(),
        &[("content-type", "application/json"), (PREFILLER, prefiller)],
    );
    fetch(&http1(), req).await
}

fn add_peer(sidecar: &SidecarHandle, addr: SocketAddr) {
    sidecar
        .fleet()
        .upsert_peer(PodInfo {
            id: addr.to_string(),
            sidecar_addr: Some(addr),
            role: Role::Prefill,
            models: vec![MODEL.to_owned()],
            lora_adapters: vec![],
            labels: Default::default(),
        })
        .unwrap();
}

/// Inference requests (not health or metrics polls) an engine received.
fn inference(engine: &SimHandle) -> usize {
    engine
        .received_requests()
        .iter()
        .filter(|r| r.path.starts_with("/v1/"))
        .count()
}

/// Whether anything connected to `listener` (already queued by the kernel:
/// a client's connect completes before it sends, so by the time the sidecar
/// answered, any connection it made is in the backlog).
fn saw_a_connection(listener: &TcpListener) -> bool {
    listener.set_nonblocking(true).unwrap();
    match listener.accept() {
        Ok(_) => true,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
        Err(e) => panic!("accept: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_prefiller_is_refused_before_any_connection() {
    let decode = pd_sim(SimRole::Decode).await;
    let sidecar = start(config(&decode, &[], None)).await;
    let target = TcpListener::bind("127.0.0.1:0").unwrap();
    let named = target.local_addr().unwrap().to_string();
    let resp = completion(&sidecar, &named).await;
    assert_eq!(resp.status, 403, "{}", resp.text());
    assert_eq!(resp.json()["error"]["code"], "prefiller_not_allowed");
    assert!(
        resp.text().contains("not a pod the fleet knows"),
        "{}",
        resp.text()
    );
    assert!(
        !saw_a_connection(&target),
        "the sidecar connected to an unknown host"
    );
    assert_eq!(inference(&decode), 0, "nothing reached the engine either");
    // A host name is not looked up either.
    let resp = completion(&sidecar, "metadata.google.internal:80").await;
    assert_eq!(resp.status, 403);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_pod_is_followed_through_its_sidecar() {
    let prefill = pd_sim(SimRole::Prefill).await;
    let decode = pd_sim(SimRole::Decode).await;
    let mut pc = config(&prefill, &[], None);
    pc.pod.role = Role::Prefill;
    let prefill_sidecar = start(pc).await;
    let sidecar = start(config(&decode, &[], None)).await;
    add_peer(&sidecar, prefill_sidecar.addr());
    // Named by its sidecar's address, and by its engine's address (the IP
    // is the only peer's): both legs run, the prefill leg via the peer's sidecar.
    for named in [
        prefill_sidecar.addr().to_string(),
        prefill.addr().to_string(),
    ] {
        let before = (inference(&prefill), inference(&decode));
        let resp = completion(&sidecar, &named).await;
        assert_eq!(resp.status, 200, "{named}: {}", resp.text());
        assert_eq!(
            inference(&prefill),
            before.0 + 1,
            "{named}: one prefill leg"
        );
        assert_eq!(inference(&decode), before.1 + 1, "{named}: one decode leg");
        let leg = prefill
            .received_requests()
            .into_iter()
            .rfind(|r| r.path.starts_with("/v1/"))
            .unwrap();
        assert_eq!(
            leg.header(PREFILLER),
            None,
            "the header stops at the first sidecar"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ip_shared_by_several_peers_needs_the_exact_sidecar_address() {
    let decode = pd_sim(SimRole::Decode).await;
    let sidecar = start(config(&decode, &[], None)).await;
    let a = TcpListener::bind("127.0.0.1:0").unwrap();
    let b = TcpListener::bind("127.0.0.1:0").unwrap();
    add_peer(&sidecar, a.local_addr().unwrap());
    add_peer(&sidecar, b.local_addr().unwrap());
    let engine_port = TcpListener::bind("127.0.0.1:0").unwrap();
    let resp = completion(&sidecar, &engine_port.local_addr().unwrap().to_string()).await;
    assert_eq!(resp.status, 403, "ambiguous: {}", resp.text());
    for l in [&a, &b, &engine_port] {
        assert!(!saw_a_connection(l));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allow_listed_engine_outside_the_fleet_is_called_directly() {
    let prefill = pd_sim(SimRole::Prefill).await;
    let decode = pd_sim(SimRole::Decode).await;
    let mut c = config(&decode, &[], None);
    c.pd.allowed_prefillers = vec![prefill.addr().to_string()];
    let sidecar = start(c).await;
    let resp = completion(&sidecar, &prefill.addr().to_string()).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(inference(&prefill), 1);
    assert_eq!(inference(&decode), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_mesh_tls_the_prefill_leg_to_a_known_pod_goes_over_it() {
    use kvmesh_proxy::config::Duration as CfgDuration;
    use kvmesh_tests::certs::{MeshPki, TestCert};
    use kvmesh_tests::mesh::{start_on, write_peers};
    use kvmesh_tests::route::eventually;

    let pki = MeshPki::new();
    let peers = tempfile::NamedTempFile::new().unwrap();
    // The prefill pod's client port speaks TLS for its clients: a plain-HTTP
    // prefill leg to it would fail, so a served request proves the leg took
    // the mesh port's mutual TLS.
    let client_cert = TestCert::new();
    let prefill = pd_sim(SimRole::Prefill).await;
    let decode = pd_sim(SimRole::Decode).await;
    let mut sidecars = Vec::new();
    for (i, (e, role)) in [(&prefill, Role::Prefill), (&decode, Role::Decode)]
        .into_iter()
        .enumerate()
    {
        let mut c = config(e, &[], None);
        c.pod.role = role;
        c.mesh.listen = Some("127.0.0.1:0".parse().unwrap());
        c.mesh.file = Some(peers.path().to_path_buf());
        c.mesh.refresh_interval = CfgDuration::from_millis(100);
        c.mesh.reconnect_max = CfgDuration::from_millis(200);
        c.mesh.tls = Some(pki.files(&format!("pod{i}"), "kvmesh-mesh"));
        if role == Role::Prefill {
            c.listeners.tls = Some(kvmesh_proxy::config::Tls {
                cert: client_cert.cert_path.clone(),
                key: client_cert.key_path.clone(),
            });
        }
        sidecars.push(start_on(c, None).await);
    }
    let addrs: Vec<SocketAddr> = sidecars.iter().map(|s| s.mesh_addr().unwrap()).collect();
    write_peers(peers.path(), &addrs);
    let (p_side, d_side) = (&sidecars[0], &sidecars[1]);
    let prefill_id = p_side.addr().to_string();
    eventually(
        "the decode pod knows the prefill pod over the TLS mesh",
        || async { d_side.fleet().contains(&prefill_id).then_some(()) },
    )
    .await;
    let resp = completion(d_side, &prefill.addr().to_string()).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(
        inference(&prefill),
        1,
        "the prefill leg reached the prefill engine"
    );
    assert_eq!(inference(&decode), 1);
    let received =
        kvmesh_tests::route::metric(p_side, r#"kvmesh_mesh_requests_total{served="received"}"#)
            .await;
    assert_eq!(
        received,
        Some(1.0),
        "the prefill pod received the leg over the mesh"
    );
    for s in sidecars {
        s.shutdown().await;
    }
}
