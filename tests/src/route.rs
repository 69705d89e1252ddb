//! Helpers for the routing suites (`tests/tests/route_*.rs`): simulated
//! engines, sidecars with a pod identity and a filter file, metric reads, and
//! adding a peer to a sidecar's fleet by hand (what the mesh does for real).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use kvmesh_engine_sim::{Engine, Flavor, Role as SimRole, SimConfig, SimHandle};
use kvmesh_filters::sched::Role;
use kvmesh_proxy::config::{Config, Duration as CfgDuration};
use kvmesh_proxy::fleet::{EngineLoad, PodInfo};
use kvmesh_proxy::SidecarHandle;

use crate::client::admin_get;
use crate::sidecar::{start, test_config};

/// The model every simulated engine in these suites serves.
pub const MODEL: &str = "tiny";

/// A simulated vLLM engine serving [`MODEL`], ten times faster than real time.
pub async fn sim() -> SimHandle {
    sim_with(SimConfig::new(MODEL).with_time_scale(10.0)).await
}

pub async fn sim_with(config: SimConfig) -> SimHandle {
    Engine::start_local(config).await.expect("simulator starts")
}

/// A vLLM-flavoured simulated engine in a P/D `role`, ten times real time.
pub async fn pd_sim(role: SimRole) -> SimHandle {
    sim_with(
        SimConfig::new(MODEL)
            .with_time_scale(10.0)
            .with_role(role)
            .with_flavor(Flavor::Vllm),
    )
    .await
}

/// A sidecar config in front of `engine`: this pod serves [`MODEL`], carries
/// `labels`, scrapes every 50 ms and checks `filters` (if any) every 50 ms.
pub fn config(engine: &SimHandle, labels: &[(&str, &str)], filters: Option<&Path>) -> Config {
    let mut c = test_config(engine.addr());
    c.pod.models = vec![MODEL.to_owned()];
    c.pod.labels = labels_of(labels);
    c.engine.metrics_interval = CfgDuration::from_millis(50);
    c.scheduling.filters = filters.map(Path::to_path_buf);
    c.scheduling.reload_interval = CfgDuration::from_millis(50);
    c
}

/// A sidecar in front of `engine` (see [`config`]).
pub async fn sidecar(
    engine: &SimHandle,
    labels: &[(&str, &str)],
    filters: Option<&Path>,
) -> SidecarHandle {
    start(config(engine, labels, filters)).await
}

pub fn labels_of(labels: &[(&str, &str)]) -> BTreeMap<String, String> {
    labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Makes `peer` a pod in `on`'s fleet, as the mesh would: identity and
/// forwarding address are the peer's client listener, its load fresh and idle.
pub fn add_peer(on: &SidecarHandle, peer: &SidecarHandle, labels: &[(&str, &str)]) -> String {
    let id = peer.addr().to_string();
    on.fleet()
        .upsert_peer(PodInfo {
            id: id.clone(),
            sidecar_addr: Some(peer.addr()),
            role: Role::Both,
            models: vec![MODEL.to_owned()],
            lora_adapters: vec![],
            labels: labels_of(labels),
        })
        .expect("peer added");
    on.fleet()
        .set_load(&id, EngineLoad::default(), tokio::time::Instant::now());
    id
}

/// The value of one series on the admin port's `/metrics`, by its exact
/// name and labels as printed (`kvmesh_x_total{a="b"}`); `None` if absent.
pub async fn metric(h: &SidecarHandle, series: &str) -> Option<f64> {
    let text = admin_get(h.admin_addr(), "/metrics").await.text();
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(series)?;
        rest.strip_prefix(' ')?.trim().parse().ok()
    })
}

/// Polls `probe` every 20 ms until it returns `Some`, for at most 5 s.
pub async fn eventually<T, F, Fut>(what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    for _ in 0..250 {
        if let Some(v) = probe().await {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{what}: not within 5 s");
}

/// A `filters.yaml` with the given plugins (YAML list items, indented by two).
pub fn filters_yaml(plugins: &str) -> String {
    format!("apiVersion: kvmesh.dev/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n{plugins}")
}

/// A filter file in `dir` that keeps only the pods labelled `pod: <name>`
/// (so that a test decides where its requests run).
pub fn only_pod(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let file = dir.join(format!("only-{name}.yaml"));
    let plugins = format!(
        "  - type: label-selector-filter\n    parameters:\n      matchLabels: {{pod: {name}}}\n  - type: queue-scorer\n"
    );
    std::fs::write(&file, filters_yaml(&plugins)).unwrap();
    file
}
