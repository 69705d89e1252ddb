use super::*;
use crate::prefix::kvevents::{ExtraKey, Medium};

const BS: usize = 4;

fn toks(n: usize, base: u32) -> Vec<u32> {
    (0..n as u32).map(|i| base + i).collect()
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> BlockStored {
    BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: BS as u32,
        ..Default::default()
    }
}

fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch {
        events,
        ..Default::default()
    }
}

fn removed(hashes: &[u64], medium: Medium) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium,
        ..Default::default()
    })
}

#[test]
fn stored_blocks_match_the_request_keys_and_children_chain_through_parents() {
    let idx = PrefixIndex::default();
    let a = idx.pod("a").unwrap();
    let b = idx.pod("b").unwrap();
    assert_eq!(idx.pod("a").unwrap(), a);
    let t = toks(4 * BS + 2, 100);
    let st = idx.apply(
        a,
        "m",
        &batch(vec![KvEvent::BlockStored(stored(
            &[1, 2],
            None,
            &t[..2 * BS],
        ))]),
    );
    assert_eq!(st.stored, 2);
    // Decode-filled blocks arrive one by one with their parent.
    idx.apply(
        a,
        "m",
        &batch(vec![KvEvent::BlockStored(stored(
            &[3],
            Some(2),
            &t[2 * BS..3 * BS],
        ))]),
    );
    idx.apply(
        b,
        "m",
        &batch(vec![KvEvent::BlockStored(stored(&[9], None, &t[..BS]))]),
    );
    let keys = idx.request_keys("m", None, &t, BS);
    assert_eq!(keys.len(), 4);
    let m = idx.match_prefix(&keys);
    assert_eq!(
        m,
        [
            PrefixMatch {
                pod: a,
                blocks: 3,
                gpu_blocks: 3
            },
            PrefixMatch {
                pod: b,
                blocks: 1,
                gpu_blocks: 1
            }
        ]
    );
    // Another model's request shares nothing; a parent never seen is not indexed.
    assert!(idx
        .match_prefix(&idx.request_keys("other", None, &t, BS))
        .is_empty());
    let st = idx.apply(
        b,
        "m",
        &batch(vec![KvEvent::BlockStored(stored(
            &[5],
            Some(777),
            &t[..BS],
        ))]),
    );
    assert_eq!((st.stored, st.unknown_parent), (0, 1));
    assert!(idx.match_prefix(&[]).is_empty());
}

#[test]
fn duplicate_copies_need_one_removal_each() {
    let idx = PrefixIndex::default();
    let a = idx.pod("a").unwrap();
    let t = toks(BS, 7);
    let ev = KvEvent::BlockStored(stored(&[1], None, &t));
    idx.apply(a, "m", &batch(vec![ev.clone(), ev]));
    let keys = idx.request_keys("m", None, &t, BS);
    let st = idx.apply(a, "m", &batch(vec![removed(&[1], Medium::Gpu)]));
    assert_eq!(st.removed, 1);
    assert_eq!(idx.match_prefix(&keys).len(), 1, "one copy left");
    idx.apply(a, "m", &batch(vec![removed(&[1], Medium::Gpu)]));
    assert!(idx.match_prefix(&keys).is_empty());
    let st = idx.apply(a, "m", &batch(vec![removed(&[1], Medium::Gpu)]));
    assert_eq!(st.unknown_removed, 1);
    assert_eq!(idx.stats().entries, 0);
    assert_eq!(idx.stats().keys, 0);
}

#[test]
fn mediums_salts_loras_and_groups() {
    let idx = PrefixIndex::default();
    let a = idx.pod("a").unwrap();
    let t = toks(2 * BS, 1);
    // Offloaded copy of block 1 only on CPU: held, but the GPU run stops at 1.
    idx.apply(
        a,
        "m",
        &batch(vec![KvEvent::BlockStored(stored(&[1, 2], None, &t))]),
    );
    idx.apply(
        a,
        "m",
        &batch(vec![KvEvent::BlockStored(BlockStored {
            medium: Medium::Cpu,
            ..stored(&[2], Some(1), &t[BS..])
        })]),
    );
    idx.apply(a, "m", &batch(vec![removed(&[2], Medium::Gpu)]));
    let keys = idx.request_keys("m", None, &t, BS);
    assert_eq!(
        idx.match_prefix(&keys),
        [PrefixMatch {
            pod: a,
            blocks: 2,
            gpu_blocks: 1
        }]
    );

    // Salt from block-0 extra keys; LoRA name replaces the model.
    let mut s = stored(&[10, 11], None, &t);
    s.lora_name = Some("ad".into());
    s.extra_keys = Some(vec![
        Some(vec![
            ExtraKey::Str("ad".into()),
            ExtraKey::Str("tenant".into()),
        ]),
        None,
    ]);
    idx.apply(a, "m", &batch(vec![KvEvent::BlockStored(s)]));
    assert_eq!(
        idx.match_prefix(&idx.request_keys("ad", Some("tenant"), &t, BS))[0].blocks,
        2
    );
    assert!(idx
        .match_prefix(&idx.request_keys("ad", None, &t, BS))
        .is_empty());

    // Non-main groups and sliding-window groups are not indexed.
    let b = idx.pod("b").unwrap();
    let mut g = stored(&[20], None, &t[..BS]);
    g.group_idx = Some(1);
    let mut w = stored(&[21], None, &t[..BS]);
    w.kv_cache_spec_kind = Some("sliding_window".into());
    let st = idx.apply(
        b,
        "x",
        &batch(vec![KvEvent::BlockStored(g), KvEvent::BlockStored(w)]),
    );
    assert_eq!((st.stored, st.skipped_events), (0, 2));
}

#[test]
fn longest_consecutive_prefix_only() {
    let idx = PrefixIndex::default();
    let a = idx.pod("a").unwrap();
    let t = toks(4 * BS, 1);
    idx.apply(
        a,
        "m",
        &batch(vec![KvEvent::BlockStored(stored(&[1, 2, 3, 4], None, &t))]),
    );
    idx.apply(a, "m", &batch(vec![removed(&[3], Medium::Gpu)]));
    let keys = idx.request_keys("m", None, &t, BS);
    assert_eq!(idx.match_prefix(&keys)[0].blocks, 2);
    assert!(
        idx.match_prefix(&keys[1..]).len() == 1,
        "a suffix of held keys still matches"
    );
}

#[test]
fn clearing_and_removing_pods() {
    let idx = PrefixIndex::default();
    let a = idx.pod("a").unwrap();
    let t = toks(2 * BS, 1);
    let keys = idx.request_keys("m", None, &t, BS);
    idx.apply(
        a,
        "m",
        &batch(vec![KvEvent::BlockStored(stored(&[1, 2], None, &t))]),
    );
    let st = idx.apply(a, "m", &batch(vec![KvEvent::AllBlocksCleared]));
    assert_eq!(st.cleared, 1);
    assert!(idx.match_prefix(&keys).is_empty());
    idx.apply(
        a,
        "m",
        &batch(vec![KvEvent::BlockStored(stored(&[1, 2], None, &t))]),
    );
    idx.clear_pod(a);
    assert!(idx.match_prefix(&keys).is_empty());
    idx.apply(
        a,
        "m",
        &batch(vec![KvEvent::BlockStored(stored(&[1, 2], None, &t))]),
    );
    idx.remove_pod(a);
    assert!(idx.match_prefix(&keys).is_empty());
    assert_eq!(idx.pod_name(a), None);
    let c = idx.pod("c").unwrap();
    assert_eq!(c, a, "ids are reused");
    assert_eq!(
        idx.apply(PodId(999), "m", &batch(vec![])),
        ApplyStats::default()
    );
    assert_eq!(idx.stats().entries, 0);
}

#[test]
fn a_full_pod_drops_its_least_recently_stored_blocks() {
    let cap = 64;
    let idx = PrefixIndex::new(IndexConfig {
        max_blocks_per_pod: cap,
        hash_seed: String::new(),
    });
    let a = idx.pod("a").unwrap();
    let mut prompts = Vec::new();
    for p in 0..100u32 {
        let t = toks(2 * BS, p * 1000);
        idx.apply(
            a,
            "m",
            &batch(vec![KvEvent::BlockStored(stored(
                &[u64::from(p) * 2 + 1, u64::from(p) * 2 + 2],
                None,
                &t,
            ))]),
        );
        prompts.push(t);
        // Touch prompt 0 now and then: stored again, it stays recent.
        if p % 8 == 0 {
            idx.apply(
                a,
                "m",
                &batch(vec![KvEvent::BlockStored(stored(
                    &[1, 2],
                    None,
                    &prompts[0],
                ))]),
            );
        }
        assert!(idx.stats().entries <= cap);
    }
    let held = |p: usize| {
        idx.match_prefix(&idx.request_keys("m", None, &prompts[p], BS))
            .first()
            .map_or(0, |m| m.blocks)
    };
    assert_eq!(held(99), 2);
    assert_eq!(held(1), 0, "old prompts were evicted");
    assert_eq!(held(0), 2, "re-stored prompt survived");
    assert!(idx.stats().entries >= cap * 3 / 4);
}

#[test]
fn readers_run_alongside_per_pod_writers() {
    let idx = Arc::new(PrefixIndex::new(IndexConfig {
        max_blocks_per_pod: 4096,
        hash_seed: String::new(),
    }));
    let t = toks(64 * BS, 5);
    let keys = idx.request_keys("m", None, &t, BS);
    std::thread::scope(|s| {
        for w in 0..4u64 {
            let idx = idx.clone();
            let t = &t;
            s.spawn(move || {
                let pod = idx.pod(&format!("p{w}")).unwrap();
                for round in 0..50u64 {
                    let hashes: Vec<u64> = (0..64).map(|i| w << 32 | round << 8 | i).collect();
                    idx.apply(
                        pod,
                        "m",
                        &batch(vec![KvEvent::BlockStored(stored(&hashes, None, t))]),
                    );
                    idx.apply(pod, "m", &batch(vec![removed(&hashes[32..], Medium::Gpu)]));
                }
            });
        }
        for _ in 0..2 {
            let idx = idx.clone();
            let keys = &keys;
            s.spawn(move || {
                for _ in 0..200 {
                    for m in idx.match_prefix(keys) {
                        assert!(m.blocks <= 64);
                    }
                }
            });
        }
    });
    let m = idx.match_prefix(&keys);
    assert_eq!(m.len(), 4);
    assert!(m.iter().all(|m| m.blocks == 32));
}

mod model {
    //! `match_prefix` against a naive model, with up to 80 pods (more than one
    //! 64-bit word of candidates), two mediums and removals.
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// Copies held per (pod, block, medium): a duplicate store needs its own removal.
    type Held = HashMap<(usize, usize, Medium), u32>;

    const BLOCKS: usize = 12;

    /// Per pod: how many leading blocks it stores, in which medium, and which
    /// of them it later removes.
    fn pod_plan() -> impl Strategy<Value = (usize, bool, Vec<usize>)> {
        (
            0..=BLOCKS,
            any::<bool>(),
            proptest::collection::vec(0..BLOCKS, 0..3),
        )
    }

    proptest! {
        #[test]
        fn matches_the_naive_longest_runs(
            plans in proptest::collection::vec(pod_plan(), 1..80),
            offload in proptest::collection::vec((0usize..80, 1..=BLOCKS), 0..20),
        ) {
            let idx = PrefixIndex::default();
            let t = toks(BLOCKS * BS, 7);
            let engine = |pod: usize, b: usize| (pod * 1000 + b + 1) as u64;
            // (pod, block, medium) held.
            let mut held = Held::new();
            let store = |pod: usize, n: usize, medium: Medium, held: &mut Held| {
                let id = idx.pod(&format!("p{pod}")).unwrap();
                let hashes: Vec<u64> = (0..n).map(|b| engine(pod, b)).collect();
                let mut ev = stored(&hashes, None, &t[..n * BS]);
                ev.medium = medium;
                idx.apply(id, "m", &batch(vec![KvEvent::BlockStored(ev)]));
                for b in 0..n {
                    *held.entry((pod, b, medium)).or_default() += 1;
                }
            };
            for (pod, (n, cpu, _)) in plans.iter().enumerate() {
                let medium = if *cpu { Medium::Cpu } else { Medium::Gpu };
                store(pod, *n, medium, &mut held);
            }
            for &(pod, n) in &offload {
                if pod < plans.len() {
                    store(pod, n, Medium::Cpu, &mut held);
                }
            }
            for (pod, (_, cpu, removals)) in plans.iter().enumerate() {
                let medium = if *cpu { Medium::Cpu } else { Medium::Gpu };
                let id = idx.pod(&format!("p{pod}")).unwrap();
                for &b in removals {
                    if let Some(copies) = held.get_mut(&(pod, b, medium)) {
                        idx.apply(id, "m", &batch(vec![removed(&[engine(pod, b)], medium)]));
                        *copies -= 1;
                        if *copies == 0 {
                            held.remove(&(pod, b, medium));
                        }
                    }
                }
            }
            let keys = idx.request_keys("m", None, &t, BS);
            let run = |pod: usize, ok: &dyn Fn(usize) -> bool| (0..BLOCKS).take_while(|&b| ok(b) && ok_any(&held, pod, b)).count();
            let mut expected: Vec<PrefixMatch> = (0..plans.len())
                .map(|pod| PrefixMatch {
                    pod: idx.pod(&format!("p{pod}")).unwrap(),
                    blocks: run(pod, &|_| true),
                    gpu_blocks: run(pod, &|b| held.contains_key(&(pod, b, Medium::Gpu))),
                })
                .filter(|m| m.blocks > 0)
                .collect();
            expected.sort_by(|a, b| b.blocks.cmp(&a.blocks).then(a.pod.cmp(&b.pod)));
            prop_assert_eq!(idx.match_prefix(&keys), expected);
        }
    }

    fn ok_any(held: &Held, pod: usize, b: usize) -> bool {
        held.contains_key(&(pod, b, Medium::Gpu)) || held.contains_key(&(pod, b, Medium::Cpu))
    }
}

#[test]
fn apply_touching_names_every_key_whose_holding_changed_and_pod_blocks_lists_them() {
    let idx = PrefixIndex::default();
    let a = idx.pod("a").unwrap();
    let b = idx.pod("b").unwrap();
    let t = toks(3 * BS, 7);
    let keys = idx.request_keys("m", None, &t, BS);
    let mut lora = stored(&[11], Some(10), &t[BS..2 * BS]);
    lora.lora_name = Some("adapter".into());
    let mut touched = Vec::new();
    let st = idx.apply_touching(
        a,
        "m",
        &batch(vec![
            KvEvent::BlockStored(stored(&[10], None, &t[..BS])),
            KvEvent::BlockStored(lora),
        ]),
        &mut touched,
    );
    assert_eq!(st.stored, 2);
    assert_eq!(
        touched.iter().map(|t| (t.key, t.event)).collect::<Vec<_>>()[0],
        (keys[0], 0)
    );
    assert_eq!(
        touched[1].event, 1,
        "the second event stored the second key"
    );
    // Another pod's blocks are not a's.
    idx.apply(
        b,
        "m",
        &batch(vec![KvEvent::BlockStored(stored(&[10], None, &t[..BS]))]),
    );
    let gpu = 1 << Medium::Gpu.code();
    assert_eq!(idx.pod_mediums(a, keys[0]), gpu);
    assert_eq!(idx.pod_blocks(a).len(), 2);
    assert_eq!(idx.pod_blocks(b), vec![(keys[0], gpu)]);

    // A removal names the key it dropped, as removed, and a's blocks shrink.
    touched.clear();
    idx.apply_touching(
        a,
        "m",
        &batch(vec![removed(&[10], Medium::Gpu)]),
        &mut touched,
    );
    assert_eq!(
        touched,
        vec![Touched {
            key: keys[0],
            event: Touched::REMOVED
        }]
    );
    assert_eq!(idx.pod_mediums(a, keys[0]), 0);
    assert_eq!(idx.pod_mediums(b, keys[0]), gpu, "b still holds it");
    assert_eq!(idx.pod_blocks(a).len(), 1);

    // A clear touches nothing; the stats say the pod starts over.
    touched.clear();
    let st = idx.apply_touching(
        a,
        "m",
        &batch(vec![KvEvent::AllBlocksCleared]),
        &mut touched,
    );
    assert_eq!(st.cleared, 1);
    assert!(touched.is_empty());
    assert!(idx.pod_blocks(a).is_empty());
}
