//! The filter config loader: every example in `deploy/examples` loads and
//! schedules; every kind of mistake is rejected with its file, line and field.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvmesh_filters::sched::{
    ConfigErrorKind, EndpointView, FilterConfig, PluginKind, RequestView, Role, Route, Scheduler,
};

const HDR: &str = "apiVersion: kvmesh.dev/v1alpha1\nkind: EndpointPickerConfig\n";

fn load(body: &str) -> Result<FilterConfig, kvmesh_filters::sched::ConfigError> {
    FilterConfig::from_yaml(&format!("{HDR}{body}"), "filters.yaml")
}

/// Asserts the error kind, 1-based line and field path, and that Display
/// starts with `filters.yaml:LINE:`.
#[track_caller]
fn assert_err(body: &str, kind: ConfigErrorKind, line: usize, path: &str) -> String {
    let e = load(body).expect_err("config should be rejected");
    let shown = e.to_string();
    assert_eq!(e.kind, kind, "{shown}");
    assert_eq!(e.path, path, "{shown}");
    assert_eq!(e.line, Some(line), "{shown}");
    assert!(
        shown.starts_with(&format!("filters.yaml:{line}:")),
        "{shown}"
    );
    assert!(shown.contains(path), "{shown}");
    shown
}

fn examples() -> Vec<(String, String)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("filters-") && name.ends_with(".yaml") {
            out.push((name, std::fs::read_to_string(&p).unwrap()));
        }
    }
    out.sort();
    out
}

fn pool() -> Vec<EndpointView> {
    let mut eps: Vec<EndpointView> = (0..6)
        .map(|i| EndpointView {
            models: vec!["m".into()],
            labels: [("pool".to_owned(), "chat".to_owned())].into(),
            ..EndpointView::new(format!("10.0.0.{i}:8000"))
        })
        .collect();
    eps[0].role = Role::Prefill;
    eps[1].role = Role::Decode;
    eps
}

#[test]
fn every_example_loads_and_schedules() {
    let all = examples();
    for want in [
        "default",
        "precise-prefix",
        "pd-disaggregated",
        "round-robin",
        "least-queue",
    ] {
        assert!(
            all.iter()
                .any(|(n, _)| *n == format!("filters-{want}.yaml")),
            "missing example filters-{want}.yaml"
        );
    }
    for (name, text) in all {
        let cfg = FilterConfig::from_yaml(&text, &name).unwrap_or_else(|e| panic!("{e}"));
        let sched = Scheduler::new(&cfg).unwrap_or_else(|e| panic!("{name}: {e}"));
        let req = RequestView {
            prompt_tokens: 5000,
            prompt_blocks: 312,
            ..RequestView::new("r1", "m")
        };
        let d = sched
            .schedule(&req, &pool(), 0, 7)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!d.trace.profiles.is_empty(), "{name}");
    }
}

#[test]
fn default_example_is_the_builtin_default() {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/examples/filters-default.yaml"),
    )
    .unwrap();
    let file = FilterConfig::from_yaml(&text, "filters-default.yaml").unwrap();
    let builtin = FilterConfig::builtin_default();
    assert_eq!(file.profiles, builtin.profiles);
    assert_eq!(file.handler, builtin.handler);
    let names = |c: &FilterConfig| {
        c.plugins
            .iter()
            .map(|p| (p.name.clone(), p.kind))
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&file), names(&builtin));
    Scheduler::new(&builtin).unwrap();
}

/// The scheduler of deploy/examples/filters-pd-disaggregated.yaml.
fn pd_example() -> Scheduler {
    let text = examples()
        .into_iter()
        .find(|(n, _)| n == "filters-pd-disaggregated.yaml")
        .unwrap()
        .1;
    Scheduler::new(&FilterConfig::from_yaml(&text, "pd.yaml").unwrap()).unwrap()
}

#[test]
fn pd_example_disaggregates_long_uncached_prompts() {
    let sched = pd_example();
    let req = RequestView {
        prompt_tokens: 5000,
        prompt_blocks: 312,
        ..RequestView::new("r1", "m")
    };
    let eps = pool();
    let d = sched.schedule(&req, &eps, 0, 1).unwrap();
    match &d.route {
        Route::Disaggregated { prefill, decode } => {
            assert!(eps[prefill.index].role.can_prefill());
            assert!(eps[decode.index].role.can_decode());
            assert_ne!(prefill.id, decode.id);
        }
        other => panic!("expected P/D, got {other:?}"),
    }
    assert_eq!(d.trace.reason, "uncached 5000 >= nonCachedTokens 2048");
    let short = RequestView {
        prompt_tokens: 500,
        ..req
    };
    let d = sched.schedule(&short, &eps, 0, 1).unwrap();
    assert_eq!(d.route.kind(), "aggregated");
    assert_eq!(
        d.trace.reason,
        "prompt 500 < promptTokens 1024; uncached 500 x 0 requests = 0 < batchStallTokens 14300"
    );
}

/// Every pod of [`pool`] with `running` requests in its batch.
fn loaded_pool(running: u32) -> Vec<EndpointView> {
    let mut eps = pool();
    for e in &mut eps {
        e.load.running = running;
    }
    eps
}

#[test]
fn pd_example_splits_a_shorter_prompt_only_on_a_busy_decode_pod() {
    let sched = pd_example();
    let req = RequestView {
        prompt_tokens: 1000,
        prompt_blocks: 62,
        ..RequestView::new("r1", "m")
    };
    // 1000 uncached tokens x 14 running = 14000 < 14300: served whole.
    let d = sched.schedule(&req, &loaded_pool(14), 0, 1).unwrap();
    assert_eq!(d.route.kind(), "aggregated", "{}", d.trace.reason);
    assert_eq!(
        d.trace.reason,
        "prompt 1000 < promptTokens 1024; uncached 1000 x 14 requests = 14000 < batchStallTokens 14300"
    );
    // x 45 (24 req/s on two decode pods): every one of them would sit
    // through the prefill, so it gets a prefill pod.
    let eps = loaded_pool(45);
    let d = sched.schedule(&req, &eps, 0, 1).unwrap();
    match &d.route {
        Route::Disaggregated { prefill, decode } => {
            assert!(eps[prefill.index].role.can_prefill());
            assert!(eps[decode.index].role.can_decode());
        }
        other => panic!("expected P/D, got {other:?}"),
    }
    assert_eq!(
        d.trace.reason,
        "uncached 1000 x 45 requests = 45000 >= batchStallTokens 14300"
    );
}

#[test]
fn pd_decider_without_batch_stall_tokens_is_llm_d_s() {
    // llm-d's decider config: load does not move the decision.
    let body = "plugins:\n  - type: decode-filter\n  - type: prefill-filter\n  - type: queue-scorer\n  - type: max-score-picker\n  - type: prefix-based-pd-decider\n    parameters:\n      nonCachedTokens: 2048\n      promptTokens: 1024\n  - type: disagg-profile-handler\nschedulingProfiles:\n  - name: decode\n    plugins:\n      - pluginRef: decode-filter\n      - pluginRef: queue-scorer\n      - pluginRef: max-score-picker\n  - name: prefill\n    plugins:\n      - pluginRef: prefill-filter\n      - pluginRef: max-score-picker\n";
    let sched = Scheduler::new(&load(body).unwrap()).unwrap();
    for (prompt, kind, reason) in [
        (1000, "aggregated", "prompt 1000 < promptTokens 1024"),
        (1500, "aggregated", "uncached 1500 < nonCachedTokens 2048"),
        (
            3000,
            "disaggregated",
            "uncached 3000 >= nonCachedTokens 2048",
        ),
    ] {
        let req = RequestView {
            prompt_tokens: prompt,
            prompt_blocks: prompt / 16,
            ..RequestView::new("r1", "m")
        };
        for running in [0, 45, 1000] {
            let d = sched.schedule(&req, &loaded_pool(running), 0, 1).unwrap();
            assert_eq!((d.route.kind(), d.trace.reason.as_str()), (kind, reason));
        }
    }
}

#[test]
fn defaults_are_filled_in() {
    // No profiles: one `default` profile with all filters, scorers, picker.
    let cfg = load("plugins:\n  - type: decode-filter\n  - type: queue-scorer\n  - type: kv-cache-utilization-scorer\n").unwrap();
    assert_eq!(cfg.profiles.len(), 1);
    let p = &cfg.profiles[0];
    assert_eq!(p.name, "default");
    assert_eq!(p.filters, vec!["decode-filter"]);
    assert_eq!(
        p.scorers,
        vec![
            ("queue-scorer".to_owned(), 1.0),
            ("kv-cache-utilization-scorer".to_owned(), 1.0)
        ]
    );
    assert_eq!(p.picker, "max-score-picker");
    assert_eq!(cfg.handler, "single-profile-handler");
    let handler = cfg.plugins.iter().find(|p| p.name == cfg.handler).unwrap();
    assert_eq!(handler.kind, PluginKind::ProfileHandler);
    // A profile without a picker gets max-score-picker; the name defaults to the type.
    let cfg = load(
        "plugins:\n  - type: queue-scorer\n    name: q\nschedulingProfiles:\n  - name: only\n    plugins:\n      - pluginRef: q\n        weight: 2.5\n",
    )
    .unwrap();
    assert_eq!(cfg.profiles[0].picker, "max-score-picker");
    assert_eq!(cfg.profiles[0].scorers, vec![("q".to_owned(), 2.5)]);
    // An empty plugin list is valid: every endpoint is equal, ties are random.
    let cfg = load("plugins: []\n").unwrap();
    Scheduler::new(&cfg).unwrap();
}

#[test]
fn dangling_plugin_ref() {
    let body = "\
plugins:
  - type: queue-scorer
  - type: decode-filter
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: decode-filter
      - pluginRef: foo
        weight: 2
";
    let shown = assert_err(
        body,
        ConfigErrorKind::DanglingRef,
        10,
        "schedulingProfiles[0].plugins[1].pluginRef",
    );
    assert_eq!(
        shown,
        "filters.yaml:10:9: schedulingProfiles[0].plugins[1].pluginRef: no plugin named \"foo\""
    );
}

#[test]
fn syntax_and_shape_errors() {
    assert_err(
        "plugins:\n  - type: \"unterminated\n",
        ConfigErrorKind::Syntax,
        5,
        "plugins[0].type",
    );
    assert_err(
        "plugins: []\ndataLayer: {}\n",
        ConfigErrorKind::UnknownField,
        4,
        "dataLayer",
    );
    assert_err(
        "plugins:\n  - type: queue-scorer\n    params: {}\n",
        ConfigErrorKind::UnknownField,
        5,
        "plugins[0].params",
    );
    assert_err(
        "plugins:\n  - type: queue-scorer\nschedulingProfiles:\n  - name: p\n    plugins:\n      - pluginRef: queue-scorer\n        weight: heavy\n",
        ConfigErrorKind::WrongType,
        9,
        "schedulingProfiles[0].plugins[0].weight",
    );
    assert_err(
        "plugins:\n  - name: x\n",
        ConfigErrorKind::MissingField,
        4,
        "plugins[0]",
    );
    let e = FilterConfig::from_yaml("kind: EndpointPickerConfig\n", "f.yaml").unwrap_err();
    assert_eq!(e.kind, ConfigErrorKind::MissingField);
    assert!(e.message.contains("apiVersion"), "{e}");
}

#[test]
fn api_version_and_kind() {
    let e = FilterConfig::from_yaml("apiVersion: v9\nkind: EndpointPickerConfig\n", "f.yaml")
        .unwrap_err();
    assert_eq!(
        (e.kind, e.line, e.path.as_str()),
        (ConfigErrorKind::UnknownValue, Some(1), "apiVersion")
    );
    let e = FilterConfig::from_yaml("apiVersion: llm-d.ai/v1alpha1\nkind: Pod\n", "f.yaml")
        .unwrap_err();
    assert_eq!(
        (e.kind, e.line, e.path.as_str()),
        (ConfigErrorKind::UnknownValue, Some(2), "kind")
    );
}

#[test]
fn plugin_errors() {
    let shown = assert_err(
        "plugins:\n  - type: queue-scorer\n  - type: magic-scorer\n",
        ConfigErrorKind::UnknownPluginType,
        5,
        "plugins[1].type",
    );
    assert!(shown.contains("\"magic-scorer\""), "{shown}");
    assert_err(
        "plugins:\n  - type: queue-scorer\n  - type: queue-scorer\n",
        ConfigErrorKind::Duplicate,
        5,
        "plugins[1].type",
    );
    assert_err(
        "plugins:\n  - type: load-aware-scorer\n    parameters:\n      threshold: lots\n",
        ConfigErrorKind::WrongType,
        6,
        "plugins[0].parameters.threshold",
    );
    assert_err(
        "plugins:\n  - type: load-aware-scorer\n    parameters:\n      threshold: 0\n",
        ConfigErrorKind::Invalid,
        6,
        "plugins[0].parameters.threshold",
    );
    assert_err(
        "plugins:\n  - type: load-aware-scorer\n    parameters:\n      treshold: 5\n",
        ConfigErrorKind::UnknownField,
        6,
        "plugins[0].parameters.treshold",
    );
    assert_err(
        "plugins:\n  - type: queue-scorer\n    parameters:\n      x: 1\n",
        ConfigErrorKind::UnknownField,
        6,
        "plugins[0].parameters.x",
    );
    assert_err(
        "plugins:\n  - type: prefix-cache-scorer\n    parameters:\n      matchLengthWeight: 2\n",
        ConfigErrorKind::Invalid,
        6,
        "plugins[0].parameters.matchLengthWeight",
    );
    assert_err(
        "plugins:\n  - type: prefix-cache-scorer\n    parameters:\n      prefixMatchInfoProducerName: nope\n",
        ConfigErrorKind::DanglingRef,
        6,
        "plugins[0].parameters.prefixMatchInfoProducerName",
    );
    assert_err(
        "plugins:\n  - type: label-selector-filter\n    parameters:\n      matchExpressions:\n        - key: zone\n          operator: In\n",
        ConfigErrorKind::Invalid,
        7,
        "plugins[0].parameters.matchExpressions[0].values",
    );
    assert_err(
        "plugins:\n  - type: label-selector-filter\n    parameters:\n      matchExpressions:\n        - key: zone\n          operator: Maybe\n",
        ConfigErrorKind::UnknownValue,
        8,
        "plugins[0].parameters.matchExpressions[0].operator",
    );
    for bad in ["lots", "-1", "1.5"] {
        let shown = assert_err(
            &format!("plugins:\n  - type: prefix-based-pd-decider\n    parameters:\n      nonCachedTokens: 2048\n      batchStallTokens: {bad}\n"),
            ConfigErrorKind::WrongType,
            7,
            "plugins[0].parameters.batchStallTokens",
        );
        assert!(shown.contains("batchStallTokens"), "{shown}");
    }
    assert_err(
        "plugins:\n  - type: approx-prefix-cache-producer\n    parameters:\n      maxPrefixBlocksToMatch: 0\n",
        ConfigErrorKind::Invalid,
        6,
        "plugins[0].parameters.maxPrefixBlocksToMatch",
    );
    assert_err(
        "plugins:\n  - type: max-score-picker\n  - type: round-robin-picker\n",
        ConfigErrorKind::Invalid,
        5,
        "plugins[1]",
    );
}

#[test]
fn profile_errors() {
    let p = "plugins:\n  - type: decode-filter\n  - type: queue-scorer\n  - type: max-score-picker\n  - type: round-robin-picker\n  - type: prefix-based-pd-decider\nschedulingProfiles:\n";
    // Line numbers: the header is 2 lines, `p` is 7; profiles start on line 10.
    assert_err(
        &format!(
            "{p}  - name: a\n    plugins:\n      - pluginRef: decode-filter\n        weight: 1\n"
        ),
        ConfigErrorKind::Invalid,
        13,
        "schedulingProfiles[0].plugins[0].weight",
    );
    assert_err(
        &format!(
            "{p}  - name: a\n    plugins:\n      - pluginRef: queue-scorer\n        weight: -1\n"
        ),
        ConfigErrorKind::Invalid,
        13,
        "schedulingProfiles[0].plugins[0].weight",
    );
    assert_err(
        &format!("{p}  - name: a\n    plugins:\n      - pluginRef: max-score-picker\n      - pluginRef: round-robin-picker\n"),
        ConfigErrorKind::Invalid,
        13,
        "schedulingProfiles[0].plugins[1].pluginRef",
    );
    assert_err(
        &format!("{p}  - name: a\n    plugins:\n      - pluginRef: prefix-based-pd-decider\n"),
        ConfigErrorKind::Invalid,
        12,
        "schedulingProfiles[0].plugins[0].pluginRef",
    );
    assert_err(
        &format!("{p}  - name: a\n  - name: a\n"),
        ConfigErrorKind::Duplicate,
        11,
        "schedulingProfiles[1].name",
    );
    assert_err(
        &format!("{p}  - name: a\n  - name: b\n"),
        ConfigErrorKind::Invalid,
        9,
        "schedulingProfiles",
    );
}

#[test]
fn handler_errors() {
    let base = "plugins:\n  - type: prefill-filter\n  - type: decode-filter\n";
    let profiles = "schedulingProfiles:\n  - name: decode\n    plugins:\n      - pluginRef: decode-filter\n  - name: prefill\n    plugins:\n      - pluginRef: prefill-filter\n";
    // A disagg handler whose decider does not exist (default name).
    assert_err(
        &format!("{base}  - type: disagg-profile-handler\n{profiles}"),
        ConfigErrorKind::DanglingRef,
        6,
        "plugins[2].parameters.deciders.prefill",
    );
    // A disagg handler naming a missing profile.
    assert_err(
        &format!(
            "{base}  - type: prefix-based-pd-decider\n  - type: disagg-profile-handler\n    parameters:\n      profiles:\n        prefill: pre\n{profiles}"
        ),
        ConfigErrorKind::DanglingRef,
        10,
        "plugins[3].parameters.profiles.prefill",
    );
    // Two handlers.
    assert_err(
        &format!(
            "{base}  - type: single-profile-handler\n  - type: disagg-profile-handler\n{profiles}"
        ),
        ConfigErrorKind::Duplicate,
        7,
        "plugins[3].type",
    );
    // A single handler with two profiles.
    assert_err(
        &format!("{base}  - type: single-profile-handler\n{profiles}"),
        ConfigErrorKind::Invalid,
        6,
        "plugins[2].parameters",
    );
    // stageOrder other than decode-first.
    assert_err(
        &format!(
            "{base}  - type: prefix-based-pd-decider\n  - type: disagg-profile-handler\n    parameters:\n      stageOrder: prefill-first\n{profiles}"
        ),
        ConfigErrorKind::UnknownValue,
        9,
        "plugins[3].parameters.stageOrder",
    );
}
