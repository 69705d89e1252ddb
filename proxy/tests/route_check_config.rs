//! `kvmesh-proxy check-config --filters` as a user runs it: the built binary,
//! real files, the exit code, and the first error with file, line and field.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh-proxy"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run kvmesh-proxy");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

const HEAD: &str = "apiVersion: kvmesh.dev/v1alpha1\nkind: EndpointPickerConfig\n";

#[test]
fn every_example_filter_config_passes() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    let mut n = 0;
    for entry in std::fs::read_dir(&examples).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !(name.starts_with("filters") && name.ends_with(".yaml")) {
            continue;
        }
        let (code, stdout, stderr) = run(&["check-config", "--filters", path.to_str().unwrap()]);
        assert_eq!(code, 0, "{name}: {stderr}");
        assert!(stdout.contains(": ok (profiles:"), "{stdout}");
        n += 1;
    }
    assert!(n >= 5, "only {n} example filter configs found");
}

#[test]
fn a_producer_parameter_kvmesh_does_not_read_gets_a_note_naming_its_setting() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "filters.yaml",
        &format!(
            "{HEAD}plugins:\n  - type: approx-prefix-cache-producer\n    parameters:\n      \
             maxPrefixBlocksToMatch: 128\n      blockSizeTokens: 64\n  - type: prefix-cache-scorer\n  \
             - type: max-score-picker\n"
        ),
    );
    let (code, stdout, stderr) = run(&["check-config", "--filters", f.to_str().unwrap()]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    let notes: Vec<&str> = stdout.lines().filter(|l| l.contains(": note: ")).collect();
    assert_eq!(notes.len(), 1, "{stdout}");
    assert!(
        notes[0].contains("blockSizeTokens") && notes[0].contains("prefix.approx_chunk_chars"),
        "{stdout}"
    );
}

#[test]
fn a_dangling_plugin_ref_is_reported_with_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "filters.yaml",
        &format!(
            "{HEAD}plugins:\n  - type: queue-scorer\nschedulingProfiles:\n  - name: default\n    plugins:\n      - pluginRef: queue-scorer\n      - pluginRef: prefix\n"
        ),
    );
    let (code, _, stderr) = run(&["check-config", "--filters", f.to_str().unwrap()]);
    assert_eq!(code, 2, "{stderr}");
    let want = format!("{}:9:", f.display());
    assert!(stderr.starts_with(&want), "{stderr}");
    assert!(
        stderr.contains("schedulingProfiles[0].plugins[1].pluginRef"),
        "{stderr}"
    );
}

#[test]
fn proxy_yaml_naming_a_bad_filter_file_fails_on_the_filter_file() {
    let dir = tempfile::tempdir().unwrap();
    let filters = write(
        dir.path(),
        "filters.yaml",
        &format!("{HEAD}plugins:\n  - type: queue-scorer\n    parameters: {{depth: 3}}\n"),
    );
    let proxy = write(
        dir.path(),
        "proxy.yaml",
        &format!(
            "pod:\n  role: decode\n  models: [tiny]\nscheduling:\n  filters: {}\n",
            filters.display()
        ),
    );
    let (code, stdout, stderr) = run(&["check-config", proxy.to_str().unwrap()]);
    assert_eq!(code, 2, "{stdout}{stderr}");
    assert!(stdout.contains("proxy.yaml: ok"), "{stdout}");
    let want = format!("{}:5:", filters.display());
    assert!(stderr.starts_with(&want), "{stderr}");
    assert!(stderr.contains("plugins[0].parameters"), "{stderr}");
}

#[test]
fn a_bad_pod_section_is_reported_with_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let proxy = write(dir.path(), "proxy.yaml", "pod:\n  role: leader\n");
    let (code, _, stderr) = run(&["check-config", proxy.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("proxy.yaml:2:") && stderr.contains("pod.role"),
        "{stderr}"
    );
}

#[test]
fn run_refuses_to_start_with_a_bad_filter_file() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "filters.yaml", "apiVersion: v9\n");
    // Port 0 listeners: nothing is bound if it wrongly starts, and it exits at once.
    let (code, _, stderr) = run(&[
        "run",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--filters",
        f.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("filters.yaml:1:"), "{stderr}");
}
