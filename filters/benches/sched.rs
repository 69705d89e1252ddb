//! One scheduling decision with the built-in default config (3 filters, 5
//! scorers, max-score picker, full trace) over 8, 64 and 512 endpoints.
//! Targets: < 20 µs at 64 endpoints, < 150 µs at 512 (tokenization and
//! prefix lookup excluded: the caller fills the views).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use criterion::{criterion_group, BenchmarkId, Criterion};
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
                ..LoadSnapshot::default()
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

fn request() -> RequestView {
    RequestView {
        prompt_tokens: 4000,
        prompt_blocks: 250,
        session_key: Some("s-1".into()),
        ..RequestView::new("bench", "llama")
    }
}

fn bench(c: &mut Criterion) {
    let sched = Scheduler::new(&FilterConfig::builtin_default()).unwrap();
    let req = request();
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

/// Thread CPU time per decision (from `/proc/thread-self/stat`, 10 ms
/// ticks, so the loop runs for seconds). On a shared, oversubscribed build
/// box criterion's wall time mostly measures waiting for a core; this does not.
fn cpu_time_report(sched: &Scheduler, req: &RequestView) {
    fn ticks() -> Option<u64> {
        let s = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
        let rest = s.get(s.rfind(')')? + 2..)?;
        let f: Vec<&str> = rest.split(' ').collect();
        Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
    }
    for warm in [true, false] {
        for n in [8usize, 64, 512] {
            let eps = pool(n, warm);
            let iters = 4_000_000 / n as u64;
            let t0 = ticks().unwrap();
            for s in 0..iters {
                black_box(sched.schedule(req, &eps, s, s).unwrap());
            }
            let us = (ticks().unwrap() - t0) as f64 * 10_000.0 / iters as f64;
            let kind = if warm { "warm" } else { "cold" };
            println!("sched/default/{kind}/{n}: {us:.1} µs CPU per decision");
        }
    }
}

criterion_group!(benches, bench);

fn main() {
    if std::env::var_os("KVMESH_BENCH_CPU_TIME").is_some() {
        let sched = Scheduler::new(&FilterConfig::builtin_default()).unwrap();
        cpu_time_report(&sched, &request());
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
