//! One scheduling decision with the built-in default config (3 filters, 5
//! scorers, max-score picker, full trace) over 8, 64 and 512 endpoints.
//! Targets: < 20 µs at 64 endpoints, < 150 µs at 512 (tokenization and
//! prefix lookup excluded: the caller fills the views).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvmesh_filters::sched::{
    EndpointView, FilterConfig, LoadSnapshot, PrefixMatch, RequestView, Scheduler,
};

fn pool(n: usize, warm: bool) -> Vec<EndpointView> {
    (0..n)
        .map(|i| EndpointView {
            models: vec!["llama".into()],
            labels: [("pool".to_owned(), "a".to_owned())].into(),
            load: LoadSnapshot {
                waiting: (i * 7 % 13) as u32,
                running: (i * 5 % 32) as u32,
                in_flight: (i % 4) as u32,
                kv_usage: (i % 10) as f64 / 10.0,
                block_size: 16,
            },
            prefix: PrefixMatch {
                // A quarter of the pods hold some of the prefix when warm.
                matched_blocks: if warm && i % 4 == 0 {
                    (i % 200) as u32
                } else {
                    0
                },
                block_size: 16,
            },
            staleness_ms: (i % 500) as u64,
            ..EndpointView::new(format!("10.0.{}.{}:8000", i / 250, i % 250))
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let sched = Scheduler::new(&FilterConfig::builtin_default()).unwrap();
    let req = RequestView {
        prompt_tokens: 4000,
        prompt_blocks: 250,
        session_key: Some("s-1".into()),
        ..RequestView::new("bench", "llama")
    };
    let mut g = c.benchmark_group("sched/default");
    for warm in [true, false] {
        for n in [8usize, 64, 512] {
            let eps = pool(n, warm);
            let id = BenchmarkId::new(if warm { "warm" } else { "cold" }, n);
            let mut seed = 0u64;
            g.bench_with_input(id, &eps, |b, eps| {
                b.iter(|| {
                    seed = seed.wrapping_add(1);
                    black_box(sched.schedule(black_box(&req), eps, seed, seed).unwrap())
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
