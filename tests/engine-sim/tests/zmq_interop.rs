//! KV events against libzmq, the library most of vLLM's consumers use
//! (pyzmq 27.3 / libzmq 4.3.5 from the test venv, driven by `py/zmq_peer.py`):
//! connect mode reaches a bound SUB, and again after that SUB restarts; bind
//! mode reaches a connecting SUB; the ROUTER replay answers a DEALER; and a
//! libzmq PUB reaches a bound `zeromq`-crate SUB (the sidecar's side when vLLM
//! connects). Loopback and OS-chosen ports only. Uses `$KVMESH_PYTHON` (set by
//! `scripts/test`), else runs `scripts/setup-python` itself.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use kvmesh_engine_sim::kv::client::decode_batch;
use kvmesh_engine_sim::{Engine, KvEventsConfig, KvSubscriber, SimConfig, SimHandle};
use rmpv::Value as Mp;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

const TOPIC: &str = "kv@sim@sim";
/// Bound on any one wait for the Python peer.
const WAIT: Duration = Duration::from_secs(10);
/// How long a quiet subscriber is taken to have nothing more.
const QUIET: Duration = Duration::from_millis(150);
/// 80 words and BOS: 5 full blocks of 16.
const PROMPT_WORDS: usize = 80;

/// The venv's interpreter: `$KVMESH_PYTHON`, else the one `scripts/setup-python` makes.
fn python() -> PathBuf {
    if let Ok(p) = std::env::var("KVMESH_PYTHON") {
        if !p.is_empty() {
            return PathBuf::from(p);
        }
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let status = std::process::Command::new(root.join("scripts/setup-python"))
        .status()
        .expect("run scripts/setup-python");
    assert!(status.success(), "scripts/setup-python failed");
    let cache = std::env::var("KVMESH_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").expect("HOME")).join(".cache/kvmesh")
        });
    cache.join("venv/bin/python")
}

/// One `zmq_peer.py` process: JSON lines out, commands in.
struct Peer {
    _child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Peer {
    async fn start(args: &[&str]) -> Self {
        let python = tokio::task::spawn_blocking(python).await.unwrap();
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/zmq_peer.py");
        let mut child = tokio::process::Command::new(python)
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("start the Python peer");
        let stdin = child.stdin.take().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Self {
            _child: child,
            stdin,
            lines,
        }
    }

    /// The next line, or `None` after `timeout` (or if the peer has ended).
    async fn next(&mut self, timeout: Duration) -> Option<Value> {
        let line = tokio::time::timeout(timeout, self.lines.next_line())
            .await
            .ok()?
            .expect("read the Python peer")?;
        Some(serde_json::from_str(&line).expect("a JSON line"))
    }

    /// The value of the next line's `key` (`bound`, `connected`).
    async fn expect(&mut self, key: &str) -> String {
        let v = self.next(WAIT).await.expect("the Python peer said nothing");
        v[key]
            .as_str()
            .unwrap_or_else(|| panic!("{key}? {v}"))
            .to_string()
    }

    /// The frames of the next message received, or `None` after `timeout`.
    async fn frames(&mut self, timeout: Duration) -> Option<Vec<Vec<u8>>> {
        let v = self.next(timeout).await?;
        let frames = v["frames"].as_array().unwrap_or_else(|| panic!("{v}"));
        Some(frames.iter().map(|f| unhex(f.as_str().unwrap())).collect())
    }

    async fn command(&mut self, line: &str) {
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        self.stdin.flush().await.unwrap();
    }
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

async fn engine(kv: KvEventsConfig) -> SimHandle {
    let cfg = SimConfig::new("sim")
        .with_time_scale(100.0)
        .with_kv_events(kv);
    Engine::start_local(cfg).await.unwrap()
}

fn kv_config(endpoint: &str) -> KvEventsConfig {
    let mut k = KvEventsConfig::new(endpoint);
    k.topic = TOPIC.into();
    k
}

/// One live message checked against vLLM's framing: `[topic, seq (8-byte
/// BE), msgpack batch]`. Returns the seq.
fn seq_of(frames: &[Vec<u8>]) -> u64 {
    assert_eq!(frames.len(), 3, "vLLM sends 3 frames: {frames:?}");
    assert_eq!(frames[0], TOPIC.as_bytes());
    u64::from_be_bytes(frames[1].as_slice().try_into().expect("8-byte seq"))
}

/// Readiness: a PUB drops what precedes the SUB's subscription, so clear the
/// (empty) cache until an `AllBlocksCleared` comes through, then drain the
/// clears that raced with it. Returns the last seq seen.
async fn sync(e: &SimHandle, sub: &mut Peer) -> u64 {
    let mut last = None;
    for _ in 0..100 {
        assert!(e.reset_prefix_cache().await);
        if let Some(f) = sub.frames(Duration::from_millis(100)).await {
            let batch = decode_batch(&f[2]).expect("a batch");
            assert_eq!(batch.events[0].kind, "AllBlocksCleared");
            last = Some(seq_of(&f));
            break;
        }
    }
    let mut last = last.expect("the subscriber never saw the engine's events");
    while let Some(f) = sub.frames(QUIET).await {
        last = seq_of(&f);
    }
    last
}

/// One request and the live messages it causes, checked as vLLM's format:
/// consecutive seqs after `after`, and a `BlockStored` of the prompt's 5 full
/// blocks as a tagged map with uint64 hashes.
async fn request_events(e: &SimHandle, sub: &mut Peer, tag: &str, after: u64) -> Vec<Vec<Vec<u8>>> {
    let (s, _) = post(
        e.addr(),
        "/v1/completions",
        &completion(&words(tag, PROMPT_WORDS), 1),
    )
    .await;
    assert_eq!(s, 200);
    let mut msgs = Vec::new();
    let mut stored = None;
    let mut next = after + 1;
    while let Some(f) = sub
        .frames(if stored.is_some() { QUIET } else { WAIT })
        .await
    {
        assert_eq!(seq_of(&f), next, "consecutive sequence numbers");
        next += 1;
        if stored.is_none() {
            stored = stored_event(&f[2]);
        }
        msgs.push(f);
    }
    let ev = stored.expect("no BlockStored for the request");
    let field = |k: &str| {
        ev.as_map()
            .unwrap()
            .iter()
            .find(|(key, _)| key.as_str() == Some(k))
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("no {k} in {ev}"))
    };
    let hashes = field("block_hashes");
    let hashes = hashes.as_array().unwrap();
    assert_eq!(hashes.len(), 5, "{ev}");
    assert!(
        hashes.iter().all(|h| h.as_u64().is_some()),
        "uint64 hashes: {ev}"
    );
    assert!(field("parent_block_hash").is_nil());
    assert_eq!(field("token_ids").as_array().unwrap().len(), 80);
    assert_eq!(field("block_size").as_u64(), Some(16));
    msgs
}

/// The batch's `BlockStored` event, read with a plain msgpack decoder:
/// `[ts (float), [events], dp_rank]`, events as maps tagged by `type`.
fn stored_event(payload: &[u8]) -> Option<Mp> {
    let v = rmpv::decode::read_value(&mut &payload[..]).expect("msgpack");
    let batch = v.as_array().expect("a batch is an array");
    assert_eq!(batch.len(), 3, "[ts, events, dp_rank]: {v}");
    assert!(batch[0].as_f64().is_some(), "ts: {v}");
    batch[1]
        .as_array()
        .expect("events")
        .iter()
        .find(|ev| {
            ev.as_map().is_some_and(|m| {
                m.iter()
                    .any(|(k, v)| k.as_str() == Some("type") && v.as_str() == Some("BlockStored"))
            })
        })
        .cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_mode_reaches_a_bound_libzmq_sub_and_again_after_it_restarts() {
    let mut sub = Peer::start(&["sub-bind", TOPIC]).await;
    let ep = sub.expect("bound").await;
    let e = engine(kv_config(&ep)).await;
    assert_eq!(
        e.kv_endpoints().unwrap().events,
        ep,
        "no `*`: the engine connects (vLLM's rule)"
    );
    let last = sync(&e, &mut sub).await;
    request_events(&e, &mut sub, "first", last).await;

    // A consumer restarts: the engine must dial again, as libzmq does.
    sub.command("rebind").await;
    assert_eq!(sub.expect("bound").await, ep);
    let last = sync(&e, &mut sub).await;
    request_events(&e, &mut sub, "second", last).await;
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_mode_reaches_a_connecting_libzmq_sub() {
    let mut kv = kv_config("tcp://127.0.0.1:0");
    kv.bind = Some(true);
    let e = engine(kv).await;
    let ep = e.kv_endpoints().unwrap().events.clone();
    let mut sub = Peer::start(&["sub-connect", &ep, TOPIC]).await;
    sub.expect("connected").await;
    let last = sync(&e, &mut sub).await;
    request_events(&e, &mut sub, "bound", last).await;
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_replay_answers_a_libzmq_dealer_with_the_live_bytes() {
    let mut kv = kv_config("tcp://127.0.0.1:0");
    kv.bind = Some(true);
    kv.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    let e = engine(kv).await;
    let eps = e.kv_endpoints().unwrap().clone();
    let mut sub = Peer::start(&["sub-connect", &eps.events, TOPIC]).await;
    sub.expect("connected").await;
    let last = sync(&e, &mut sub).await;
    let live = request_events(&e, &mut sub, "replayed", last).await;

    let start = seq_of(&live[0]);
    let mut dealer =
        Peer::start(&["dealer", eps.replay.as_deref().unwrap(), &start.to_string()]).await;
    let mut replies = Vec::new();
    while let Some(f) = dealer.frames(WAIT).await {
        replies.push(f);
    }
    let end = replies.pop().expect("no end marker");
    assert_eq!(
        end,
        vec![vec![], vec![], vec![0xff; 8], vec![]],
        "end marker [\"\", \"\", -1, \"\"]"
    );
    let expected: Vec<Vec<Vec<u8>>> = live
        .iter()
        .map(|f| std::iter::once(vec![]).chain(f.iter().cloned()).collect())
        .collect();
    // A batch that reached the live subscriber after its quiet spell may follow.
    assert!(replies.len() >= expected.len(), "{} replies", replies.len());
    assert_eq!(
        replies[..expected.len()],
        expected,
        "[\"\", topic, seq, payload] per kept batch from {start}"
    );
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_libzmq_pub_reaches_a_bound_crate_sub() {
    // The sidecar's side when vLLM connects: the zeromq crate's SUB binds.
    let (mut sub, ep) = KvSubscriber::bind("tcp://127.0.0.1:0").await.unwrap();
    // [0.0, [], 0]: an empty batch.
    let payload = [0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x90, 0x00];
    let mut publ = Peer::start(&["pub-connect", &ep, TOPIC, &hex(&payload)]).await;
    publ.expect("connected").await;
    // The PUB sends every 20 ms and drops until the subscription reaches it.
    let m = sub.recv(WAIT).await.expect("nothing from the libzmq PUB");
    assert_eq!(m.topic.as_ref(), TOPIC.as_bytes());
    assert_eq!(m.payload.as_ref(), payload);
    let batch = m.decode().expect("a batch");
    assert!(batch.events.is_empty());
    let next = sub.recv(WAIT).await.expect("the stream goes on");
    assert_eq!(next.seq, m.seq + 1);
}
