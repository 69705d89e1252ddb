//! The chaos suite's fleet: every engine a `kvmesh-engine-sim` process and
//! every sidecar a `kvmesh-proxy` process (so SIGKILL and SIGTERM are real),
//! each on ports fixed at the start so a killed process comes back where its
//! peers and clients expect it. Helpers scrape what the accounting needs:
//! the sims' running counts, the sidecars' in-flight gauges and their
//! `/debug/fleet`.
//!
//! A pod is placed on loopback in the test's namespace, or on a "node" (a
//! network namespace of `kvmesh_tests::netns`): its processes then run under
//! `ip netns exec` on the node's pod address, and the test reaches them from a
//! runtime whose threads live in that namespace ([`Place`]).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvmesh_engine_sim::KvSubscriber;
use kvmesh_tests::route::MODEL;
use serde_json::Value;
use tokio::process::{Child, Command};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

/// Simulated seconds per real second: streams last long enough to be cut
/// mid-way, short enough for a few thousand requests in a couple of minutes.
pub const TIME_SCALE: &str = "5";

/// How long a process may take to become ready.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// Where the fleet's fixed ports are drawn from, up to the kernel's
/// ephemeral range.
const FIXED_PORTS_FROM: u16 = 12000;

/// Ports free a moment ago, all distinct, each listener held until every port
/// is chosen. A pod keeps its ports across restarts, so they are drawn from
/// below the kernel's ephemeral range: a port from `bind(0)` would sit inside
/// it, and while its process is down the kernel may hand it to an outgoing
/// connection as a local port, after which the restarted listener cannot
/// bind it.
pub fn free_ports(n: usize) -> Vec<u16> {
    let below = ephemeral_floor();
    assert!(
        below > FIXED_PORTS_FROM + 1000,
        "the ephemeral range starts at {below}: no room below it for fixed ports"
    );
    let span = u64::from(below - FIXED_PORTS_FROM);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mut draw = u64::from(std::process::id()) << 32 | u64::from(nanos) | 1;
    let mut held = Vec::with_capacity(n);
    for _ in 0..n * 100 {
        if held.len() == n {
            break;
        }
        // xorshift64: a different walk per process, so parallel tests rarely
        // try the same ports.
        draw ^= draw << 13;
        draw ^= draw >> 7;
        draw ^= draw << 17;
        let port = FIXED_PORTS_FROM + (draw % span) as u16;
        if let Ok(listener) = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, port)) {
            held.push(listener);
        }
    }
    assert_eq!(
        held.len(),
        n,
        "found {} of {n} free ports below {below}",
        held.len()
    );
    held.iter()
        .map(|l| l.local_addr().expect("local addr").port())
        .collect()
}

/// The first port of the kernel's ephemeral range (Linux's default when it
/// cannot be read).
fn ephemeral_floor() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// Where a pod runs: its address, and the namespace its processes and the
/// test's calls to it run in (`None`: the test's own).
#[derive(Clone)]
pub struct Place {
    pub ip: IpAddr,
    /// The node's namespace and a runtime whose threads entered it.
    pub node: Option<(String, Handle)>,
}

impl Place {
    pub fn loopback() -> Self {
        Self {
            ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            node: None,
        }
    }
}

/// The `kvmesh-proxy` binary beside this test's own, brought up to date.
pub fn proxy_bin() -> PathBuf {
    kvmesh_tests::simproc::workspace_bin("kvmesh-proxy", "kvmesh-proxy")
}

/// What a pod's engine does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Both,
    Prefill,
    Decode,
}

impl Role {
    fn arg(self) -> &'static str {
        match self {
            Self::Both => "both",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

/// The ports of one pod, fixed for the run.
#[derive(Debug, Clone)]
pub struct Ports {
    pub engine: u16,
    pub kv: u16,
    pub replay: u16,
    pub client: u16,
    pub admin: u16,
    pub mesh: u16,
}

impl Ports {
    fn from(p: &[u16]) -> Self {
        Self {
            engine: p[0],
            kv: p[1],
            replay: p[2],
            client: p[3],
            admin: p[4],
            mesh: p[5],
        }
    }
}

/// One pod: its engine process, a KV-event relay that can drop batches, and
/// its sidecar process.
pub struct Pod {
    pub name: String,
    pub role: Role,
    pub ports: Ports,
    pub place: Place,
    engine: Option<Child>,
    sidecar: Option<Child>,
    engine_id: String,
    config: PathBuf,
    log: PathBuf,
    sim_bin: PathBuf,
    proxy_bin: PathBuf,
    /// KV-event batches the relay still has to drop.
    pub drop_batches: Arc<AtomicUsize>,
    /// Batches the relay dropped.
    pub dropped: Arc<AtomicUsize>,
    relay: Option<JoinHandle<()>>,
    /// The Valkey URLs of `index.backend: valkey`; `None`: the mesh.
    pub valkey: Option<Vec<String>>,
}

impl Pod {
    pub fn client_addr(&self) -> SocketAddr {
        SocketAddr::new(self.place.ip, self.ports.client)
    }

    pub fn admin_addr(&self) -> SocketAddr {
        SocketAddr::new(self.place.ip, self.ports.admin)
    }

    pub fn engine_addr(&self) -> SocketAddr {
        SocketAddr::new(self.place.ip, self.ports.engine)
    }

    /// The pod's id in every sidecar's `/debug/fleet` (its client address).
    pub fn id(&self) -> String {
        self.client_addr().to_string()
    }

    /// A command for `bin`, run in the pod's namespace.
    fn command(&self, bin: &Path) -> Command {
        match &self.place.node {
            Some((ns, _)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(bin);
                c
            }
            None => Command::new(bin),
        }
    }

    /// One HTTP call from the pod's namespace (`None`: no answer in 3 s).
    async fn call(
        &self,
        addr: SocketAddr,
        method: &'static str,
        path: &str,
        body: Option<Value>,
    ) -> Option<(u16, Bytes)> {
        let fut = raw(addr, method, path.to_owned(), body);
        match &self.place.node {
            Some((_, net)) => net.spawn(fut).await.ok().flatten(),
            None => fut.await,
        }
    }

    async fn get_json(&self, addr: SocketAddr, path: &str) -> Option<Value> {
        let (status, body) = self.call(addr, "GET", path, None).await?;
        (status == 200).then(|| serde_json::from_slice(&body).ok())?
    }

    async fn get_text(&self, addr: SocketAddr, path: &str) -> Option<String> {
        let (status, body) = self.call(addr, "GET", path, None).await?;
        (status == 200).then(|| String::from_utf8_lossy(&body).into_owned())
    }

    /// Starts the engine (again) on its ports and waits until it answers
    /// with its engine id. Retries while a port is still held by the
    /// process it replaces.
    pub async fn start_engine(&mut self) {
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            let mut cmd = self.command(&self.sim_bin);
            cmd.args([
                "--model",
                MODEL,
                "--time-scale",
                TIME_SCALE,
                "--max-num-seqs",
                "64",
                "--role",
                self.role.arg(),
                "--engine-id",
                &self.engine_id,
                "--listen",
                &self.engine_addr().to_string(),
                "--kv-events-endpoint",
                &format!("tcp://*:{}", self.ports.kv),
                "--kv-events-replay",
                &format!("tcp://*:{}", self.ports.replay),
                "--kv-events-topic",
                &format!("kv@{}@{MODEL}", self.name),
            ])
            // A decode that never fetches frees its blocks after 10 simulated
            // seconds (2 s real), as vLLM's NIXL abort timeout does in 480.
            .args(["--pd-hold-timeout-s", "10"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
            let mut child = cmd.spawn().expect("the simulator starts");
            if self.wait_engine(&mut child, deadline).await {
                self.engine = Some(child);
                return;
            }
            let _ = child.kill().await;
            assert!(
                Instant::now() < deadline,
                "engine of {} not ready within {READY_WITHIN:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn wait_engine(&self, child: &mut Child, deadline: Instant) -> bool {
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return false;
            }
            if let Some(v) = self.get_json(self.engine_addr(), "/sim/stats").await {
                if v["engine_id"].as_str() == Some(self.engine_id.as_str()) {
                    return true;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// SIGKILL the engine (an OOM kill); returns the requests in flight on
    /// it, bounded from above: the engine is frozen first (SIGSTOP: from then
    /// on no request gets a response head from it, so any request reaching
    /// it later fails before its head and goes to a fallback), then its
    /// sidecar's in-flight gauge is read (every request to this engine passes
    /// through that sidecar; the gauge also counts requests it forwarded
    /// elsewhere, so it is an upper bound), then the kill.
    pub async fn kill_engine_counting(&mut self) -> u64 {
        // Mid-stream: wait (bounded) until the engine runs something.
        for _ in 0..250 {
            if self.engine_in_flight().await.unwrap_or(0) > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if let Some(pid) = self.engine.as_ref().and_then(Child::id) {
            let _ = std::process::Command::new("kill")
                .args(["-STOP", &pid.to_string()])
                .status();
        }
        let in_flight = self.metric_sum("kvmesh_requests_in_flight").await as u64;
        self.kill_engine().await;
        in_flight
    }

    /// SIGTERM the engine (what Kubernetes sends its container in a rolling
    /// restart) and wait until it exits (bounded).
    pub async fn term_engine(&mut self) {
        let Some(mut c) = self.engine.take() else {
            return;
        };
        if let Some(pid) = c.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        if tokio::time::timeout(Duration::from_secs(10), c.wait())
            .await
            .is_err()
        {
            let _ = c.kill().await;
        }
    }

    /// SIGKILL the engine.
    pub async fn kill_engine(&mut self) {
        if let Some(mut c) = self.engine.take() {
            let _ = c.kill().await;
        }
    }

    /// Starts the sidecar (again) and waits until it is ready.
    pub async fn start_sidecar(&mut self) {
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.log)
                .expect("sidecar log");
            let mut child = self
                .command(&self.proxy_bin)
                .args(["--config"])
                .arg(&self.config)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::from(log))
                .kill_on_drop(true)
                .spawn()
                .expect("the sidecar starts");
            let mut up = false;
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                let ready = self.call(self.admin_addr(), "GET", "/ready", None).await;
                if ready.map(|r| r.0) == Some(200) {
                    up = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if up {
                self.sidecar = Some(child);
                return;
            }
            let _ = child.kill().await;
            assert!(
                Instant::now() < deadline,
                "sidecar of {} not ready within {READY_WITHIN:?}; its log ends:\n{}",
                self.name,
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The access lines of every run of this pod's sidecar (its log keeps
    /// them across restarts): `(request id, migrations, migrated tokens)`
    /// of each line that says the stream migrated.
    pub fn migrations(&self) -> Vec<(String, u64, u64)> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines()
            .filter(|l| l.starts_with('{'))
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter_map(|v| {
                let n = v["migrations"].as_u64().filter(|n| *n > 0)?;
                let id = v["request_id"].as_str()?.to_owned();
                Some((id, n, v["migrated_tokens"].as_u64().unwrap_or(0)))
            })
            .collect()
    }

    /// The last lines of the sidecar's log, its access lines left out.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('{')).collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// SIGKILL the sidecar.
    pub async fn kill_sidecar(&mut self) {
        if let Some(mut c) = self.sidecar.take() {
            let _ = c.kill().await;
        }
    }

    /// SIGTERM the sidecar (what Kubernetes sends) and wait until it exits
    /// (bounded by its drain deadline plus a margin).
    pub async fn term_sidecar(&mut self) {
        let Some(mut c) = self.sidecar.take() else {
            return;
        };
        if let Some(pid) = c.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        let exited = tokio::time::timeout(Duration::from_secs(30), c.wait()).await;
        assert!(
            exited.is_ok(),
            "sidecar of {} did not exit within 30 s of SIGTERM",
            self.name
        );
    }

    /// The engine's running + waiting requests (`None`: it did not answer).
    pub async fn engine_in_flight(&self) -> Option<u64> {
        let v = self.get_json(self.engine_addr(), "/sim/stats").await?;
        Some(v["running"].as_u64()? + v["waiting"].as_u64()?)
    }

    /// Transfers a prefill engine still holds for a decode.
    pub async fn held_transfers(&self) -> Option<u64> {
        self.get_json(self.engine_addr(), "/sim/stats").await?["held_transfers"].as_u64()
    }

    /// Sets the engine's fault script (`POST /sim/faults`).
    pub async fn faults(&self, script: Value) {
        let ok = self
            .call(
                self.engine_addr(),
                "POST",
                "/sim/faults",
                Some(script.clone()),
            )
            .await;
        assert_eq!(
            ok.map(|r| r.0),
            Some(200),
            "fault script {script} on {}",
            self.name
        );
    }

    /// The sidecar's in-flight gauges, by series.
    pub async fn in_flight_gauges(&self) -> Option<Vec<(String, f64)>> {
        let text = self.get_text(self.admin_addr(), "/metrics").await?;
        Some(
            text.lines()
                .filter(|l| !l.starts_with('#') && l.contains("in_flight"))
                .filter_map(|l| {
                    let (name, v) = l.rsplit_once(' ')?;
                    Some((name.to_owned(), v.parse().ok()?))
                })
                .collect(),
        )
    }

    /// One counter or gauge from the sidecar's `/metrics` (summed over
    /// series whose name starts with `prefix`).
    pub async fn metric_sum(&self, prefix: &str) -> f64 {
        let Some(text) = self.get_text(self.admin_addr(), "/metrics").await else {
            return 0.0;
        };
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum()
    }

    /// The sidecar's `/debug/fleet`.
    pub async fn fleet_json(&self) -> Option<Value> {
        self.get_json(self.admin_addr(), "/debug/fleet").await
    }

    /// The pods this sidecar knows, as `(id, healthy)`, sorted.
    pub async fn fleet_view(&self) -> Option<Vec<(String, bool)>> {
        let v = self.fleet_json().await?;
        let mut pods: Vec<(String, bool)> = v["pods"]
            .as_array()?
            .iter()
            .filter_map(|p| {
                Some((
                    p["info"]["id"].as_str()?.to_owned(),
                    p["healthy"].as_bool()?,
                ))
            })
            .collect();
        pods.sort();
        Some(pods)
    }
}

/// The fleet: its pods and the peers file they follow.
pub struct Fleet {
    pub pods: Vec<Pod>,
    pub dir: tempfile::TempDir,
}

impl Fleet {
    /// Waits (bounded, 10 s) until every sidecar's in-flight gauges are back
    /// to 0; returns the series still above 0 (empty when all are).
    pub async fn in_flight_settled(&self) -> Vec<String> {
        let mut stuck = Vec::new();
        for _ in 0..200 {
            stuck.clear();
            for p in &self.pods {
                for (series, v) in p.in_flight_gauges().await.expect("metrics") {
                    if v != 0.0 {
                        stuck.push(format!("{}: {series} = {v}", p.name));
                    }
                }
            }
            if stuck.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stuck
    }

    /// Starts `roles.len()` pods, engines first, then sidecars meshed over a
    /// peers file listing every mesh port; waits until every sidecar sees
    /// every pod healthy.
    pub async fn start(roles: &[Role], sim_bin: PathBuf, proxy_bin: PathBuf) -> Self {
        let placed: Vec<_> = roles.iter().map(|r| (*r, Place::loopback())).collect();
        Self::start_placed(&placed, sim_bin, proxy_bin, None).await
    }

    /// [`Fleet::start`] with the sidecars' index on the Valkey at `urls`
    /// (`index.backend: valkey`) instead of the mesh.
    pub async fn start_on_valkey(
        roles: &[Role],
        sim_bin: PathBuf,
        proxy_bin: PathBuf,
        urls: Vec<String>,
    ) -> Self {
        let placed: Vec<_> = roles.iter().map(|r| (*r, Place::loopback())).collect();
        Self::start_placed(&placed, sim_bin, proxy_bin, Some(urls)).await
    }

    /// [`Fleet::start`] with each pod where its [`Place`] says. A pod on a
    /// node reads its engine's KV events directly (the relay that drops
    /// batches lives in the test's namespace, out of the node's reach).
    pub async fn start_placed(
        roles: &[(Role, Place)],
        sim_bin: PathBuf,
        proxy_bin: PathBuf,
        valkey: Option<Vec<String>>,
    ) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let peers = dir.path().join("peers");
        let mut pods = Vec::new();
        let ports = free_ports(6 * roles.len());
        for (i, (role, place)) in roles.iter().enumerate() {
            let name = format!("pod{i}");
            let ports = Ports::from(&ports[6 * i..6 * i + 6]);
            let config = dir.path().join(format!("{name}.yaml"));
            let log = dir.path().join(format!("{name}.log"));
            pods.push(Pod {
                name,
                role: *role,
                ports,
                place: place.clone(),
                engine: None,
                sidecar: None,
                engine_id: format!("chaos-engine-{i}"),
                config,
                log,
                sim_bin: sim_bin.clone(),
                proxy_bin: proxy_bin.clone(),
                drop_batches: Arc::new(AtomicUsize::new(0)),
                dropped: Arc::new(AtomicUsize::new(0)),
                relay: None,
                valkey: valkey.clone(),
            });
        }
        let text: String = pods
            .iter()
            .map(|p| format!("{}\n", SocketAddr::new(p.place.ip, p.ports.mesh)))
            .collect();
        std::fs::write(&peers, text).expect("peers file");
        for p in &mut pods {
            p.start_engine().await;
            let direct = format!("tcp://{}:{}", p.place.ip, p.ports.kv);
            let events = if p.place.node.is_some() {
                direct
            } else {
                // The sidecar reads KV events through a relay that can drop batches.
                let (relayed, task) =
                    relay(&direct, p.drop_batches.clone(), p.dropped.clone()).await;
                p.relay = Some(task);
                relayed
            };
            std::fs::write(&p.config, sidecar_yaml(p, &events, &peers)).expect("config");
        }
        for p in &mut pods {
            p.start_sidecar().await;
        }
        let fleet = Self { pods, dir };
        fleet.converged(Duration::from_secs(60)).await;
        fleet
    }

    /// The peers file.
    pub fn peers_file(&self) -> PathBuf {
        self.dir.path().join("peers")
    }

    /// Waits (bounded) until every sidecar answers `/debug/fleet` with the
    /// same pods, all of them, all healthy; returns how long that took.
    pub async fn converged(&self, within: Duration) -> Duration {
        if self.pods.first().is_some_and(|p| p.valkey.is_some()) {
            return self.registered(within).await;
        }
        let start = Instant::now();
        let want: Vec<(String, bool)> = {
            let mut v: Vec<_> = self.pods.iter().map(|p| (p.id(), true)).collect();
            v.sort();
            v
        };
        let mut last = Vec::new();
        while start.elapsed() < within {
            let mut views = Vec::new();
            for p in &self.pods {
                views.push(p.fleet_view().await);
            }
            if views.iter().all(|v| v.as_ref() == Some(&want)) {
                return start.elapsed();
            }
            last = views;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the mesh did not converge within {within:?}: want {want:?}, views {last:?}");
    }

    /// On Valkey: waits (bounded) until every sidecar has been seen connected
    /// with its pod registered and nothing left to write (its rewrite done,
    /// its changes flushed); returns how long that took. Each is judged on
    /// its own: under load a writer has a few changes pending most of the
    /// time, so all of them at zero in the same instant is chance.
    pub async fn registered(&self, within: Duration) -> Duration {
        let start = Instant::now();
        let mut caught_up = vec![false; self.pods.len()];
        let mut last = Vec::new();
        while start.elapsed() < within {
            let mut views = Vec::new();
            for (i, p) in self.pods.iter().enumerate() {
                let v = p.get_json(p.admin_addr(), "/debug/index").await;
                caught_up[i] |= v.as_ref().is_some_and(|v| {
                    v["up"] == true
                        && v["writer"]["registered"] == true
                        && v["writer"]["pending"] == 0
                        && v["writer"]["rewriting"] == 0
                });
                views.push(v);
            }
            if caught_up.iter().all(|&c| c) {
                return start.elapsed();
            }
            last = views;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the sidecars did not register in valkey within {within:?}: {last:?}");
    }

    /// Stops every process; with `KVMESH_CHAOS_LOGS=DIR`, keeps the
    /// sidecars' logs there (`RUST_LOG` reaches the sidecars).
    pub async fn shutdown(mut self) {
        if let Ok(dir) = std::env::var("KVMESH_CHAOS_LOGS") {
            let _ = std::fs::create_dir_all(&dir);
            for p in &self.pods {
                let _ = std::fs::copy(&p.log, Path::new(&dir).join(format!("{}.log", p.name)));
            }
        }
        for p in &mut self.pods {
            p.kill_sidecar().await;
            p.kill_engine().await;
            if let Some(t) = p.relay.take() {
                t.abort();
            }
        }
    }
}

fn sidecar_yaml(p: &Pod, kv_events: &str, peers: &Path) -> String {
    let role = p.role.arg();
    let ip = p.place.ip;
    let index = match &p.valkey {
        Some(urls) => format!(
            "index:
  backend: valkey
  valkey:
    urls: [{}]
    lease_interval: 100ms
    lease_ttl: 1s
    resync_jitter: 300ms
",
            urls.iter()
                .map(|u| format!("\"{u}\""))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        None => format!(
            "mesh:
  listen: {ip}:{mesh}
  file: {peers}
  refresh_interval: 100ms
  stale_after: 1s
  load_interval: 100ms
  connect_timeout: 1s
  reconnect_max: 300ms
",
            mesh = p.ports.mesh,
            peers = peers.display(),
        ),
    };
    format!(
        "listeners:
  client: {ip}:{client}
  admin: {ip}:{admin}
engine:
  url: http://{ip}:{engine}
  health_interval: 100ms
  metrics_interval: 100ms
  kv_events:
    endpoint: {kv_events}
    replay_endpoint: tcp://{ip}:{replay}
    topic: \"\"
    socket: connect
    replay_timeout: 1s
    reconnect_max: 300ms
timeouts:
  connect: 1s
  first_byte: 10s
  stream_idle: 5s
  overall: 15s
  shutdown_drain: 15s
logging:
  level: warn
  access_log: true
pod:
  role: {role}
  models: [{MODEL}]
prefix:
  tokenizer: builtin
  block_size: 16
{index}pd:
  min_uncached_tokens: 256
  prefill_timeout: 5s
",
        client = p.ports.client,
        admin = p.ports.admin,
        engine = p.ports.engine,
        replay = p.ports.replay,
    )
}

/// A PUB on `127.0.0.1:0` forwarding the engine's KV events, dropping the
/// next `drop` batches whenever a test sets it. The SUB side reconnects by
/// itself when the engine comes back.
async fn relay(
    events: &str,
    drop: Arc<AtomicUsize>,
    dropped: Arc<AtomicUsize>,
) -> (String, JoinHandle<()>) {
    let mut from = KvSubscriber::connect(events).await.expect("relay connects");
    let mut publ = PubSocket::new();
    let ep = publ
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("relay binds")
        .to_string();
    let task = tokio::spawn(async move {
        // Bounded: aborted when the fleet stops.
        for _ in 0..10_000_000u64 {
            let Some(m) = from.recv(Duration::from_secs(600)).await else {
                return;
            };
            let take = drop
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .is_ok();
            if take {
                dropped.fetch_add(1, Ordering::AcqRel);
                continue;
            }
            let frames = vec![
                m.topic,
                Bytes::copy_from_slice(&m.seq.to_be_bytes()),
                m.payload,
            ];
            if let Ok(msg) = ZmqMessage::try_from(frames) {
                let _ = publ.send(msg).await;
            }
        }
    });
    (ep, task)
}

async fn raw(
    addr: SocketAddr,
    method: &'static str,
    path: String,
    body: Option<Value>,
) -> Option<(u16, Bytes)> {
    use http_body_util::{BodyExt, Full};
    let client = kvmesh_tests::client::http1();
    let mut b = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    let body = match body {
        Some(v) => {
            b = b.header("content-type", "application/json");
            Bytes::from(v.to_string())
        }
        None => Bytes::new(),
    };
    let req = b.body(Full::new(body)).ok()?;
    let fut = async {
        let resp = client.request(req).await.ok()?;
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await.ok()?.to_bytes();
        Some((status, bytes))
    };
    tokio::time::timeout(Duration::from_secs(3), fut)
        .await
        .ok()?
}
