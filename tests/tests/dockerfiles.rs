//! The Dockerfiles under deploy/ agree with the workspace and with the
//! manifests that run their images, without docker: each `cargo build` names
//! a package, binary and features that exist, with `--locked`; the build
//! image's Rust is the toolchain's; the binary copied is the one built and
//! is the entry point; the image each Dockerfile documents is the one the
//! manifests (and `inject`) use. `scripts/dockerfile-builds` (in CI) runs the
//! builds themselves.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kvmesh_tests::workspace::{metadata, root};

/// A Dockerfile's instructions, continuation lines joined, comments kept apart.
struct Dockerfile {
    instructions: Vec<(String, String)>,
    comments: String,
}

fn parse(path: &Path) -> Dockerfile {
    let text = std::fs::read_to_string(path).unwrap();
    let mut instructions = Vec::new();
    let mut comments = String::new();
    let mut pending = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('#') {
            comments.push_str(t);
            comments.push('\n');
            continue;
        }
        if t.is_empty() && pending.is_empty() {
            continue;
        }
        match t.strip_suffix('\\') {
            Some(head) => {
                pending.push_str(head);
                pending.push(' ');
            }
            None => {
                pending.push_str(t);
                let (op, rest) = pending.split_once(' ').unwrap_or((&pending, ""));
                instructions.push((op.to_uppercase(), rest.trim().to_owned()));
                pending.clear();
            }
        }
    }
    Dockerfile {
        instructions,
        comments,
    }
}

impl Dockerfile {
    fn all(&self, op: &str) -> Vec<&str> {
        self.instructions
            .iter()
            .filter(|(o, _)| o == op)
            .map(|(_, r)| r.as_str())
            .collect()
    }

    fn args(&self) -> HashMap<String, String> {
        self.all("ARG")
            .into_iter()
            .filter_map(|a| a.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    /// The `-t IMAGE` of the documented `docker build` command.
    fn documented_image(&self) -> String {
        let line = self
            .comments
            .lines()
            .find(|l| l.contains("docker build") && l.contains(" -t "))
            .unwrap();
        line.split_whitespace()
            .skip_while(|w| *w != "-t")
            .nth(1)
            .unwrap()
            .to_owned()
    }
}

/// The cargo build command's flags (`-p`, `--bin`, `--features`), ARG defaults substituted.
fn cargo_build(d: &Dockerfile) -> (Vec<String>, HashMap<String, String>) {
    let runs: Vec<&str> = d
        .all("RUN")
        .into_iter()
        .filter(|r| r.starts_with("cargo build"))
        .collect();
    assert_eq!(runs.len(), 1, "one cargo build per Dockerfile");
    let mut cmd = runs[0].to_owned();
    for (k, v) in d.args() {
        cmd = cmd
            .replace(&format!("\"${k}\""), &v)
            .replace(&format!("${k}"), &v);
    }
    let words: Vec<String> = cmd.split_whitespace().map(str::to_owned).collect();
    let mut flags = HashMap::new();
    for pair in words.windows(2) {
        if ["-p", "--bin", "--features"].contains(&pair[0].as_str()) {
            flags.insert(pair[0].clone(), pair[1].clone());
        }
    }
    (words, flags)
}

fn dockerfiles() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(root().join("deploy"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("Dockerfile.")
        })
        .collect();
    out.sort();
    out
}

#[test]
fn each_dockerfile_builds_a_binary_the_workspace_has() {
    let meta = metadata();
    let toolchain = std::fs::read_to_string(root().join("rust-toolchain.toml")).unwrap();
    let files = dockerfiles();
    let names: Vec<String> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["Dockerfile.kvagent", "Dockerfile.proxy"]);
    for f in &files {
        let d = parse(f);
        let name = f.display();
        let (words, flags) = cargo_build(&d);
        for w in ["--release", "--locked"] {
            assert!(
                words.iter().any(|x| x == w),
                "{name}: cargo build without {w}"
            );
        }
        let package = &flags["-p"];
        let bin = &flags["--bin"];
        let pkg = meta["packages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == package.as_str())
            .unwrap_or_else(|| panic!("{name}: no package {package} in the workspace"));
        let has_bin = pkg["targets"].as_array().unwrap().iter().any(|t| {
            t["name"] == bin.as_str() && t["kind"].as_array().unwrap().iter().any(|k| k == "bin")
        });
        assert!(has_bin, "{name}: {package} has no binary {bin}");
        for feature in flags
            .get("--features")
            .map_or("", String::as_str)
            .split(',')
            .filter(|s| !s.is_empty())
        {
            assert!(
                pkg["features"].get(feature).is_some(),
                "{name}: {package} has no feature {feature}"
            );
        }
        // The build image's Rust is the toolchain's (a newer toolchain would not build there).
        let from = d.all("FROM");
        let rust = from[0]
            .split_whitespace()
            .next()
            .unwrap()
            .strip_prefix("rust:")
            .unwrap();
        let version = rust.split('-').next().unwrap();
        assert!(
            toolchain.contains(&format!("channel = \"{version}")),
            "{name}: FROM rust:{version} but rust-toolchain.toml says otherwise"
        );
        // The binary built is the one copied and started.
        let copy = d
            .all("COPY")
            .into_iter()
            .find(|c| c.starts_with("--from=build"))
            .unwrap();
        let parts: Vec<&str> = copy.split_whitespace().collect();
        assert_eq!(parts[1], format!("/src/target/release/{bin}"), "{name}");
        let entry: Vec<String> = serde_json::from_str(d.all("ENTRYPOINT")[0]).unwrap();
        assert_eq!(
            entry[0], parts[2],
            "{name}: ENTRYPOINT runs what COPY put there"
        );
    }
}

#[test]
fn the_manifests_run_the_images_the_dockerfiles_build() {
    let version = env!("CARGO_PKG_VERSION");
    let proxy = parse(&root().join("deploy/Dockerfile.proxy")).documented_image();
    let kvagent = parse(&root().join("deploy/Dockerfile.kvagent")).documented_image();
    assert_eq!(
        proxy,
        format!("ghcr.io/kvmesh/kvmesh-proxy:{version}"),
        "the tag follows the workspace version"
    );
    assert_eq!(kvagent, format!("ghcr.io/kvmesh/kvmesh-kvagent:{version}"));
    let image_lines = |file: &str| -> Vec<String> {
        std::fs::read_to_string(root().join(file))
            .unwrap()
            .lines()
            .filter_map(|l| l.trim().strip_prefix("image:"))
            .map(|l| l.split('#').next().unwrap().trim().to_owned())
            .collect()
    };
    assert_eq!(image_lines("deploy/kvagent/daemonset.yaml"), [kvagent]);
    assert_eq!(
        image_lines("deploy/sidecar/sidecar-patch.yaml"),
        std::slice::from_ref(&proxy)
    );
    // inject's default image.
    let args = kvmesh::inject::command::InjectArgs {
        input: "-".to_owned(),
        role: None,
        pd_connector: None,
        model: Some("m".to_owned()),
        config: None,
        filters: None,
        image: None,
        ..Default::default()
    };
    let (opts, _) = kvmesh::inject::command::options(&args).unwrap();
    assert_eq!(opts.image, proxy);
}
