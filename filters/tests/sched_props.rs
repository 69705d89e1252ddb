//! Properties over random endpoint sets: a decision never names an endpoint
//! that a filter removed, pickers return valid distinct positions, and every
//! built-in scorer stays within [0, 1].
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;

use kvmesh_filters::sched::plugin::{PickCtx, SchedRng};
use kvmesh_filters::sched::registry::{BuildCtx, Plugin};
use kvmesh_filters::sched::{
    EndpointView, FilterConfig, LoadSnapshot, PluginKind, PluginRegistry, PrefixMatch, RequestView,
    Role, Scheduler,
};
use proptest::prelude::*;

fn arb_endpoint() -> impl Strategy<Value = EndpointView> {
    (
        (0u8..3, any::<bool>(), 0u64..20_000, 0u32..300),
        (0u32..50, 0u32..50, -0.5f64..1.5, 0u32..400),
        (0u8..3, 0u8..3, 0u8..3),
    )
        .prop_map(
            |(
                (role, healthy, stale, waiting),
                (running, in_flight, kv, hit),
                (model, zone, lora),
            )| {
                let mut labels = BTreeMap::new();
                labels.insert("pool".to_owned(), "chat".to_owned());
                if zone > 0 {
                    labels.insert("zone".to_owned(), ["a", "b", "c"][zone as usize].to_owned());
                }
                EndpointView {
                    role: [Role::Prefill, Role::Decode, Role::Both][role as usize],
                    models: vec![["m", "m", "x"][model as usize].to_owned()],
                    lora_adapters: if lora == 0 {
                        vec!["sql".into()]
                    } else {
                        vec![]
                    },
                    labels,
                    healthy,
                    staleness_ms: stale,
                    load: LoadSnapshot {
                        waiting,
                        running,
                        in_flight,
                        kv_usage: kv,
                        block_size: 16,
                        ..LoadSnapshot::default()
                    },
                    prefix: PrefixMatch {
                        matched_blocks: if hit % 3 == 0 { hit } else { 0 },
                        block_size: 16,
                    },
                    ..EndpointView::default()
                }
            },
        )
}

fn arb_pool() -> impl Strategy<Value = Vec<EndpointView>> {
    prop::collection::vec(arb_endpoint(), 0..40).prop_map(|mut v| {
        for (i, e) in v.iter_mut().enumerate() {
            e.id = format!("10.0.{}.{}:8000", i / 250, i % 250);
            e.address = e.id.clone();
        }
        v
    })
}

fn arb_request() -> impl Strategy<Value = RequestView> {
    (0u32..8000, any::<bool>(), prop::option::of("[a-z]{1,6}")).prop_map(
        |(tokens, lora, session)| RequestView {
            prompt_tokens: tokens,
            prompt_blocks: tokens / 16,
            lora_adapter: lora.then(|| "sql".to_owned()),
            session_key: session,
            ..RequestView::new("r", "m")
        },
    )
}

fn schedulers() -> Vec<(String, Scheduler)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    let mut out = vec![(
        "builtin".to_owned(),
        Scheduler::new(&FilterConfig::builtin_default()).unwrap(),
    )];
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("filters-") {
            let cfg =
                FilterConfig::from_yaml(&std::fs::read_to_string(&p).unwrap(), &name).unwrap();
            out.push((name, Scheduler::new(&cfg).unwrap()));
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn decisions_never_name_a_filtered_endpoint(eps in arb_pool(), req in arb_request(), seed in any::<u64>()) {
        for (name, sched) in schedulers() {
            let Ok(d) = sched.schedule(&req, &eps, 0, seed) else { continue };
            let mut choices = vec![d.route.primary().clone()];
            choices.extend(d.route.prefill().cloned());
            for c in &choices {
                // The profile that picked it kept it as a candidate and removed it nowhere.
                let p = d.trace.profiles.iter().find(|p| p.picked.first() == Some(&c.id)).unwrap();
                for id in std::iter::once(&c.id).chain(&c.fallbacks) {
                    prop_assert!(p.candidates.contains(id), "{name}: {id} not a candidate");
                    prop_assert!(p.filters.iter().all(|f| !f.removed.contains(id)), "{name}: {id} was filtered");
                    let ep = eps.iter().find(|e| &e.id == id).unwrap();
                    if name != "filters-session-lora.yaml" {
                        // Every other config filters on health and on freshness
                        // against the fleet's freshest healthy endpoint.
                        let freshest = eps.iter().filter(|e| e.healthy).map(|e| e.staleness_ms).min();
                        let oldest = freshest.unwrap_or(0).saturating_add(5000);
                        prop_assert!(ep.healthy && ep.staleness_ms <= oldest, "{name}: {id} unhealthy or stale");
                    }
                }
                prop_assert!(!c.fallbacks.contains(&c.id));
                prop_assert_eq!(&eps[c.index].id, &c.id);
            }
            if let Some(p) = d.route.prefill() {
                prop_assert!(eps[p.index].role.can_prefill(), "{}", name);
                prop_assert!(eps[d.route.primary().index].role.can_decode(), "{}", name);
            }
        }
    }

    #[test]
    fn scores_stay_in_unit_range(eps in arb_pool(), req in arb_request()) {
        let reg = PluginRegistry::builtin();
        let cands: Vec<usize> = (0..eps.len()).collect();
        for t in reg.type_names().filter(|t| reg.kind(t) == Some(PluginKind::Scorer)) {
            let Ok(Plugin::Scorer(s)) = reg.build(t, &serde_yaml_ng::Value::Null, &BuildCtx::default()) else {
                panic!("{t} did not build");
            };
            let mut out = vec![f64::NAN; eps.len()];
            s.score(&req, &eps, &cands, &mut out);
            for v in out {
                prop_assert!((0.0..=1.0).contains(&v), "{t} scored {v}");
            }
        }
    }

    #[test]
    fn pickers_return_distinct_valid_positions(
        totals in prop::collection::vec(prop_oneof![-1.0f64..10.0, Just(f64::NAN), Just(0.0)], 0..64),
        seed in any::<u64>(),
    ) {
        let reg = PluginRegistry::builtin();
        let eps: Vec<EndpointView> = (0..totals.len()).map(|i| EndpointView::new(format!("e{i}"))).collect();
        let cands: Vec<usize> = (0..totals.len()).collect();
        for t in reg.type_names().filter(|t| reg.kind(t) == Some(PluginKind::Picker)) {
            let Ok(Plugin::Picker(p)) = reg.build(t, &serde_yaml_ng::Value::Null, &BuildCtx::default()) else {
                panic!("{t} did not build");
            };
            let mut ctx = PickCtx { rng: SchedRng::new(seed), dry_run: false };
            let mut out = Vec::new();
            p.pick(&mut ctx, &eps, &cands, &totals, &mut out);
            prop_assert_eq!(out.len(), totals.len().min(4), "{}", t);
            let mut sorted = out.clone();
            sorted.sort_unstable();
            sorted.dedup();
            prop_assert_eq!(sorted.len(), out.len(), "{} repeated a position", t);
            prop_assert!(out.iter().all(|&p| p < totals.len()));
        }
    }
}
