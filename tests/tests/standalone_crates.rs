//! Each crate stands alone (issue 43): nothing a crate compiles in
//! (`include_str!`, `include_bytes!`, `#[path]`) lies outside its own folder,
//! so `cargo package -p NAME` (scripts/check-crates, in CI) holds every file
//! the crate builds from. Where a crate compiles in a file that also lives
//! under deploy/ (a built-in filter config, the sidecar's default proxy.yaml,
//! the manifests inject's tests read), it keeps its own copy under
//! `<crate>/assets/`, at the path the original has from the repository root,
//! and this test holds each copy equal to its original: editing one without
//! the other fails here, with the command that copies it over.
//!
//! This crate (kvmesh-tests, `publish = false`) is the one place that reads
//! across folders: its suites check deploy/ against the code.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Component, Path, PathBuf};

use serde_json::Value;

/// Reaches out of a crate's folder that remain, with the reason each is still
/// there. The list may only shrink.
const EXCEPTIONS: &[(&str, &str)] = &[];

/// The macros and attribute whose string literal names a file the crate compiles in.
const REACHES: &[&str] = &["include_str!(", "include_bytes!(", "#[path = "];

use kvmesh_tests::workspace::{metadata, root};

/// `path` with `.` and `..` resolved lexically (the files need not exist).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// The folder of every workspace crate but this one, relative to the root.
fn crate_dirs() -> Vec<PathBuf> {
    let meta: Value = metadata();
    let root = normalize(&root().canonicalize().unwrap());
    let dirs: Vec<PathBuf> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["name"] != "kvmesh-tests")
        .map(|p| {
            let manifest = Path::new(p["manifest_path"].as_str().unwrap());
            let dir = normalize(manifest.parent().unwrap());
            dir.strip_prefix(&root).unwrap().to_path_buf()
        })
        .collect();
    assert!(dirs.len() >= 7, "too few crates: {dirs:?}");
    dirs
}

/// Every file under `dir` (relative to the root), skipping the folders of other crates.
fn files(dir: &Path, crates: &[PathBuf], out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(root().join(dir))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    entries.sort();
    for name in entries {
        let rel = dir.join(&name);
        let full = root().join(&rel);
        if full.is_dir() {
            if name != "target" && !crates.contains(&rel) {
                files(&rel, crates, out);
            }
        } else {
            out.push(rel);
        }
    }
}

/// The string literals `text` passes to `include_str!`, `include_bytes!` and
/// `#[path]` (`None` for an argument that is not a plain literal).
fn reaches(text: &str) -> Vec<Option<String>> {
    let mut found = Vec::new();
    for pat in REACHES {
        for (at, _) in text.match_indices(pat) {
            let rest = text[at + pat.len()..].trim_start();
            found.push(
                rest.strip_prefix('"')
                    .and_then(|r| r.split_once('"'))
                    .map(|(lit, _)| lit.to_owned()),
            );
        }
    }
    found
}

#[test]
fn no_crate_compiles_in_a_file_outside_its_folder() {
    let crates = crate_dirs();
    let mut outside = Vec::new();
    for dir in &crates {
        let mut all = Vec::new();
        files(dir, &crates, &mut all);
        for file in all
            .iter()
            .filter(|f| f.extension().is_some_and(|e| e == "rs"))
        {
            let text = std::fs::read_to_string(root().join(file)).unwrap();
            for lit in reaches(&text) {
                let Some(lit) = lit else {
                    outside.push(format!(
                        "{}: an argument that is not a literal",
                        file.display()
                    ));
                    continue;
                };
                let target = normalize(&file.parent().unwrap().join(&lit));
                if !target.starts_with(dir) {
                    outside.push(format!("{}: {lit}", file.display()));
                }
            }
        }
    }
    let excepted = |line: &String| EXCEPTIONS.iter().any(|(f, _)| line.starts_with(f));
    let unexcused: Vec<_> = outside.iter().filter(|l| !excepted(l)).collect();
    assert!(
        unexcused.is_empty(),
        "files compiled in from outside their crate's folder (keep a copy under \
         <crate>/assets/<path from the root>):\n{}",
        unexcused
            .iter()
            .map(|l| format!("  {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // An exception whose reach is gone leaves the list.
    for (file, _) in EXCEPTIONS {
        assert!(
            outside.iter().any(|l| l.starts_with(file)),
            "{file} no longer reaches out of its crate: remove it from EXCEPTIONS"
        );
    }
}

#[test]
fn each_crate_asset_equals_its_original() {
    let crates = crate_dirs();
    let mut copies = 0;
    for dir in &crates {
        let assets = dir.join("assets");
        if !root().join(&assets).is_dir() {
            continue;
        }
        let mut all = Vec::new();
        files(&assets, &crates, &mut all);
        for copy in all {
            let original = copy.strip_prefix(&assets).unwrap();
            let want = std::fs::read(root().join(original)).unwrap_or_else(|e| {
                panic!(
                    "{} copies {}, which cannot be read: {e}",
                    copy.display(),
                    original.display()
                )
            });
            let have = std::fs::read(root().join(&copy)).unwrap();
            assert!(
                have == want,
                "{} differs from {}: edit the original and copy it over \
                 (cp {} {})",
                copy.display(),
                original.display(),
                original.display(),
                copy.display()
            );
            copies += 1;
        }
    }
    // proxy's built-in P/D config and KEDA example, cli's demo configs,
    // default proxy.yaml and inject examples.
    assert!(copies >= 12, "only {copies} asset copies found");
}
