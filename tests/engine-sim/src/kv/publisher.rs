//! The ZMQ side of KV events, as vLLM's `ZmqEventPublisher`.
//!
//! One task owns a PUB socket (live stream) and, optionally, a ROUTER socket
//! (replay). Each batch goes out as `[topic, seq (8-byte BE), payload]`; `seq`
//! starts at 0 and grows by one per batch. The last `buffer_steps` batches are
//! kept: a DEALER that sends `["", start_seq]` gets `["", topic, seq, payload]`
//! for every kept batch with `seq >= start_seq`, then `["", "", END_SEQ, ""]`
//! (the vLLM >= 0.26 layout). The PUB endpoint is bound when it contains `*`
//! or `::` (or is `ipc://`/`inproc://`) and connected otherwise; the replay
//! endpoint is always bound.

use std::collections::VecDeque;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::config::KvEventsConfig;
use crate::SimError;

/// The replay end marker: -1 as an 8-byte big-endian integer.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// Bounded queue between the scheduler and the publisher task (vLLM
/// `max_queue_size`); a full queue drops the batch and counts it.
const QUEUE: usize = 100_000;

/// vLLM's bind-vs-connect rule for the PUB endpoint.
pub fn should_bind(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// `tcp://*:N` as the zeromq crate can bind it (`*` is not a host to it).
fn bindable(endpoint: &str) -> String {
    endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1)
}

pub(crate) enum PubCmd {
    Batch(Vec<u8>),
    /// Engine restart: sequence back to 0, replay buffer emptied.
    Reset,
}

/// Where the sockets ended up (ports resolved when 0 was asked for).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEndpoints {
    /// The PUB endpoint, resolved if bound, as given if connected.
    pub events: String,
    pub replay: Option<String>,
}

/// The scheduler's side: send batches, reset on restart.
#[derive(Debug, Clone)]
pub(crate) struct PublisherTx {
    tx: mpsc::Sender<PubCmd>,
}

impl std::fmt::Debug for PubCmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PubCmd::Batch(b) => write!(f, "Batch({} bytes)", b.len()),
            PubCmd::Reset => write!(f, "Reset"),
        }
    }
}

impl PublisherTx {
    /// Queues one batch; false if the queue was full (the batch is lost, as
    /// in vLLM when its queue overflows).
    pub fn send(&self, payload: Vec<u8>) -> bool {
        self.tx.try_send(PubCmd::Batch(payload)).is_ok()
    }

    pub fn reset(&self) {
        let _ = self.tx.try_send(PubCmd::Reset);
    }
}

/// Binds what must be bound, then spawns the task. The task ends on `cancel`.
pub(crate) async fn start(
    cfg: &KvEventsConfig,
    cancel: CancellationToken,
) -> Result<(PublisherTx, KvEndpoints, tokio::task::JoinHandle<()>), SimError> {
    let zmq_err =
        |what: &str, ep: &str, e: zeromq::ZmqError| SimError::KvEvents(format!("{what} {ep}: {e}"));
    let mut publ = PubSocket::new();
    let bind = cfg.bind.unwrap_or_else(|| should_bind(&cfg.endpoint));
    let events = if bind {
        let ep = publ
            .bind(&bindable(&cfg.endpoint))
            .await
            .map_err(|e| zmq_err("bind", &cfg.endpoint, e))?;
        ep.to_string()
    } else {
        cfg.endpoint.clone()
    };
    let mut router = None;
    let mut replay = None;
    if let Some(rep) = &cfg.replay_endpoint {
        let mut r = RouterSocket::new();
        let ep = r
            .bind(&bindable(rep))
            .await
            .map_err(|e| zmq_err("bind", rep, e))?;
        replay = Some(ep.to_string());
        router = Some(r);
    }
    let (tx, rx) = mpsc::channel(QUEUE);
    let task = Task {
        publ,
        router,
        connect_to: (!bind).then(|| cfg.endpoint.clone()),
        topic: Bytes::from(cfg.topic.clone().into_bytes()),
        ring: VecDeque::new(),
        cap: cfg.buffer_steps.max(1),
        next_seq: 0,
        unsent_from: 0,
    };
    let handle = tokio::spawn(task.run(rx, cancel));
    Ok((PublisherTx { tx }, KvEndpoints { events, replay }, handle))
}

struct Task {
    publ: PubSocket,
    router: Option<RouterSocket>,
    /// Set until a connect-mode PUB has reached its peer.
    connect_to: Option<String>,
    topic: Bytes,
    ring: VecDeque<(u64, Bytes)>,
    cap: usize,
    next_seq: u64,
    /// First seq not yet handed to the PUB socket (connect mode queues, as
    /// libzmq does before a connection exists).
    unsent_from: u64,
}

impl Task {
    async fn run(mut self, mut rx: mpsc::Receiver<PubCmd>, cancel: CancellationToken) {
        loop {
            let connecting = self.connect_to.clone();
            tokio::select! {
                _ = cancel.cancelled() => break,
                cmd = rx.recv() => match cmd {
                    Some(PubCmd::Batch(p)) => self.push(p).await,
                    Some(PubCmd::Reset) => {
                        self.ring.clear();
                        self.next_seq = 0;
                        self.unsent_from = 0;
                    }
                    None => break,
                },
                msg = recv_opt(&mut self.router) => {
                    if let Some(m) = msg {
                        self.replay(m).await;
                    }
                }
                ok = connect_opt(&mut self.publ, connecting.as_deref()) => {
                    if ok {
                        self.connect_to = None;
                        self.flush().await;
                    } else {
                        // Peer not there yet: retry after a pause, like libzmq's reconnect.
                        tokio::select! {
                            _ = cancel.cancelled() => break,
                            _ = tokio::time::sleep(std::time::Duration::from_millis(100)) => {}
                        }
                    }
                }
            }
        }
    }

    async fn push(&mut self, payload: Vec<u8>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        if self.ring.len() == self.cap {
            self.ring.pop_front();
        }
        self.ring.push_back((seq, Bytes::from(payload)));
        if self.connect_to.is_none() {
            self.flush().await;
        }
    }

    async fn flush(&mut self) {
        let from = self.unsent_from;
        let msgs: Vec<ZmqMessage> = self
            .ring
            .iter()
            .filter(|(s, _)| *s >= from)
            .filter_map(|(s, p)| frames(&[self.topic.clone(), seq_bytes(*s), p.clone()]))
            .collect();
        for m in msgs {
            // PUB drops for slow or absent subscribers; that is ZMQ's contract.
            let _ = self.publ.send(m).await;
        }
        self.unsent_from = self.next_seq;
    }

    async fn replay(&mut self, msg: ZmqMessage) {
        let parts = msg.into_vec();
        let [identity, _empty, start] = parts.as_slice() else {
            return; // vLLM logs and ignores anything but 3 frames.
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            return;
        };
        let start = u64::from_be_bytes(start);
        let Some(router) = self.router.as_mut() else {
            return;
        };
        let empty = Bytes::new();
        for (seq, payload) in self.ring.iter().filter(|(s, _)| *s >= start) {
            let parts = [
                identity.clone(),
                empty.clone(),
                self.topic.clone(),
                seq_bytes(*seq),
                payload.clone(),
            ];
            if let Some(m) = frames(&parts) {
                if router.send(m).await.is_err() {
                    return;
                }
            }
        }
        let end = [
            identity.clone(),
            empty.clone(),
            empty.clone(),
            Bytes::from_static(&END_SEQ),
            empty,
        ];
        if let Some(m) = frames(&end) {
            let _ = router.send(m).await;
        }
    }
}

fn seq_bytes(seq: u64) -> Bytes {
    Bytes::copy_from_slice(&seq.to_be_bytes())
}

fn frames(parts: &[Bytes]) -> Option<ZmqMessage> {
    ZmqMessage::try_from(parts.to_vec()).ok()
}

async fn recv_opt(router: &mut Option<RouterSocket>) -> Option<ZmqMessage> {
    match router {
        Some(r) => r.recv().await.ok(),
        None => std::future::pending().await,
    }
}

async fn connect_opt(publ: &mut PubSocket, to: Option<&str>) -> bool {
    match to {
        Some(ep) => {
            let attempt = publ.connect(ep);
            matches!(
                tokio::time::timeout(std::time::Duration::from_secs(1), attempt).await,
                Ok(Ok(()))
            )
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_rule_is_vllms() {
        assert!(should_bind("tcp://*:5557"));
        assert!(should_bind("tcp://[::]:5557"));
        assert!(should_bind("ipc:///tmp/kv"));
        assert!(!should_bind("tcp://127.0.0.1:5557"));
        assert!(!should_bind("tcp://sidecar:5557"));
        assert_eq!(bindable("tcp://*:0"), "tcp://0.0.0.0:0");
    }
}
