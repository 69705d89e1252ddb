//! `kvmesh bench peers` in miniature: one rate, two seeds, round-robin and
//! kvmesh on the pressured shared-prefix workload, and an SMG that cannot be
//! found. The report must have the JSON shape, medians over the
//! seeds with their ranges, a capacity per router, the unavailable router
//! with its reason, and kvmesh computing fewer prompt tokens than
//! round-robin on the same requests.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use kvmesh::demo::peers::{self, PeersOpts, Router};

#[test]
fn a_small_sweep_reports_points_capacities_and_unavailable_routers() {
    // SMG is looked up through KVMESH_SMG first: a missing file makes it
    // unavailable, whatever is installed on this machine.
    std::env::set_var("KVMESH_SMG", "/nonexistent/smg");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut opts = PeersOpts::new(true);
    opts.seeds = vec![1, 2];
    opts.routers = vec![Router::RoundRobin, Router::SmgCacheAware, Router::Kvmesh];
    opts.rates = Some(vec![20.0]);
    opts.requests = Some(60);
    opts.pd = false;
    let report = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(240), peers::run(&opts)).await })
        .expect("the sweep finishes within 4 minutes")
        .expect("the sweep runs");
    rt.shutdown_timeout(Duration::from_secs(5));

    let json = serde_json::to_value(&report).unwrap();
    let w = &json["workloads"][0];
    assert_eq!(w["name"], "shared-prefix-pressure");
    assert!(w["pressure"].as_f64().unwrap() > 1.0, "{}", w["pressure"]);
    assert!(w["slo"]["ttft_p90_ms"].as_f64().is_some());
    let caps = w["capacity_at_slo"].as_object().unwrap();
    for r in ["round-robin", "smg-cache-aware", "kvmesh"] {
        assert!(caps.contains_key(r), "{caps:?}");
    }
    assert!(caps["smg-cache-aware"].is_null());
    let smg = w["routers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "smg-cache-aware")
        .unwrap();
    assert_eq!(smg["available"], false);
    assert!(
        smg["reason"].as_str().unwrap().contains("KVMESH_SMG"),
        "{smg}"
    );

    let points = w["points"].as_array().unwrap();
    assert_eq!(
        points.len(),
        2,
        "one point per available router: {points:?}"
    );
    let point = |r: &str| points.iter().find(|p| p["router"] == r).unwrap();
    for r in ["round-robin", "kvmesh"] {
        let p = point(r);
        assert_eq!(p["seeds"], 2);
        assert_eq!(p["errors"], 0, "{p}");
        let [lo, hi] = [0, 1].map(|i| p["ttft_p90_range"][i].as_f64().unwrap());
        let median = p["ttft_p90_ms"].as_f64().unwrap();
        assert!(lo <= median && median <= hi, "{p}");
        for field in ["itl_p99_ms", "hit_rate", "computed_tokens", "goodput"] {
            assert!(
                p[field].as_f64().is_some_and(f64::is_finite),
                "{r}.{field}: {p}"
            );
        }
    }
    // The same requests (same seeds): routing by prefix computes fewer prompt
    // tokens than spreading them, and every run names its ideal.
    let computed = |r: &str| point(r)["computed_tokens"].as_f64().unwrap();
    assert!(
        computed("kvmesh") < computed("round-robin"),
        "kvmesh {} vs round-robin {}",
        computed("kvmesh"),
        computed("round-robin")
    );
    for run in w["runs"].as_array().unwrap() {
        let ideal = run["ideal_computed_tokens"].as_u64().unwrap();
        assert!(run["computed_tokens"].as_u64().unwrap() >= ideal, "{run}");
        assert_eq!(run["computed_per_engine"].as_array().unwrap().len(), 4);
    }
    assert!(peers::table(&report).contains("capacity at SLO"));
}
