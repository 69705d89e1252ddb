//! kvmesh's own decoder (`kvmesh_filters::prefix::kvevents`) reads what the
//! simulator sends: both event encodings, both flavors, live and replayed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use kvmesh_engine_sim::kv::events::{encode_batch, Encoding, KvEvent};
use kvmesh_engine_sim::kv::publisher::END_SEQ;
use kvmesh_engine_sim::{
    replay, Engine, Flavor, KvEventsConfig, KvEventsFormat, KvSubscriber, SimConfig,
};
use kvmesh_filters::prefix::kvevents::{
    self as fk, decode_batch, decode_message, decode_replay_reply, ReplayReply,
};

fn sample() -> Vec<KvEvent> {
    vec![
        KvEvent::BlockRemoved {
            block_hashes: vec![u64::MAX - 7],
        },
        KvEvent::BlockStored {
            block_hashes: vec![0xdead_beef_0000_0001, u64::MAX - 1],
            parent_block_hash: None,
            token_ids: (0..32).collect(),
            block_size: 16,
            lora_name: None,
            extra_keys: vec![Some(vec!["tenant-a".into()]), None],
        },
        KvEvent::BlockStored {
            block_hashes: vec![7],
            parent_block_hash: Some(u64::MAX - 1),
            token_ids: (0..16).collect(),
            block_size: 16,
            lora_name: None,
            extra_keys: vec![None],
        },
        KvEvent::AllBlocksCleared,
    ]
}

#[test]
fn every_encoding_decodes_to_the_same_events() {
    for flavor in [Flavor::Vllm, Flavor::Sglang] {
        for format in [KvEventsFormat::Map, KvEventsFormat::Array] {
            let payload = encode_batch(1.5, &sample(), 0, Encoding { flavor, format });
            let b = decode_batch(&payload).unwrap_or_else(|e| panic!("{flavor:?}/{format:?}: {e}"));
            assert_eq!(b.ts, 1.5);
            assert_eq!(b.dp_rank, Some(0));
            assert_eq!(b.events.len(), 4, "{flavor:?}/{format:?}");
            let fk::KvEvent::BlockRemoved(r) = &b.events[0] else {
                panic!("{:?}", b.events[0])
            };
            assert_eq!(
                r.block_hashes,
                vec![u64::MAX - 7],
                "hash bits survive {flavor:?}"
            );
            let fk::KvEvent::BlockStored(s) = &b.events[1] else {
                panic!("{:?}", b.events[1])
            };
            assert_eq!(s.block_hashes, vec![0xdead_beef_0000_0001, u64::MAX - 1]);
            assert_eq!(s.parent_block_hash, None);
            assert_eq!(s.token_ids.len(), 32);
            assert_eq!(s.block_size, 16);
            assert_eq!(s.salt(), Some("tenant-a"), "{flavor:?}/{format:?}");
            let fk::KvEvent::BlockStored(c) = &b.events[2] else {
                panic!("{:?}", b.events[2])
            };
            assert_eq!(c.parent_block_hash, Some(u64::MAX - 1));
            assert_eq!(c.salt(), None);
            assert_eq!(b.events[3], fk::KvEvent::AllBlocksCleared);
        }
    }
}

#[tokio::test]
async fn live_and_replayed_frames_decode() {
    let mut k = KvEventsConfig::new("tcp://127.0.0.1:0");
    k.bind = Some(true);
    k.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    k.topic = "kv@pod-a@sim".into();
    let e = Engine::start_local(
        SimConfig::new("sim")
            .with_time_scale(100.0)
            .with_kv_events(k),
    )
    .await
    .unwrap();
    let mut sub = KvSubscriber::connect(&e.kv_endpoints().unwrap().events)
        .await
        .unwrap();
    let mut live = None;
    for _ in 0..50 {
        e.reset_prefix_cache().await;
        if let Some(m) = sub.recv(Duration::from_millis(100)).await {
            live = Some(m);
            break;
        }
    }
    let m = live.expect("no live message");
    let seq = m.seq.to_be_bytes();
    let d = decode_message(&[m.topic.as_ref(), &seq[..], m.payload.as_ref()]).unwrap();
    assert_eq!(d.topic, "kv@pod-a@sim");
    assert_eq!(fk::parse_topic(&d.topic).unwrap().pod, "pod-a");
    assert_eq!(d.batch.events, vec![fk::KvEvent::AllBlocksCleared]);
    post(
        e.addr(),
        "/v1/completions",
        &completion(&words("dec", 50), 1),
    )
    .await;
    let got = replay(
        &e.kv_endpoints().unwrap().replay.clone().unwrap(),
        0,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let last = got.last().unwrap();
    let seq = last.seq.to_be_bytes();
    let reply = decode_replay_reply(&[
        &b""[..],
        last.topic.as_ref(),
        &seq[..],
        last.payload.as_ref(),
    ])
    .unwrap();
    let ReplayReply::Batch(b) = reply else {
        panic!("{reply:?}")
    };
    assert!(matches!(&b.batch.events[0], fk::KvEvent::BlockStored(s) if s.block_hashes.len() == 3));
    assert_eq!(
        decode_replay_reply(&[&b""[..], &b""[..], &END_SEQ[..], &b""[..]]).unwrap(),
        ReplayReply::End
    );
    e.shutdown().await;
}
