//! KV event ingestion against the simulator: the sidecar's prefix index holds
//! exactly the blocks the engine reports, through evictions, cache resets,
//! engine restarts, lost messages and garbage on the wire.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashSet;
use std::time::Duration;

use bytes::Bytes;
use kvmesh_engine_sim::KvSubscriber;
use kvmesh_tests::prefix::{
    complete, endpoints, kv_config, local_blocks, relay, sim_with_events, wait_synced, words,
    RelayScript, BLOCK,
};
use kvmesh_tests::route::{eventually, metric};
use kvmesh_tests::sidecar::start;

/// Leading blocks of `prompt` the sidecar's index says its own pod holds.
fn held(h: &kvmesh_proxy::SidecarHandle, prompt: &str) -> u32 {
    use kvmesh_filters::prefix::tokenize::{Builtin, Tokenizer};
    let p = h.prefix();
    let ids = Builtin.encode(prompt, true).unwrap();
    let keys = p
        .index()
        .request_keys(kvmesh_tests::route::MODEL, None, &ids, BLOCK);
    let (local, _) = p.local_pod();
    p.index()
        .match_prefix(&keys)
        .iter()
        .find(|m| m.pod == local)
        .map_or(0, |m| m.blocks as u32)
}

/// Full blocks of `prompt` as the engine tokenizes it.
fn full_blocks(prompt: &str) -> u32 {
    use kvmesh_filters::prefix::tokenize::{Builtin, Tokenizer};
    (Builtin.encode(prompt, true).unwrap().len() / BLOCK) as u32
}

/// Waits until the sidecar's SUB socket to the engine is open.
async fn subscribed(h: &kvmesh_proxy::SidecarHandle) {
    eventually("subscribed", || async {
        (metric(h, "kvmesh_kv_events_connected").await == Some(1.0)).then_some(())
    })
    .await;
}

/// Waits until the index holds every full block of each of `prompts` (block
/// counts alone can match by accident while a replay is still under way).
async fn until_held(h: &kvmesh_proxy::SidecarHandle, prompts: &[String]) {
    eventually("the index holds every prompt's blocks", || async {
        prompts
            .iter()
            .all(|p| held(h, p) == full_blocks(p))
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_holds_exactly_what_the_engine_reported() {
    let sim = sim_with_events(4096).await;
    let (events, replay) = endpoints(&sim);
    // An independent tap counts what the engine published.
    let mut tap = KvSubscriber::connect(&events).await.unwrap();
    let h = start(kv_config(&sim, &events, Some(&replay))).await;
    subscribed(&h).await;
    let prompts: Vec<String> = (0..4).map(|i| words(&format!("p{i}w"), 0, 100)).collect();
    for p in &prompts {
        complete(h.addr(), p).await;
    }
    wait_synced(&h, &sim).await;
    // The tap saw the same set of live blocks.
    let mut live: HashSet<u64> = HashSet::new();
    while let Some(m) = tap.recv(Duration::from_millis(300)).await {
        for ev in m.decode().unwrap().events {
            match ev.kind.as_str() {
                "BlockStored" => live.extend(ev.block_hashes),
                "BlockRemoved" => ev.block_hashes.iter().for_each(|b| {
                    live.remove(b);
                }),
                _ => {}
            }
        }
    }
    assert_eq!(live.len(), local_blocks(&h));
    assert!(live.len() >= 4 * (100 / BLOCK), "{} blocks", live.len());
    // Each prompt's full blocks are held, as the request path will match them.
    for p in &prompts {
        assert_eq!(held(&h, p), full_blocks(p), "prompt {p:.20}");
    }
    assert!(
        metric(&h, "kvmesh_kv_events_total{kind=\"stored\"}")
            .await
            .unwrap()
            >= live.len() as f64
    );
    h.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evictions_and_cache_reset_remove_blocks() {
    // 24 blocks of 16 tokens: the fourth 100-word prompt evicts the first.
    let sim = sim_with_events(24).await;
    let (events, replay) = endpoints(&sim);
    let h = start(kv_config(&sim, &events, Some(&replay))).await;
    let first = words("a", 0, 100);
    complete(h.addr(), &first).await;
    wait_synced(&h, &sim).await;
    assert_eq!(held(&h, &first), full_blocks(&first));
    for i in 1..5 {
        complete(h.addr(), &words(&format!("b{i}x"), 0, 100)).await;
    }
    wait_synced(&h, &sim).await;
    assert_eq!(held(&h, &first), 0, "evicted blocks left the index");
    assert!(
        metric(&h, "kvmesh_kv_events_total{kind=\"removed\"}")
            .await
            .unwrap()
            > 0.0
    );
    assert!(local_blocks(&h) > 0);
    assert!(sim.reset_prefix_cache().await, "reset accepted");
    eventually("index emptied by AllBlocksCleared", || async {
        (local_blocks(&h) == 0).then_some(())
    })
    .await;
    assert_eq!(
        metric(&h, "kvmesh_kv_events_total{kind=\"cleared\"}").await,
        Some(1.0)
    );
    h.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_restart_clears_the_pod_and_it_refills() {
    let sim = sim_with_events(4096).await;
    let (events, replay) = endpoints(&sim);
    let h = start(kv_config(&sim, &events, Some(&replay))).await;
    let before = words("r", 0, 120);
    complete(h.addr(), &before).await;
    complete(h.addr(), &words("s", 0, 120)).await;
    wait_synced(&h, &sim).await;
    assert_eq!(held(&h, &before), full_blocks(&before));
    sim.restart().await.unwrap();
    let after = words("t", 0, 40);
    complete(h.addr(), &after).await;
    eventually("restart detected", || async {
        metric(&h, "kvmesh_kv_event_restarts_total")
            .await
            .filter(|v| *v >= 1.0)
    })
    .await;
    wait_synced(&h, &sim).await;
    assert_eq!(
        held(&h, &before),
        0,
        "blocks from before the restart are gone"
    );
    assert_eq!(held(&h, &after), full_blocks(&after));
    h.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_batch_is_replayed_and_the_index_converges() {
    let sim = sim_with_events(4096).await;
    let (events, replay) = endpoints(&sim);
    // Batches 1 and 2 never reach the sidecar live.
    let (relayed, task) = relay(
        &events,
        RelayScript {
            drop_seqs: vec![1, 2],
            ..RelayScript::default()
        },
    )
    .await;
    let h = start(kv_config(&sim, &relayed, Some(&replay))).await;
    subscribed(&h).await;
    let prompts: Vec<String> = (0..5).map(|i| words(&format!("g{i}q"), 0, 64)).collect();
    for p in &prompts {
        complete(h.addr(), p).await;
    }
    // Converged: every prompt's blocks are in the index.
    until_held(&h, &prompts).await;
    wait_synced(&h, &sim).await;
    assert!(metric(&h, "kvmesh_kv_event_gaps_total").await.unwrap() >= 1.0);
    assert!(
        metric(&h, "kvmesh_kv_event_replays_total{outcome=\"ok\"}")
            .await
            .unwrap()
            >= 1.0
    );
    task.abort();
    h.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_stream_that_delivers_nothing_is_caught_by_the_silence_check() {
    let sim = sim_with_events(4096).await;
    let (events, replay) = endpoints(&sim);
    // The sidecar's live stream is a PUB that forwards none of the engine's
    // batches: no gap ever shows, since no later batch arrives either.
    let (silent, task) = relay(
        &events,
        RelayScript {
            drop_seqs: (0..100_000).collect(),
            ..RelayScript::default()
        },
    )
    .await;
    let mut config = kv_config(&sim, &silent, Some(&replay));
    if let Some(kv) = config.engine.kv_events.as_mut() {
        kv.silence_check = kvmesh_proxy::config::Duration::from_millis(300);
    }
    let h = start(config).await;
    subscribed(&h).await;
    let prompts: Vec<String> = (0..3).map(|i| words(&format!("s{i}l"), 0, 64)).collect();
    for p in &prompts {
        complete(h.addr(), p).await;
    }
    until_held(&h, &prompts).await;
    wait_synced(&h, &sim).await;
    assert!(
        metric(&h, "kvmesh_kv_event_silent_streams_total")
            .await
            .unwrap()
            >= 1.0
    );
    assert_eq!(metric(&h, "kvmesh_kv_event_gaps_total").await, Some(0.0));
    task.abort();
    h.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_engine_costs_no_replay() {
    let sim = sim_with_events(4096).await;
    let (events, replay) = endpoints(&sim);
    let mut config = kv_config(&sim, &events, Some(&replay));
    if let Some(kv) = config.engine.kv_events.as_mut() {
        kv.silence_check = kvmesh_proxy::config::Duration::from_millis(100);
    }
    let h = start(config).await;
    subscribed(&h).await;
    let p = words("quiet", 0, 64);
    complete(h.addr(), &p).await;
    until_held(&h, std::slice::from_ref(&p)).await;
    let replays = metric(&h, "kvmesh_kv_event_replays_total{outcome=\"ok\"}").await;
    // Silence checks run every 100 ms from here on and find nothing new:
    // not counted as replays, and the socket stays open.
    eventually("several silence checks", || async {
        let checks = metric(&h, "kvmesh_kv_event_silence_checks_total").await;
        checks.is_some_and(|c| c >= 5.0).then_some(())
    })
    .await;
    assert_eq!(
        metric(&h, "kvmesh_kv_event_replays_total{outcome=\"ok\"}").await,
        replays
    );
    assert_eq!(
        metric(&h, "kvmesh_kv_event_silent_streams_total").await,
        Some(0.0)
    );
    assert_eq!(metric(&h, "kvmesh_kv_events_connected").await, Some(1.0));
    h.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_frames_are_counted_and_do_not_stop_ingestion() {
    let sim = sim_with_events(4096).await;
    let (events, _) = endpoints(&sim);
    let seq = |s: u64| Bytes::copy_from_slice(&s.to_be_bytes());
    let garbage = vec![
        // Truncated msgpack.
        vec![
            Bytes::new(),
            seq(900),
            Bytes::from_static(&[0x93, 0xcb, 0x41]),
        ],
        // A batch that is a string.
        vec![Bytes::new(), seq(901), Bytes::from_static(b"\xa3abc")],
        // An array claiming 2^32-1 events in five bytes.
        vec![
            Bytes::new(),
            seq(902),
            Bytes::from_static(&[0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff]),
        ],
        // A short sequence frame.
        vec![
            Bytes::new(),
            Bytes::from_static(&[1, 2]),
            Bytes::from_static(&[0x90]),
        ],
        // Two frames.
        vec![Bytes::new(), seq(903)],
    ];
    let (relayed, task) = relay(
        &events,
        RelayScript {
            garbage,
            ..RelayScript::default()
        },
    )
    .await;
    // No replay endpoint: the garbage must not be mistaken for real sequence numbers either.
    let h = start(kv_config(&sim, &relayed, None)).await;
    subscribed(&h).await;
    // The first request's batch carries the garbage in front of it.
    let first = words("x", 0, 64);
    complete(h.addr(), &first).await;
    eventually("garbage counted", || async {
        metric(&h, "kvmesh_kv_event_decode_errors_total")
            .await
            .filter(|v| *v >= 5.0)
    })
    .await;
    let second = words("y", 0, 64);
    complete(h.addr(), &second).await;
    // Ingestion goes on.
    until_held(&h, std::slice::from_ref(&second)).await;
    task.abort();
    h.shutdown().await;
    sim.shutdown().await;
}
