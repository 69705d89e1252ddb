//! `kvmesh-proxy check-config` as a user runs it: the built binary, real files,
//! the exit code and the first error with file, line and field.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kvmesh_proxy(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvmesh-proxy"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run kvmesh-proxy")
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn check(file: &Path) -> (i32, String, String) {
    let out = kvmesh_proxy(&["check-config", file.to_str().unwrap()]);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_example_passes_check_config() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    let mut n = 0;
    for entry in std::fs::read_dir(&examples).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !(name.starts_with("proxy") && name.ends_with(".yaml")) {
            continue;
        }
        // Decoding and validation, without the TLS files of a real pod.
        let text = std::fs::read_to_string(&path).unwrap();
        kvmesh_proxy::config::from_yaml_str(&text, &name).unwrap_or_else(|e| panic!("{e}"));
        if !text.contains("tls:") {
            let (code, stdout, stderr) = check(&path);
            assert_eq!(code, 0, "{stderr}");
            assert!(stdout.contains(": ok"), "{stdout}");
        }
        n += 1;
    }
    assert!(n >= 3, "expected the proxy examples, found {n}");
}

#[test]
fn unknown_key_reports_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "p.yaml",
        "engine:\n  url: http://127.0.0.1:8001\n  knd: vllm\n",
    );
    let (code, _, stderr) = check(&f);
    assert_eq!(code, 2);
    let want = format!("{}:3:", f.display());
    assert!(stderr.starts_with(&want), "{stderr}");
    assert!(
        stderr.contains(": engine.knd: unknown field `knd`, expected one of"),
        "{stderr}"
    );
}

#[test]
fn bad_values_report_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("timeouts:\n  connect: 5 seconds\n", 2, "timeouts.connect"),
        ("engine:\n  kind: tgi\n", 2, "engine.kind"),
        ("listeners:\n  client: localhost\n", 2, "listeners.client"),
        ("engine:\n  url: https://127.0.0.1:8001\n", 2, "engine.url"),
        (
            "limits:\n  max_connections: -1\n",
            2,
            "limits.max_connections",
        ),
        (
            "timeouts:\n  overall: 1m\n  first_byte: 30s\n  stream_idle: 2m\n",
            4,
            "timeouts.stream_idle",
        ),
        ("logging:\n  level: \"[[[\"\n", 2, "logging.level"),
        (
            "runtime:\n  worker_threads: 0\n",
            2,
            "runtime.worker_threads",
        ),
    ];
    for (text, line, field) in cases {
        let f = write(dir.path(), "bad.yaml", text);
        let (code, _, stderr) = check(&f);
        assert_eq!(code, 2, "{text:?} was accepted");
        let want = format!("{}:{line}:", f.display());
        assert!(stderr.starts_with(&want), "{text:?}: {stderr}");
        assert!(
            stderr.contains(&format!(": {field}: ")),
            "{text:?}: {stderr}"
        );
    }
}

#[test]
fn missing_tls_key_is_reported_with_its_field() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "tls.yaml",
        "listeners:\n  tls:\n    cert: /nonexistent/tls.crt\n    key: /nonexistent/tls.key\n",
    );
    let (code, _, stderr) = check(&f);
    assert_eq!(code, 2);
    assert!(stderr.contains(":3:5: listeners.tls.cert:"), "{stderr}");
}

#[test]
fn missing_mesh_tls_files_are_reported_with_their_field() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "mesh-tls.yaml",
        "mesh:\n  listen: 127.0.0.1:7000\n  tls:\n    ca: /nonexistent/ca.pem\n    cert: /nonexistent/tls.crt\n    key: /nonexistent/tls.key\n",
    );
    let (code, _, stderr) = check(&f);
    assert_eq!(code, 2);
    assert!(stderr.contains(":4:5: mesh.tls.ca:"), "{stderr}");
}

#[test]
fn filters_file_must_be_yaml() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "p.yaml",
        "engine:\n  url: http://127.0.0.1:8001\n",
    );
    let bad = write(
        dir.path(),
        "filters.yaml",
        "plugins:\n  - type: x\n    [oops\n",
    );
    let out = kvmesh_proxy(&[
        "check-config",
        p.to_str().unwrap(),
        "--filters",
        bad.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("filters.yaml"),
        "the error does not name the file: {stderr}"
    );
}

#[test]
fn run_rejects_a_bad_flag_value() {
    let out = kvmesh_proxy(&["run", "--engine", "http://127.0.0.1:1/v1"]);
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no path"));
}

/// Every document of a YAML file.
fn yaml_docs(path: &Path) -> Vec<serde_yaml_ng::Value> {
    use serde::Deserialize;
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde_yaml_ng::Value::deserialize(d).unwrap())
        .collect()
}

#[test]
fn the_sidecar_component_passes_check_config_and_its_ports_agree() {
    use serde_yaml_ng::Value;
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/sidecar");
    // The proxy.yaml the ConfigMap is generated from, as the sidecar will read it.
    let file = deploy.join("proxy.yaml");
    let (code, _, stderr) = check(&file);
    assert_eq!(code, 0, "{stderr}");
    let text = std::fs::read_to_string(&file).unwrap();
    let c = kvmesh_proxy::config::from_yaml_str(&text, "proxy.yaml").unwrap();
    let kustomization = &yaml_docs(&deploy.join("kustomization.yaml"))[0];
    let generated = &kustomization["configMapGenerator"][0];
    assert_eq!(generated["name"], "kvmesh-proxy");
    assert_eq!(generated["files"][0], "proxy.yaml");
    let (client, admin) = (c.listeners.client.port(), c.listeners.admin.port());
    let mesh = c.mesh.listen.unwrap().port();
    // The container exposes those ports, advertises the client port, probes the admin port.
    let patch = &yaml_docs(&deploy.join("sidecar-patch.yaml"))[0];
    let sidecar = &patch["spec"]["template"]["spec"]["initContainers"][0];
    let ports: Vec<u64> = sidecar["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| p["containerPort"].as_u64().unwrap())
        .collect();
    assert_eq!(
        ports,
        [u64::from(client), u64::from(admin), u64::from(mesh)]
    );
    let args: Vec<&str> = sidecar["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        args.contains(&format!("--advertise=$(POD_IP):{client}").as_str()),
        "{args:?}"
    );
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(
            sidecar[probe]["httpGet"]["port"].as_u64(),
            Some(u64::from(admin))
        );
    }
    // The client Service targets the client port; the headless one is what mesh.dns names.
    let services = yaml_docs(&deploy.join("services.yaml"));
    let target = |name: &str| -> &Value {
        let s = services
            .iter()
            .find(|s| s["metadata"]["name"] == name)
            .unwrap();
        &s["spec"]["ports"][0]
    };
    assert_eq!(
        target("kvmesh")["targetPort"].as_u64(),
        Some(u64::from(client))
    );
    let dns = c.mesh.dns.as_ref().unwrap();
    assert_eq!(dns.name, "kvmesh-mesh");
    assert_eq!(
        target("kvmesh-mesh")["port"].as_u64(),
        Some(u64::from(dns.port))
    );
    assert_eq!(
        target("kvmesh-mesh")["targetPort"].as_u64(),
        Some(u64::from(mesh))
    );
}

#[test]
fn the_full_example_names_every_key_of_every_section() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/proxy.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    // A key counts as named when a line (commented or not) starts with it.
    let named = |key: &str| {
        text.lines().any(|l| {
            let l = l.trim_start().trim_start_matches('#').trim_start();
            l.starts_with(&format!("{key}:"))
        })
    };
    let defaults = serde_json::to_value(kvmesh_proxy::config::Config::default()).unwrap();
    let mut missing = Vec::new();
    for (section, keys) in defaults.as_object().unwrap() {
        if !named(section) {
            missing.push(section.clone());
        }
        // An optional section absent by default (`tracing`) is `null`: named
        // above is enough.
        let Some(keys) = keys.as_object() else {
            continue;
        };
        for key in keys.keys() {
            if !named(key) {
                missing.push(format!("{section}.{key}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "deploy/examples/proxy.yaml lacks {missing:?}"
    );
}
