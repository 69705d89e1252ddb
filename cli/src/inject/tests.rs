use serde_yaml_ng::Value;

use super::*;

const DEPLOYMENT: &str = include_str!("../../assets/deploy/inject/examples/deployment.yaml");
const STATEFULSET: &str = include_str!("../../assets/deploy/inject/examples/statefulset.yaml");
const LWS: &str = include_str!("../../assets/deploy/inject/examples/leaderworkerset.yaml");
const LWS_LEADER: &str =
    include_str!("../../assets/deploy/inject/examples/leaderworkerset-leader.yaml");

fn opts() -> InjectOptions {
    InjectOptions {
        image: "img:1".to_owned(),
        proxy_yaml: "pod:\n  models: [m]\n".to_owned(),
        filters_yaml: None,
        ports: Ports {
            client: 8100,
            admin: 9090,
            mesh: Some(7000),
        },
        mesh_service: true,
        extra_args: vec!["--model=m".to_owned()],
        version: "0.1.0".to_owned(),
    }
}

fn docs(text: &str) -> Vec<Value> {
    yaml::parse_stream(text, "test").unwrap()
}

fn injected(text: &str) -> Outcome {
    inject(docs(text), &opts()).unwrap()
}

fn at<'a>(v: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(v, |v, k| {
        v.get(k).unwrap_or_else(|| panic!("no {k} in {path:?}"))
    })
}

/// The last document (the workload; generated resources come first).
fn workload(out: &Outcome) -> &Value {
    out.docs.last().unwrap()
}

fn init_names(tpl: &Value) -> Vec<&str> {
    at(tpl, &["spec", "initContainers"])
        .as_sequence()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect()
}

#[test]
fn every_example_injects_with_the_engine_container_unchanged() {
    for (text, tpl_path) in [
        (DEPLOYMENT, &["spec", "template"][..]),
        (STATEFULSET, &["spec", "template"][..]),
        (
            LWS_LEADER,
            &["spec", "leaderWorkerTemplate", "leaderTemplate"][..],
        ),
    ] {
        let before = docs(text).remove(0);
        let out = injected(text);
        let after = workload(&out);
        let (b, a) = (at(&before, tpl_path), at(after, tpl_path));
        assert_eq!(b["spec"]["containers"], a["spec"]["containers"], "{text}");
        for key in ["metadata", "apiVersion", "kind"] {
            if key != "metadata" {
                assert_eq!(before[key], after[key]);
            }
        }
        assert_eq!(
            before["metadata"], after["metadata"],
            "the object's own metadata"
        );
        assert_eq!(init_names(a).last(), Some(&CONTAINER));
        assert_eq!(at(a, &["metadata", "labels", LABEL]), &Value::from("true"));
        assert_eq!(
            at(a, &["metadata", "annotations", INJECTED]),
            &Value::from("0.1.0")
        );
    }
}

#[test]
fn the_sidecar_is_a_native_sidecar_with_ports_probes_env_and_config() {
    let out = injected(DEPLOYMENT);
    let tpl = at(workload(&out), &["spec", "template"]);
    let inits = at(tpl, &["spec", "initContainers"]).as_sequence().unwrap();
    let c = &inits[0];
    assert_eq!(c["restartPolicy"], Value::from("Always"));
    assert_eq!(c["image"], Value::from("img:1"));
    let args: Vec<&str> = c["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(
        args,
        [
            "run",
            "--config=/etc/kvmesh/proxy.yaml",
            "--advertise=$(POD_IP):8100",
            "--node-ip=$(NODE_IP)",
            "--model=m"
        ]
    );
    let env: Vec<&str> = c["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|e| {
            at(e, &["valueFrom", "fieldRef", "fieldPath"])
                .as_str()
                .unwrap()
        })
        .collect();
    assert_eq!(env, ["status.podIP", "status.hostIP", "metadata.name"]);
    let ports: Vec<u64> = c["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| p["containerPort"].as_u64().unwrap())
        .collect();
    assert_eq!(ports, [8100, 9090, 7000]);
    assert_eq!(
        at(c, &["readinessProbe", "httpGet", "port"]),
        &Value::from(9090)
    );
    let volumes = at(tpl, &["spec", "volumes"]).as_sequence().unwrap();
    assert_eq!(volumes.len(), 2, "the user's volume, then ours");
    let cm_name = at(&volumes[1], &["configMap", "name"]).clone();
    // ConfigMap, Service, headless Service, then the workload; all in the workload's namespace.
    assert_eq!(out.docs.len(), 4);
    assert_eq!(out.docs[0]["kind"], Value::from("ConfigMap"));
    assert_eq!(at(&out.docs[0], &["metadata", "name"]), &cm_name);
    assert_eq!(
        at(&out.docs[0], &["data", "proxy.yaml"]),
        &Value::from("pod:\n  models: [m]\n")
    );
    for d in &out.docs[..3] {
        assert_eq!(at(d, &["metadata", "namespace"]), &Value::from("serving"));
    }
    assert_eq!(
        at(&out.docs[2], &["spec", "clusterIP"]),
        &Value::from("None")
    );
}

#[test]
fn injecting_twice_is_injecting_once_and_uninject_restores_the_input() {
    for text in [DEPLOYMENT, STATEFULSET, LWS, LWS_LEADER] {
        let once = injected(text);
        let twice = inject(once.docs.clone(), &opts()).unwrap();
        assert_eq!(once.docs, twice.docs, "{text}");
        let back = uninject(twice.docs).unwrap();
        assert_eq!(back.docs, docs(text), "{text}");
        assert!(back.notes.is_empty(), "{:?}", back.notes);
    }
}

#[test]
fn reinjecting_with_another_config_replaces_the_sidecar_and_config_map() {
    let once = injected(DEPLOYMENT);
    let mut other = opts();
    other.proxy_yaml.push_str("logging: {format: json}\n");
    let again = inject(once.docs.clone(), &other).unwrap();
    assert_eq!(
        again.docs.len(),
        4,
        "the old ConfigMap and Services are dropped"
    );
    assert_ne!(
        once.docs[0]["metadata"]["name"],
        again.docs[0]["metadata"]["name"]
    );
    let tpl = at(workload(&again), &["spec", "template"]);
    assert_eq!(init_names(tpl), [CONTAINER]);
    assert_eq!(
        at(tpl, &["spec", "volumes"]).as_sequence().unwrap()[1]["configMap"]["name"],
        again.docs[0]["metadata"]["name"]
    );
}

#[test]
fn lws_without_a_leader_template_gets_one_copied_from_the_workers() {
    let before = docs(LWS).remove(0);
    let out = injected(LWS);
    let after = workload(&out);
    let lwt = at(after, &["spec", "leaderWorkerTemplate"]);
    let worker = &lwt["workerTemplate"];
    assert_eq!(
        worker,
        at(&before, &["spec", "leaderWorkerTemplate", "workerTemplate"]),
        "workers untouched"
    );
    let leader = &lwt["leaderTemplate"];
    assert_eq!(leader["spec"]["containers"], worker["spec"]["containers"]);
    assert_eq!(init_names(leader), [CONTAINER]);
    let created = at(leader, &["metadata", "annotations", CREATED])
        .as_str()
        .unwrap();
    assert!(
        created.split(',').any(|c| c == "leaderTemplate"),
        "{created}"
    );
    assert_eq!(lwt["size"], Value::from(2));
}

#[test]
fn lws_with_a_leader_template_changes_the_leader_only() {
    let before = docs(LWS_LEADER).remove(0);
    let out = injected(LWS_LEADER);
    let lwt = at(workload(&out), &["spec", "leaderWorkerTemplate"]);
    assert_eq!(
        lwt["workerTemplate"],
        before["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    );
    assert_eq!(init_names(&lwt["leaderTemplate"]), [CONTAINER]);
}

#[test]
fn other_kinds_pass_through_with_a_note_and_lists_are_walked() {
    let text = "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Service\n  metadata: {name: s}\n  spec: {ports: [{port: 1}]}\n- apiVersion: apps/v1\n  kind: DaemonSet\n  metadata: {name: d}\n  spec: {template: {spec: {containers: [{name: c, image: i}]}}}\n- apiVersion: v1\n  kind: Pod\n  metadata: {name: p}\n  spec: {containers: [{name: c, image: i}]}\n";
    let input = docs(text);
    let out = inject(input.clone(), &opts()).unwrap();
    let list = workload(&out);
    let items = list["items"].as_sequence().unwrap();
    let input_items = input[0]["items"].as_sequence().unwrap();
    assert_eq!(items[0], input_items[0]);
    assert_eq!(items[1], input_items[1]);
    assert_eq!(init_names(&items[2]), [CONTAINER]);
    assert_eq!(out.notes.len(), 2, "{:?}", out.notes);
    assert!(out.notes[0].starts_with("Service/s:"), "{:?}", out.notes);
    assert!(out.notes[1].starts_with("DaemonSet/d:"), "{:?}", out.notes);
    // A pod without metadata labels or annotations gets them, and loses them again.
    assert_eq!(uninject(out.docs).unwrap().docs, input);
}

#[test]
fn pods_labelled_out_are_left_alone() {
    let text = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  selector: {matchLabels: {a: b}}\n  template:\n    metadata:\n      labels: {a: b, kvmesh.io/inject: \"false\"}\n    spec: {containers: [{name: c, image: i}]}\n";
    let out = injected(text);
    assert_eq!(
        out.docs,
        docs(text),
        "no ConfigMap for a namespace with nothing injected"
    );
    assert_eq!(out.notes.len(), 1);
}

#[test]
fn a_label_the_user_set_survives_uninject() {
    let text = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  selector: {matchLabels: {a: b}}\n  template:\n    metadata:\n      labels: {a: b, kvmesh.io/inject: \"true\"}\n    spec: {containers: [{name: c, image: i}], initContainers: []}\n";
    let out = injected(text);
    assert_eq!(uninject(out.docs).unwrap().docs, docs(text));
}

#[test]
fn conflicts_and_malformed_templates_are_errors() {
    let port = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c, image: i, ports: [{containerPort: 9090}]}]}\n";
    let e = inject(docs(port), &opts()).unwrap_err();
    assert!(
        e.to_string().contains("Pod/p") && e.to_string().contains("9090"),
        "{e}"
    );
    let name = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: kvmesh-proxy, image: i}]}\n";
    assert!(matches!(
        inject(docs(name), &opts()),
        Err(InjectError::Conflict { .. })
    ));
    let bad = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\nspec: {template: [1]}\n";
    assert!(matches!(
        inject(docs(bad), &opts()),
        Err(InjectError::Malformed { .. })
    ));
}

#[test]
fn the_output_reads_back_as_the_same_documents() {
    for text in [DEPLOYMENT, STATEFULSET, LWS, LWS_LEADER] {
        let out = injected(text);
        let printed = yaml::emit_stream(&out.docs).unwrap();
        assert_eq!(
            yaml::parse_stream(&printed, "out").unwrap(),
            out.docs,
            "{printed}"
        );
    }
}

#[test]
fn the_config_map_name_follows_the_content() {
    let a = opts();
    let mut b = opts();
    assert_eq!(a.config_map_name(), b.config_map_name());
    b.filters_yaml = Some("x".to_owned());
    assert_ne!(a.config_map_name(), b.config_map_name());
    assert_eq!(a.config_map_name().len(), "kvmesh-proxy-".len() + 10);
}

fn valkey_args(config: Option<std::path::PathBuf>) -> command::InjectArgs {
    command::InjectArgs {
        model: Some("m".to_owned()),
        config,
        index: Some(command::IndexArg::Valkey),
        valkey_urls: vec![
            "redis://valkey-0.valkey:6379".to_owned(),
            "redis://valkey-1.valkey:6379".to_owned(),
        ],
        ..command::InjectArgs::default()
    }
}

fn proxy_yaml_of(out: &Outcome) -> kvmesh_proxy::config::Config {
    let cm = out.docs.iter().find(|d| d["kind"] == "ConfigMap").unwrap();
    let text = at(cm, &["data", "proxy.yaml"]).as_str().unwrap();
    kvmesh_proxy::config::load::from_yaml_str(text, "configmap").unwrap()
}

fn kinds(out: &Outcome) -> Vec<(&str, &str)> {
    out.docs
        .iter()
        .map(|d| {
            let name = at(d, &["metadata", "name"]).as_str().unwrap();
            (d["kind"].as_str().unwrap(), name)
        })
        .collect()
}

#[test]
fn index_valkey_configures_the_index_and_leaves_out_the_mesh_discovery() {
    let (o, notes) = command::options(&valkey_args(None)).unwrap();
    assert!(notes.is_empty(), "{notes:?}");
    let out = inject(docs(DEPLOYMENT), &o).unwrap();
    let c = proxy_yaml_of(&out);
    assert_eq!(c.index.backend.as_str(), "valkey");
    assert_eq!(
        c.index.valkey.urls,
        [
            "redis://valkey-0.valkey:6379",
            "redis://valkey-1.valkey:6379"
        ]
    );
    assert_eq!((c.mesh.listen, c.mesh.dns), (None, None));
    assert_eq!(c.pod.models, ["my-model"], "the rest of the built-in file");
    // No headless mesh Service, no mesh port on the sidecar.
    let found = kinds(&out);
    assert_eq!(
        found[..2],
        [("ConfigMap", found[0].1), ("Service", "kvmesh")]
    );
    assert_eq!(found.len(), 3, "{found:?}");
    let tpl = at(workload(&out), &["spec", "template"]);
    let ports: Vec<u64> = at(tpl, &["spec", "initContainers"]).as_sequence().unwrap()[0]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| p["containerPort"].as_u64().unwrap())
        .collect();
    assert_eq!(ports, [8100, 9090]);
    assert_eq!(uninject(out.docs).unwrap().docs, docs(DEPLOYMENT));
}

#[test]
fn index_valkey_keeps_the_mesh_port_for_mutual_tls_but_not_its_headless_service() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("proxy.yaml");
    std::fs::write(
        &config,
        "listeners: {client: 0.0.0.0:8100}\nmesh:\n  listen: 0.0.0.0:7000\n  dns: {name: kvmesh-mesh, port: 7000}\n  tls: {ca: /m/ca.pem, cert: /m/tls.crt, key: /m/tls.key}\n",
    )
    .unwrap();
    let mut args = valkey_args(Some(config));
    args.valkey_cluster = true;
    let (o, notes) = command::options(&args).unwrap();
    assert_eq!(o.ports.mesh, Some(7000));
    assert!(
        notes.iter().any(|n| n.contains("mesh.dns left out")),
        "{notes:?}"
    );
    let out = inject(docs(DEPLOYMENT), &o).unwrap();
    let c = proxy_yaml_of(&out);
    assert!(c.index.valkey.cluster);
    assert_eq!(
        (c.mesh.listen.map(|a| a.port()), c.mesh.dns),
        (Some(7000), None)
    );
    assert!(!kinds(&out).contains(&("Service", "kvmesh-mesh")));

    let e = command::options(&command::InjectArgs {
        index: None,
        ..valkey_args(None)
    })
    .unwrap_err();
    assert!(e.to_string().contains("need --index valkey"), "{e}");
}
