//! The filter config on disk: a change is picked up while serving; a bad
//! change keeps the previous config and is counted; an emptied candidate set
//! is a 503 that names the filter.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvmesh_tests::client::{admin_get, fetch, http1, post_json};
use kvmesh_tests::route::{eventually, filters_yaml, metric, sidecar, sim};

const COMPLETION: &str = r#"{"model":"tiny","prompt":"hello","max_tokens":2}"#;
const ERRORS: &str = "kvmesh_filters_reload_errors_total";
const RELOADS: &str = "kvmesh_filters_reloads_total";

fn selector(value: &str) -> String {
    filters_yaml(&format!(
        "  - type: label-selector-filter\n    parameters:\n      matchLabels: {{pool: {value}}}\n  - type: queue-scorer\n"
    ))
}

#[tokio::test]
async fn a_bad_file_keeps_the_old_config_and_a_good_one_takes_effect() {
    let engine = sim().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("filters.yaml");
    std::fs::write(&file, selector("chat")).unwrap();
    let proxy = sidecar(&engine, &[("pool", "chat")], Some(&file)).await;
    let c = http1();
    let ok = fetch(&c, post_json(proxy.addr(), "/v1/completions", COMPLETION)).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert_eq!(metric(&proxy, ERRORS).await, Some(0.0));

    // A typo in a field name: rejected, counted, the old config still serves.
    let bad = selector("chat").replace("matchLabels", "matchLabel");
    std::fs::write(&file, bad).unwrap();
    eventually("the bad file is counted", || async {
        (metric(&proxy, ERRORS).await == Some(1.0)).then_some(())
    })
    .await;
    let still = fetch(&c, post_json(proxy.addr(), "/v1/completions", COMPLETION)).await;
    assert_eq!(still.status, 200, "{}", still.text());
    assert_eq!(metric(&proxy, RELOADS).await, Some(0.0));

    // A good file selecting a pool nobody is in: takes effect, and every
    // request is refused with a 503 naming the filter.
    std::fs::write(&file, selector("batch")).unwrap();
    eventually("the good file is loaded", || async {
        (metric(&proxy, RELOADS).await == Some(1.0)).then_some(())
    })
    .await;
    let r = fetch(&c, post_json(proxy.addr(), "/v1/completions", COMPLETION)).await;
    assert_eq!(r.status, 503, "{}", r.text());
    let e = &r.json()["error"];
    assert_eq!(e["code"], "no_endpoint");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("label-selector-filter"),
        "{e}"
    );
    let f = admin_get(proxy.admin_addr(), "/debug/fleet").await.json();
    assert_eq!(f["filters"], file.display().to_string());
    assert_eq!(metric(&proxy, ERRORS).await, Some(1.0));
    proxy.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test]
async fn a_sidecar_does_not_start_with_a_bad_filter_file() {
    let engine = sim().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("filters.yaml");
    std::fs::write(&file, filters_yaml("  - type: no-such-scorer\n")).unwrap();
    let cfg = kvmesh_tests::route::config(&engine, &[], Some(&file));
    let client = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let err = kvmesh_proxy::Sidecar::start(cfg, client, admin)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("filters.yaml:4") && err.contains("no-such-scorer"),
        "{err}"
    );
    engine.shutdown().await;
}
