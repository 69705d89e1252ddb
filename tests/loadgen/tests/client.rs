//! The client and runner against the in-process fast fake engine: latencies
//! measured where they happen, loads bounded, requests spread and ordered as
//! asked.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use kvmesh_loadgen::fake::{FastEngine, FastEngineConfig};
use kvmesh_loadgen::workload::{tiny, MultiTurnParams, SharedPrefixParams};
use kvmesh_loadgen::{run, Load, RunConfig, Spread};

async fn engine(cfg: FastEngineConfig) -> FastEngine {
    FastEngine::bind("127.0.0.1:0", cfg).await.unwrap()
}

#[tokio::test]
async fn ttft_and_itl_follow_the_engines_scripted_delays() {
    let e = engine(FastEngineConfig {
        chunks: 5,
        first_token_delay: Duration::from_millis(150),
        chunk_delay: Duration::from_millis(40),
        cached_tokens: 10,
    })
    .await;
    let cfg = RunConfig::new(&[e.url()], "m").unwrap();
    let mut w = SharedPrefixParams::small().build(1);
    w.requests.truncate(2);
    let res = run(&cfg, &w, &Load::closed(1, 2)).await.unwrap();
    assert_eq!(res.records.len(), 2);
    for r in &res.records {
        assert!(r.is_ok(), "{r:?}");
        let ttft = r.ttft.unwrap();
        assert!(
            ttft >= Duration::from_millis(150) && ttft < Duration::from_millis(1500),
            "{ttft:?}"
        );
        assert_eq!(r.itl.len(), 4, "5 chunks give 4 gaps");
        for gap in &r.itl {
            assert!(
                *gap >= Duration::from_millis(35) && *gap < Duration::from_millis(1000),
                "{gap:?}"
            );
        }
        assert!(r.e2e >= ttft + Duration::from_millis(4 * 35));
        assert_eq!((r.completion_tokens, r.cached_tokens), (Some(5), Some(10)));
        assert!(r.prompt_tokens.unwrap() > 600);
    }
    let s = res.summary();
    assert!(s.ttft_p50_ms.unwrap() >= 150.0 && s.itl_p50_ms.unwrap() >= 35.0);
    assert!(s.hit_rate.unwrap() > 0.0 && s.hit_rate.unwrap() < 0.05);
    e.shutdown().await;
}

#[tokio::test]
async fn open_loop_sends_exactly_the_bounded_count() {
    let e = engine(FastEngineConfig::default()).await;
    let cfg = RunConfig::new(&[e.url()], "m").unwrap();
    let w = tiny(10, 0);
    // More requests than the workload holds: it cycles.
    let res = run(&cfg, &w, &Load::poisson(400.0, 25)).await.unwrap();
    assert_eq!(res.records.len(), 25);
    assert!(res.records.iter().all(|r| r.is_ok()));
    // Bounded by duration only: ~ rate × duration arrivals, never unbounded.
    let mut load = Load::poisson(100.0, 1);
    load.stages[0].max_requests = None;
    load.stages[0].max_duration = Some(Duration::from_millis(300));
    let res = run(&cfg, &w, &load).await.unwrap();
    assert!(
        res.records.len() > 3 && res.records.len() < 100,
        "{}",
        res.records.len()
    );
    e.shutdown().await;
}

#[tokio::test]
async fn closed_loop_runs_its_concurrency_in_parallel() {
    let e = engine(FastEngineConfig {
        first_token_delay: Duration::from_millis(100),
        ..FastEngineConfig::default()
    })
    .await;
    let cfg = RunConfig::new(&[e.url()], "m").unwrap();
    let res = run(&cfg, &tiny(8, 0), &Load::closed(4, 8)).await.unwrap();
    assert_eq!(res.records.len(), 8);
    // Serially 8 × 100 ms; four at a time about 200 ms.
    assert!(
        res.elapsed >= Duration::from_millis(200),
        "{:?}",
        res.elapsed
    );
    assert!(
        res.elapsed < Duration::from_millis(700),
        "{:?}",
        res.elapsed
    );
    e.shutdown().await;
}

#[tokio::test]
async fn sticky_spread_keeps_users_on_one_target_and_round_robin_balances() {
    let (a, b) = (
        engine(FastEngineConfig::default()).await,
        engine(FastEngineConfig::default()).await,
    );
    let mut cfg = RunConfig::new(&[a.url(), b.url()], "m").unwrap();
    let w = MultiTurnParams::small().build(4);
    cfg.spread = Spread::StickyUser;
    let res = run(&cfg, &w, &Load::closed(4, w.len())).await.unwrap();
    assert!(res
        .records
        .iter()
        .all(|r| r.is_ok() && r.target == r.user as usize % 2));
    cfg.spread = Spread::RoundRobin;
    let res = run(&cfg, &tiny(10, 0), &Load::closed(2, 10)).await.unwrap();
    let on_first = res.records.iter().filter(|r| r.target == 0).count();
    assert_eq!(on_first, 5);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn ordered_workloads_send_a_users_next_turn_after_the_previous_one() {
    let e = engine(FastEngineConfig {
        first_token_delay: Duration::from_millis(30),
        ..FastEngineConfig::default()
    })
    .await;
    let cfg = RunConfig::new(&[e.url()], "m").unwrap();
    let w = MultiTurnParams::small().build(4);
    // Many workers, so that nothing but the ordering keeps turns apart.
    let res = run(&cfg, &w, &Load::closed(12, w.len())).await.unwrap();
    for user in 0..4u32 {
        let turns: Vec<_> = res.records.iter().filter(|r| r.user == user).collect();
        assert_eq!(turns.len(), 3);
        for pair in turns.windows(2) {
            assert!(
                pair[1].start >= pair[0].start + pair[0].e2e,
                "user {user}: {pair:?}"
            );
        }
    }
    e.shutdown().await;
}

#[tokio::test]
async fn refused_connections_are_recorded_as_errors() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    let cfg = RunConfig::new(&[url], "m").unwrap();
    let res = run(&cfg, &tiny(3, 0), &Load::closed(1, 3)).await.unwrap();
    let s = res.summary();
    assert_eq!((s.requests, s.ok, s.errors), (3, 0, 3));
    assert!(res.records[0]
        .error
        .as_deref()
        .unwrap()
        .starts_with("send:"));
}
