//! Every manifest under `deploy/` and `kvmesh inject`'s output pass a
//! Kubernetes schema validator (`tests/deploy/validate.py`: kubernetes-validate's
//! bundled schemas, strict, for Kubernetes 1.30; the CRD schemas in
//! `deploy/schemas/` for LeaderWorkerSet and KEDA's ScaledObject), read as
//! kubectl reads them (YAML 1.1).
//!
//! The kustomize Component cannot be validated file by file (its patch is a
//! partial Deployment, without containers), and there is no kustomize here:
//! the test renders `deploy/sidecar/example` itself, as kustomize would for
//! the fields the Component uses (resources, a configMapGenerator with a
//! content-hashed name and its references renamed, a strategic-merge patch
//! on label-selected Deployments), refusing any other kustomization field so
//! the rendering cannot silently fall behind. Rendering what users get beats
//! validating the pieces: a patch that merges into an invalid pod is caught.
//!
//! Uses `$KVMESH_PYTHON` (set by `scripts/test`), else runs `scripts/setup-python`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use kvmesh::inject::command::{options, ConnectorArg, IndexArg, InjectArgs, RoleArg};
use kvmesh::inject::{self, yaml, CONTAINER};
use serde_yaml_ng::{Mapping, Value};

#[path = "deploy/valkey_start.rs"]
mod valkey_start;

const K8S: &str = "1.30.0";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn python() -> PathBuf {
    kvmesh_tests::python::interpreter()
}

/// One validated document, as validate.py reports it.
#[derive(Debug, serde::Deserialize)]
struct Checked {
    file: String,
    kind: Option<String>,
    name: Option<String>,
    ok: bool,
    error: Option<String>,
}

/// Runs the validator over `files`; every document's result.
fn validate(files: &[PathBuf]) -> Vec<Checked> {
    let out = std::process::Command::new(python())
        .arg(root().join("tests/tests/deploy/validate.py"))
        .args(["--k8s", K8S, "--schemas"])
        .arg(root().join("deploy/schemas"))
        .args(files)
        .output()
        .expect("run validate.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.code().is_some_and(|c| c < 2),
        "validate.py failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect(l))
        .collect()
}

fn assert_valid(files: &[PathBuf]) -> Vec<Checked> {
    let checked = validate(files);
    let bad: Vec<String> = checked
        .iter()
        .filter(|c| !c.ok)
        .map(|c| {
            format!(
                "{} {:?}/{:?}: {}",
                c.file,
                c.kind,
                c.name,
                c.error.as_deref().unwrap_or("")
            )
        })
        .collect();
    assert!(bad.is_empty(), "invalid manifests:\n{}", bad.join("\n"));
    checked
}

fn read_docs(path: &Path) -> Vec<Value> {
    yaml::parse_stream(
        &std::fs::read_to_string(path).unwrap(),
        &path.display().to_string(),
    )
    .unwrap()
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            yaml_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            out.push(p);
        }
    }
}

/// What a YAML file under deploy/ is, and so how it is checked.
#[derive(Debug, PartialEq, Eq)]
enum Role {
    /// Kubernetes objects, validated as they are.
    Manifest,
    /// A kustomization or a file only a kustomization uses: validated rendered.
    Kustomize,
    /// proxy.yaml or filters.yaml, checked by the sidecar's own loaders.
    Config,
}

fn role(path: &Path, kustomize_files: &[PathBuf]) -> Role {
    let canonical = |p: &Path| std::fs::canonicalize(p).unwrap();
    if kustomize_files
        .iter()
        .any(|k| canonical(k) == canonical(path))
    {
        return Role::Kustomize;
    }
    let docs = read_docs(path);
    // Filter configs carry a kind too (llm-d's EndpointPickerConfig), but are
    // files the sidecar reads, not objects of the API server.
    let is_object = |d: &Value| {
        d.get("apiVersion").is_some()
            && d.get("kind")
                .is_some_and(|k| k != &Value::from("EndpointPickerConfig"))
    };
    if docs.iter().all(is_object) && !docs.is_empty() {
        Role::Manifest
    } else {
        Role::Config
    }
}

#[test]
fn every_yaml_file_under_deploy_is_validated() {
    let deploy = root().join("deploy");
    let mut files = Vec::new();
    yaml_files(&deploy, &mut files);
    files.sort();
    let rendered = render_kustomization(&deploy.join("sidecar/example"));
    let mut manifests = Vec::new();
    for f in &files {
        match role(f, &rendered.inputs) {
            Role::Manifest => manifests.push(f.clone()),
            Role::Kustomize => {}
            Role::Config => {
                let name = f.file_name().unwrap().to_string_lossy();
                if name.starts_with("filters") {
                    kvmesh_proxy::routing::load_filters(f).unwrap_or_else(|e| panic!("{e}"));
                } else {
                    assert!(
                        name.starts_with("proxy"),
                        "{}: neither a manifest nor a known config",
                        f.display()
                    );
                    kvmesh_proxy::config::load_file(f).unwrap_or_else(|e| panic!("{e}"));
                }
            }
        }
    }
    let checked = assert_valid(&manifests);
    for kind in [
        "DaemonSet",
        "Service",
        "ScaledObject",
        "Deployment",
        "StatefulSet",
        "LeaderWorkerSet",
        "ConfigMap",
        "PodDisruptionBudget",
    ] {
        assert!(
            checked.iter().any(|c| c.kind.as_deref() == Some(kind)),
            "no {kind} was validated"
        );
    }
}

#[test]
fn the_sidecar_component_renders_to_valid_objects_that_agree_with_inject() {
    let dir = tempfile::tempdir().unwrap();
    let rendered = render_kustomization(&root().join("deploy/sidecar/example"));
    let out = dir.path().join("rendered.yaml");
    std::fs::write(&out, yaml::emit_stream(&rendered.docs).unwrap()).unwrap();
    let checked = assert_valid(&[out]);
    let kinds: Vec<&str> = checked.iter().filter_map(|c| c.kind.as_deref()).collect();
    assert_eq!(kinds, ["Deployment", "Service", "Service", "ConfigMap"]);

    // The Component and inject add the same sidecar (inject adds the node IP
    // and pod name to the env, and --model to the args).
    let dep = &rendered.docs[0];
    let component = sidecar_of(&dep["spec"]["template"]);
    let (opts, _) = options(&inject_args(&[])).unwrap();
    let injected = opts.container();
    for key in [
        "name",
        "image",
        "restartPolicy",
        "ports",
        "readinessProbe",
        "livenessProbe",
        "resources",
        "volumeMounts",
    ] {
        assert_eq!(
            component[key], injected[key],
            "{key} differs between the Component and inject"
        );
    }
    for e in component["env"].as_sequence().unwrap() {
        assert!(injected["env"].as_sequence().unwrap().contains(e), "{e:?}");
    }
    // The ConfigMap reference was renamed to the generated, hashed name.
    let volumes = dep["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap();
    let cm = rendered
        .docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap")
        .unwrap();
    assert_eq!(volumes[0]["configMap"]["name"], cm["metadata"]["name"]);
}

#[test]
fn inject_output_for_the_examples_is_valid() {
    let dir = tempfile::tempdir().unwrap();
    let examples = root().join("deploy/inject/examples");
    let mut outputs = Vec::new();
    for (file, flags) in [
        ("deployment.yaml", &[][..]),
        ("statefulset.yaml", &[RoleArg::Decode][..]),
        ("leaderworkerset.yaml", &[][..]),
        ("leaderworkerset-leader.yaml", &[][..]),
    ] {
        let (opts, _) = options(&inject_args(flags)).unwrap();
        let out = inject::inject(read_docs(&examples.join(file)), &opts).unwrap();
        let injected = out.docs.iter().filter(|d| {
            serde_yaml_ng::to_string(d)
                .unwrap()
                .contains(&format!("name: {CONTAINER}\n"))
        });
        assert_eq!(injected.count(), 1, "{file}: one workload with the sidecar");
        let path = dir.path().join(file);
        std::fs::write(&path, yaml::emit_stream(&out.docs).unwrap()).unwrap();
        outputs.push(path);
    }
    let checked = assert_valid(&outputs);
    let lws = checked
        .iter()
        .filter(|c| c.kind.as_deref() == Some("LeaderWorkerSet"))
        .count();
    assert_eq!(lws, 2, "both LWS examples checked against the CRD schema");
    assert!(checked
        .iter()
        .any(|c| c.kind.as_deref() == Some("StatefulSet")));
}

#[test]
fn the_validator_rejects_what_kubectl_would() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        // A typo in a LeaderWorkerSet's pod template (CRD schema, closed objects).
        "apiVersion: leaderworkerset.x-k8s.io/v1\nkind: LeaderWorkerSet\nmetadata: {name: a}\nspec:\n  leaderWorkerTemplate:\n    workerTemplate:\n      spec: {containers: [{name: c, image: i, imagePullPolcy: Always}]}\n",
        // A typo in a Deployment (strict built-in schema).
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: b}\nspec: {selector: {}, template: {spec: {containers: [{name: c, imag: i}]}}}\n",
        // A string where Kubernetes wants a number, as YAML 1.1 reads it.
        "apiVersion: v1\nkind: Service\nmetadata: {name: c}\nspec: {ports: [{port: \"80\"}]}\n",
        // A kind nothing knows.
        "apiVersion: example.com/v1\nkind: Unknown\nmetadata: {name: d}\n",
    ];
    let files: Vec<PathBuf> = cases
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let p = dir.path().join(format!("bad{i}.yaml"));
            std::fs::write(&p, text).unwrap();
            p
        })
        .collect();
    let checked = validate(&files);
    assert_eq!(checked.len(), cases.len());
    for c in &checked {
        assert!(!c.ok, "{} passed", c.file);
    }
}

fn inject_args(roles: &[RoleArg]) -> InjectArgs {
    InjectArgs {
        input: "-".to_owned(),
        role: roles.first().copied(),
        pd_connector: None,
        model: Some("my-model".to_owned()),
        config: None,
        filters: None,
        image: Some("ghcr.io/kvmesh/kvmesh-proxy:0.1.0".to_owned()),
        ..InjectArgs::default()
    }
}

fn sidecar_of(template: &Value) -> &Value {
    template["spec"]["initContainers"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|c| c["name"] == CONTAINER)
        .expect("the sidecar")
}

/// A kustomization rendered, and the files it read.
struct Rendered {
    docs: Vec<Value>,
    inputs: Vec<PathBuf>,
}

/// Renders a kustomization with Components, for the fields deploy/ uses.
fn render_kustomization(dir: &Path) -> Rendered {
    let mut r = Rendered {
        docs: Vec::new(),
        inputs: Vec::new(),
    };
    apply_kustomization(dir, &mut r);
    r
}

fn apply_kustomization(dir: &Path, r: &mut Rendered) {
    let kpath = dir.join("kustomization.yaml");
    r.inputs.push(kpath.clone());
    let k = read_docs(&kpath).remove(0);
    let k = k.as_mapping().unwrap();
    for key in k.keys() {
        let key = key.as_str().unwrap();
        assert!(
            [
                "apiVersion",
                "kind",
                "resources",
                "components",
                "configMapGenerator",
                "patches"
            ]
            .contains(&key),
            "{}: the test's renderer does not know `{key}`; teach it",
            kpath.display()
        );
    }
    for res in strings(k.get("resources")) {
        let p = dir.join(res);
        r.inputs.push(p.clone());
        r.docs.extend(read_docs(&p));
    }
    for c in strings(k.get("components")) {
        apply_kustomization(&dir.join(c), r);
    }
    let mut renames = Vec::new();
    for g in k
        .get("configMapGenerator")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
    {
        let name = g["name"].as_str().unwrap();
        let mut data = Mapping::new();
        for f in strings(g.get("files")) {
            let p = dir.join(f);
            r.inputs.push(p.clone());
            data.insert(
                Value::from(f),
                Value::from(std::fs::read_to_string(&p).unwrap()),
            );
        }
        let text = serde_yaml_ng::to_string(&data).unwrap();
        // kustomize's suffix is a hash of the content; any content hash will do here.
        let hashed = format!("{name}-{:010x}", fnv(text.as_bytes()) & 0xff_ffff_ffff);
        let mut cm = Mapping::new();
        cm.insert("apiVersion".into(), "v1".into());
        cm.insert("kind".into(), "ConfigMap".into());
        cm.insert(
            "metadata".into(),
            Value::Mapping(
                [("name".into(), Value::from(hashed.clone()))]
                    .into_iter()
                    .collect(),
            ),
        );
        cm.insert("data".into(), Value::Mapping(data));
        r.docs.push(Value::Mapping(cm));
        renames.push((name.to_owned(), hashed));
    }
    for p in k
        .get("patches")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
    {
        let path = dir.join(p["path"].as_str().unwrap());
        r.inputs.push(path.clone());
        let patch = read_docs(&path).remove(0);
        let target = &p["target"];
        let (kind, selector) = (
            target["kind"].as_str().unwrap(),
            target["labelSelector"].as_str().unwrap(),
        );
        let (lk, lv) = selector.split_once('=').unwrap();
        let mut hits = 0;
        for d in &mut r.docs {
            let labelled = d["metadata"]["labels"][lk] == lv;
            if d["kind"] == kind && labelled {
                let name = d["metadata"]["name"].clone();
                merge(d, &patch);
                d["metadata"]["name"] = name;
                hits += 1;
            }
        }
        assert!(hits > 0, "{}: the patch matched nothing", path.display());
    }
    for d in &mut r.docs {
        let volumes = d
            .get_mut("spec")
            .and_then(|s| s.get_mut("template"))
            .and_then(|t| t.get_mut("spec"))
            .and_then(|s| s.get_mut("volumes"))
            .and_then(Value::as_sequence_mut);
        for v in volumes.into_iter().flatten() {
            for (from, to) in &renames {
                if v["configMap"]["name"] == from.as_str() {
                    v["configMap"]["name"] = Value::from(to.as_str());
                }
            }
        }
    }
}

/// A strategic merge patch, as far as pod specs need it: mappings merge
/// key by key; lists of named entries (containers, volumes, env) merge by
/// name; anything else is replaced.
fn merge(base: &mut Value, patch: &Value) {
    match (base, patch) {
        (Value::Mapping(b), Value::Mapping(p)) => {
            for (k, v) in p {
                match b.get_mut(k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Sequence(b), Value::Sequence(p)) if p.iter().all(|v| v.get("name").is_some()) => {
            for v in p {
                match b.iter_mut().find(|e| e.get("name") == v.get("name")) {
                    Some(existing) => merge(existing, v),
                    None => b.push(v.clone()),
                }
            }
        }
        (b, p) => *b = p.clone(),
    }
}

fn strings(v: Option<&Value>) -> Vec<&str> {
    v.and_then(Value::as_sequence)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The heterogeneous-pools example as its README says to deploy it: each
/// pool injected with its own proxy.yaml (role and GPU labels) and the shared
/// filters.yaml; the output is valid, keeps each pool's nodeSelector, and the
/// ConfigMap carries the labels the filters select on.
#[test]
fn heterogeneous_pools_inject_to_valid_objects() {
    let dir = tempfile::tempdir().unwrap();
    let example = root().join("deploy/examples/heterogeneous");
    let mut outputs = Vec::new();
    for (file, role, config, gpu, node) in [
        (
            "prefill-h100.yaml",
            RoleArg::Prefill,
            "proxy-prefill.yaml",
            "h100",
            "NVIDIA-H100-80GB-HBM3",
        ),
        (
            "decode-h200.yaml",
            RoleArg::Decode,
            "proxy-decode.yaml",
            "h200",
            "NVIDIA-H200",
        ),
    ] {
        let mut args = inject_args(&[role]);
        args.model = None;
        args.config = Some(example.join(config));
        args.filters = Some(example.join("filters.yaml"));
        let (opts, _) = options(&args).unwrap();
        let out = inject::inject(read_docs(&example.join(file)), &opts).unwrap();
        let text = yaml::emit_stream(&out.docs).unwrap();
        let deployment = out
            .docs
            .iter()
            .find(|d| d["kind"] == "Deployment")
            .expect("the Deployment");
        let pod = &deployment["spec"]["template"]["spec"];
        assert_eq!(
            pod["nodeSelector"]["nvidia.com/gpu.product"], node,
            "{file}"
        );
        let args =
            serde_yaml_ng::to_string(&sidecar_of(&deployment["spec"]["template"])["args"]).unwrap();
        assert!(
            args.contains(&format!(
                "--role={}",
                if gpu == "h100" { "prefill" } else { "decode" }
            )),
            "{args}"
        );
        let map = out
            .docs
            .iter()
            .find(|d| d["kind"] == "ConfigMap")
            .expect("the ConfigMap");
        let proxy_yaml = map["data"]["proxy.yaml"].as_str().unwrap();
        assert!(proxy_yaml.contains(&format!("gpu: {gpu}")), "{proxy_yaml}");
        assert!(map["data"]["filters.yaml"]
            .as_str()
            .unwrap()
            .contains("h200-pool"));
        let path = dir.path().join(file);
        std::fs::write(&path, text).unwrap();
        outputs.push(path);
    }
    let checked = assert_valid(&outputs);
    assert_eq!(
        checked
            .iter()
            .filter(|c| c.kind.as_deref() == Some("Deployment"))
            .count(),
        2
    );
}

/// `--pd-connector` reaches the sidecar's arguments and is checked with the
/// rest of its config, as the sidecar will load it: SGLang's decode servers
/// take only split requests, so a P/D threshold with the sglang connector is
/// refused at inject time, before anything is applied.
#[test]
fn pd_connector_flag_is_passed_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = inject_args(&[RoleArg::Decode]);
    args.pd_connector = Some(ConnectorArg::Kvagent);
    let (opts, _) = options(&args).unwrap();
    let examples = root().join("deploy/inject/examples");
    let out = inject::inject(read_docs(&examples.join("deployment.yaml")), &opts).unwrap();
    let deployment = out
        .docs
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("the Deployment");
    let sidecar_args =
        serde_yaml_ng::to_string(&sidecar_of(&deployment["spec"]["template"])["args"]).unwrap();
    assert!(
        sidecar_args.contains("--pd-connector=kvagent"),
        "{sidecar_args}"
    );
    assert!(sidecar_args.contains("--role=decode"), "{sidecar_args}");
    let path = dir.path().join("out.yaml");
    std::fs::write(&path, yaml::emit_stream(&out.docs).unwrap()).unwrap();
    assert_valid(&[path]);

    let config = dir.path().join("proxy.yaml");
    std::fs::write(&config, "pd:\n  min_uncached_tokens: 2048\n").unwrap();
    let mut args = inject_args(&[RoleArg::Decode]);
    args.config = Some(config);
    args.pd_connector = Some(ConnectorArg::Sglang);
    let err = options(&args).unwrap_err().to_string();
    assert!(err.contains("pd.min_uncached_tokens"), "{err}");
    assert!(err.contains("with the flags"), "{err}");
}

/// deploy/valkey as its README says to run it, and the sidecars pointed at
/// it: `kvmesh inject --index valkey --valkey-url ...` on the examples gives
/// valid objects whose proxy.yaml has the index section and no mesh
/// discovery, without the headless mesh Service; the URLs of
/// deploy/examples/proxy-valkey.yaml name deploy/valkey's pods.
#[test]
fn valkey_index_inject_output_and_deploy_valkey_agree_and_are_valid() {
    let valkey_dir = root().join("deploy/valkey");
    let sts = read_docs(&valkey_dir.join("statefulset.yaml")).remove(0);
    let svc = read_docs(&valkey_dir.join("service.yaml")).remove(0);
    assert_eq!(sts["spec"]["serviceName"], svc["metadata"]["name"]);
    assert_eq!(svc["spec"]["clusterIP"], "None");
    let container = &sts["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["image"], "valkey/valkey:8.1");
    let replicas = sts["spec"]["replicas"].as_u64().unwrap();
    let env_replicas = container["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "VALKEY_REPLICAS")
        .unwrap();
    assert_eq!(env_replicas["value"], replicas.to_string().as_str());
    let urls: Vec<String> = (0..replicas)
        .map(|i| {
            format!(
                "redis://{}-{i}.{}:6379",
                sts["metadata"]["name"].as_str().unwrap(),
                svc["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect();
    let example =
        kvmesh_proxy::config::load_file(&root().join("deploy/examples/proxy-valkey.yaml")).unwrap();
    assert_eq!(example.index.valkey.urls, urls);
    assert_eq!(example.index.backend.as_str(), "valkey");

    let dir = tempfile::tempdir().unwrap();
    let examples = root().join("deploy/inject/examples");
    let mut outputs = Vec::new();
    for file in [
        "deployment.yaml",
        "statefulset.yaml",
        "leaderworkerset.yaml",
    ] {
        let args = InjectArgs {
            index: Some(IndexArg::Valkey),
            valkey_urls: urls.clone(),
            ..inject_args(&[])
        };
        let (opts, notes) = options(&args).unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        let out = inject::inject(read_docs(&examples.join(file)), &opts).unwrap();
        let cm = out.docs.iter().find(|d| d["kind"] == "ConfigMap").unwrap();
        let proxy_yaml = cm["data"]["proxy.yaml"].as_str().unwrap();
        let c = kvmesh_proxy::config::from_yaml_str(proxy_yaml, "configmap").unwrap();
        assert_eq!(c.index.backend.as_str(), "valkey", "{proxy_yaml}");
        assert_eq!(c.index.valkey.urls, urls);
        assert!(
            c.mesh.dns.is_none() && c.mesh.listen.is_none(),
            "{proxy_yaml}"
        );
        let services: Vec<&str> = out
            .docs
            .iter()
            .filter(|d| d["kind"] == "Service")
            .map(|d| d["metadata"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(services, ["kvmesh"], "{file}: no headless mesh Service");
        let path = dir.path().join(file);
        std::fs::write(&path, yaml::emit_stream(&out.docs).unwrap()).unwrap();
        outputs.push(path);
    }
    assert_valid(&outputs);
}
