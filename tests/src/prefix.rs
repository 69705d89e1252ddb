//! Helpers for the prefix suites (`tests/tests/prefix_*.rs`): simulated
//! engines publishing KV events on loopback (PUB and replay ROUTER on port 0),
//! sidecars subscribed to them with the builtin tokenizer, a ZMQ relay that
//! can drop or inject messages between the two, and completion calls that
//! return the engine's `cached_tokens`.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use kvmesh_engine_sim::{Engine, KvEventsConfig, KvSubscriber, SimConfig, SimHandle};
use kvmesh_proxy::config::{Config, KvEvents, SocketMode, TokenizerChoice};
use kvmesh_proxy::SidecarHandle;
use tokio::task::JoinHandle;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use crate::client::{fetch, http1, post_json};
use crate::route::{config, MODEL};

/// Tokens per KV block in these suites.
pub const BLOCK: usize = 16;

/// A simulated engine with KV events on `127.0.0.1:0` (PUB bound) and a
/// replay socket; `num_blocks` small forces evictions.
pub async fn sim_with_events(num_blocks: usize) -> SimHandle {
    let mut kv = KvEventsConfig::new("tcp://127.0.0.1:0");
    kv.bind = Some(true);
    kv.replay_endpoint = Some("tcp://127.0.0.1:0".to_owned());
    let cfg = SimConfig::new(MODEL)
        .with_time_scale(50.0)
        .with_block_size(BLOCK)
        .with_num_blocks(num_blocks)
        .with_kv_events(kv);
    Engine::start_local(cfg).await.expect("simulator starts")
}

/// The simulator's resolved (events, replay) endpoints.
pub fn endpoints(sim: &SimHandle) -> (String, String) {
    let ep = sim.kv_endpoints().expect("kv events on");
    (ep.events.clone(), ep.replay.clone().expect("replay on"))
}

/// A sidecar config in front of `sim`, subscribed to `events` (connecting),
/// replaying from `replay`, tokenizing with the builtin tokenizer.
pub fn kv_config(sim: &SimHandle, events: &str, replay: Option<&str>) -> Config {
    let mut c = config(sim, &[], None);
    c.prefix.tokenizer = TokenizerChoice::Builtin;
    c.engine.kv_events = Some(KvEvents {
        endpoint: events.to_owned(),
        replay_endpoint: replay.map(str::to_owned),
        socket: SocketMode::Connect,
        replay_timeout: kvmesh_proxy::config::Duration::from_millis(1000),
        reconnect_max: kvmesh_proxy::config::Duration::from_millis(200),
        ..KvEvents::default()
    });
    c
}

/// (block, medium) entries the sidecar's index holds for its own pod.
pub fn local_blocks(h: &SidecarHandle) -> usize {
    h.prefix().index().stats().entries
}

/// A prompt of `words` distinct words starting at word `from` (about one
/// builtin token per word).
pub fn words(prefix: &str, from: usize, words: usize) -> String {
    (from..from + words)
        .map(|i| format!("{prefix}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Sends a completion to `addr` (a sidecar or an engine) and returns the body.
pub async fn complete(addr: SocketAddr, prompt: &str) -> serde_json::Value {
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}).to_string();
    let r = fetch(&http1(), post_json(addr, "/v1/completions", &body)).await;
    assert!(
        r.status.is_success(),
        "completion failed: {} {}",
        r.status,
        r.text()
    );
    r.json()
}

/// `usage.prompt_tokens_details.cached_tokens` of a completion.
pub fn cached_tokens(resp: &serde_json::Value) -> u64 {
    resp["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// Waits (bounded, 10 s) until the sidecar's index holds exactly the blocks
/// the engine has cached.
pub async fn wait_synced(h: &SidecarHandle, sim: &SimHandle) {
    let mut last = (0, 0, 0.0, 0.0);
    for _ in 0..500 {
        // Every batch the engine published was applied (live or replayed),
        // and the block counts agree. Counts alone are no barrier: with a
        // full cache each batch removes as many blocks as it stores.
        let published = sim.stats().kv_batches_published as f64;
        let applied = crate::route::metric(h, "kvmesh_kv_event_batches_total")
            .await
            .unwrap_or(0.0);
        let (mine, theirs) = (local_blocks(h), sim.stats().cached_blocks);
        if applied >= published && mine == theirs {
            return;
        }
        last = (mine, theirs, applied, published);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "index holds {} blocks, the engine {}; {} of {} batches applied",
        last.0, last.1, last.2, last.3
    );
}

/// What the relay does with each message from the engine.
#[derive(Debug, Clone, Default)]
pub struct RelayScript {
    /// Sequence numbers not forwarded (a lossy network).
    pub drop_seqs: Vec<u64>,
    /// Sent before the first forwarded message: garbage the sidecar must skip.
    pub garbage: Vec<Vec<Bytes>>,
}

/// A PUB on `127.0.0.1:0` that forwards the engine's KV events per `script`.
/// Returns its endpoint and the task (abort it when done).
pub async fn relay(events: &str, script: RelayScript) -> (String, JoinHandle<()>) {
    let mut from = KvSubscriber::connect(events).await.expect("tap connects");
    let mut publ = PubSocket::new();
    let ep = publ
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("relay binds")
        .to_string();
    let task = tokio::spawn(async move {
        let mut garbage = Some(script.garbage);
        // Bounded: a test runs for seconds; the task is aborted at its end.
        for _ in 0..1_000_000 {
            let Some(m) = from.recv(Duration::from_secs(30)).await else {
                return;
            };
            if let Some(g) = garbage.take() {
                for frames in g {
                    if let Ok(msg) = ZmqMessage::try_from(frames) {
                        let _ = publ.send(msg).await;
                    }
                }
            }
            if script.drop_seqs.contains(&m.seq) {
                continue;
            }
            let frames = vec![
                m.topic,
                Bytes::copy_from_slice(&m.seq.to_be_bytes()),
                m.payload,
            ];
            if let Ok(msg) = ZmqMessage::try_from(frames) {
                let _ = publ.send(msg).await;
            }
        }
    });
    (ep, task)
}
