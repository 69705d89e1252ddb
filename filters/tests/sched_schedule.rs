//! Scheduling decisions a user would notice: cache hits attract requests
//! unless the holder is overloaded, cold requests spread, fallbacks are
//! usable, empty sets name the filter, P/D only when it pays, and every
//! decision explains itself.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvmesh_filters::sched::{
    EndpointView, FilterConfig, LoadSnapshot, PrefixMatch, RequestView, Role, Route, ScheduleError,
    Scheduler, TraceLevel,
};

fn ep(i: usize) -> EndpointView {
    EndpointView {
        models: vec!["m".into()],
        load: LoadSnapshot {
            block_size: 16,
            ..LoadSnapshot::default()
        },
        ..EndpointView::new(format!("10.0.0.{i}:8000"))
    }
}

fn pool(n: usize) -> Vec<EndpointView> {
    (0..n).map(ep).collect()
}

fn req(blocks: u32) -> RequestView {
    RequestView {
        prompt_tokens: blocks * 16,
        prompt_blocks: blocks,
        ..RequestView::new("req-1", "m")
    }
}

fn hit(e: &mut EndpointView, blocks: u32) {
    e.prefix = PrefixMatch {
        matched_blocks: blocks,
        block_size: 16,
    };
}

fn default_sched() -> Scheduler {
    Scheduler::new(&FilterConfig::builtin_default()).unwrap()
}

#[test]
fn prefix_holder_wins_at_equal_load() {
    let mut eps = pool(8);
    hit(&mut eps[5], 90);
    for seed in 0..20 {
        let d = default_sched().schedule(&req(100), &eps, 0, seed).unwrap();
        assert_eq!(d.route.primary().id, eps[5].id);
    }
}

#[test]
fn overloaded_holder_of_a_small_hit_loses() {
    let mut eps = pool(4);
    hit(&mut eps[2], 25);
    eps[2].load.waiting = 60;
    eps[2].load.kv_usage = 0.9;
    let d = default_sched().schedule(&req(100), &eps, 0, 1).unwrap();
    assert_ne!(d.route.primary().id, eps[2].id, "{:#?}", d.trace);
}

#[test]
fn fallbacks_are_distinct_ranked_and_filtered() {
    let mut eps = pool(8);
    eps[1].healthy = false;
    eps[3].role = Role::Prefill;
    eps[4].models = vec!["other".into()];
    for (i, e) in eps.iter_mut().enumerate() {
        e.load.waiting = i as u32;
    }
    let d = default_sched().schedule(&req(10), &eps, 0, 3).unwrap();
    let Route::Aggregated { target } = &d.route else {
        panic!("aggregated expected")
    };
    assert_eq!(target.id, eps[0].id, "shortest queue wins");
    assert_eq!(
        target.fallbacks.len(),
        3,
        "maxNumOfEndpoints 4 = choice + 3"
    );
    let banned = [&eps[1].id, &eps[3].id, &eps[4].id];
    for f in &target.fallbacks {
        assert_ne!(f, &target.id);
        assert!(!banned.contains(&f), "filtered endpoint {f} in fallbacks");
    }
    assert_eq!(
        target.fallbacks,
        vec![eps[2].id.clone(), eps[5].id.clone(), eps[6].id.clone()]
    );
    // The trace names who removed what.
    let p = &d.trace.profiles[0];
    let removed: Vec<(&str, &Vec<String>)> = p
        .filters
        .iter()
        .map(|f| (f.filter.as_str(), &f.removed))
        .collect();
    assert_eq!(
        removed,
        vec![
            ("healthy-fresh-filter", &vec![eps[1].id.clone()]),
            ("model-filter", &vec![eps[4].id.clone()]),
            ("decode-filter", &vec![eps[3].id.clone()]),
        ]
    );
}

#[test]
fn empty_set_names_the_filter() {
    let mut eps = pool(3);
    for e in &mut eps {
        e.models = vec!["other".into()];
    }
    let err = default_sched().schedule(&req(10), &eps, 0, 0).unwrap_err();
    assert_eq!(
        err,
        ScheduleError::NoEndpoint {
            model: "m".into(),
            filter: "model-filter".into(),
            profile: "default".into()
        }
    );
    let (route, trace) = default_sched().explain(&req(10), &eps, 0);
    assert!(route.is_err());
    assert_eq!(
        trace.profiles[0].emptied_by.as_deref(),
        Some("model-filter")
    );
    assert!(trace.reason.contains("model-filter"), "{}", trace.reason);
    let err = default_sched().schedule(&req(10), &[], 0, 0).unwrap_err();
    assert!(matches!(err, ScheduleError::NoEndpoint { filter, .. } if filter == "<no endpoints>"));
}

#[test]
fn trace_has_every_score_and_the_totals() {
    let mut eps = pool(3);
    hit(&mut eps[1], 50);
    eps[2].load.waiting = 4;
    eps[0].load.kv_usage = 0.5;
    let d = default_sched().schedule(&req(100), &eps, 0, 0).unwrap();
    let p = &d.trace.profiles[0];
    assert_eq!(p.scorers.len(), 4);
    assert_eq!(p.score_of("prefix-cache-scorer", &eps[1].id), Some(0.5));
    // No KV capacity reported: no pod must wait for KV.
    assert_eq!(p.score_of("token-cost-scorer", &eps[0].id), Some(1.0));
    // No anchor: the affinity scorer has no home to prefer.
    assert_eq!(p.score_of("prefix-affinity-scorer", &eps[0].id), Some(0.5));
    assert_eq!(p.score_of("active-request-scorer", &eps[2].id), Some(0.0));
    assert_eq!(p.score_of("active-request-scorer", &eps[0].id), Some(1.0));
    for (pos, id) in p.candidates.iter().enumerate() {
        let sum: f64 = p.scorers.iter().map(|s| s.weight * s.scores[pos]).sum();
        assert!((p.total_of(id).unwrap() - sum).abs() < 1e-12);
    }
    assert_eq!(p.picked[0], d.route.primary().id);
    let json = serde_json::to_value(&d).unwrap();
    assert_eq!(json["route"]["kind"], "aggregated");
    assert_eq!(
        json["trace"]["profiles"][0]["scorers"][0]["scorer"],
        "prefix-cache-scorer"
    );
}

#[test]
fn summary_trace_decides_the_same_and_keeps_only_the_reason() {
    let mut eps = pool(6);
    hit(&mut eps[4], 40);
    eps[1].healthy = false;
    eps[2].load.waiting = 9;
    // Two schedulers, so stateful plugins see the same history on both sides.
    let (full, summary) = (default_sched(), default_sched());
    for seed in 0..32 {
        let r = req(if seed % 2 == 0 { 0 } else { 100 });
        let a = full.schedule(&r, &eps, seed, seed).unwrap();
        let b = summary
            .schedule_with(&r, &eps, seed, seed, TraceLevel::Summary)
            .unwrap();
        assert_eq!(a.route, b.route, "seed {seed}");
        assert_eq!(a.trace.reason, b.trace.reason);
        assert!(b.trace.profiles.is_empty() && b.trace.request_id.is_empty());
        assert_eq!(
            a.trace.profiles[0].scorers.len(),
            4,
            "full trace stays complete"
        );
        assert_eq!(a.trace.request_id, "req-1");
    }
}

#[test]
fn one_candidate_summary_still_filters_and_picks_it() {
    let sched = default_sched();
    let one = pool(1);
    let d = sched
        .schedule_with(&req(10), &one, 0, 7, TraceLevel::Summary)
        .unwrap();
    assert_eq!(d.route.primary().id, one[0].id);
    assert!(d.route.primary().fallbacks.is_empty());
    // The filters that can reject the only pod still do, with the same error.
    for (broken, filter) in [
        (
            EndpointView {
                healthy: false,
                ..ep(0)
            },
            "healthy-fresh-filter",
        ),
        (
            EndpointView {
                models: vec!["x".into()],
                ..ep(0)
            },
            "model-filter",
        ),
        (
            EndpointView {
                role: Role::Prefill,
                ..ep(0)
            },
            "decode-filter",
        ),
    ] {
        let eps = [broken];
        let full = sched.schedule(&req(10), &eps, 0, 0).unwrap_err();
        let summary = sched
            .schedule_with(&req(10), &eps, 0, 0, TraceLevel::Summary)
            .unwrap_err();
        assert_eq!(full, summary);
        assert!(
            matches!(&summary, ScheduleError::NoEndpoint { filter: f, .. } if f == filter),
            "{summary:?}"
        );
    }
    let none = sched.schedule_with(&req(10), &[], 0, 0, TraceLevel::Summary);
    assert_eq!(
        none.unwrap_err(),
        sched.schedule(&req(10), &[], 0, 0).unwrap_err()
    );
}

#[test]
fn same_seed_same_decision_and_ties_spread() {
    let eps = pool(16);
    let a = default_sched().explain(&req(0), &eps, 42).0.unwrap();
    let b = default_sched().explain(&req(0), &eps, 42).0.unwrap();
    assert_eq!(a, b);
    let chosen: std::collections::BTreeSet<String> = (0..64)
        .map(|s| {
            default_sched()
                .explain(&req(0), &eps, s)
                .0
                .unwrap()
                .primary()
                .id
                .clone()
        })
        .collect();
    assert!(
        chosen.len() >= 8,
        "ties should be broken at random: {chosen:?}"
    );
}

#[test]
fn cold_prefixes_spread_over_endpoints_and_each_has_one_home() {
    let eps = pool(4);
    let cold = |anchor: u64| RequestView {
        block_keys: vec![anchor],
        ..req(20)
    };
    // Two schedulers stand for two sidecars: they agree on every home,
    // whatever their seeds, without sharing any state.
    let (a, b) = (default_sched(), default_sched());
    let mut homes = std::collections::BTreeMap::new();
    for anchor in 0..256u64 {
        let here = a.schedule(&cold(anchor), &eps, 0, anchor).unwrap();
        let there = b.schedule(&cold(anchor), &eps, 0, anchor + 1000).unwrap();
        assert_eq!(here.route.primary().id, there.route.primary().id);
        *homes.entry(here.route.primary().id.clone()).or_insert(0) += 1;
    }
    // 64 expected each; 40 is 3.5 standard deviations below.
    assert_eq!(homes.len(), 4, "256 cold prefixes over 4 pods: {homes:?}");
    assert!(homes.values().all(|&n| n >= 40), "{homes:?}");
}

#[test]
fn a_home_with_far_more_requests_than_the_others_spills() {
    let mut eps = pool(4);
    let r = RequestView {
        block_keys: vec![5],
        ..req(20)
    };
    let home = default_sched()
        .schedule(&r, &eps, 0, 0)
        .unwrap()
        .route
        .primary()
        .id
        .clone();
    let i = eps.iter().position(|e| e.id == home).unwrap();
    eps[i].load.in_flight = 12;
    let d = default_sched().schedule(&r, &eps, 0, 0).unwrap();
    assert_ne!(d.route.primary().id, home, "{:#?}", d.trace);
}

fn pd_sched() -> Scheduler {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/examples/filters-pd-disaggregated.yaml"),
    )
    .unwrap();
    Scheduler::new(&FilterConfig::from_yaml(&text, "pd.yaml").unwrap()).unwrap()
}

fn pd_pool() -> Vec<EndpointView> {
    let mut eps = pool(4);
    eps[0].role = Role::Prefill;
    eps[1].role = Role::Prefill;
    eps[2].role = Role::Decode;
    eps[3].role = Role::Decode;
    eps
}

#[test]
fn pd_when_the_decode_pod_lacks_the_prefix() {
    let eps = pd_pool();
    let d = pd_sched().schedule(&req(300), &eps, 0, 0).unwrap();
    let Route::Disaggregated { prefill, decode } = &d.route else {
        panic!("{:?}", d.trace)
    };
    assert_eq!(eps[prefill.index].role, Role::Prefill);
    assert_eq!(eps[decode.index].role, Role::Decode);
    assert_eq!(prefill.fallbacks.len(), 1);
    assert_eq!(d.trace.reason, "uncached 4800 >= nonCachedTokens 2048");
    assert_eq!(d.trace.profiles.len(), 2);
}

#[test]
fn aggregated_when_the_decode_pod_holds_the_prefix() {
    let mut eps = pd_pool();
    hit(&mut eps[3], 280);
    let d = pd_sched().schedule(&req(300), &eps, 0, 0).unwrap();
    assert_eq!(d.route.kind(), "aggregated");
    assert_eq!(d.route.primary().id, eps[3].id);
    // An idle decode pod: nobody sits through the prefill either.
    assert_eq!(
        d.trace.reason,
        "uncached 320 < nonCachedTokens 2048; uncached 320 x 0 requests = 0 < batchStallTokens 14300"
    );
    assert_eq!(d.trace.profiles.len(), 1, "prefill profile not run");
}

#[test]
fn aggregated_when_no_prefill_endpoint() {
    let mut eps = pd_pool();
    eps[0].healthy = false;
    eps[1].staleness_ms = 60_000;
    let d = pd_sched().schedule(&req(300), &eps, 0, 0).unwrap();
    assert_eq!(d.route.kind(), "aggregated");
    assert!(eps[d.route.primary().index].role.can_decode());
    assert!(
        d.trace.reason.contains("no prefill endpoint"),
        "{}",
        d.trace.reason
    );
}

#[test]
fn sessions_stick_despite_load() {
    let text = "apiVersion: kvmesh.dev/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n  - type: session-affinity-scorer\n  - type: queue-scorer\nschedulingProfiles:\n  - name: s\n    plugins:\n      - pluginRef: session-affinity-scorer\n        weight: 5\n      - pluginRef: queue-scorer\n";
    let sched = Scheduler::new(&FilterConfig::from_yaml(text, "s.yaml").unwrap()).unwrap();
    let mut eps = pool(6);
    let r = RequestView {
        session_key: Some("chat-77".into()),
        ..req(10)
    };
    let home = sched
        .schedule(&r, &eps, 0, 0)
        .unwrap()
        .route
        .primary()
        .id
        .clone();
    for (i, e) in eps.iter_mut().enumerate() {
        e.load.waiting = (i * 7 % 5) as u32;
    }
    for seed in 0..10 {
        assert_eq!(
            sched
                .schedule(&r, &eps, 0, seed)
                .unwrap()
                .route
                .primary()
                .id,
            home
        );
    }
}

#[test]
fn scheduler_is_shareable_across_tasks() {
    fn assert_send_sync<T: Send + Sync + 'static>(_: &T) {}
    let sched = std::sync::Arc::new(default_sched());
    assert_send_sync(&sched);
    let eps = pool(4);
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let (sched, eps) = (sched.clone(), eps.clone());
            std::thread::spawn(move || {
                sched
                    .schedule(&req(0), &eps, t, t)
                    .unwrap()
                    .route
                    .primary()
                    .id
                    .clone()
            })
        })
        .collect();
    for h in handles {
        assert!(h.join().unwrap().starts_with("10.0.0."));
    }
}

/// The heterogeneous-pools example (deploy/examples/heterogeneous/): two
/// prefill-capable and two decode-capable pods of each GPU type; prefill
/// goes only to the H100 pool and decode only to the H200 pool, by label,
/// even where a pod of the other pool has the role and more room.
#[test]
fn heterogeneous_pools_split_by_label() {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/examples/heterogeneous/filters.yaml"),
    )
    .unwrap();
    let sched =
        Scheduler::new(&FilterConfig::from_yaml(&text, "heterogeneous.yaml").unwrap()).unwrap();
    let mut eps = pool(8);
    for (i, e) in eps.iter_mut().enumerate() {
        // Pods 0-3 are H100s, 4-7 H200s; within each, two prefill, two decode.
        let gpu = if i < 4 { "h100" } else { "h200" };
        e.labels.insert("gpu".into(), gpu.into());
        e.role = if i % 4 < 2 {
            Role::Prefill
        } else {
            Role::Decode
        };
        // The pods the split must avoid are the idle ones.
        let wrong_pool = (gpu == "h100") == (e.role == Role::Decode);
        e.load.in_flight = if wrong_pool { 0 } else { 6 };
    }
    for seed in 0..20 {
        let d = sched.schedule(&req(300), &eps, 0, seed).unwrap();
        let Route::Disaggregated { prefill, decode } = &d.route else {
            panic!("{:?}", d.trace)
        };
        assert_eq!(eps[prefill.index].labels["gpu"], "h100", "{:?}", d.trace);
        assert_eq!(eps[prefill.index].role, Role::Prefill);
        assert_eq!(eps[decode.index].labels["gpu"], "h200", "{:?}", d.trace);
        assert_eq!(eps[decode.index].role, Role::Decode);
        let gpu_of = |id: &String| eps.iter().find(|e| &e.id == id).unwrap().labels["gpu"].clone();
        assert!(prefill.fallbacks.iter().all(|f| gpu_of(f) == "h100"));
        assert!(decode.fallbacks.iter().all(|f| gpu_of(f) == "h200"));
    }
}
