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
//!
//! # Connect mode
//!
//! vLLM's libzmq PUB dials its endpoint again whenever the connection drops
//! (`ZMQ_RECONNECT_IVL`, 100 ms), so a subscriber that restarts and binds its
//! port again is reached again. The `zeromq` crate's `PubSocket::connect`
//! dials once: its PUB has no redial (its SUB has one). This task redials
//! itself: the socket's monitor names the peer that went away, and the task
//! dials every [`REDIAL_PAUSE`] until one succeeds. This is a workaround here
//! rather than a patched crate: the crate's public monitor gives all it needs,
//! and a `[patch]` would vendor some 8k lines of source for what these few do.
//!
//! A dial runs to its end while batches and replay requests keep being served
//! (a dial dropped half-way closes a connection the subscriber already
//! accepted). Batches made while no connection exists are queued (within the
//! replay buffer) and sent when one is made.
//!
//! Slow joiner, as with vLLM: a SUB sends its subscriptions after the
//! handshake (libzmq's once its application next touches the socket), and a
//! PUB drops what matches no subscription, so batches sent in that gap are not
//! seen live. The replay socket returns them; a consumer that must not miss the
//! first batch waits for any event first (the tests reset the prefix cache
//! until its `AllBlocksCleared` arrives).

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{self, BoxStream};
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::util::PeerIdentity;
use zeromq::{PubSocket, RouterSocket, Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use crate::config::KvEventsConfig;
use crate::SimError;

/// The replay end marker: -1 as an 8-byte big-endian integer.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// Bounded queue between the scheduler and the publisher task (vLLM
/// `max_queue_size`); a full queue drops the batch and counts it.
const QUEUE: usize = 100_000;

/// Pause between failed dials in connect mode: libzmq's `ZMQ_RECONNECT_IVL`.
const REDIAL_PAUSE: Duration = Duration::from_millis(100);

/// Bound on one dial (TCP connect and ZMTP handshake).
const DIAL_TIMEOUT: Duration = Duration::from_secs(1);

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
    let (events, link) = if bind {
        let ep = publ
            .bind(&bindable(&cfg.endpoint))
            .await
            .map_err(|e| zmq_err("bind", &cfg.endpoint, e))?;
        (ep.to_string(), None)
    } else {
        let monitor = publ.monitor();
        (
            cfg.endpoint.clone(),
            Some(Link::new(&cfg.endpoint, monitor)),
        )
    };
    let mut replay_socket = None;
    let mut replay = None;
    if let Some(rep) = &cfg.replay_endpoint {
        let mut r = RouterSocket::new();
        let ep = r
            .bind(&bindable(rep))
            .await
            .map_err(|e| zmq_err("bind", rep, e))?;
        replay = Some(ep.to_string());
        replay_socket = Some(r);
    }
    let (tx, rx) = mpsc::channel(QUEUE);
    let task = Task {
        publ,
        link,
        replay: replay_socket,
        out: Outbox::new(
            Bytes::from(cfg.topic.clone().into_bytes()),
            cfg.buffer_steps,
        ),
    };
    let handle = tokio::spawn(task.run(rx, cancel));
    Ok((PublisherTx { tx }, KvEndpoints { events, replay }, handle))
}

struct Task {
    publ: PubSocket,
    /// Connect mode only: the endpoint to (re)dial and the connection's state.
    link: Option<Link>,
    replay: Option<RouterSocket>,
    out: Outbox,
}

impl Task {
    async fn run(mut self, mut rx: mpsc::Receiver<PubCmd>, cancel: CancellationToken) {
        loop {
            if let Some(link) = self.link.as_mut().filter(|l| l.is_down()) {
                let dialled = dial(
                    &mut self.publ,
                    &link.endpoint,
                    &mut self.out,
                    &mut self.replay,
                    &mut rx,
                    &cancel,
                )
                .await;
                if !dialled {
                    break;
                }
                link.dialled();
                self.flush().await;
            }
            tokio::select! {
                _ = cancel.cancelled() => break,
                cmd = rx.recv() => match cmd {
                    Some(cmd) => {
                        self.out.apply(cmd);
                        if self.link.as_ref().is_none_or(|l| !l.is_down()) {
                            self.flush().await;
                        }
                    }
                    None => break,
                },
                msg = recv_opt(&mut self.replay) => {
                    if let Some(m) = msg {
                        answer(&mut self.replay, &self.out, m).await;
                    }
                }
                ev = next_event(&mut self.link) => {
                    if let (Some(link), Some(ev)) = (self.link.as_mut(), ev) {
                        link.observe(ev);
                    }
                }
            }
        }
    }

    async fn flush(&mut self) {
        for m in self.out.take_unsent() {
            // PUB drops for slow or absent subscribers; that is ZMQ's contract.
            let _ = self.publ.send(m).await;
        }
    }
}

/// Dials `endpoint` until a connection is made, serving batches and replay
/// requests meanwhile. False when the task must stop.
async fn dial(
    publ: &mut PubSocket,
    endpoint: &str,
    out: &mut Outbox,
    replay: &mut Option<RouterSocket>,
    rx: &mut mpsc::Receiver<PubCmd>,
    cancel: &CancellationToken,
) -> bool {
    loop {
        let attempt = tokio::time::timeout(DIAL_TIMEOUT, publ.connect(endpoint));
        match serving(attempt, out, replay, rx, cancel).await {
            None => return false,
            Some(Ok(Ok(()))) => return true,
            Some(Ok(Err(e))) => tracing::debug!(endpoint, error = %e, "KV events: dial failed"),
            Some(Err(_)) => tracing::debug!(endpoint, "KV events: dial timed out"),
        }
        let pause = tokio::time::sleep(REDIAL_PAUSE);
        if serving(pause, out, replay, rx, cancel).await.is_none() {
            return false;
        }
    }
}

/// Runs `fut` to its end while queueing batches and answering replays; `None`
/// when cancelled or when the scheduler's side is gone.
async fn serving<F: Future>(
    fut: F,
    out: &mut Outbox,
    replay: &mut Option<RouterSocket>,
    rx: &mut mpsc::Receiver<PubCmd>,
    cancel: &CancellationToken,
) -> Option<F::Output> {
    tokio::pin!(fut);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return None,
            r = &mut fut => return Some(r),
            cmd = rx.recv() => out.apply(cmd?),
            msg = recv_opt(replay) => {
                if let Some(m) = msg {
                    answer(replay, out, m).await;
                }
            }
        }
    }
}

/// The connect-mode connection as the socket's monitor tells it.
struct Link {
    endpoint: String,
    /// The PUB socket's monitor; never ends (see [`Link::new`]).
    monitor: BoxStream<'static, SocketEvent>,
    state: LinkState,
    /// Peers reported gone before their `Connected` event was read (the
    /// crate sends `Connected` after the peer's reader task has started).
    gone_early: HashSet<PeerIdentity>,
}

enum LinkState {
    /// No connection: dial.
    Down,
    /// Connected; the peer once the monitor has named it.
    Up(Option<PeerIdentity>),
}

impl Link {
    fn new<S>(endpoint: &str, monitor: S) -> Self
    where
        S: futures_util::Stream<Item = SocketEvent> + Send + 'static,
    {
        Self {
            endpoint: endpoint.to_string(),
            // A closed monitor must not wake the task's loop forever.
            monitor: monitor.chain(stream::pending()).boxed(),
            state: LinkState::Down,
            gone_early: HashSet::new(),
        }
    }

    fn is_down(&self) -> bool {
        matches!(self.state, LinkState::Down)
    }

    /// A dial succeeded; its peer is named by the next `Connected` event.
    fn dialled(&mut self) {
        self.state = LinkState::Up(None);
    }

    fn observe(&mut self, ev: SocketEvent) {
        match (ev, &mut self.state) {
            (SocketEvent::Connected(_, peer), LinkState::Up(current @ None)) => {
                if self.gone_early.remove(&peer) {
                    self.lost(&peer);
                } else {
                    *current = Some(peer);
                }
                self.gone_early.clear();
            }
            (SocketEvent::Disconnected(peer), LinkState::Up(Some(current))) if *current == peer => {
                self.lost(&peer);
            }
            // Either this connection's peer, gone before its `Connected` was
            // read, or a late second report about an older one.
            (SocketEvent::Disconnected(peer), LinkState::Up(None)) => {
                self.gone_early.insert(peer);
            }
            _ => {}
        }
    }

    fn lost(&mut self, peer: &PeerIdentity) {
        tracing::debug!(endpoint = %self.endpoint, ?peer, "KV events: subscriber gone, redialling");
        self.state = LinkState::Down;
    }
}

/// The batches: sequence numbers, the replay ring and what is still unsent.
struct Outbox {
    topic: Bytes,
    ring: VecDeque<(u64, Bytes)>,
    cap: usize,
    next_seq: u64,
    /// First seq not yet handed to the PUB socket (queued while connect mode
    /// has no connection).
    unsent_from: u64,
}

impl Outbox {
    fn new(topic: Bytes, buffer_steps: usize) -> Self {
        Self {
            topic,
            ring: VecDeque::new(),
            cap: buffer_steps.max(1),
            next_seq: 0,
            unsent_from: 0,
        }
    }

    fn apply(&mut self, cmd: PubCmd) {
        match cmd {
            PubCmd::Batch(payload) => {
                let seq = self.next_seq;
                self.next_seq += 1;
                if self.ring.len() == self.cap {
                    self.ring.pop_front();
                }
                self.ring.push_back((seq, Bytes::from(payload)));
            }
            PubCmd::Reset => {
                self.ring.clear();
                self.next_seq = 0;
                self.unsent_from = 0;
            }
        }
    }

    /// The live messages not yet sent (those still in the ring), now counted as sent.
    fn take_unsent(&mut self) -> Vec<ZmqMessage> {
        let from = self.unsent_from;
        self.unsent_from = self.next_seq;
        self.ring
            .iter()
            .filter(|(s, _)| *s >= from)
            .filter_map(|(s, p)| frames(&[self.topic.clone(), seq_bytes(*s), p.clone()]))
            .collect()
    }

    /// The replies to a replay request from `identity` for `start..`, end marker last.
    fn replay(&self, identity: &Bytes, start: u64) -> Vec<ZmqMessage> {
        let empty = Bytes::new();
        let kept = self
            .ring
            .iter()
            .filter(|(s, _)| *s >= start)
            .map(|(seq, payload)| {
                [
                    identity.clone(),
                    empty.clone(),
                    self.topic.clone(),
                    seq_bytes(*seq),
                    payload.clone(),
                ]
            });
        let end = [
            identity.clone(),
            empty.clone(),
            empty.clone(),
            Bytes::from_static(&END_SEQ),
            empty.clone(),
        ];
        kept.chain(std::iter::once(end))
            .filter_map(|parts| frames(&parts))
            .collect()
    }
}

/// Answers one ROUTER request `[identity, "", start_seq]`.
async fn answer(router: &mut Option<RouterSocket>, out: &Outbox, msg: ZmqMessage) {
    let parts = msg.into_vec();
    let [identity, _empty, start] = parts.as_slice() else {
        return; // vLLM logs and ignores anything but 3 frames.
    };
    let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
        return;
    };
    let Some(router) = router.as_mut() else {
        return;
    };
    for m in out.replay(identity, u64::from_be_bytes(start)) {
        if router.send(m).await.is_err() {
            return;
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

async fn next_event(link: &mut Option<Link>) -> Option<SocketEvent> {
    match link {
        Some(l) => l.monitor.next().await,
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

    fn seqs(msgs: &[ZmqMessage]) -> Vec<Bytes> {
        msgs.iter().filter_map(|m| m.get(1).cloned()).collect()
    }

    #[test]
    fn outbox_sends_each_batch_once_and_keeps_the_last_for_replay() {
        let mut out = Outbox::new(Bytes::from_static(b"t"), 2);
        for p in [b"a", b"b", b"c"] {
            out.apply(PubCmd::Batch(p.to_vec()));
        }
        // Queued while unconnected: only what the ring still holds goes out.
        assert_eq!(seqs(&out.take_unsent()), vec![seq_bytes(1), seq_bytes(2)]);
        assert!(out.take_unsent().is_empty());
        out.apply(PubCmd::Batch(b"d".to_vec()));
        assert_eq!(seqs(&out.take_unsent()), vec![seq_bytes(3)]);

        let id = Bytes::from_static(b"id");
        let replies = out.replay(&id, 0);
        let seq_frames: Vec<Bytes> = replies.iter().filter_map(|m| m.get(3).cloned()).collect();
        assert_eq!(
            seq_frames,
            vec![seq_bytes(2), seq_bytes(3), Bytes::from_static(&END_SEQ)]
        );
        assert_eq!(replies[0].len(), 5);

        out.apply(PubCmd::Reset);
        out.apply(PubCmd::Batch(b"e".to_vec()));
        assert_eq!(seqs(&out.take_unsent()), vec![seq_bytes(0)]);
    }

    fn link() -> Link {
        let mut l = Link::new("tcp://127.0.0.1:1", stream::pending());
        l.dialled();
        l
    }

    fn ep() -> zeromq::Endpoint {
        "tcp://127.0.0.1:1".parse().unwrap()
    }

    #[test]
    fn link_redials_when_its_peer_goes() {
        let (a, b) = (PeerIdentity::new(), PeerIdentity::new());
        let mut l = link();
        l.observe(SocketEvent::Connected(ep(), a.clone()));
        l.observe(SocketEvent::Disconnected(b));
        assert!(!l.is_down(), "another peer's report is not ours");
        l.observe(SocketEvent::Disconnected(a.clone()));
        assert!(l.is_down());
        // A second report about the same peer after the redial changes nothing.
        l.dialled();
        let c = PeerIdentity::new();
        l.observe(SocketEvent::Connected(ep(), c));
        l.observe(SocketEvent::Disconnected(a));
        assert!(!l.is_down());
    }

    #[test]
    fn link_redials_when_its_peer_goes_before_connected_is_read() {
        let (old, a) = (PeerIdentity::new(), PeerIdentity::new());
        let mut l = link();
        l.observe(SocketEvent::Disconnected(old));
        l.observe(SocketEvent::Disconnected(a.clone()));
        l.observe(SocketEvent::Connected(ep(), a));
        assert!(l.is_down());
    }
}
