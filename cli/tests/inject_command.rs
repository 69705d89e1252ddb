//! `kvmesh inject` / `uninject` as a pipe stage: YAML in on stdin, a
//! file or a directory; YAML out on stdout; any error on stderr with a
//! non-zero exit and nothing on stdout, so `| kubectl apply -f -` never
//! applies half a stream.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use kvmesh::inject::yaml::parse_stream;

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/inject/examples")
}

fn run(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A command that refuses its arguments may exit before reading stdin:
    // the write then fails with a broken pipe, which is not the test's concern.
    let _ = child.stdin.take().unwrap().write_all(stdin.as_bytes());
    child.wait_with_output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_pipe_round_trips_through_inject_and_uninject() {
    let input = std::fs::read_to_string(examples().join("deployment.yaml")).unwrap();
    let injected = run(&["inject", "--model", "my-model", "-"], &input);
    assert_eq!(injected.status.code(), Some(0), "{}", stderr(&injected));
    let text = String::from_utf8(injected.stdout).unwrap();
    let docs = parse_stream(&text, "stdout").unwrap();
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["ConfigMap", "Service", "Service", "Deployment"]);
    assert!(text.contains("--model=my-model"));
    let back = run(&["uninject"], &text);
    assert_eq!(back.status.code(), Some(0), "{}", stderr(&back));
    let back = parse_stream(&String::from_utf8(back.stdout).unwrap(), "stdout").unwrap();
    assert_eq!(back, parse_stream(&input, "in").unwrap());
}

#[test]
fn a_directory_is_read_in_name_order_and_other_kinds_are_noted() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("b.yml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: b}\nspec: {ports: [{port: 1}]}\n",
    )
    .unwrap();
    std::fs::copy(
        examples().join("statefulset.yaml"),
        dir.path().join("a.yaml"),
    )
    .unwrap();
    std::fs::write(dir.path().join("notes.txt"), "not yaml: [").unwrap();
    let out = run(
        &["inject", "--model", "m", dir.path().to_str().unwrap()],
        "",
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let docs = parse_stream(&String::from_utf8_lossy(&out.stdout), "stdout").unwrap();
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["ConfigMap", "Service", "Service", "StatefulSet", "Service"]
    );
    assert!(
        stderr(&out).contains("Service/b: not a Deployment"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn bad_input_fails_with_nothing_on_stdout() {
    let good = std::fs::read_to_string(examples().join("deployment.yaml")).unwrap();
    let cases: [(&[&str], String, &str); 5] = [
        (&["inject", "--model", "m", "-"], format!("{good}---\nkind: [unclosed\n"), "<stdin>"),
        (&["inject", "--model", "m", "-"], format!("{good}---\napiVersion: v1\nkind: Secret\nmetadata: {{name: s}}\nx:\n  mode: 0644\n"), "<stdin>:"),
        (&["inject", "-"], good.clone(), "--model"),
        (&["inject", "--model", "m", "/nonexistent/x.yaml"], String::new(), "/nonexistent/x.yaml"),
        (&["inject", "--model", "m", "-"], good.replace("containerPort: 8000", "containerPort: 9090"), "9090"),
    ];
    for (args, input, says) in cases {
        let out = run(args, &input);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(out.stdout.is_empty(), "{args:?} wrote to stdout");
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
    }
}

#[test]
fn the_config_is_validated_with_the_flags() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("proxy.yaml");
    std::fs::write(&bad, "listeners:\n  client: 0.0.0.0:8100\n  clinet: x\n").unwrap();
    let out = run(&["inject", "--config", bad.to_str().unwrap(), "-"], "");
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("proxy.yaml:3"), "{}", stderr(&out));
    let filters = dir.path().join("filters.yaml");
    std::fs::write(&filters, "not: [a filter config").unwrap();
    let out = run(
        &[
            "inject",
            "--model",
            "m",
            "--filters",
            filters.to_str().unwrap(),
            "-",
        ],
        "",
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("filter"), "{}", stderr(&out));
}
