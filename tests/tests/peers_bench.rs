//! `kvmesh bench peers` in miniature: one rate and one bisection probe, two
//! seeds, round-robin and kvmesh on the pressured shared-prefix workload, and
//! an SMG that cannot be found. The report must have the JSON shape,
//! medians over the seeds with their ranges, a capacity per router with its
//! bracket and each seed's own, every router's computed-to-ideal ratio (issue
//! 40), the unavailable router with its reason, and kvmesh computing fewer
//! prompt tokens than round-robin on the same requests. A second sweep, as
//! small, covers the
//! multi-turn chat workload, SMG's and kvmesh's P/D on SGLang pods and the
//! where-P/D-pays grid.
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
    opts.probes = 1;
    opts.kv_admission = false;
    opts.pd = false;
    opts.chat = false;
    opts.pd_pays = false;
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

    // Bisection: the grid's one rate, then one probe (below it if it
    // missed, above it if it passed), for each router that ran.
    let points = w["points"].as_array().unwrap();
    assert_eq!(
        points.len(),
        4,
        "two rates per available router: {points:?}"
    );
    for r in ["round-robin", "kvmesh"] {
        let rates: Vec<f64> = points
            .iter()
            .filter(|p| p["router"] == r)
            .map(|p| p["rate"].as_f64().unwrap())
            .collect();
        assert_eq!(rates[0], 20.0, "{r}: {rates:?}");
        assert!(rates[1] == 10.0 || rates[1] == 30.0, "{r}: {rates:?}");
        let cap = caps[r].as_f64();
        assert!(cap.is_none_or(|c| rates.contains(&c)), "{r}: {cap:?}");
        let miss = w["capacity_bracket"][r].as_f64();
        assert!(
            miss.is_none_or(|m| rates.contains(&m) && cap.is_none_or(|c| m > c)),
            "{r}: capacity {cap:?}, first miss {miss:?}"
        );
        let seeds = w["capacity_at_slo_seeds"][r].as_array().unwrap();
        assert_eq!(seeds.len(), 2, "{r}: {seeds:?}");
    }
    assert_ratios(w, &["round-robin", "kvmesh"]);
    assert!(w["computed_vs_ideal"].get("smg-cache-aware").is_none());
    let point = |r: &str| {
        points
            .iter()
            .find(|p| p["router"] == r && p["rate"] == 20.0)
            .unwrap()
    };
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
    assert!(json["capacity_tolerance"].as_f64().unwrap() > 0.0);
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
    let text = peers::table(&report);
    assert!(text.contains("capacity at SLO"), "{text}");
    assert!(text.contains("ideal placement's"), "{text}");
}

/// Every router of `routers` has a computed-to-ideal ratio in the workload,
/// finite and positive (not necessarily at least 1: a noisy seed's engines
/// may keep more than the ideal's accounting assumes).
fn assert_ratios(w: &serde_json::Value, routers: &[&str]) {
    let ratios = w["computed_vs_ideal"].as_object().unwrap();
    for r in routers {
        let x = ratios.get(*r).and_then(|x| x.as_f64());
        assert!(
            x.is_some_and(|x| x.is_finite() && x > 0.0),
            "{}: {r}: {ratios:?}",
            w["name"]
        );
    }
}

#[test]
fn multi_turn_sglang_pd_and_the_pd_grid_report_their_parts() {
    std::env::set_var("KVMESH_SMG", "/nonexistent/smg");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut opts = PeersOpts::new(true);
    opts.seeds = vec![1];
    opts.routers = vec![Router::RoundRobin, Router::Kvmesh];
    opts.shared_prefix = false;
    opts.rates = Some(vec![15.0]);
    opts.requests = Some(20);
    // The grid alone: bisection is the first test's.
    opts.probes = 0;
    opts.kv_admission = false;
    let report = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(300), peers::run(&opts)).await })
        .expect("the sweep finishes within 5 minutes")
        .expect("the sweep runs");
    rt.shutdown_timeout(Duration::from_secs(5));
    let json = serde_json::to_value(&report).unwrap();
    let workload = |name: &str| {
        json["workloads"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["name"] == name)
            .unwrap_or_else(|| panic!("no {name} in {json}"))
            .clone()
    };

    // Multi-turn chat: sessions whose prompts grow; kvmesh keeps a session
    // where its previous turn is cached, round-robin spreads it.
    let chat = workload("multi-turn-chat");
    assert!(
        chat["pressure"].as_f64().unwrap() > 0.0,
        "{}",
        chat["pressure"]
    );
    for r in ["round-robin", "kvmesh"] {
        assert!(chat["capacity_at_slo"].as_object().unwrap().contains_key(r));
    }
    assert_ratios(&chat, &["round-robin", "kvmesh"]);
    let runs = chat["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "{runs:?}");
    for run in runs {
        assert_eq!(run["errors"], 0, "{run}");
        assert_eq!(run["requests"], 20, "{run}");
        let ideal = run["ideal_computed_tokens"].as_u64().unwrap();
        assert!(run["computed_tokens"].as_u64().unwrap() >= ideal, "{run}");
    }
    let computed = |r: &str| {
        runs.iter().find(|x| x["router"] == r).unwrap()["computed_tokens"]
            .as_u64()
            .unwrap()
    };
    assert!(
        computed("kvmesh") < computed("round-robin"),
        "kvmesh {} vs round-robin {}",
        computed("kvmesh"),
        computed("round-robin")
    );

    // P/D on SGLang pods: SMG cannot be found here, kvmesh's sglang
    // connector serves every request through the bootstrap protocol.
    let pd = workload("pd-long-prompt");
    let routers = pd["routers"].as_array().unwrap();
    let smg = routers.iter().find(|r| r["name"] == "smg-pd-2p").unwrap();
    assert_eq!(smg["available"], false, "{smg}");
    assert!(
        smg["reason"].as_str().unwrap().contains("KVMESH_SMG"),
        "{smg}"
    );
    // Nothing shared: ideally every prompt token computed once.
    assert_ratios(&pd, &["aggregated", "kvmesh-pd-2p", "kvmesh-pd-2p-sglang"]);
    let sglang: Vec<_> = pd["points"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["router"] == "kvmesh-pd-2p-sglang")
        .collect();
    assert_eq!(sglang.len(), 2, "one point per rate: {sglang:?}");
    for p in sglang {
        assert_eq!(p["errors"], 0, "{p}");
        assert!(p["itl_p99_ms"].as_f64().is_some_and(f64::is_finite), "{p}");
    }

    // The grid: two prompt lengths at one rate, each with both options and
    // the decider's share. Its threshold (2048 uncached tokens) never
    // splits 1000-token prompts and splits every 6000-token one (5 of 20).
    let grid = &json["pd_pays"];
    let cells = grid["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 2, "{cells:?}");
    for c in cells {
        for option in ["aggregated", "pd", "decider"] {
            let g = c[option]["goodput"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&g), "{c}");
        }
        assert!(
            c["better"].is_string() && c["decider_right"].is_boolean(),
            "{c}"
        );
        let (split, choice) = (c["decider_split"].as_f64().unwrap(), &c["decider_choice"]);
        match c["prompt_tokens"].as_u64().unwrap() {
            1000 => assert!(split == 0.0 && choice == "aggregated", "{c}"),
            6000 => assert!((split - 0.25).abs() < 1e-9 && choice == "pd", "{c}"),
            other => panic!("unexpected prompt length {other}"),
        }
    }
    assert_eq!(grid["runs"].as_array().unwrap().len(), 6);
    let text = peers::table(&report);
    assert!(text.contains("where P/D pays"), "{text}");
}
