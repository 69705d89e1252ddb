#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The index fed with every batch a real vLLM sent (capture-1) agrees, batch
//! by batch, with a plain model of which engine blocks are live.

use std::collections::HashMap;

use kvmesh_filters::prefix::index::PrefixIndex;
use kvmesh_filters::prefix::kvevents::{decode_message, parse_topic, KvEvent};

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

#[test]
fn the_capture_replayed_into_the_index_matches_live_blocks() {
    let vectors: serde_json::Value =
        serde_json::from_str(&fixture("vllm-cpu/hash_vectors.json")).unwrap();
    let vectors: Vec<(Vec<u32>, Vec<u64>, Option<String>)> = vectors["vectors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            let toks = v["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            let hashes = v["block_hashes_u64"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| h.as_u64().unwrap())
                .collect();
            let salt = v["extra_keys_block0"]
                .as_array()
                .map(|e| e[0][1].as_str().unwrap().to_owned());
            (toks, hashes, salt)
        })
        .collect();
    let idx = PrefixIndex::default();
    let mut live: HashMap<u64, usize> = HashMap::new();
    let mut max_matched = 0;
    for line in fixture("vllm-cpu/capture-1/events.jsonl").lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let frames: Vec<Vec<u8>> = v["frames_hex"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| unhex(f.as_str().unwrap()))
            .collect();
        let msg = decode_message(&frames).unwrap();
        let topic = parse_topic(&msg.topic).unwrap();
        let pod = idx.pod(topic.pod).unwrap();
        let stats = idx.apply(pod, topic.model, &msg.batch);
        assert_eq!((stats.unknown_parent, stats.unknown_removed), (0, 0));
        for ev in &msg.batch.events {
            match ev {
                KvEvent::BlockStored(s) => s
                    .block_hashes
                    .iter()
                    .for_each(|h| *live.entry(*h).or_default() += 1),
                KvEvent::BlockRemoved(r) => r.block_hashes.iter().for_each(|h| {
                    let n = live.get_mut(h).unwrap();
                    *n -= 1;
                    if *n == 0 {
                        live.remove(h);
                    }
                }),
                KvEvent::AllBlocksCleared => live.clear(),
            }
        }
        assert_eq!(idx.block_size(), 32);
        for (toks, hashes, salt) in &vectors {
            // The engine's view: how many leading blocks of this prompt are live.
            let want = hashes.iter().take_while(|h| live.contains_key(h)).count();
            let keys = idx.request_keys("tiny-llama", salt.as_deref(), toks, 32);
            let got = idx.match_prefix(&keys).first().map_or(0, |m| m.blocks);
            assert_eq!(got, want, "seq {}", msg.seq);
            max_matched = max_matched.max(got);
        }
    }
    assert_eq!(
        max_matched, 14,
        "a whole 14-block prompt was matched at some point"
    );
    assert_eq!(idx.stats().entries, live.len());
}
