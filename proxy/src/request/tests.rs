//! The request core stays a leaf: no file under `request/`, `routing/`,
//! `pd/` or `mesh/` names the stages (`crate::path`), and the request core
//! names none of `routing`, `pd` or `mesh`. The stages take narrow handles:
//! no file under `path/` but `mod.rs` (which builds them), and none under
//! `pd/`, names `crate::app`. Read from the sources, so a new import that
//! would close the circle again fails here.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        panic!("cannot read {}", dir.display());
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Files under `src/<module>` whose code (comments aside) names one of `needles`.
fn offenders(module: &str, needles: &[&str]) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src")
        .join(module);
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(!files.is_empty(), "no sources under {}", root.display());
    let mut bad = Vec::new();
    // This file names what it looks for.
    files.retain(|f| !f.ends_with("request/tests.rs"));
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if needles.iter().any(|needle| code.contains(needle)) {
                bad.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
            }
        }
    }
    bad
}

#[test]
fn no_cycle() {
    for module in ["request", "routing", "pd", "mesh"] {
        let bad = offenders(module, &["crate::path"]);
        assert!(
            bad.is_empty(),
            "{module} imports the stages:\n{}",
            bad.join("\n")
        );
    }
    let bad = offenders(
        "request",
        &["crate::routing", "crate::pd", "crate::mesh", "crate::app"],
    );
    assert!(
        bad.is_empty(),
        "the request core is no leaf:\n{}",
        bad.join("\n")
    );
    let mut bad = offenders("pd", &["crate::app"]);
    let wiring = Path::new("src").join("path").join("mod.rs");
    let wiring = wiring.to_string_lossy();
    bad.extend(
        offenders("path", &["crate::app"])
            .into_iter()
            .filter(|b| !b.contains(&format!("{wiring}:"))),
    );
    assert!(
        bad.is_empty(),
        "a stage takes the whole App, not a narrow handle:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_check_sees_an_import() {
    // The scan finds what it looks for: `path/` names the request core.
    assert!(!offenders("path", &["crate::request"]).is_empty());
    // And sees the one file allowed to name `App`: the stages' wiring.
    assert!(!offenders("path", &["crate::app"]).is_empty());
}
