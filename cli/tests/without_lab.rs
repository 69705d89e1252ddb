//! A `kvmesh` built without the `lab` feature (`--no-default-features`, the
//! ops CLI alone): `demo` and `bench` stay names a user can type, and each
//! answers, whatever follows it, with one error that says the build has no
//! lab and how to get one, not a usage error. `scripts/check-crates` (in CI)
//! runs this file; in a default build it compiles to nothing.
#![cfg(not(feature = "lab"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

fn kvmesh(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn demo_and_bench_say_the_build_has_no_lab_and_how_to_get_it() {
    for args in [
        &["demo"][..],
        &["demo", "--quick", "--json"],
        &["bench", "peers", "--quick"],
        &["bench", "--help"],
    ] {
        let (code, stdout, stderr) = kvmesh(args);
        assert_eq!(code, 1, "{args:?}: {stderr}");
        assert!(stdout.is_empty(), "{args:?}: {stdout}");
        assert!(
            stderr.contains("built without the lab")
                && stderr.contains(&format!("cargo run -p kvmesh -- {}", args[0])),
            "{args:?}: {stderr}"
        );
    }
}

#[test]
fn help_lists_the_ops_commands_and_says_demo_and_bench_are_not_in_this_build() {
    let (code, stdout, _) = kvmesh(&["--help"]);
    assert_eq!(code, 0);
    for ops in ["inject", "uninject", "stat", "check-config", "prefix"] {
        assert!(
            stdout.contains(&format!("  {ops} ")),
            "{ops} missing:\n{stdout}"
        );
    }
    for lab in ["demo", "bench"] {
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(lab))
            .unwrap_or_else(|| panic!("{lab} missing:\n{stdout}"));
        assert!(line.contains("Not in this build"), "{line}");
    }
}
