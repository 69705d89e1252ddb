//! A fleet of 8 engines in one process stays cheap: one scheduler task per
//! engine, no task per token, so a 2-core machine serves thousands of
//! simulated requests per second of virtual load.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Instant;

use common::*;
use kvmesh_engine_sim::{Engine, SimConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_engines_serve_a_burst() {
    let scale = 200.0;
    let mut engines = Vec::new();
    for _ in 0..8 {
        engines.push(
            Engine::start_local(SimConfig::new("sim").with_time_scale(scale))
                .await
                .unwrap(),
        );
    }
    let addrs: Arc<Vec<_>> = Arc::new(engines.iter().map(|e| e.addr()).collect());
    let total = 800;
    let t = Instant::now();
    let sem = Arc::new(tokio::sync::Semaphore::new(128));
    let mut tasks = Vec::new();
    for i in 0..total {
        let addrs = addrs.clone();
        let permit = sem.clone().acquire_owned().await.unwrap();
        tasks.push(tokio::spawn(async move {
            let prompt = format!("{} tail{i}", words("shared", 150));
            let (s, _) = post(addrs[i % 8], "/v1/completions", &completion(&prompt, 32)).await;
            drop(permit);
            s
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let real = t.elapsed().as_secs_f64();
    let served: usize = engines.iter().map(|e| e.completed_requests().len()).sum();
    assert_eq!(served, total);
    let virtual_rps = total as f64 / (real * scale);
    eprintln!("fleet: {total} requests in {real:.2} s real = {:.0} req/s real, {virtual_rps:.1} req/s of simulated time", total as f64 / real);
    // Every engine saw the shared prefix cached after its first request.
    for e in &engines {
        assert!(e.stats().prefix_hits > 0);
    }
    for e in engines {
        e.shutdown().await;
    }
}
