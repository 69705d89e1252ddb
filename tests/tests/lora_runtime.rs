//! LoRA adapters loaded at run time, end to end: two simulated vLLM engines
//! with LoRA on (`--max-loras 2`, runtime updating), one sidecar each, meshed
//! through a peers file. An adapter loaded on engine B while everything runs
//! reaches sidecar A through B's `/v1/models` and the mesh's `Adapters`
//! frame; requests for it sent to A are then served by B; unloaded, it
//! leaves A's view of B within a poll, and a request for it is a 404 again.
//! A sidecar that joins later learns the adapter from B's `Hello`. A
//! subscriber that does not ask for `Adapters` frames (an older sidecar) gets
//! none and keeps its stream. On the Valkey backend, the pod's record carries
//! the live set and the pod registers under a new adapter, so a lookup for it
//! finds the pod before it has stored a block of it.
//! (docs/filters.md, "LoRA adapters loaded at run time".)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvmesh_proxy::mesh::subscriber::split_frames;
use kvmesh_proxy::mesh::wire::Msg;

use kvmesh_engine_sim::SimHandle;
use kvmesh_loadgen::valkey::ValkeyServer;
use kvmesh_proxy::config::index::Backend;
use kvmesh_proxy::config::Duration as CfgDuration;
use kvmesh_proxy::SidecarHandle;
use kvmesh_tests::client::{fetch, http1, post_json};
use kvmesh_tests::mesh::{kv_sim_with, mesh_config, start_on, write_peers};
use kvmesh_tests::route::{eventually, MODEL};
use kvmesh_tests::sidecar::fast_valkey;

const ADAPTER: &str = "sql-lora";

/// A simulated engine serving [`MODEL`] with LoRA on, publishing KV events.
async fn lora_sim() -> SimHandle {
    kv_sim_with(|c| c.with_max_loras(2)).await
}

/// A meshed sidecar in front of `engine` that reads `/v1/models` every 100 ms.
async fn sidecar(engine: &SimHandle, peers: &std::path::Path) -> SidecarHandle {
    let mut c = mesh_config(engine, peers);
    c.engine.models_interval = CfgDuration::from_millis(100);
    start_on(c, None).await
}

/// An engine-side adapter call (`load_lora_adapter` or `unload_lora_adapter`).
/// Loads [`ADAPTER`] on `engine` (the simulator reads no adapter files).
async fn load_adapter(engine: &SimHandle) {
    let path = std::env::temp_dir().to_string_lossy().into_owned();
    adapter_call(
        engine,
        "load",
        serde_json::json!({"lora_name": ADAPTER, "lora_path": path}),
    )
    .await;
}

async fn adapter_call(engine: &SimHandle, op: &str, body: serde_json::Value) {
    let path = format!("/v1/{op}_lora_adapter");
    let r = fetch(&http1(), post_json(engine.addr(), &path, &body.to_string())).await;
    assert_eq!(r.status, 200, "{op}: {}", r.text());
}

/// The adapters `on` knows pod `pod` to have loaded.
fn adapters_of(on: &SidecarHandle, pod: &SidecarHandle) -> Vec<String> {
    let id = pod.addr().to_string();
    on.fleet()
        .snapshot(tokio::time::Instant::now())
        .into_iter()
        .find(|p| p.info.id == id)
        .map(|p| p.info.lora_adapters)
        .unwrap_or_default()
}

/// Waits until `on` sees `pod` with the adapter loaded (`loaded`) or not.
async fn wait_adapter(on: &SidecarHandle, pod: &SidecarHandle, loaded: bool) {
    eventually("the adapter's state reached the sidecar", || async {
        (adapters_of(on, pod).iter().any(|a| a == ADAPTER) == loaded).then_some(())
    })
    .await;
}

/// One completion for `model` through the sidecar at `addr`: its status and
/// the model the engine answered with.
async fn complete(addr: SocketAddr, model: &str) -> (u16, String) {
    let body = serde_json::json!({"model": model, "prompt": "select the rows where id is seven", "max_tokens": 2});
    let r = fetch(
        &http1(),
        post_json(addr, "/v1/completions", &body.to_string()),
    )
    .await;
    let answered = r.json()["model"].as_str().unwrap_or_default().to_owned();
    (r.status.as_u16(), answered)
}

/// Whether a request for the adapter through `addr` is the sidecar's own 404
/// (no pod serves it), not an engine's.
async fn own_404(addr: SocketAddr) -> bool {
    let body = serde_json::json!({"model": ADAPTER, "prompt": "a", "max_tokens": 1});
    let r = fetch(
        &http1(),
        post_json(addr, "/v1/completions", &body.to_string()),
    )
    .await;
    r.status == 404 && r.json()["error"]["code"] == "model_not_found"
}

/// Completion calls an engine received for `model`.
fn calls_for(engine: &SimHandle, model: &str) -> usize {
    engine
        .received_requests()
        .iter()
        .filter(|r| r.path == "/v1/completions")
        .filter(|r| {
            serde_json::from_slice::<serde_json::Value>(&r.body)
                .is_ok_and(|b| b["model"].as_str() == Some(model))
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_loaded_at_run_time_is_routed_to_until_unloaded() {
    let peers = tempfile::NamedTempFile::new().unwrap();
    let (ea, eb) = (lora_sim().await, lora_sim().await);
    let (a, b) = (
        sidecar(&ea, peers.path()).await,
        sidecar(&eb, peers.path()).await,
    );
    write_peers(
        peers.path(),
        &[a.mesh_addr().unwrap(), b.mesh_addr().unwrap()],
    );
    eventually("A and B know each other", || async {
        let now = tokio::time::Instant::now();
        (a.fleet().snapshot(now).len() == 2 && b.fleet().snapshot(now).len() == 2).then_some(())
    })
    .await;

    // Nothing serves the adapter yet: the sidecar's own 404.
    assert_eq!(complete(a.addr(), ADAPTER).await.0, 404);

    load_adapter(&eb).await;
    wait_adapter(&b, &b, true).await;
    wait_adapter(&a, &b, true).await;
    assert!(adapters_of(&a, &a).is_empty(), "A's engine loaded nothing");

    for _ in 0..6 {
        assert_eq!(
            complete(a.addr(), ADAPTER).await,
            (200, ADAPTER.to_owned()),
            "a request for the adapter, sent to A, is served"
        );
    }
    assert_eq!(
        calls_for(&eb, ADAPTER),
        6,
        "every one ran on B, which has it"
    );
    assert_eq!(calls_for(&ea, ADAPTER), 0);
    // The base model still goes anywhere.
    assert_eq!(complete(a.addr(), MODEL).await.0, 200);

    // A sidecar that joins now learns the adapter from B's snapshot.
    let ec = lora_sim().await;
    let c = sidecar(&ec, peers.path()).await;
    let all = [
        a.mesh_addr().unwrap(),
        b.mesh_addr().unwrap(),
        c.mesh_addr().unwrap(),
    ];
    write_peers(peers.path(), &all);
    wait_adapter(&c, &b, true).await;

    adapter_call(&eb, "unload", serde_json::json!({"lora_name": ADAPTER})).await;
    wait_adapter(&a, &b, false).await;
    wait_adapter(&c, &b, false).await;
    assert_eq!(
        complete(a.addr(), ADAPTER).await.0,
        404,
        "unloaded everywhere: no pod serves it"
    );

    for s in [a, b, c] {
        s.shutdown().await;
    }
    for e in [ea, eb, ec] {
        e.shutdown().await;
    }
}

/// Every frame of one hand-read mesh stream, as it arrives: `(seq, msg)`.
type Frames = Arc<Mutex<Vec<(u64, Msg)>>>;

/// Subscribes to `s`'s state stream by hand, with the `x-kvmesh-adapters`
/// header or (as an older sidecar) without; frames are collected in the
/// background until the task is aborted.
async fn read_stream(s: &SidecarHandle, adapters: bool) -> (Frames, tokio::task::JoinHandle<()>) {
    let addr = s.mesh_addr().unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .handshake::<_, Empty<Bytes>>(TokioIo::new(tcp))
        .await
        .unwrap();
    let mut req = http::Request::get(format!("http://{addr}/mesh/v1/stream"));
    if adapters {
        req = req.header(kvmesh_proxy::mesh::server::TAKES_ADAPTERS, "1");
    }
    let frames: Frames = Arc::default();
    let sink = frames.clone();
    let task = tokio::spawn(async move {
        let driver = tokio::spawn(conn);
        let resp = send
            .send_request(req.body(Empty::new()).unwrap())
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        let mut buf = BytesMut::new();
        while let Some(Ok(f)) = body.frame().await {
            if let Ok(data) = f.into_data() {
                buf.extend_from_slice(&data);
                sink.lock().unwrap().extend(split_frames(&mut buf).unwrap());
            }
        }
        driver.abort();
    });
    (frames, task)
}

/// The adapter lists of the `Adapters` frames received so far, each with its `seq`.
fn adapter_frames(frames: &Frames) -> Vec<(u64, Vec<String>)> {
    frames
        .lock()
        .unwrap()
        .iter()
        .filter_map(|(seq, m)| match m {
            Msg::Adapters(a) => Some((*seq, a.clone())),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_subscribers_that_ask_get_adapters_frames_and_snapshots_carry_the_set() {
    let peers = tempfile::NamedTempFile::new().unwrap();
    let e = lora_sim().await;
    let s = sidecar(&e, peers.path()).await;
    let (old, old_task) = read_stream(&s, false).await;
    let (new, new_task) = read_stream(&s, true).await;
    eventually("both streams subscribed", || async {
        (s.mesh().subscribers() == 2).then_some(())
    })
    .await;

    load_adapter(&e).await;
    let seq = eventually("the new subscriber gets the set", || async {
        adapter_frames(&new)
            .into_iter()
            .find(|(_, a)| a == &[ADAPTER])
            .map(|(seq, _)| seq)
    })
    .await;
    // A later delta reached the old subscriber: the tick that sent the set is behind it.
    eventually("the old subscriber is past that tick", || async {
        old.lock()
            .unwrap()
            .iter()
            .any(|(q, _)| *q > seq)
            .then_some(())
    })
    .await;
    assert!(
        adapter_frames(&old).is_empty(),
        "an older sidecar would end its stream on one"
    );
    assert_eq!(s.mesh().subscribers(), 2, "both streams stay");

    // A fresh snapshot's Hello carries the live set.
    let (fresh, fresh_task) = read_stream(&s, false).await;
    let hello = eventually("the fresh snapshot's hello", || async {
        fresh.lock().unwrap().iter().find_map(|(_, m)| match m {
            Msg::Hello(a) => Some(a.lora_adapters.clone()),
            _ => None,
        })
    })
    .await;
    assert_eq!(hello, [ADAPTER]);

    adapter_call(&e, "unload", serde_json::json!({"lora_name": ADAPTER})).await;
    eventually("the new subscriber gets the empty set", || async {
        adapter_frames(&new)
            .last()
            .filter(|(_, a)| a.is_empty())
            .map(|_| ())
    })
    .await;
    for t in [old_task, new_task, fresh_task] {
        t.abort();
    }
    s.shutdown().await;
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_valkey_a_pod_is_found_by_an_adapter_it_loaded_at_run_time() {
    let server = ValkeyServer::start().await.unwrap();
    let valkey = fast_valkey(vec![server.url()]);
    let no_peers = std::env::temp_dir().join("kvmesh-lora-valkey-no-peers");
    let (ea, eb) = (lora_sim().await, lora_sim().await);
    let mut sidecars = Vec::new();
    for e in [&ea, &eb] {
        let mut c = mesh_config(e, &no_peers);
        c.mesh.file = None;
        c.mesh.listen = None;
        c.engine.models_interval = CfgDuration::from_millis(100);
        c.index.backend = Backend::Valkey;
        c.index.valkey = valkey.clone();
        let s = start_on(c, None).await;
        eventually("registered in valkey", || async {
            s.index()?.status().writer.registered.then_some(())
        })
        .await;
        sidecars.push(s);
    }
    let a = &sidecars[0];
    load_adapter(&eb).await;
    // B has served nothing for the adapter: only its registration under it
    // makes A's lookup name it.
    eventually("A finds B by the adapter", || async {
        (complete(a.addr(), ADAPTER).await.0 == 200).then_some(())
    })
    .await;
    for _ in 0..4 {
        assert_eq!(complete(a.addr(), ADAPTER).await, (200, ADAPTER.to_owned()));
    }
    assert_eq!(calls_for(&eb, ADAPTER), 5);
    assert_eq!(calls_for(&ea, ADAPTER), 0);

    adapter_call(&eb, "unload", serde_json::json!({"lora_name": ADAPTER})).await;
    // Until B's record drops it, a request may still reach B (whose engine
    // answers 404); after, A answers its own `model_not_found`.
    eventually("B's record drops the adapter", || async {
        (own_404(a.addr()).await && own_404(a.addr()).await).then_some(())
    })
    .await;
    let reached = calls_for(&eb, ADAPTER);
    assert!(own_404(a.addr()).await);
    assert_eq!(calls_for(&eb, ADAPTER), reached, "nothing more reached B");
    for s in sidecars {
        s.shutdown().await;
    }
    for e in [ea, eb] {
        e.shutdown().await;
    }
}
