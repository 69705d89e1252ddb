//! A KV-events tap: a ZMQ SUB socket bound on loopback that vLLM connects to, whose raw frames are
//! decoded in Rust with `kvmesh_filters::prefix::kvevents`.
//!
//! The socket itself is pyzmq from the vLLM venv (the same libzmq vLLM publishes with), run as a small
//! child process that prints every multipart message as one line of hex frames; this crate's
//! dependencies do not include a ZMQ binding. vLLM connects when its endpoint is `tcp://127.0.0.1:PORT`,
//! so the tap binds first and the engine is started with the tap's endpoint. The child exits when its
//! stdin closes, so it never outlives the test.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvmesh_filters::prefix::kvevents::{decode_message, KvMessage};

use super::setup::Venv;

const SCRIPT: &str = r#"
import select, sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.SUB)
s.setsockopt(zmq.SUBSCRIBE, b"")
s.setsockopt(zmq.LINGER, 0)
port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
poller = zmq.Poller()
poller.register(s, zmq.POLLIN)
poller.register(sys.stdin.fileno(), zmq.POLLIN)
while True:
    ready = dict(poller.poll(1000))
    if sys.stdin.fileno() in ready and not sys.stdin.buffer.read1(4096):
        break
    if s in ready:
        frames = s.recv_multipart()
        print(" ".join(f.hex() or "-" for f in frames), flush=True)
"#;

/// How many undelivered messages the reader thread may queue (the cases read them as they go).
const QUEUE: usize = 4096;

/// A bound SUB socket and the messages it received, in order.
#[derive(Debug)]
pub struct EventTap {
    /// `tcp://127.0.0.1:PORT`, to pass to vLLM's `--kv-events-config` `endpoint`.
    pub endpoint: String,
    rx: Receiver<Vec<Vec<u8>>>,
    child: Child,
    stdin: Option<ChildStdin>,
}

impl EventTap {
    /// Binds the SUB socket on a loopback port chosen by the OS.
    pub fn bind(venv: &Venv) -> Result<EventTap> {
        let mut child = Command::new(&venv.python)
            .arg("-c")
            .arg(SCRIPT)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the ZMQ SUB tap")?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().context("tap stdout")?;
        let (port_tx, port_rx) = mpsc::sync_channel::<String>(1);
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        // The thread ends when the child closes stdout (it exits when we close its stdin).
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(port)) = lines.next() {
                let _ = port_tx.send(port);
            }
            for line in lines.map_while(Result::ok) {
                let frames: Option<Vec<Vec<u8>>> = line
                    .split(' ')
                    .map(|h| if h == "-" { Some(Vec::new()) } else { hex(h) })
                    .collect();
                if let Some(frames) = frames {
                    if tx.send(frames).is_err() {
                        break;
                    }
                }
            }
        });
        let mut tap = EventTap {
            endpoint: String::new(),
            rx,
            child,
            stdin,
        };
        let port = port_rx
            .recv_timeout(Duration::from_secs(30))
            .context("the ZMQ SUB tap did not report its port")?;
        let port: u16 = port
            .trim()
            .parse()
            .with_context(|| format!("tap port {port:?}"))?;
        tap.endpoint = format!("tcp://127.0.0.1:{port}");
        Ok(tap)
    }

    /// Every message received so far, decoded; an undecodable message fails the case.
    pub fn drain(&self) -> Result<Vec<KvMessage>> {
        let mut out = Vec::new();
        while let Ok(frames) = self.rx.try_recv() {
            out.push(decode_message(&frames).context("decoding a KV-event message from vLLM")?);
        }
        Ok(out)
    }

    /// Collects messages until `done` holds for what was collected, or fails after `deadline`.
    pub fn collect_until(
        &self,
        deadline: Duration,
        mut done: impl FnMut(&[KvMessage]) -> bool,
    ) -> Result<Vec<KvMessage>> {
        let end = Instant::now() + deadline;
        let mut got = self.drain()?;
        while !done(&got) {
            let left = end.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(frames) => got.push(
                    decode_message(&frames).context("decoding a KV-event message from vLLM")?,
                ),
                Err(RecvTimeoutError::Timeout) => {
                    bail!(
                        "KV events: condition not met within {} s; got {got:?}",
                        deadline.as_secs()
                    )
                }
                Err(RecvTimeoutError::Disconnected) => bail!("the ZMQ SUB tap stopped"),
            }
        }
        Ok(got)
    }
}

impl Drop for EventTap {
    fn drop(&mut self) {
        // EOF on stdin ends the child; kill it if it has not gone within a second.
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.flush();
        }
        let end = Instant::now() + Duration::from_secs(1);
        while Instant::now() < end {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}
