//! deploy/valkey's start script (the `valkey-start` ConfigMap), run by `sh`
//! with a stub `valkey-cli` that answers ROLE per host as scripted and a stub
//! `valkey-server` that prints its arguments: which pod starts as primary,
//! and whom a replica follows, after a first start, a restart and a manual
//! promotion.

use std::path::Path;
use std::process::Command;

use super::{read_docs, root};

/// The script's decision for pod `hostname` when the other pods answer
/// `roles` (host, first line of ROLE; a host not listed does not answer):
/// `None` for primary, else the host it replicates.
fn start(dir: &Path, hostname: &str, roles: &[(&str, &str)]) -> Option<String> {
    let cm = read_docs(&root().join("deploy/valkey/configmap.yaml")).remove(0);
    let script = cm["data"]["start.sh"].as_str().unwrap().to_owned();
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let mut cases = String::new();
    for (host, role) in roles {
        cases.push_str(&format!(
            "    {host}) printf '{role}\\n127.0.0.1\\n6379\\n' ;;\n"
        ));
    }
    let cli = format!(
        "#!/bin/sh\nwhile [ $# -gt 0 ]; do [ \"$1\" = -h ] && host=$2; shift; done\ncase \"$host\" in\n{cases}    *) echo \"Could not connect to $host\" >&2; exit 1 ;;\nesac\n"
    );
    let server = "#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done\n";
    for (name, text) in [("valkey-cli", cli.as_str()), ("valkey-server", server)] {
        let p = bin.join(name);
        std::fs::write(&p, text).unwrap();
        Command::new("chmod").arg("+x").arg(&p).status().unwrap();
    }
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let out = Command::new("sh")
        .args(["-c", &script])
        .env("PATH", path)
        .env("HOSTNAME", hostname)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let args: Vec<&str> = stdout.lines().skip(1).collect();
    for want in ["--save", "", "--appendonly", "no"] {
        assert!(args.contains(&want), "{args:?}");
    }
    let at = args.iter().position(|a| *a == "--replicaof")?;
    assert_eq!(args[at + 2], "6379");
    Some(args[at + 1].to_owned())
}

#[test]
fn the_valkey_start_script_keeps_one_primary() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // First start: pod 0 alone is the primary; pod 1 follows it.
    assert_eq!(start(d, "valkey-0", &[]), None);
    assert_eq!(
        start(d, "valkey-1", &[("valkey-0.valkey", "master")]).as_deref(),
        Some("valkey-0.valkey")
    );
    // Pod 1 restarts while pod 0 is away: it waits for pod 0.
    assert_eq!(
        start(d, "valkey-1", &[]).as_deref(),
        Some("valkey-0.valkey")
    );
    // Pod 0 restarts, pod 1 is still its replica: pod 0 is the primary again.
    assert_eq!(start(d, "valkey-0", &[("valkey-1.valkey", "slave")]), None);
    // Pod 1 was promoted while pod 0 was away: pod 0 comes back as its replica.
    assert_eq!(
        start(d, "valkey-0", &[("valkey-1.valkey", "master")]).as_deref(),
        Some("valkey-1.valkey")
    );
    // Pod 1 restarts and pod 0 replicates it (now gone): pod 1 is the primary.
    assert_eq!(start(d, "valkey-1", &[("valkey-0.valkey", "slave")]), None);
}
