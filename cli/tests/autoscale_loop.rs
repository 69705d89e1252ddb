//! `kvmesh bench autoscale`'s closed loop, shortened: the trace and every
//! clock 30 times faster than Kubernetes' (a trace minute is one simulated
//! second), kvmesh's SLO hook on an aggregated and a P/D fleet. It checks
//! what the loop must do, not how well (the benchmark measures that,
//! docs/autoscaling.md): the hook grows each pool the burst loads, prefill
//! apart from decode; pods join and leave while requests run, losing none;
//! the report carries the contract's fields.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvmesh::autoscale::policy::ScalePolicy;
use kvmesh::autoscale::{self, AutoscaleOpts, FleetKind, Timing};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slo_hook_grows_the_pools_the_burst_loads_and_loses_nothing() {
    let mut opts = AutoscaleOpts::new(true);
    opts.policies = vec![ScalePolicy::KvmeshSlo];
    opts.timing = Timing::compressed(30);
    // Debug builds beside the rest of the suite: a slow clock keeps the
    // harness on time.
    opts.time_scale = 2.0;
    let report = autoscale::run(&opts).await.unwrap();
    let json = serde_json::to_value(&report).unwrap();
    let runs = json["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "{json}");
    for (run, fleet) in runs.iter().zip([FleetKind::Aggregated, FleetKind::Pd]) {
        assert_eq!(run["fleet"], fleet.name());
        let p = &run["policies"][0];
        assert_eq!(p["policy"], "kvmesh-slo");
        for field in ["slo_attainment", "pod_seconds", "scale_actions", "lost"] {
            assert!(p[field].is_number(), "{field} in {p}");
        }
        let seed = &p["seeds"][0];
        let requests = seed["requests"].as_u64().unwrap();
        assert!(requests > 100, "{seed}");
        // Pods join and leave under load, at 30x, in a debug build: not one
        // request may fail (a draining prefill pod once answered 503 "no
        // decode pod" for requests it took as it left, docs/autoscaling.md).
        let lost = p["lost"].as_u64().unwrap();
        assert_eq!(
            lost,
            0,
            "{}: {lost} of {requests} lost: {}",
            fleet.name(),
            seed["errors"]
        );
        assert!(p["scale_actions"].as_u64().unwrap() >= 2, "{p}");
        // The burst (3x) grows the pool that serves it past its start.
        let first = &seed["series"][0];
        let started = first[1].as_u64().unwrap();
        let pools = seed["pool_max"].as_object().unwrap();
        let peak: u64 = pools.values().map(|v| v.as_u64().unwrap()).sum();
        assert!(peak > started, "never grew past {started}: {pools:?}");
        if fleet == FleetKind::Pd {
            assert!(pools["prefill"].as_u64().unwrap() >= 2, "{pools:?}");
            assert!(pools.contains_key("decode"), "{pools:?}");
        }
    }
}
