//! Starting and stopping real vLLM servers on loopback.
//!
//! Each engine runs `vllm serve` (through the venv's `kvmesh-vllm` launcher) in its own process group,
//! with every cache and temporary file inside the group's work directory, bound to one CPU core. Start
//! waits for `/health` with a deadline while watching that the process is still alive, and a failure
//! shows the tail of the engine's log. Dropping an [`Engine`] (also while a test panics) stops the whole
//! process group: SIGTERM, a grace period, then SIGKILL. Should the test process itself be killed, the
//! launcher sees its stdin close and takes the group down, so no engine outlives the suite.

use std::fs::File;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::json;

use super::setup::Venv;
use super::{consecutive_ports, free_port, model_dir, BLOCK_SIZE, MODEL};

/// How long one engine may take to answer `/health`: 23-40 s alone on an idle core, but two engines
/// starting together on 2 cores took 66-94 s in quiet CI runs, 186 s at a load average of 5, and
/// more than 300 s once beside a debug build and the demo. Only an engine that never starts waits
/// this long. `KVMESH_VLLM_START_TIMEOUT` (seconds) sets another value.
const HEALTH_DEADLINE: Duration = Duration::from_secs(600);

fn health_deadline() -> Duration {
    std::env::var("KVMESH_VLLM_START_TIMEOUT")
        .ok()
        .and_then(|s| s.parse().ok())
        .map(Duration::from_secs)
        .unwrap_or(HEALTH_DEADLINE)
}
/// Waits for this process's turn to start engines and returns the held lock (released on drop).
///
/// The groups (tests) run in parallel, and three vLLM engines starting at once on 2 cores made an
/// engine core fail to initialize (then abort at shutdown); two starting together is what the
/// deadline above was measured with. The lock is a file lock, so it also orders test binaries run
/// side by side.
fn start_turn() -> Result<std::fs::File> {
    let path = std::env::temp_dir().join("kvmesh-vllm-start.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    file.lock()
        .with_context(|| format!("locking {}", path.display()))?;
    Ok(file)
}

/// How long a stopped engine gets to exit on SIGTERM before the group is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// The P/D role of an engine with vLLM's `NixlConnector`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvRole {
    Producer,
    Consumer,
    Both,
}

impl KvRole {
    fn as_vllm(self) -> &'static str {
        match self {
            KvRole::Producer => "kv_producer",
            KvRole::Consumer => "kv_consumer",
            KvRole::Both => "kv_both",
        }
    }
}

/// What one engine needs: the flags that differ between cases.
#[derive(Debug, Clone)]
pub struct EngineSpec {
    /// Short name, used for the log file and in messages.
    pub name: &'static str,
    /// The CPU core the engine's OpenMP threads are bound to (with data parallelism, rank r's
    /// threads to core `cpu + r`).
    pub cpu: u32,
    /// `--data-parallel-size` (1: none): that many engine ranks behind one port, each publishing its
    /// KV events on the endpoints' port + rank, as vLLM offsets them.
    pub data_parallel: u32,
    /// Size of the KV cache in bytes (tiny-llama: 65,536 bytes per 32-token block).
    pub kv_cache_bytes: u64,
    /// `--max-num-seqs`.
    pub max_num_seqs: u32,
    /// `--prefix-caching-hash-algo sha256_cbor`: the hashes a router can recompute exactly.
    pub sha256_cbor: bool,
    /// `PYTHONHASHSEED` for the engine (the root of vLLM's block-hash chain when set).
    pub python_hash_seed: Option<String>,
    /// KV events published to a subscriber that has bound this endpoint (`tcp://127.0.0.1:PORT`);
    /// vLLM connects to it. A replay ROUTER is bound on a fresh port as well.
    pub kv_events_to: Option<String>,
    /// P/D with `NixlConnector` over UCX TCP on loopback.
    pub nixl: Option<KvRole>,
    /// Any other `--kv-transfer-config` (a JSON object, e.g. an external connector loaded with
    /// `kv_connector_module_path`) plus the environment it needs. Exclusive with `nixl`.
    pub kv_transfer: Option<(serde_json::Value, Vec<(String, String)>)>,
    /// More `vllm serve` arguments (e.g. `--chat-template PATH`).
    pub extra_args: Vec<String>,
    /// More environment for the engine (e.g. `VLLM_ALLOW_RUNTIME_LORA_UPDATING`).
    pub env: Vec<(String, String)>,
}

impl EngineSpec {
    /// One engine with prefix caching, block size 32 and a 40-block KV cache, on `cpu`.
    pub fn new(name: &'static str, cpu: u32) -> Self {
        EngineSpec {
            name,
            cpu,
            data_parallel: 1,
            kv_cache_bytes: 40 * 65_536,
            max_num_seqs: 4,
            sha256_cbor: false,
            python_hash_seed: None,
            kv_events_to: None,
            nixl: None,
            kv_transfer: None,
            extra_args: Vec::new(),
            env: Vec::new(),
        }
    }
}

/// A running vLLM server. Dropping it stops the whole process group.
#[derive(Debug)]
pub struct Engine {
    pub name: &'static str,
    /// `http://127.0.0.1:PORT`.
    pub base_url: String,
    pub port: u16,
    /// The replay ROUTER endpoint, when KV events are on.
    pub replay_endpoint: Option<String>,
    /// The topic the engine publishes KV events under.
    pub topic: String,
    /// The NIXL side-channel port, when P/D is on.
    pub nixl_port: Option<u16>,
    pub log: PathBuf,
    child: Child,
    /// Held open so the launcher can tell the test process is gone (EOF) and stop the engine.
    _stdin: Option<ChildStdin>,
    stopped: bool,
}

impl Engine {
    /// Starts every engine of one group at once (their start-ups overlap) and waits until all are
    /// healthy. Groups take turns: the start holds a machine-wide lock ([`start_turn`]). On any
    /// failure the engines already started are stopped before the error returns.
    pub fn start_all(venv: &Venv, work: &Path, specs: &[EngineSpec]) -> Result<Vec<Engine>> {
        let _turn = start_turn()?;
        let mut pending = Vec::with_capacity(specs.len());
        for spec in specs {
            pending.push((spec, Engine::spawn(venv, work, spec)?));
        }
        let mut ready = Vec::with_capacity(specs.len());
        for (spec, engine) in pending {
            match engine.wait_healthy() {
                Ok(engine) => ready.push(engine),
                Err(StartError::Failed(why)) => return Err(anyhow::anyhow!(why)),
                Err(again) => {
                    // Another process took a port between our probe and vLLM's bind, or vLLM
                    // died while starting (its own start-up, not what the group tests; its
                    // log's tail goes to the report): once more on fresh ports. Twice in a row
                    // fails the group.
                    super::report::note(&format!("{}: {}, retrying once", spec.name, again.why()));
                    let engine = Engine::spawn(venv, work, spec)?;
                    ready.push(engine.wait_healthy().map_err(StartError::into_anyhow)?);
                }
            }
        }
        Ok(ready)
    }

    fn spawn(venv: &Venv, work: &Path, spec: &EngineSpec) -> Result<Engine> {
        let port = free_port()?;
        let dir = work.join(spec.name);
        for sub in ["cache/vllm", "cache/inductor", "cache/hf", "tmp"] {
            std::fs::create_dir_all(dir.join(sub))
                .with_context(|| format!("creating {}", dir.display()))?;
        }
        let log = work.join(format!("{}-{port}.log", spec.name));
        let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let topic = format!("kv@127.0.0.1:{port}@{MODEL}");

        let mut cmd = Command::new(&venv.python);
        cmd.arg(&venv.launcher)
            .arg("serve")
            .arg(model_dir())
            .args([
                "--served-model-name",
                MODEL,
                "--host",
                "127.0.0.1",
                "--port",
            ])
            .arg(port.to_string())
            .args([
                "--enable-prefix-caching",
                "--enforce-eager",
                "--dtype",
                "float32",
            ])
            .args([
                "--block-size",
                &BLOCK_SIZE.to_string(),
                "--max-model-len",
                "1024",
            ])
            .args(["--kv-cache-memory-bytes", &spec.kv_cache_bytes.to_string()])
            .args(["--max-num-seqs", &spec.max_num_seqs.to_string()])
            .arg("--enable-prompt-tokens-details");
        if spec.sha256_cbor {
            cmd.args(["--prefix-caching-hash-algo", "sha256_cbor"]);
        }
        let mut replay_endpoint = None;
        if let Some(endpoint) = &spec.kv_events_to {
            let replay = format!("tcp://127.0.0.1:{}", ports(spec.data_parallel)?);
            let config = json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": endpoint,
                "replay_endpoint": replay,
                "topic": topic,
            });
            cmd.arg("--kv-events-config").arg(config.to_string());
            replay_endpoint = Some(replay);
        }
        let mut nixl_port = None;
        if let Some(role) = spec.nixl {
            let config = json!({
                "kv_connector": "NixlConnector",
                "kv_role": role.as_vllm(),
                "kv_buffer_device": "cpu",
            });
            cmd.arg("--kv-transfer-config").arg(config.to_string());
            let side = free_port()?;
            cmd.env("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
                .env("VLLM_NIXL_SIDE_CHANNEL_PORT", side.to_string())
                // Shared-memory UCX transports fail here; TCP on loopback works.
                .env("UCX_TLS", "tcp,self")
                .env("UCX_NET_DEVICES", "lo");
            nixl_port = Some(side);
        }
        if let Some((config, env)) = &spec.kv_transfer {
            cmd.arg("--kv-transfer-config").arg(config.to_string());
            cmd.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        }
        cmd.args(&spec.extra_args);
        cmd.envs(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        if spec.data_parallel > 1 {
            cmd.args(["--data-parallel-size", &spec.data_parallel.to_string()]);
        }
        // One core per rank: `VLLM_CPU_OMP_THREADS_BIND` takes rank 0's cores|rank 1's|...
        let cores: Vec<String> = (0..spec.data_parallel.max(1))
            .map(|r| (spec.cpu + r).to_string())
            .collect();
        match &spec.python_hash_seed {
            Some(seed) => cmd.env("PYTHONHASHSEED", seed),
            None => cmd.env_remove("PYTHONHASHSEED"),
        };
        cmd.env("VLLM_TARGET_DEVICE", "cpu")
            // Without it vLLM's internal queues bind a non-loopback address.
            .env("VLLM_HOST_IP", "127.0.0.1")
            .env("VLLM_CPU_OMP_THREADS_BIND", cores.join("|"))
            // `POST /reset_prefix_cache` is a dev-mode endpoint.
            .env("VLLM_SERVER_DEV_MODE", "1")
            .env("VLLM_CACHE_ROOT", dir.join("cache/vllm"))
            .env("XDG_CACHE_HOME", dir.join("cache"))
            .env("HF_HOME", dir.join("cache/hf"))
            .env("TORCHINDUCTOR_CACHE_DIR", dir.join("cache/inductor"))
            .env("TRITON_CACHE_DIR", dir.join("cache/triton"))
            .env("TMPDIR", dir.join("tmp"))
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("DO_NOT_TRACK", "1")
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .env("KVMESH_EXIT_ON_STDIN_EOF", "1")
            .current_dir(&dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting vLLM ({})", venv.launcher.display()))?;
        let stdin = child.stdin.take();
        Ok(Engine {
            name: spec.name,
            base_url: format!("http://127.0.0.1:{port}"),
            port,
            replay_endpoint,
            topic,
            nixl_port,
            log,
            child,
            _stdin: stdin,
            stopped: false,
        })
    }

    fn wait_healthy(mut self) -> std::result::Result<Engine, StartError> {
        let limit = health_deadline();
        let deadline = Instant::now() + limit;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    let tail = log_tail(&self.log, 60);
                    if tail.contains("Address already in use") {
                        return Err(StartError::PortTaken(self.base_url.clone()));
                    }
                    return Err(StartError::Exited(format!(
                        "vLLM {} exited during start-up ({status}); last lines of {}:\n{tail}",
                        self.name,
                        self.log.display()
                    )));
                }
                Ok(None) => {}
                Err(e) => {
                    return Err(StartError::Failed(format!(
                        "waiting for vLLM {}: {e}",
                        self.name
                    )))
                }
            }
            if health_ok(self.port) {
                return Ok(self);
            }
            if Instant::now() >= deadline {
                let tail = log_tail(&self.log, 60);
                return Err(StartError::Failed(format!(
                    "vLLM {} not healthy after {} s; last lines of {}:\n{tail}",
                    self.name,
                    limit.as_secs(),
                    self.log.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Whether the engine's main process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The last `lines` lines of the engine's log, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log, lines)
    }

    /// Kills the engine at once (SIGKILL to its group), as a crash would.
    pub fn kill(&mut self) {
        signal_group(self.child.id(), "KILL");
        let _ = self.child.wait();
        self.stopped = true;
    }

    /// Stops the engine: SIGTERM to its group, a grace period, then SIGKILL for whatever is left.
    pub fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let pid = self.child.id();
        signal_group(pid, "TERM");
        let deadline = Instant::now() + STOP_GRACE;
        // Poll without reaping the leader: while it is a zombie its process-group id cannot be reused,
        // so the final SIGKILL reaches only what is left of this engine (its engine-core children).
        while Instant::now() < deadline && !is_zombie_or_gone(pid) {
            std::thread::sleep(Duration::from_millis(100));
        }
        signal_group(pid, "KILL");
        let _ = self.child.wait();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The first of `n` consecutive free ports (one per data-parallel rank), or one free port.
fn ports(n: u32) -> Result<u16> {
    if n > 1 {
        consecutive_ports(n)
    } else {
        Ok(free_port()?)
    }
}

enum StartError {
    PortTaken(String),
    /// The process ended before it was healthy.
    Exited(String),
    Failed(String),
}

impl StartError {
    /// What went wrong, for the report.
    fn why(&self) -> String {
        match self {
            StartError::PortTaken(url) => format!("port taken ({url})"),
            StartError::Exited(msg) => format!("exited during start-up: {msg}"),
            StartError::Failed(msg) => msg.clone(),
        }
    }

    fn into_anyhow(self) -> anyhow::Error {
        match self {
            StartError::PortTaken(url) => {
                anyhow::anyhow!("vLLM could not bind {url} twice in a row")
            }
            StartError::Exited(msg) | StartError::Failed(msg) => anyhow::anyhow!(msg),
        }
    }
}

/// `GET /health` answered 200, within a short deadline.
fn health_ok(port: u16) -> bool {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
    let req =
        format!("GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    if stream.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.1 200")
}

/// Sends `SIGsig` to the process group `pgid` (the engine's main process leads its own group).
fn signal_group(pgid: u32, sig: &str) {
    // `kill` from procps, so this needs no libc binding; errors (the group is gone) are expected.
    let _ = Command::new("kill")
        .args([format!("-{sig}"), "--".into(), format!("-{pgid}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

fn is_zombie_or_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses and may contain spaces.
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.trim_start().starts_with('Z'))
            .unwrap_or(true),
        Err(_) => true,
    }
}

fn log_tail(log: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
