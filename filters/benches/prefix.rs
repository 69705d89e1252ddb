//! Benchmarks of the prefix path (issue 5): tokenize + hash an 8k-token chat
//! prompt (cold, and warm through the token prefix cache), index lookup of a
//! 512-block prompt against 64 pods holding 1M blocks, `BlockStored` ingest,
//! and bytes per indexed block. Run: `cargo bench -p kvmesh-filters --bench prefix`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvmesh_filters::prefix::hash::LocalHasher;
use kvmesh_filters::prefix::index::{IndexConfig, PrefixIndex};
use kvmesh_filters::prefix::kvevents::{decode_batch, BlockStored, EventBatch, KvEvent};
use kvmesh_filters::prefix::tokenize::{
    CachedTokenizer, ChatMessage, HfTokenizer, TokenCacheConfig, Tokenizer,
};

const BS: usize = 16;

/// CPU time this thread has run, from `/proc/thread-self/schedstat` (Linux).
/// The build machine is shared (load far above its core count), so wall-clock
/// figures from criterion include time spent waiting for a core; the CPU-time
/// figure printed next to each benchmark does not.
fn cpu_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// Runs `f` `n` times and prints the CPU time per call.
fn cpu_time<R>(name: &str, n: u32, per_call: Option<(f64, &str)>, mut f: impl FnMut() -> R) {
    let Some(start) = cpu_ns() else { return };
    for _ in 0..n {
        black_box(f());
    }
    let Some(end) = cpu_ns() else { return };
    let ns = (end - start) as f64 / f64::from(n);
    match per_call {
        Some((units, unit)) => eprintln!(
            "cpu-time {name}: {:.1} us/call, {:.2} {unit}/s",
            ns / 1e3,
            units * 1e9 / ns
        ),
        None => eprintln!("cpu-time {name}: {:.2} us/call", ns / 1e3),
    }
}

fn hf() -> HfTokenizer {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-llama");
    let json = std::fs::read(dir.join("tokenizer.json")).unwrap();
    let cfg = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
    let tpl = std::fs::read_to_string(dir.join("chat_template.jinja")).unwrap();
    HfTokenizer::from_parts(&json, Some(&cfg), Some(&tpl)).unwrap()
}

/// A system prompt of about 8k tokens for the fixture tokenizer and a question.
fn chat(system: &str, i: usize) -> Vec<ChatMessage> {
    vec![
        ChatMessage {
            role: "system".into(),
            content: system.into(),
        },
        ChatMessage {
            role: "user".into(),
            content: format!("Question {i}: how long is data kept after closure?"),
        },
    ]
}

fn system_prompt(t: &HfTokenizer) -> String {
    let para = "You are a careful assistant for a storage company. Answer in short sentences, cite the policy section, and never invent numbers. Policies: 1. Refunds within 30 days. 2. Data is kept for 90 days after account closure.\n";
    let mut s = String::new();
    while t.encode(&s, false).unwrap().len() < 8000 {
        s.push_str(para);
    }
    s
}

fn tokenize(c: &mut Criterion) {
    let t = hf();
    let system = system_prompt(&t);
    let hasher = LocalHasher::new("");
    let text_len = t.render_chat(&chat(&system, 0), true).unwrap().len() as u64;
    let mut g = c.benchmark_group("tokenize_hash_8k");
    g.throughput(Throughput::Bytes(text_len));
    g.sample_size(20);
    let mut i = 0;
    g.bench_function("cold", |b| {
        b.iter(|| {
            i += 1;
            let ids = t.encode_chat(&chat(&system, i), true).unwrap();
            black_box(hasher.block_keys("m", None, &ids, BS))
        })
    });
    let cached = CachedTokenizer::new(&t, TokenCacheConfig::default());
    cached.encode_chat(&chat(&system, 0), true).unwrap();
    g.bench_function("warm_shared_system_prompt", |b| {
        b.iter(|| {
            i += 1;
            let ids = cached.encode_chat(&chat(&system, i), true).unwrap();
            black_box(hasher.block_keys("m", None, &ids, BS))
        })
    });
    g.finish();
    let mb = text_len as f64 / 1e6;
    cpu_time("tokenize_hash_8k/cold", 20, Some((mb, "MB")), || {
        i += 1;
        hasher.block_keys(
            "m",
            None,
            &t.encode_chat(&chat(&system, i), true).unwrap(),
            BS,
        )
    });
    cpu_time("tokenize_hash_8k/warm", 200, Some((mb, "MB")), || {
        i += 1;
        hasher.block_keys(
            "m",
            None,
            &cached.encode_chat(&chat(&system, i), true).unwrap(),
            BS,
        )
    });
    let s = cached.stats();
    eprintln!("prefix cache: {s:?}");
}

fn stored(hashes: Vec<u64>, tokens: Vec<u32>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes,
        token_ids: tokens,
        block_size: BS as u32,
        ..Default::default()
    })
}

/// 64 pods, 1M blocks in all; pods 0..4 hold the whole 512-block prompt.
fn loaded_index() -> (PrefixIndex, Vec<u64>) {
    let idx = PrefixIndex::new(IndexConfig {
        max_blocks_per_pod: 1 << 20,
        hash_seed: String::new(),
    });
    let prompt: Vec<u32> = (0..512 * BS as u32).map(|i| i % 2000).collect();
    let mut engine = 1u64;
    let mut total = 0;
    for p in 0..64u32 {
        let pod = idx.pod(&format!("pod-{p}")).unwrap();
        let mut events = Vec::new();
        if p < 4 {
            events.push(stored(
                (0..512).map(|i| engine + i).collect(),
                prompt.clone(),
            ));
            engine += 512;
            total += 512;
        }
        // Fill with distinct 64-block prompts up to 1M blocks in all.
        let mut seq = 0u32;
        while total < (p as usize + 1) * (1 << 20) / 64 {
            let toks: Vec<u32> = (0..64 * BS as u32)
                .map(|i| p << 24 | seq << 10 | i)
                .collect();
            events.push(stored((0..64).map(|i| engine + i).collect(), toks));
            engine += 64;
            total += 64;
            seq += 1;
        }
        idx.apply(
            pod,
            "m",
            &EventBatch {
                events,
                ..Default::default()
            },
        );
    }
    let keys = idx.request_keys("m", None, &prompt, BS);
    (idx, keys)
}

fn lookup(c: &mut Criterion) {
    let (idx, keys) = loaded_index();
    let s = idx.stats();
    eprintln!(
        "index: {} pods, {} keys, {} entries, {} bytes = {:.1} bytes per block per pod",
        s.pods,
        s.keys,
        s.entries,
        s.memory_bytes,
        s.memory_bytes as f64 / s.entries as f64
    );
    assert_eq!(idx.match_prefix(&keys)[0].blocks, 512);
    c.bench_function("index_lookup_512_blocks_64_pods_1M", |b| {
        b.iter(|| black_box(idx.match_prefix(black_box(&keys))))
    });
    cpu_time("index_lookup_512_blocks_64_pods_1M", 2000, None, || {
        idx.match_prefix(&keys)
    });
    let miss: Vec<u64> = keys.iter().map(|k| k ^ 1).collect();
    c.bench_function("index_lookup_miss", |b| {
        b.iter(|| black_box(idx.match_prefix(black_box(&miss))))
    });
}

/// Msgpack payloads as vLLM sends them: 256 batches of one 16-block event.
fn payloads() -> Vec<Vec<u8>> {
    use rmp::encode as enc;
    (0..256u32)
        .map(|e| {
            let mut b = Vec::new();
            enc::write_array_len(&mut b, 3).unwrap();
            enc::write_f64(&mut b, 1.0).unwrap();
            enc::write_array_len(&mut b, 1).unwrap();
            enc::write_map_len(&mut b, 8).unwrap();
            enc::write_str(&mut b, "type").unwrap();
            enc::write_str(&mut b, "BlockStored").unwrap();
            enc::write_str(&mut b, "block_hashes").unwrap();
            enc::write_array_len(&mut b, 16).unwrap();
            for i in 0..16u64 {
                enc::write_u64(
                    &mut b,
                    (u64::from(e) << 20 | i).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                )
                .unwrap();
            }
            enc::write_str(&mut b, "parent_block_hash").unwrap();
            enc::write_nil(&mut b).unwrap();
            enc::write_str(&mut b, "token_ids").unwrap();
            enc::write_array_len(&mut b, 16 * BS as u32).unwrap();
            for i in 0..16 * BS as u32 {
                enc::write_uint(&mut b, u64::from((e * 7 + i) % 2048)).unwrap();
            }
            enc::write_str(&mut b, "block_size").unwrap();
            enc::write_uint(&mut b, BS as u64).unwrap();
            enc::write_str(&mut b, "lora_id").unwrap();
            enc::write_nil(&mut b).unwrap();
            enc::write_str(&mut b, "medium").unwrap();
            enc::write_str(&mut b, "GPU").unwrap();
            enc::write_str(&mut b, "lora_name").unwrap();
            enc::write_nil(&mut b).unwrap();
            enc::write_nil(&mut b).unwrap();
            b
        })
        .collect()
}

fn ingest(c: &mut Criterion) {
    let payloads = payloads();
    let batches: Vec<EventBatch> = payloads.iter().map(|p| decode_batch(p).unwrap()).collect();
    let blocks = 256 * 16;
    let mut g = c.benchmark_group("ingest_block_stored");
    g.throughput(Throughput::Elements(blocks));
    g.bench_function("decode", |b| {
        b.iter(|| {
            payloads
                .iter()
                .map(|p| decode_batch(p).unwrap().events.len())
                .sum::<usize>()
        })
    });
    g.bench_function("apply", |b| {
        b.iter_batched(
            || {
                let idx = PrefixIndex::default();
                let pod = idx.pod("p").unwrap();
                (idx, pod)
            },
            |(idx, pod)| {
                for batch in &batches {
                    idx.apply(pod, "m", batch);
                }
                idx
            },
            BatchSize::LargeInput,
        )
    });
    g.bench_function("decode_and_apply", |b| {
        b.iter_batched(
            || {
                let idx = PrefixIndex::default();
                let pod = idx.pod("p").unwrap();
                (idx, pod)
            },
            |(idx, pod)| {
                for p in &payloads {
                    idx.apply(pod, "m", &decode_batch(p).unwrap());
                }
                idx
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
    let m = f64::from(256 * 16) / 1e6;
    cpu_time("ingest/decode", 50, Some((m, "M blocks")), || {
        payloads
            .iter()
            .map(|p| decode_batch(p).unwrap().events.len())
            .sum::<usize>()
    });
    cpu_time("ingest/decode_and_apply", 50, Some((m, "M blocks")), || {
        let idx = PrefixIndex::default();
        let pod = idx.pod("p").unwrap();
        for p in &payloads {
            idx.apply(pod, "m", &decode_batch(p).unwrap());
        }
        idx
    });
}

criterion_group!(benches, tokenize, lookup, ingest);
criterion_main!(benches);
