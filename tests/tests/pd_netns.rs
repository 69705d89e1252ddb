//! P/D with the `kvagent` connector placed as a cluster places it: two nodes
//! (network namespaces joined by a veth pair), each with its kvagent on the
//! node address (hostNetwork, `status.hostIP`) and an engine pod (a simulated
//! engine speaking the kvmesh KV connector, and its sidecar) on a pod address
//! of its own. The prefill node's sidecar learns the decode node's agent
//! from the mesh (`pod.node_ip`, announced), the KV blocks cross the veth
//! (its byte counters grow by at least the blocks' bytes) and land at the
//! decode node's agent, where the decode engine takes them. An agent address
//! that is wrong (another node's, or the pod's own IP as before the node IP
//! was announced) fails: the decode engine recomputes and counts the failed
//! load, and the KV bytes never cross.
//!
//! Needs root (`ip netns`); without it each test says so and passes. The
//! namespaces and the veth are the test's own and are removed on drop, also
//! when an assertion fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use kvmesh_engine_sim::{Engine, KvagentConfig, Role as SimRole, SimConfig, SimHandle};
use kvmesh_filters::sched::Role;
use kvmesh_proxy::config::{Config, Duration as CfgDuration, PdConnector};
use kvmesh_proxy::{Sidecar, SidecarHandle};
use kvmesh_tests::client::{admin_get, fetch, http1, request};
use kvmesh_tests::netns::{kvagent_bin, Node, NodeAgent, NodePair};
use kvmesh_tests::route::MODEL;
use kvmesh_tests::sidecar::test_config;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::runtime::Runtime;

/// The agents' port: fixed, as `pd.kvagent_port` is one value for a fleet;
/// nothing else listens in namespaces this test made.
const AGENT_PORT: u16 = 7600;
/// The sidecars' mesh port (each peers with the other's before either runs).
const MESH_PORT: u16 = 7000;
/// Bytes of one KV block the simulated engines move (one per prompt block).
const BLOCK_BYTES: u64 = 64 << 10;
/// The simulated engines' block size, in tokens.
const BLOCK_TOKENS: u64 = 16;

/// One node: its runtime (threads in its namespace), agent, engine, sidecar.
struct Side {
    rt: Runtime,
    agent: NodeAgent,
    engine: SimAddrs,
    sidecar: SidecarAddrs,
    handles: Option<(SidecarHandle, SimHandle)>,
}

#[derive(Clone, Copy)]
struct SimAddrs {
    http: SocketAddr,
}

#[derive(Clone, Copy)]
struct SidecarAddrs {
    client: SocketAddr,
    admin: SocketAddr,
}

impl Side {
    /// Runs `fut` on this node's runtime (so its sockets are the node's).
    fn run<T: Send + 'static>(
        &self,
        fut: impl std::future::Future<Output = T> + Send + 'static,
    ) -> T {
        self.rt
            .block_on(self.rt.spawn(fut))
            .expect("task on the node runtime")
    }

    fn stop(mut self) {
        if let Some((sidecar, engine)) = self.handles.take() {
            self.run(async move {
                sidecar.shutdown().await;
                engine.shutdown().await;
            });
        }
    }
}

/// Starts a node: its agent, an engine in `role` with the KV connector, and
/// a sidecar that announces `announced_node_ip` (`None`: no node IP set).
fn start_side(
    node: &Node,
    other: &Node,
    role: Role,
    announced_node_ip: Option<IpAddr>,
    load_deadline: Duration,
    dir: &Path,
    agent_bin: &Path,
) -> Side {
    let agent = NodeAgent::start(agent_bin, node, AGENT_PORT, dir);
    let rt = node.runtime();
    let sim_role = match role {
        Role::Prefill => SimRole::Prefill,
        Role::Decode => SimRole::Decode,
        Role::Both => SimRole::Both,
    };
    let sim = SimConfig::new(MODEL)
        .with_time_scale(10.0)
        .with_role(sim_role)
        .with_kvagent(KvagentConfig {
            socket: agent.socket.clone(),
            block_bytes: BLOCK_BYTES,
            staging_blocks: 256,
            deadline: load_deadline,
        });
    let pod_ip = node.pod_ip;
    let peer = format!("{}:{MESH_PORT}", other.pod_ip);
    let (sidecar, engine) = rt
        .block_on(rt.spawn(async move {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind engine");
            let engine = Engine::start(sim, listener).await.expect("engine starts");
            let mut c: Config = test_config(engine.addr());
            c.pod.models = vec![MODEL.to_owned()];
            c.pod.role = role;
            c.pod.node_ip = announced_node_ip;
            c.engine.metrics_interval = CfgDuration::from_millis(50);
            c.pd.connector = PdConnector::Kvagent;
            c.pd.kvagent_port = AGENT_PORT;
            c.pd.min_uncached_tokens = Some(256);
            c.mesh.listen = Some(SocketAddr::new(pod_ip, MESH_PORT));
            c.mesh.peers = vec![peer];
            let client = TcpListener::bind((pod_ip, 0)).await.expect("bind client");
            let admin = TcpListener::bind("127.0.0.1:0").await.expect("bind admin");
            let sidecar = Sidecar::start(c, client, admin)
                .await
                .expect("sidecar starts");
            (sidecar, engine)
        }))
        .expect("node start-up");
    Side {
        engine: SimAddrs {
            http: engine.addr(),
        },
        sidecar: SidecarAddrs {
            client: sidecar.addr(),
            admin: sidecar.admin_addr(),
        },
        handles: Some((sidecar, engine)),
        rt,
        agent,
    }
}

/// Waits (bounded) until `side`'s sidecar follows the peer at `peer` with
/// its load, and knows the agent it announced (`None`: announced none).
fn wait_peered(side: &Side, peer: SocketAddr, agent: Option<SocketAddr>) {
    let (sidecar, _) = side.handles.as_ref().expect("running");
    let fleet = sidecar.fleet().clone();
    let mesh = sidecar.mesh().clone();
    side.run(async move {
        for _ in 0..500 {
            let now = tokio::time::Instant::now();
            let loaded = fleet
                .snapshot(now)
                .iter()
                .any(|p| p.info.sidecar_addr == Some(peer) && p.load_age_ms.is_some());
            if loaded && mesh.routes().get(peer).is_some() && mesh.routes().kv_agent(peer) == agent
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the sidecar did not follow its peer {peer} (with agent {agent:?}) within 10 s");
    });
}

/// A completion through `side`'s sidecar: (status, prompt tokens).
fn complete(side: &Side, prompt: String) -> (u16, u64, String) {
    let addr = side.sidecar.client;
    side.run(async move {
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4}).to_string();
        let r = fetch(
            &http1(),
            request(
                "POST",
                addr,
                "/v1/completions",
                body,
                &[("content-type", "application/json")],
            ),
        )
        .await;
        let text = r.text();
        let tokens = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["usage"]["prompt_tokens"].as_u64())
            .unwrap_or(0);
        (r.status.as_u16(), tokens, text)
    })
}

fn sim_stats(side: &Side) -> Value {
    let addr = side.engine.http;
    side.run(async move { admin_get(addr, "/sim/stats").await.json() })
}

/// The sum of a metric's series (any labels) in Prometheus text.
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn sidecar_metric(side: &Side, name: &str) -> f64 {
    let addr = side.sidecar.admin;
    let text = side.run(async move { admin_get(addr, "/metrics").await.text() });
    metric_sum(&text, name)
}

fn agent_metric(side: &Side, name: &str) -> f64 {
    let addr = side.agent.admin;
    let text = side.run(async move { admin_get(addr, "/metrics").await.text() });
    metric_sum(&text, name)
}

/// A prompt over the built-in P/D config's 1024-token minimum.
fn long_prompt(tag: &str) -> String {
    format!("{tag} ") + &"the quick brown fox jumps over the lazy dog ".repeat(150)
}

/// The KV bytes the simulated connector moves for a prompt.
fn kv_bytes(prompt_tokens: u64) -> u64 {
    prompt_tokens.div_ceil(BLOCK_TOKENS) * BLOCK_BYTES
}

struct Fleet {
    pair: NodePair,
    prefill: Side,
    decode: Side,
    _dir: tempfile::TempDir,
}

/// Both nodes up and peered; the decode node announces `decode_node_ip`.
fn fleet(
    decode_node_ip: impl FnOnce(&NodePair) -> Option<IpAddr>,
    load_deadline: Duration,
) -> Option<Fleet> {
    let pair = NodePair::create_or_skip("two-node P/D")?;
    let bin = kvagent_bin();
    let dir = tempfile::Builder::new()
        .prefix("kvmesh-netns-")
        .tempdir()
        .expect("tempdir");
    let announced = decode_node_ip(&pair);
    let prefill = start_side(
        &pair.a,
        &pair.b,
        Role::Prefill,
        Some(pair.a.node_ip),
        load_deadline,
        dir.path(),
        &bin,
    );
    let decode = start_side(
        &pair.b,
        &pair.a,
        Role::Decode,
        announced,
        load_deadline,
        dir.path(),
        &bin,
    );
    let agent_of = |ip: Option<IpAddr>| ip.map(|ip| SocketAddr::new(ip, AGENT_PORT));
    wait_peered(&prefill, decode.sidecar.client, agent_of(announced));
    wait_peered(
        &decode,
        prefill.sidecar.client,
        agent_of(Some(pair.a.node_ip)),
    );
    Some(Fleet {
        pair,
        prefill,
        decode,
        _dir: dir,
    })
}

impl Fleet {
    fn stop(self) {
        self.prefill.stop();
        self.decode.stop();
        drop(self.pair);
    }
}

#[test]
fn kv_blocks_cross_the_veth_to_the_decode_nodes_agent() {
    let Some(f) = fleet(|p| Some(p.b.node_ip), Duration::from_secs(5)) else {
        return;
    };
    // 1. Entering at the prefill pod: the decode pod is a peer, its agent
    //    the one it announced over the mesh.
    // 2. Entering at the decode pod: the decode pod is local, its agent at
    //    its own node IP.
    for (n, entry) in [(1, &f.prefill), (2, &f.decode)] {
        let (tx0, _) = f.pair.a.veth_bytes();
        let (_, rx0) = f.pair.b.veth_bytes();
        let sent0 = agent_metric(&f.prefill, "kvagent_transfer_bytes_total");
        let (status, tokens, text) = complete(entry, long_prompt(&format!("case {n}")));
        assert_eq!(status, 200, "case {n}: {text}");
        assert!(tokens > 1024, "case {n}: {tokens} prompt tokens");
        let kv = kv_bytes(tokens);

        let entry_pd = sidecar_metric(entry, "kvmesh_pd_requests_total");
        assert_eq!(
            entry_pd, 1.0,
            "case {n}: one disaggregated request at the entry sidecar"
        );
        let stats = sim_stats(&f.decode);
        assert_eq!(stats["failed_kv_transfers"], 0, "case {n}: {stats}");
        // The decode engine took every prompt token from the transfer
        // (cumulative over the cases; nothing was cached before).
        let external = stats["external_kv_tokens"].as_u64().unwrap_or(0);
        assert!(
            external >= tokens,
            "case {n}: {external} external tokens of {tokens}: {stats}"
        );

        let sent = agent_metric(&f.prefill, "kvagent_transfer_bytes_total") - sent0;
        assert!(
            sent >= kv as f64,
            "case {n}: the prefill agent moved {sent} bytes, want {kv}"
        );
        let (tx1, _) = f.pair.a.veth_bytes();
        let (_, rx1) = f.pair.b.veth_bytes();
        assert!(
            tx1 - tx0 >= kv,
            "case {n}: {} bytes left node a, the KV is {kv}",
            tx1 - tx0
        );
        assert!(
            rx1 - rx0 >= kv,
            "case {n}: {} bytes reached node b, the KV is {kv}",
            rx1 - rx0
        );
        // The connector's engines were the ones to serve: prefill on a, decode on b.
        assert_eq!(
            sim_stats(&f.prefill)["failed_kv_transfers"],
            0,
            "case {n}: the prefill engine never loads"
        );
    }
    f.stop();
}

#[test]
fn a_wrong_agent_address_fails_the_transfer_and_decode_recomputes() {
    // The decode pod announces node a's IP (a misconfigured node IP), or none
    // (the sidecar then takes the agent to be at the decode pod's own IP, as
    // before the node IP was announced: nothing listens there).
    type Wrong = fn(&NodePair) -> Option<IpAddr>;
    let cases: [(&str, Wrong); 2] = [
        ("another node's IP", |p| Some(p.a.node_ip)),
        ("no node IP", |_| None),
    ];
    for (what, wrong) in cases {
        let Some(f) = fleet(wrong, Duration::from_secs(2)) else {
            return;
        };
        let (tx0, _) = f.pair.a.veth_bytes();
        let (status, tokens, text) = complete(&f.prefill, long_prompt(what));
        assert_eq!(status, 200, "{what}: decode recomputes and answers: {text}");
        let kv = kv_bytes(tokens);
        let stats = sim_stats(&f.decode);
        assert_eq!(stats["failed_kv_transfers"], 1, "{what}: {stats}");
        assert_eq!(stats["external_kv_tokens"], 0, "{what}: {stats}");
        let (tx1, _) = f.pair.a.veth_bytes();
        assert!(
            tx1 - tx0 < kv,
            "{what}: {} bytes left node a, the KV ({kv}) must not have",
            tx1 - tx0
        );
        f.stop();
    }
}
