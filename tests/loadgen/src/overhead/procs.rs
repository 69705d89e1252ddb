//! Child processes of the overhead bench (kvmesh-proxy, nginx): ports from
//! the OS, readiness waits with deadlines, CPU time read from `/proc` (the
//! scheduler's on-CPU time of each thread), and a stop that never leaves a
//! process behind.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

use crate::client::Client;
use crate::error::LoadgenError;

/// Linux reports `/proc/PID/stat` times in USER_HZ ticks, 100 per second on
/// every architecture Linux exports to user space.
const USER_HZ: f64 = 100.0;

/// A free loopback port: bound on port 0, read back, released. (The child
/// binds it right after; on a quiet loopback nothing takes it in between.)
pub fn free_port() -> Result<u16, LoadgenError> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|source| LoadgenError::Net {
        what: "bind 127.0.0.1:0".into(),
        source,
    })?;
    let port = l.local_addr().map_err(|source| LoadgenError::Net {
        what: "local address".into(),
        source,
    })?;
    Ok(port.port())
}

/// A spawned child that is stopped (TERM, then KILL) when dropped.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    child: Child,
    pid: u32,
}

impl Proc {
    /// Spawns `cmd` with stdout and stderr appended to `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> Result<Proc, LoadgenError> {
        let open = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .map_err(|source| LoadgenError::Io {
                    path: log.to_path_buf(),
                    source,
                })
        };
        cmd.stdin(Stdio::null())
            .stdout(open()?)
            .stderr(open()?)
            .kill_on_drop(true);
        let child = cmd.spawn().map_err(|e| LoadgenError::Child {
            name: name.to_string(),
            reason: format!("spawn: {e}"),
        })?;
        let pid = child.id().ok_or_else(|| LoadgenError::Child {
            name: name.to_string(),
            reason: "exited at once".into(),
        })?;
        Ok(Proc {
            name: name.to_string(),
            child,
            pid,
        })
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Waits until `url` answers `200` (polling every 50 ms), failing when
    /// the child exits or `deadline` passes.
    pub async fn wait_ready(
        &mut self,
        client: &Client,
        url: &str,
        deadline: Duration,
    ) -> Result<(), LoadgenError> {
        let fail = |reason: String| LoadgenError::Child {
            name: self.name.clone(),
            reason,
        };
        let uri: http::Uri = url
            .parse()
            .map_err(|_| fail(format!("bad readiness URL {url}")))?;
        let end = Instant::now() + deadline;
        while Instant::now() < end {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(fail(format!("exited with {status} before it was ready")));
            }
            if client
                .get_status(uri.clone(), Duration::from_millis(500))
                .await
                == Some(200)
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(fail(format!("{url} not ready within {deadline:?}")))
    }

    /// CPU seconds used so far by the child and its direct children (nginx's
    /// workers).
    pub fn cpu_seconds(&self) -> Result<f64, LoadgenError> {
        let mut total = cpu_of(self.pid)?;
        for pid in children_of(self.pid) {
            // A worker that exited in between simply no longer counts.
            total += cpu_of(pid).unwrap_or(0.0);
        }
        Ok(total)
    }

    /// SIGTERM, up to 5 s to exit, then SIGKILL.
    pub async fn stop(mut self) {
        signal(self.pid, "TERM");
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Only a child not yet reaped: a reaped pid may belong to another
        // process by now. (`kill_on_drop` then SIGKILLs it as well.)
        if matches!(self.child.try_wait(), Ok(None)) {
            signal(self.pid, "TERM");
        }
    }
}

/// Sends a signal with the `kill` utility (no unsafe code for one syscall).
fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Fields of `/proc/PID/stat` after the `(comm)` field, which may hold spaces.
fn stat_fields(pid: u32) -> Result<Vec<String>, LoadgenError> {
    let path = PathBuf::from(format!("/proc/{pid}/stat"));
    let text =
        std::fs::read_to_string(&path).map_err(|source| LoadgenError::Io { path, source })?;
    let rest = text.rsplit_once(')').map_or("", |(_, r)| r);
    Ok(rest.split_whitespace().map(str::to_string).collect())
}

/// CPU seconds of one process: the scheduler's on-CPU time of each of its
/// threads (`/proc/PID/task/TID/schedstat`, nanoseconds), or, on a kernel
/// without schedstat, utime + stime from `/proc/PID/stat`.
///
/// The ticks of `stat` are 10 ms: a closed-loop leg of a few tenths of a
/// second reads 10 to 30 of them, so one tick more or less moved a figure by
/// 3 to 10%. Schedstat counts what ran, to the nanosecond. A thread that exits
/// takes its time with it; the proxy's threads and nginx's workers live
/// through a run.
pub fn cpu_of(pid: u32) -> Result<f64, LoadgenError> {
    match on_cpu_ns(pid) {
        Some(ns) => Ok(ns as f64 / 1e9),
        None => ticks_of(pid),
    }
}

/// Sum of the first field of every thread's schedstat; `None` when the
/// kernel has none.
fn on_cpu_ns(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0u64;
    let mut any = false;
    for task in tasks.flatten() {
        // A thread that exited in between no longer counts.
        let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        let Some(ns) = text
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
        else {
            continue;
        };
        total += ns;
        any = true;
    }
    // A kernel without schedstat accounting prints zeros rather than no file.
    (any && total > 0).then_some(total)
}

/// utime + stime of one process, seconds. Field 3 (state) is index 0 here,
/// so ppid (4) is 1, utime (14) is 11 and stime (15) is 12.
fn ticks_of(pid: u32) -> Result<f64, LoadgenError> {
    let f = stat_fields(pid)?;
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    Ok((tick(11) + tick(12)) as f64 / USER_HZ)
}

fn children_of(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            stat_fields(pid)
                .ok()
                .and_then(|f| f.get(1).and_then(|p| p.parse::<u32>().ok()))
                == Some(parent)
        })
        .collect()
}

/// Whether this process runs as root (nginx's workers then need `user root`
/// to read the bench's private temp directory).
pub fn running_as_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// Finds an executable: `given`, else `name` on `PATH`, else in `extra` dirs.
pub fn find_binary(given: Option<&Path>, name: &str, extra: &[&Path]) -> Option<PathBuf> {
    if let Some(p) = given {
        return p.is_file().then(|| p.to_path_buf());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(extra.iter().map(|p| p.to_path_buf()))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// The nginx configuration: a plain reverse proxy on loopback with a
/// keepalive upstream, nothing logged per request, bodies buffered in memory
/// (up to 1 MiB), responses streamed (`proxy_buffering off`).
pub fn nginx_conf(dir: &Path, listen: u16, upstream: u16, workers: usize) -> String {
    let d = dir.display();
    let user = if running_as_root() {
        "user root;\n"
    } else {
        ""
    };
    format!(
        "{user}worker_processes {workers};
pid {d}/nginx.pid;
error_log {d}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    client_max_body_size 64m;
    client_body_buffer_size 1m;
    tcp_nodelay on;
    keepalive_requests 1000000;
    upstream engine {{
        server 127.0.0.1:{upstream};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{listen};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The on-CPU reading of a busy single-threaded process, as the bench
    /// reads the proxy: finer than a tick, and in step with the ticks.
    #[test]
    fn cpu_time_counts_what_a_process_ran_and_agrees_with_the_ticks() {
        let mut busy = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .unwrap();
        let pid = busy.id();
        let (before, ticks_before) = (cpu_of(pid).unwrap(), ticks_of(pid).unwrap());
        std::thread::sleep(Duration::from_millis(300));
        let (after, ticks_after) = (cpu_of(pid).unwrap(), ticks_of(pid).unwrap());
        let schedstat = on_cpu_ns(pid).is_some();
        busy.kill().unwrap();
        busy.wait().unwrap();
        let (ran, ticked) = (after - before, ticks_after - ticks_before);
        // On a shared machine it waits for a core at times: some of the 300 ms ran.
        assert!(ran > 0.01, "ran {ran} s");
        if schedstat {
            // One thread, sampled at each 10 ms tick: the clocks agree to a few ticks.
            assert!(
                (ran - ticked).abs() < 0.05,
                "schedstat {ran} s, ticks {ticked} s"
            );
        }
    }
}
