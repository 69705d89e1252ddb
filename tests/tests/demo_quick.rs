//! The demo in its CI size: `kvmesh demo --quick` end to end, in
//! process. One run (shared by the tests below: it is the expensive part)
//! starts fresh simulated fleets per policy and must report every policy with
//! finite figures, show kvmesh's prefix-aware routing hitting the engines'
//! prefix caches more than round-robin, and leave no task behind.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::OnceLock;
use std::time::Duration;

use kvmesh::demo::{self, DemoOpts, DemoReport, Policy};

struct QuickRun {
    report: DemoReport,
    /// Tasks still alive on the runtime once the demo returned and every
    /// connection had a moment to close.
    alive_tasks: usize,
}

/// Runs the quick demo once, on its own runtime, and counts what is left.
fn quick_run() -> &'static QuickRun {
    static RUN: OnceLock<QuickRun> = OnceLock::new();
    RUN.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let report = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(240), demo::run(&DemoOpts::new(true)))
                .await
                .expect("the quick demo finishes within 4 minutes")
                .expect("the quick demo runs")
        });
        // Pooled client connections close as their peers shut down; give
        // them a bounded moment, then count.
        let metrics = rt.metrics();
        let alive_tasks = rt.block_on(async {
            for _ in 0..100 {
                if metrics.num_alive_tasks() == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            metrics.num_alive_tasks()
        });
        rt.shutdown_timeout(Duration::from_secs(5));
        QuickRun {
            report,
            alive_tasks,
        }
    })
}

fn finite(v: Option<f64>) -> bool {
    v.is_some_and(f64::is_finite)
}

#[test]
fn every_policy_has_finite_figures_in_json_and_table() {
    let run = quick_run();
    let json: serde_json::Value = serde_json::from_str(&demo::render(&run.report, true)).unwrap();
    let table = demo::render(&run.report, false);
    let workloads = json["workloads"].as_array().unwrap();
    let names: Vec<&str> = workloads
        .iter()
        .map(|w| w["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["shared-prefix", "long-prompt"]);

    let mut seen = Vec::new();
    for w in workloads {
        for p in w["policies"].as_array().unwrap() {
            let policy = p["policy"].as_str().unwrap();
            seen.push(policy.to_owned());
            assert!(table.contains(policy), "table lacks {policy}:\n{table}");
            if p["available"] == false {
                // Only the SMG row may be missing (SMG is not installed), and
                // it says how to add it; the demo installs nothing.
                assert_eq!(
                    policy, "smg-cache-aware",
                    "{policy} unavailable: {}",
                    p["note"]
                );
                let note = p["note"].as_str().unwrap_or_default();
                assert!(!note.is_empty());
                if demo::peers::smg::find().is_err() {
                    assert!(note.contains("setup-smg"), "{note}");
                }
                assert!(table.contains("not available"));
                continue;
            }
            for field in [
                "ttft_p50_ms",
                "ttft_p90_ms",
                "itl_p99_ms",
                "hit_rate",
                "throughput_tok_s",
            ] {
                let v = p[field].as_f64();
                assert!(finite(v), "{policy}.{field} = {}", p[field]);
                assert!(v.unwrap() >= 0.0, "{policy}.{field} = {}", p[field]);
            }
            assert!(
                p["throughput_tok_s"].as_f64().unwrap() > 0.0,
                "{policy} served nothing"
            );
            assert_eq!(p["errors"], 0, "{policy}: {}", p["note"]);
        }
    }
    for p in Policy::ALL {
        assert!(
            seen.iter().any(|s| s == p.name()),
            "no row for {p}: {seen:?}"
        );
    }
    assert!(seen.iter().any(|s| s == "smg-cache-aware"), "{seen:?}");
    // Latencies are in simulated time, and say so.
    assert!(
        table.starts_with("Times in simulated milliseconds"),
        "{table}"
    );
}

#[test]
fn kvmesh_hits_the_prefix_cache_more_than_round_robin() {
    let w = quick_run().report.workload("shared-prefix").unwrap();
    let hit = |p: Policy| {
        w.policy(p.name())
            .and_then(|r| r.summary.as_ref())
            .and_then(|s| s.hit_rate)
            .unwrap()
    };
    let (rr, kv) = (hit(Policy::RoundRobin), hit(Policy::Kvmesh));
    // Every group of users shares a 768-token system prompt: routing a group
    // to the engine that holds it must serve clearly more prompt tokens from
    // cache than spreading the group over every engine, even when the
    // groups' prompts need more KV than the fleet has.
    assert!(
        kv > rr + 0.1,
        "kvmesh hit rate {kv:.2} is not clearly above round-robin's {rr:.2}"
    );
}

#[test]
fn the_demo_leaves_no_task_running() {
    let run = quick_run();
    assert_eq!(
        run.alive_tasks, 0,
        "tasks still alive after the demo returned (engines, sidecars or clients leaked)"
    );
}

#[test]
fn the_autoscaling_hook_sizes_every_fleet_and_splits_prefill_from_decode_under_pd() {
    let report = &quick_run().report;
    for w in &report.workloads {
        // The SMG row runs bare engines behind SMG: no sidecar, no hook.
        for p in w
            .policies
            .iter()
            .filter(|p| p.available && p.policy != "smg-cache-aware")
        {
            let peak = &p.autoscale_peak;
            let pods: u32 = peak.values().map(|k| k.pods).sum();
            assert_eq!(
                pods as usize, report.engines,
                "{} {}: {peak:?}",
                w.name, p.policy
            );
            assert!(peak.values().all(|k| k.desired >= 1), "{peak:?}");
        }
    }
    let pd = report
        .workload("long-prompt")
        .and_then(|w| w.policies.iter().find(|p| p.policy == "pd"))
        .expect("the long-prompt workload runs P/D");
    assert!(pd.available, "{:?}", pd.note);
    let pools: Vec<&str> = pd.autoscale_peak.keys().map(String::as_str).collect();
    assert_eq!(pools, ["decode", "prefill"], "{:?}", pd.autoscale_peak);
    assert!(demo::render(report, false).contains("autoscale hook"));
}
