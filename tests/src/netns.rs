//! Two "nodes" as network namespaces joined by a veth pair, the way a
//! cluster places pods and node agents: each node has a node address (where
//! its hostNetwork kvagent listens) and a pod address (where its engine pod's
//! sidecar listens), both on the veth, in a private range. Everything is made
//! by [`NodePair::create`] and removed when it drops (also on a panic):
//! deleting a namespace removes its end of the veth, and the pair with it.
//!
//! In-process pieces (simulated engines, sidecars, test clients) run on a
//! [`Node::runtime`]: a tokio runtime whose threads entered the node's
//! namespace before any of them started, so every socket its tasks open is
//! the node's. Node agents run as processes under `ip netns exec`.

use std::io::{BufRead, BufReader};
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::Value;

/// One simulated node: its namespace, its end of the veth, its addresses.
pub struct Node {
    pub ns: String,
    pub veth: String,
    /// Where the node's agent listens (Kubernetes `status.hostIP`).
    pub node_ip: IpAddr,
    /// Where the node's engine pod listens (Kubernetes `status.podIP`).
    pub pod_ip: IpAddr,
}

/// Two nodes joined by a veth pair; removed on drop.
pub struct NodePair {
    pub a: Node,
    pub b: Node,
}

/// Why the pair could not be made: the test should skip, saying this.
#[derive(Debug)]
pub struct Unavailable(pub String);

impl NodePair {
    /// Makes the namespaces `kvm<pid>-<n>-a|b` and a veth pair between them:
    /// node addresses `10.231.0.1` and `.2` (/30), pod addresses `.5` and
    /// `.6` (/30), loopback up in both.
    pub fn create() -> Result<NodePair, Unavailable> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(Unavailable("not root: ip netns needs CAP_SYS_ADMIN".into()));
        }
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let tag = format!(
            "{}{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let node = |side: &str, node_ip: &str, pod_ip: &str| Node {
            ns: format!("kvm{tag}-{side}"),
            veth: format!("kv{tag}{side}"),
            node_ip: node_ip.parse().expect("ip"),
            pod_ip: pod_ip.parse().expect("ip"),
        };
        let pair = NodePair {
            a: node("a", "10.231.0.1", "10.231.0.5"),
            b: node("b", "10.231.0.2", "10.231.0.6"),
        };
        if pair.a.veth.len() > 15 {
            return Err(Unavailable(format!(
                "interface name {} too long",
                pair.a.veth
            )));
        }
        ip(&["netns", "add", &pair.a.ns]).map_err(Unavailable)?;
        // From here on, drop removes whatever was made.
        ip(&["netns", "add", &pair.b.ns]).map_err(Unavailable)?;
        let (a, b) = (&pair.a, &pair.b);
        let steps: Vec<Vec<String>> = vec![
            words(&format!(
                "link add {} type veth peer name {}",
                a.veth, b.veth
            )),
            words(&format!("link set {} netns {}", a.veth, a.ns)),
            words(&format!("link set {} netns {}", b.veth, b.ns)),
        ];
        for s in steps {
            let s: Vec<&str> = s.iter().map(String::as_str).collect();
            ip(&s).map_err(Unavailable)?;
        }
        for n in [a, b] {
            for cmd in [
                format!("addr add {}/30 dev {}", n.node_ip, n.veth),
                format!("addr add {}/30 dev {}", n.pod_ip, n.veth),
                format!("link set {} up", n.veth),
                "link set lo up".to_owned(),
            ] {
                let mut args = vec!["-n".to_owned(), n.ns.clone()];
                args.extend(words(&cmd));
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                ip(&args).map_err(Unavailable)?;
            }
        }
        Ok(pair)
    }
}

/// Set to `1` to let a test that needs network namespaces pass without
/// them (saying so); unset, such a test fails with the reason.
pub const SKIP_ENV: &str = "KVMESH_NETNS_SKIP";

impl NodePair {
    /// [`NodePair::create`] for a test that needs it: where namespaces are
    /// not available, panics with the reason, unless [`SKIP_ENV`] is `1`
    /// (then says it skipped and returns `None`).
    pub fn create_or_skip(test: &str) -> Option<NodePair> {
        match NodePair::create() {
            Ok(p) => Some(p),
            Err(why) if std::env::var(SKIP_ENV).as_deref() == Ok("1") => {
                eprintln!(
                    "SKIPPED ({SKIP_ENV}=1): {test} needs network namespaces: {}",
                    why.0
                );
                None
            }
            Err(why) => panic!(
                "{test} needs network namespaces: {} (run as root, or set {SKIP_ENV}=1 to skip it)",
                why.0
            ),
        }
    }
}

impl Drop for NodePair {
    fn drop(&mut self) {
        for n in [&self.a, &self.b] {
            if let Err(e) = ip(&["netns", "del", &n.ns]) {
                eprintln!("netns: could not remove {}: {e}", n.ns);
            }
        }
    }
}

impl Node {
    /// Sets the node's end of the veth down (a partition: the other node's
    /// end loses its carrier, and nothing crosses) or up again (healed).
    pub fn set_link(&self, up: bool) {
        let state = if up { "up" } else { "down" };
        if let Err(e) = ip(&["-n", &self.ns, "link", "set", &self.veth, state]) {
            panic!("netns: could not set {} {state}: {e}", self.veth);
        }
    }

    /// Bytes sent and received on the node's end of the veth (`ip -s link`).
    pub fn veth_bytes(&self) -> (u64, u64) {
        let out = Command::new("ip")
            .args([
                "-n", &self.ns, "-j", "-s", "link", "show", "dev", &self.veth,
            ])
            .output()
            .expect("ip -s link runs");
        assert!(out.status.success(), "ip -s link: {out:?}");
        let v: Value = serde_json::from_slice(&out.stdout).expect("ip -j is JSON");
        let stats = &v[0]["stats64"];
        let get = |dir: &str| stats[dir]["bytes"].as_u64().expect("stats64 bytes");
        (get("tx"), get("rx"))
    }

    /// A tokio runtime whose every thread lives in this node's namespace.
    /// Run work on it with `rt.block_on(rt.spawn(...))`: a spawned task runs
    /// on the runtime's threads, the `block_on` future itself does not.
    pub fn runtime(&self) -> tokio::runtime::Runtime {
        let path = PathBuf::from("/var/run/netns").join(&self.ns);
        std::thread::spawn(move || {
            let f = std::fs::File::open(&path).expect("namespace file");
            // SAFETY: a valid namespace fd; setns changes only this thread,
            // which builds the runtime (its threads inherit the namespace).
            let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime")
        })
        .join()
        .expect("namespace thread")
    }
}

/// A `kvmesh-kvagent run` process in a node's namespace, on the node
/// address; killed when dropped.
pub struct NodeAgent {
    child: Child,
    pub socket: PathBuf,
    /// `host:port` of its agent-to-agent listener.
    pub peer: String,
    /// Its admin listener (metrics), reachable from the node's namespace.
    pub admin: std::net::SocketAddr,
}

impl NodeAgent {
    /// Starts the agent on `node.node_ip:port`, its socket in `dir`.
    pub fn start(bin: &Path, node: &Node, port: u16, dir: &Path) -> NodeAgent {
        let socket = dir.join(format!("{}.sock", node.ns));
        let log = std::fs::File::create(dir.join(format!("{}-agent.log", node.ns))).expect("log");
        let mut child = Command::new("ip")
            .args(["netns", "exec", &node.ns])
            .arg(bin)
            .args(["run", "--ready-json", "--agent-id", &node.ns])
            .args(["--listen", &format!("{}:{port}", node.node_ip)])
            .args(["--admin", &format!("{}:0", node.node_ip)])
            .arg("--socket")
            .arg(&socket)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("ip netns exec kvmesh-kvagent");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let Ok(line) = rx.recv_timeout(Duration::from_secs(30)) else {
            let _ = child.kill();
            let _ = child.wait();
            panic!("agent in {} printed no ready line within 30 s", node.ns);
        };
        let ready: Value = serde_json::from_str(line.trim()).expect("ready line is JSON");
        NodeAgent {
            child,
            socket,
            peer: ready["peer"].as_str().expect("peer").to_owned(),
            admin: ready["admin"]
                .as_str()
                .and_then(|a| a.parse().ok())
                .expect("admin addr"),
        }
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `kvmesh-kvagent` binary beside this test's own, brought up to date.
pub fn kvagent_bin() -> PathBuf {
    crate::simproc::workspace_bin("kvmesh-kvagent", "kvmesh-kvagent")
}

fn words(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_owned).collect()
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}
