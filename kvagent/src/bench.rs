//! `kvmesh-kvagent bench`: the machine's ceilings (memcpy bandwidth of large buffers, raw TCP
//! loopback throughput between two processes) and, in the same run, kvagent's throughput over
//! TCP (between this process's agent and a child agent process) and over shared memory (same
//! node copy), for 16 KiB to 2 MiB blocks, as ratios to those ceilings.
//!
//! Also home of [`ChildAgent`], which starts the agent binary as a separate process and waits for
//! its ready line (used by the benchmark and the multi-process tests).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::client::LocalClient;
use crate::error::{Error, Result};
use crate::shm::Mapping;
use crate::transfer::SendArgs;
use crate::types::{BlockLayout, TransferId};

/// Block sizes measured.
pub const BLOCK_SIZES: [u64; 5] = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20];
/// Bytes per transfer (blocks per transfer = this / block size).
const TRANSFER_BYTES: u64 = 32 << 20;

/// An agent running as a child process; killed on drop.
#[derive(Debug)]
pub struct ChildAgent {
    child: Child,
    /// Its local API socket.
    pub socket: PathBuf,
    /// Its peer address.
    pub peer: String,
}

impl ChildAgent {
    /// Start `exe run` with its socket in `dir`, ports from the OS, and `extra` arguments; waits
    /// (up to 20 s) for its ready line.
    pub fn spawn(exe: &Path, dir: &Path, name: &str, extra: &[&str]) -> Result<Self> {
        let socket = dir.join(format!("{name}.sock"));
        let mut child = Command::new(exe)
            .args([
                "run",
                "--listen",
                "127.0.0.1:0",
                "--admin",
                "",
                "--ready-json",
                "--agent-id",
                name,
            ])
            .arg("--socket")
            .arg(&socket)
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| Error::Io(std::io::Error::other("no stdout")))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(l) => l,
            Err(_) => {
                let _ = child.kill();
                return Err(Error::Timeout("child agent did not report ready".into()));
            }
        };
        let v: serde_json::Value = serde_json::from_str(&line)
            .map_err(|e| Error::Protocol(format!("ready line {line:?}: {e}")))?;
        let peer = v["peer"].as_str().unwrap_or_default().to_string();
        Ok(Self {
            child,
            socket,
            peer,
        })
    }

    /// Kill the process now (SIGKILL) and reap it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildAgent {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One measured path and block size.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    /// `tcp` or `shm`.
    pub path: &'static str,
    /// Block size.
    pub block_bytes: u64,
    /// Measured bytes per second.
    pub throughput_bytes_per_s: f64,
    /// The ceiling for this path, measured in the same run.
    pub ceiling_bytes_per_s: f64,
    /// throughput / ceiling.
    pub ratio: f64,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// memcpy bandwidth of large buffers.
    pub memcpy_bytes_per_s: f64,
    /// Raw TCP loopback between two processes.
    pub tcp_loopback_bytes_per_s: f64,
    /// kvagent rows.
    pub results: Vec<BenchRow>,
}

/// The raw TCP sink process: bind loopback, print the port, count bytes until EOF, answer one byte.
pub fn sink() -> Result<()> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    println!("{}", l.local_addr()?.port());
    std::io::stdout().flush()?;
    let (mut s, _) = l.accept()?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut buf = vec![0u8; 1 << 20];
    while s.read(&mut buf)? > 0 {}
    s.write_all(b"k")?;
    Ok(())
}

fn memcpy_ceiling(total: u64) -> f64 {
    let len = 64 << 20;
    let src = vec![7u8; len];
    let mut dst = vec![0u8; len];
    dst.copy_from_slice(&src); // fault the pages in before timing
    let rounds = (total / len as u64).max(2);
    let t = Instant::now();
    for _ in 0..rounds {
        dst.copy_from_slice(std::hint::black_box(&src));
    }
    std::hint::black_box(&dst);
    (rounds * len as u64) as f64 / t.elapsed().as_secs_f64()
}

fn tcp_ceiling(exe: &Path, total: u64) -> Result<f64> {
    let mut child = Command::new(exe)
        .arg("bench-sink")
        .stdout(Stdio::piped())
        .spawn()?;
    let mut out = BufReader::new(
        child
            .stdout
            .take()
            .ok_or_else(|| Error::Io(std::io::Error::other("no stdout")))?,
    );
    let mut port = String::new();
    out.read_line(&mut port)?;
    let port: u16 = port
        .trim()
        .parse()
        .map_err(|_| Error::Protocol("sink port".into()))?;
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let buf = vec![1u8; 1 << 20];
    let t = Instant::now();
    let mut sent = 0u64;
    while sent < total {
        s.write_all(&buf)?;
        sent += buf.len() as u64;
    }
    s.shutdown(std::net::Shutdown::Write)?;
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack)?;
    let rate = sent as f64 / t.elapsed().as_secs_f64();
    let _ = child.wait();
    Ok(rate)
}

fn region(client: &mut LocalClient, name: &str, layout: BlockLayout) -> Result<(Mapping, u64)> {
    let len = layout.validate(u64::MAX)?;
    let map = Mapping::create(name, len)?;
    // Touch every page first: an engine's staging memory is warm, and page faults are not
    // what this measures.
    map.write(0, &vec![0x5a; len])?;
    let id = client.register(name, layout, map.fd())?;
    Ok((map, id))
}

/// Move `total` bytes in `block` blocks from `src` (through `sender`) to `peer`, collecting and
/// freeing on `receiver`; returns bytes per second.
fn measure(
    sender: &mut LocalClient,
    receiver: &mut LocalClient,
    peer: &str,
    block: u64,
    total: u64,
    tag: &str,
) -> Result<f64> {
    let blocks = (TRANSFER_BYTES / block) as u32;
    let layout = BlockLayout {
        block_bytes: block,
        layers: 1,
        blocks,
    };
    let (_src_map, src) = region(sender, &format!("{tag}-src-{block}"), layout)?;
    let (_dst_map, dst) = region(receiver, &format!("{tag}-dst-{block}"), layout)?;
    let ids: Vec<u32> = (0..blocks).collect();
    let rounds = (total / TRANSFER_BYTES).max(1);
    let deadline = Duration::from_secs(60);
    let mut t = Instant::now();
    // Round 0 is a warm-up (connections, first touches), not timed.
    for i in 0..=rounds {
        if i == 1 {
            t = Instant::now();
        }
        let tid = TransferId::new(format!("bench-{tag}-{block}-{i}"))?;
        let args = SendArgs {
            region: src,
            transfer: tid.clone(),
            blocks: ids.clone(),
            peer: peer.to_string(),
            dst_region: None,
        };
        sender.send(&args, deadline)?;
        let got = receiver.wait(Some(dst), &tid, deadline)?;
        receiver.free(got.region, &tid)?;
    }
    let rate = (rounds * TRANSFER_BYTES) as f64 / t.elapsed().as_secs_f64();
    sender.unregister(src)?;
    receiver.unregister(dst)?;
    Ok(rate)
}

/// Run the benchmark and print a table or JSON.
pub fn run(json: bool, total: u64) -> Result<()> {
    let exe = std::env::current_exe()?;
    let dir = tempdir()?;
    let report = (|| -> Result<BenchReport> {
        // Ceilings are the best of three trials: on a shared machine a single trial measures
        // the neighbours as much as the hardware.
        let memcpy = (0..3).map(|_| memcpy_ceiling(total)).fold(0.0, f64::max);
        let mut tcp: f64 = 0.0;
        for _ in 0..3 {
            tcp = tcp.max(tcp_ceiling(&exe, total.max(256 << 20))?);
        }
        let a = ChildAgent::spawn(&exe, &dir, "bench-a", &["--rdma", "off"])?;
        let b = ChildAgent::spawn(&exe, &dir, "bench-b", &["--rdma", "off"])?;
        let mut ca = LocalClient::connect(&a.socket, Duration::from_secs(60))?;
        let mut ca2 = LocalClient::connect(&a.socket, Duration::from_secs(60))?;
        let mut cb = LocalClient::connect(&b.socket, Duration::from_secs(60))?;
        let mut results = Vec::new();
        // kvagent's own figures are the best of three trials too, so that both
        // sides of each ratio are measured the same way.
        let best = |f: &mut dyn FnMut() -> Result<f64>| -> Result<f64> {
            let mut best: f64 = 0.0;
            for _ in 0..3 {
                best = best.max(f()?);
            }
            Ok(best)
        };
        for block in BLOCK_SIZES {
            let r = best(&mut || measure(&mut ca, &mut cb, &b.peer, block, total, "tcp"))?;
            results.push(BenchRow {
                path: "tcp",
                block_bytes: block,
                throughput_bytes_per_s: r,
                ceiling_bytes_per_s: tcp,
                ratio: r / tcp,
            });
            let r = best(&mut || measure(&mut ca, &mut ca2, "local", block, total, "shm"))?;
            results.push(BenchRow {
                path: "shm",
                block_bytes: block,
                throughput_bytes_per_s: r,
                ceiling_bytes_per_s: memcpy,
                ratio: r / memcpy,
            });
        }
        Ok(BenchReport {
            memcpy_bytes_per_s: memcpy,
            tcp_loopback_bytes_per_s: tcp,
            results,
        })
    })();
    let _ = std::fs::remove_dir_all(&dir);
    let report = report?;
    let mut out = std::io::stdout().lock();
    if json {
        let s =
            serde_json::to_string_pretty(&report).map_err(|e| Error::Protocol(e.to_string()))?;
        writeln!(out, "{s}")?;
    } else {
        let gb = |v: f64| v / 1e9;
        writeln!(
            out,
            "memcpy ceiling       {:8.2} GB/s",
            gb(report.memcpy_bytes_per_s)
        )?;
        writeln!(
            out,
            "tcp loopback ceiling {:8.2} GB/s",
            gb(report.tcp_loopback_bytes_per_s)
        )?;
        writeln!(
            out,
            "{:<5} {:>10} {:>12} {:>12} {:>7}",
            "path", "block", "GB/s", "ceiling", "ratio"
        )?;
        for r in &report.results {
            writeln!(
                out,
                "{:<5} {:>10} {:>12.2} {:>12.2} {:>7.2}",
                r.path,
                r.block_bytes,
                gb(r.throughput_bytes_per_s),
                gb(r.ceiling_bytes_per_s),
                r.ratio
            )?;
        }
    }
    Ok(())
}

fn tempdir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("kvagent-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
