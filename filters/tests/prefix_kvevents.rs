#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The decoder against every frame a real vLLM 0.32 sent (capture-1), its
//! replay reply, the SGLang sample, and random or mutated bytes.

use std::collections::HashSet;

use kvmesh_filters::prefix::hash::VllmCborHasher;
use kvmesh_filters::prefix::kvevents::{
    decode_batch, decode_message, decode_replay_reply, parse_topic, KvEvent, KvMessage, Medium,
    ReplayReply,
};
use proptest::prelude::*;

fn fixture(rel: &str) -> String {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel);
    std::fs::read_to_string(p).unwrap()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn captured_frames() -> Vec<Vec<Vec<u8>>> {
    fixture("vllm-cpu/capture-1/events.jsonl")
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["frames_hex"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| unhex(f.as_str().unwrap()))
                .collect()
        })
        .collect()
}

fn captured() -> Vec<KvMessage> {
    captured_frames()
        .iter()
        .map(|f| decode_message(f).unwrap())
        .collect()
}

#[test]
fn every_captured_vllm_frame_decodes() {
    let msgs = captured();
    assert_eq!(msgs.len(), 15);
    let mut stored: HashSet<u64> = HashSet::new();
    let (mut removed, mut cleared, mut with_parent, mut salted) = (0, 0, 0, 0);
    for (i, m) in msgs.iter().enumerate() {
        assert_eq!(m.seq, i as u64, "sequence from 0, +1 per batch");
        let t = parse_topic(&m.topic).unwrap();
        assert_eq!((t.pod, t.model), ("127.0.0.1:8100", "tiny-llama"));
        assert!(m.batch.ts > 1.7e9);
        assert_eq!(m.batch.unknown_events, 0);
        for ev in &m.batch.events {
            match ev {
                KvEvent::BlockStored(s) => {
                    assert_eq!(s.block_size, 32);
                    assert_eq!(s.token_ids.len(), s.block_hashes.len() * 32);
                    assert_eq!(s.medium, Medium::Gpu);
                    assert!(s.is_main_group());
                    if let Some(p) = s.parent_block_hash {
                        assert!(stored.contains(&p), "parent stored earlier");
                        with_parent += 1;
                    } else {
                        // A root event: vLLM's own chain over its tokens gives its hashes.
                        let salt = s.salt();
                        salted += usize::from(salt == Some("tenant-a"));
                        let h = VllmCborHasher::new(None).block_hashes(&s.token_ids, 32, salt);
                        assert_eq!(h, s.block_hashes);
                    }
                    stored.extend(&s.block_hashes);
                }
                KvEvent::BlockRemoved(r) => {
                    assert!(r.block_hashes.iter().all(|h| stored.contains(h)));
                    removed += 1;
                }
                KvEvent::AllBlocksCleared => cleared += 1,
            }
        }
    }
    assert!(with_parent >= 1 && removed >= 1 && salted == 1 && cleared == 1);
    assert_eq!(
        msgs.last().unwrap().batch.events,
        [KvEvent::AllBlocksCleared]
    );
    // Every published vector hash came through the decoder.
    let vectors: serde_json::Value =
        serde_json::from_str(&fixture("vllm-cpu/hash_vectors.json")).unwrap();
    for v in vectors["vectors"].as_array().unwrap() {
        for h in v["block_hashes_u64"].as_array().unwrap() {
            assert!(stored.contains(&h.as_u64().unwrap()));
        }
    }
}

#[test]
fn the_captured_replay_reply_matches_the_live_stream() {
    let live = captured();
    let mut replayed = Vec::new();
    let mut ended = false;
    for l in fixture("vllm-cpu/capture-1/requests.jsonl").lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        let Some(replies) = v.get("replay_frames_hex") else {
            continue;
        };
        for reply in replies.as_array().unwrap() {
            let frames: Vec<Vec<u8>> = reply
                .as_array()
                .unwrap()
                .iter()
                .map(|f| unhex(f.as_str().unwrap()))
                .collect();
            match decode_replay_reply(&frames).unwrap() {
                ReplayReply::Batch(m) => replayed.push(m),
                ReplayReply::End => ended = true,
            }
        }
    }
    assert!(ended, "END_SEQ marker seen");
    assert_eq!(replayed.first().unwrap().seq, 3, "replay from 3");
    for m in &replayed {
        assert_eq!(m, &live[usize::try_from(m.seq).unwrap()]);
    }
}

/// JSON (as decoded in the SGLang sample) to msgpack, the way SGLang encodes it.
fn to_msgpack(v: &serde_json::Value, out: &mut Vec<u8>) {
    use rmp::encode as enc;
    match v {
        serde_json::Value::Null => enc::write_nil(out).unwrap(),
        serde_json::Value::Bool(b) => enc::write_bool(out, *b).unwrap(),
        serde_json::Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                enc::write_uint(out, u).unwrap();
            } else if let Some(i) = n.as_i64() {
                enc::write_sint(out, i).unwrap();
            } else {
                enc::write_f64(out, n.as_f64().unwrap()).unwrap();
            }
        }
        serde_json::Value::String(s) => enc::write_str(out, s).unwrap(),
        serde_json::Value::Array(a) => {
            enc::write_array_len(out, u32::try_from(a.len()).unwrap()).unwrap();
            a.iter().for_each(|x| to_msgpack(x, out));
        }
        serde_json::Value::Object(m) => {
            enc::write_map_len(out, u32::try_from(m.len()).unwrap()).unwrap();
            for (k, x) in m {
                enc::write_str(out, k).unwrap();
                to_msgpack(x, out);
            }
        }
    }
}

#[test]
fn the_sglang_sample_decodes_with_signed_hashes() {
    let (mut n, mut cut_lines) = (0, 0);
    for l in fixture("sglang-cpu/kv-events-sample.txt").lines() {
        // The sample's first line was cut at 700 characters when it was saved.
        let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else {
            cut_lines += 1;
            continue;
        };
        let mut payload = Vec::new();
        to_msgpack(&v["batch"], &mut payload);
        let seq = v["seq"].as_u64().unwrap().to_be_bytes();
        let msg =
            decode_message(&[v["topic"].as_str().unwrap().as_bytes(), &seq, &payload]).unwrap();
        let events = v["batch"][1].as_array().unwrap();
        assert_eq!(msg.batch.events.len(), events.len());
        for (got, want) in msg.batch.events.iter().zip(events) {
            match got {
                KvEvent::BlockStored(s) => {
                    let hashes: Vec<u64> = want["block_hashes"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|h| h.as_i64().unwrap() as u64)
                        .collect();
                    assert_eq!(s.block_hashes, hashes);
                    assert_eq!(
                        s.parent_block_hash,
                        want["parent_block_hash"].as_i64().map(|p| p as u64)
                    );
                    assert_eq!(
                        s.token_ids.len(),
                        want["token_ids"].as_array().unwrap().len()
                    );
                    assert_eq!(s.block_size, 16);
                }
                KvEvent::BlockRemoved(_) => assert_eq!(want["type"], "BlockRemoved"),
                KvEvent::AllBlocksCleared => assert_eq!(want["type"], "AllBlocksCleared"),
            }
        }
        n += 1;
    }
    assert_eq!((n, cut_lines), (3, 1));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
        let _ = decode_replay_reply(&[&b""[..], &bytes[..bytes.len().min(8)], &bytes]);
    }

    #[test]
    fn mutated_real_frames_never_panic(idx in 0usize..15, edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8), cut in any::<usize>()) {
        let frames = captured_frames();
        let mut payload = frames[idx][2].clone();
        for (pos, b) in edits {
            let n = payload.len();
            payload[pos % n] = b;
        }
        let n = payload.len();
        payload.truncate(n - cut % (n / 4 + 1));
        if let Ok(batch) = decode_batch(&payload) {
            // Whatever decodes stays within the input's size.
            let tokens: usize = batch.events.iter().map(|e| match e {
                KvEvent::BlockStored(s) => s.token_ids.len() + s.block_hashes.len(),
                _ => 0,
            }).sum();
            prop_assert!(tokens <= payload.len());
        }
    }
}
