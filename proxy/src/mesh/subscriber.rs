//! One peer's state stream, applied here: one owned task per discovered mesh
//! address ([`run`]).
//!
//! Connect (TCP, mutual TLS with `mesh.tls`, HTTP/2, all under
//! `connect_timeout`), `GET /mesh/v1/stream`,
//! then read frames, each under the `stale_after` deadline (the peer's load
//! ticks are its heartbeat). The snapshot replaces everything known about
//! the peer (its index entries are cleared first); deltas must come with
//! consecutive sequence numbers. A gap, a malformed frame, a silent or ended
//! stream: the connection is dropped and re-made after a backoff that
//! doubles up to `reconnect_max`, with jitter ([`crate::backoff`]), and the
//! next snapshot resyncs. A peer that
//! stays unreachable past `stale_after` leaves the fleet and the index; it
//! comes back with its next snapshot. One that fell silent (its stream, or
//! its reconnects timing out) is cut off: the calls waiting for its
//! response head fail and go elsewhere ([`Fleet::cut_off_peer`]); one whose
//! reconnect is refused (a drain closed its listener, or it is gone) is
//! forgotten at once, its calls in flight left to finish. A stream announcing this sidecar's own
//! identity (DNS lists every pod, this one included) is not followed. With
//! `mesh.follow: same-models`, neither is a peer serving none of this pod's
//! models: the request names this pod's models, so the peer answers `409`
//! without building a snapshot (a peer of an older version is dropped at its
//! hello instead), and it is asked again after [`OTHER_MODELS_RECHECK`] (a
//! pod changes models only by restarting).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::server::{FOLLOW_MODELS, STREAM_PATH, TAKES_ADAPTERS, TAKES_PREFILL, TAKES_STATS};
use super::wire::{self, Announce, Msg, WireError};
use super::Tasks;
use crate::backoff::Backoff;
use crate::config::mesh::Follow;
use crate::fleet::{Fleet, PodInfo};
use crate::prefix::PrefixState;

/// First pause before reconnecting.
const BACKOFF_START: Duration = Duration::from_millis(50);

/// Pause before asking again a peer that served other models.
const OTHER_MODELS_RECHECK: Duration = Duration::from_secs(60);

/// What the discovery loop reads about one subscriber.
#[derive(Debug, Clone, Default)]
pub struct PeerStatus {
    /// The peer's pod id, once announced.
    pub id: Option<String>,
    /// In sync: snapshot applied and the stream alive.
    pub synced: bool,
    pub last_frame: Option<Instant>,
    /// The address turned out to be this sidecar itself.
    pub is_self: bool,
    /// The peer serves none of this pod's models (`mesh.follow: same-models`).
    pub other_models: bool,
}

/// Why one stream ended.
#[derive(Debug, thiserror::Error)]
enum StreamEnd {
    #[error("connect: {0}")]
    Connect(String),
    /// Nothing listens at the peer's mesh port (the OS refused the
    /// connection): a sidecar that closed its listener to drain, or whose
    /// process is gone.
    #[error("connect: {0}")]
    Refused(String),
    /// The connection or the stream's head did not come within
    /// `connect_timeout`: unlike a refusal, nothing answers there.
    #[error("connect: {0} timed out")]
    TimedOut(&'static str),
    #[error("peer answered {0}")]
    Status(http::StatusCode),
    #[error("stream silent for {0:?}")]
    Stale(Duration),
    #[error("stream ended")]
    Eof,
    #[error("stream error: {0}")]
    Body(String),
    #[error("bad frame: {0}")]
    Wire(#[from] WireError),
    #[error("sequence gap: expected {expected}, got {got}")]
    Gap { expected: u64, got: u64 },
    #[error("a delta before the snapshot's hello")]
    NoHello,
    #[error("this sidecar itself")]
    IsSelf,
    #[error("peer announced an identity it cannot be reached at: {0}")]
    BadIdentity(String),
    #[error("peer {0} serves none of this pod's models")]
    OtherModels(String),
}

/// Follows the stream of the peer at `addr` until `stop` (see the module docs).
pub async fn run(
    shared: Tasks,
    addr: SocketAddr,
    stop: CancellationToken,
    status: watch::Sender<PeerStatus>,
) {
    let cfg = shared.config.mesh.clone();
    let mut backoff = Backoff::new(BACKOFF_START, cfg.reconnect_max.get());
    let mut known: Option<String> = None;
    let mut lost_at: Option<Instant> = None;
    let mut reason: &'static str = "connect";
    loop {
        let ended = tokio::select! {
            _ = stop.cancelled() => break,
            e = follow(&shared, addr, &status, &mut known, reason) => e,
        };
        let was_synced = status.borrow().synced;
        status.send_modify(|s| s.synced = false);
        match &ended {
            StreamEnd::IsSelf => {
                status.send_modify(|s| s.is_self = true);
                stop.cancelled().await;
                break;
            }
            StreamEnd::OtherModels(_) => {
                tracing::debug!(%addr, reason = %ended, "mesh: peer not followed");
                // It may have served this pod's models before a restart.
                if let Some(id) = known.take() {
                    forget(&shared.fleet, &shared.prefix, &id);
                }
                lost_at = None;
                status.send_modify(|s| s.other_models = true);
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(OTHER_MODELS_RECHECK) => {}
                }
                backoff.reset();
                reason = "connect";
                continue;
            }
            StreamEnd::Connect(_)
            | StreamEnd::Refused(_)
            | StreamEnd::TimedOut(_)
            | StreamEnd::Status(_) => {
                tracing::debug!(%addr, reason = %ended, "mesh: peer unreachable");
            }
            _ => {
                tracing::info!(%addr, reason = %ended, "mesh: peer stream lost; resyncing");
                backoff.reset();
            }
        }
        reason = match ended {
            StreamEnd::Gap { .. } => "gap",
            StreamEnd::Stale(_) => "stale",
            StreamEnd::Eof => "reconnect",
            _ => "error",
        };
        let now = Instant::now();
        if was_synced {
            lost_at = Some(now);
        }
        let since = *lost_at.get_or_insert(now);
        // A silent stream already waited `stale_after`, and a refused
        // reconnect means nothing listens there any more (a drain closed the
        // listener, or the process is gone): forget the peer now, before
        // requests are sent to a port that refuses them. Anything else keeps
        // it for `stale_after` (a stream a busy peer dropped, a hiccup).
        let stale = matches!(ended, StreamEnd::Stale(_) | StreamEnd::Refused(_))
            || now.duration_since(since) >= cfg.stale_after.get();
        if stale {
            if let Some(id) = known.take() {
                if matches!(ended, StreamEnd::Stale(_) | StreamEnd::TimedOut(_)) {
                    // Silent, not closed or refused: a partition or a host
                    // gone. The calls waiting on it would wait out
                    // `first_byte`.
                    cut_off(&shared.fleet, &shared.prefix, &id);
                } else {
                    forget(&shared.fleet, &shared.prefix, &id);
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(backoff.next_delay()) => {}
        }
        if known.is_none() {
            lost_at = None;
        }
    }
    if let Some(id) = known {
        forget(&shared.fleet, &shared.prefix, &id);
    }
    shared.mesh.routes().remove_mesh(addr);
    if let Some(client) = shared.mesh.tls_client() {
        client.forget(addr);
    }
}

/// Drives one HTTP/2 client connection (over TCP or TLS).
type Driver = Pin<Box<dyn Future<Output = Result<(), hyper::Error>> + Send>>;

/// The HTTP/2 handshake on a connected stream.
async fn handshake<I>(io: I) -> Result<(SendRequest<Empty<Bytes>>, Driver), String>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut b = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
    // A small window: a subscriber that cannot keep up stops the sender
    // quickly instead of buffering megabytes in flight.
    b.initial_stream_window_size(256 * 1024);
    let (send, conn) = b
        .handshake::<_, Empty<Bytes>>(TokioIo::new(io))
        .await
        .map_err(|e| e.to_string())?;
    Ok((send, Box::pin(conn)))
}

/// Removes a peer from scheduling and from the index.
fn forget(fleet: &Fleet, prefix: &PrefixState, id: &str) {
    tracing::info!(peer = id, "mesh: peer left the scheduling set");
    fleet.remove_peer(id);
    prefix.remove_pod(id);
}

/// Removes a peer whose stream fell silent from scheduling and from the
/// index, and fails the calls still waiting for its response head
/// ([`Fleet::cut_off_peer`]). A peer that closes its stream (a drain, a
/// restart) is only forgotten: its calls in flight may still finish.
fn cut_off(fleet: &Fleet, prefix: &PrefixState, id: &str) {
    tracing::info!(peer = id, "mesh: peer unreachable; left the scheduling set");
    fleet.cut_off_peer(id);
    prefix.remove_pod(id);
}

/// One connection: returns why it ended.
async fn follow(
    shared: &Tasks,
    addr: SocketAddr,
    status: &watch::Sender<PeerStatus>,
    known: &mut Option<String>,
    reason: &'static str,
) -> StreamEnd {
    let cfg = &shared.config.mesh;
    let tls = shared.mesh.tls();
    let connect = async {
        let tcp = TcpStream::connect(addr).await.map_err(|e| {
            if e.kind() == std::io::ErrorKind::ConnectionRefused {
                StreamEnd::Refused(e.to_string())
            } else {
                StreamEnd::Connect(e.to_string())
            }
        })?;
        let _ = tcp.set_nodelay(true);
        match tls {
            None => handshake(tcp).await.map_err(StreamEnd::Connect),
            Some(tls) => {
                let stream = tls.connect(tcp).await.map_err(|e| {
                    shared.mesh.metrics.tls_failure("connect");
                    StreamEnd::Connect(format!("TLS handshake: {e}"))
                })?;
                handshake(stream).await.map_err(StreamEnd::Connect)
            }
        }
    };
    let (mut send, conn) = match tokio::time::timeout(cfg.connect_timeout.get(), connect).await {
        Ok(Ok(x)) => x,
        Ok(Err(end)) => return end,
        Err(_) => return StreamEnd::TimedOut("the connection"),
    };
    tokio::pin!(conn);
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut req = Request::get(format!("{scheme}://{addr}{STREAM_PATH}"))
        .header(TAKES_STATS, "1")
        .header(TAKES_ADAPTERS, "1")
        .header(TAKES_PREFILL, "1");
    if cfg.follow == Follow::SameModels {
        // The peer checks them first and answers 409 instead of a snapshot.
        if let Ok(models) = serde_json::to_string(&shared.config.pod.models) {
            req = req.header(FOLLOW_MODELS, models);
        }
    }
    let req = match req.body(Empty::new()) {
        Ok(r) => r,
        Err(e) => return StreamEnd::Connect(e.to_string()),
    };
    let head = tokio::select! {
        r = tokio::time::timeout(cfg.connect_timeout.get(), send.send_request(req)) => r,
        _ = conn.as_mut() => return StreamEnd::Eof,
    };
    let resp = match head {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            // With TLS 1.3 a peer that refuses this sidecar's certificate
            // says so here, after the handshake.
            if crate::upstream::mesh::tls_alert(&e) {
                shared.mesh.metrics.tls_failure("connect");
            }
            return StreamEnd::Connect(e.to_string());
        }
        Err(_) => return StreamEnd::TimedOut("the response head"),
    };
    if resp.status() == http::StatusCode::CONFLICT && cfg.follow == Follow::SameModels {
        return StreamEnd::OtherModels(addr.to_string());
    }
    if !resp.status().is_success() {
        return StreamEnd::Status(resp.status());
    }
    let mut body = resp.into_body();
    let mut reader = Reader {
        shared,
        addr,
        status,
        known,
        buf: BytesMut::new(),
        peer: None,
        next_seq: None,
        reason,
    };
    let stale = cfg.stale_after.get();
    loop {
        let frame = tokio::select! {
            f = tokio::time::timeout(stale, body.frame()) => f,
            _ = conn.as_mut() => return StreamEnd::Eof,
        };
        let data = match frame {
            Err(_) => return StreamEnd::Stale(stale),
            Ok(None) => return StreamEnd::Eof,
            Ok(Some(Err(e))) => return StreamEnd::Body(e.to_string()),
            Ok(Some(Ok(f))) => match f.into_data() {
                Ok(d) => d,
                Err(_) => continue, // trailers: nothing to apply
            },
        };
        reader.buf.extend_from_slice(&data);
        if let Err(e) = reader.drain().await {
            return e;
        }
    }
}

struct Reader<'a> {
    shared: &'a Tasks,
    /// The peer's mesh port (this stream's address).
    addr: SocketAddr,
    status: &'a watch::Sender<PeerStatus>,
    known: &'a mut Option<String>,
    buf: BytesMut,
    /// The peer's id once its hello is applied.
    peer: Option<String>,
    /// The sequence the next delta must carry (after the snapshot).
    next_seq: Option<u64>,
    reason: &'static str,
}

impl Reader<'_> {
    /// Applies every whole frame in the buffer.
    async fn drain(&mut self) -> Result<(), StreamEnd> {
        while let Some(h) = wire::header(&self.buf)? {
            let total = wire::HEADER_LEN + h.len as usize;
            if self.buf.len() < total {
                break;
            }
            self.buf.advance(wire::HEADER_LEN);
            let payload = self.buf.split_to(h.len as usize);
            let msg = wire::decode(h.kind, &payload)?;
            self.apply(h.seq, msg).await?;
        }
        Ok(())
    }

    async fn apply(&mut self, seq: u64, msg: Msg) -> Result<(), StreamEnd> {
        let shared = self.shared;
        shared.mesh.metrics.frame_in();
        self.status
            .send_modify(|s| s.last_frame = Some(Instant::now()));
        if let Msg::Hello(a) = msg {
            return self.hello(a).await;
        }
        let Some(peer) = self.peer.clone() else {
            return Err(StreamEnd::NoHello);
        };
        // Out of sequence: carries the last delta's number and takes none.
        if let Msg::Stats(stats) = msg {
            shared.fleet.update_stats(&peer, |s| *s = stats);
            return Ok(());
        }
        // Out of sequence too: the whole set, replacing the last.
        if let Msg::Adapters(mut names) = msg {
            names.truncate(crate::fleet::adapters::MAX_ADAPTERS);
            shared.fleet.set_lora_adapters(&peer, names);
            return Ok(());
        }
        if let Msg::Prefill(tokens) = msg {
            shared
                .fleet
                .set_remote_prefill(&peer, tokens.into_iter().collect());
            return Ok(());
        }
        match self.next_seq {
            // Snapshot frames all carry the snapshot's sequence.
            None => {}
            Some(expected) if seq == expected => self.next_seq = Some(expected + 1),
            Some(expected) => return Err(StreamEnd::Gap { expected, got: seq }),
        }
        match msg {
            Msg::Hello(_) => {}
            Msg::SnapshotEnd => {
                self.next_seq = Some(seq + 1);
                shared.mesh.metrics.resync(self.reason);
                self.status.send_modify(|s| s.synced = true);
                tracing::info!(peer, "mesh: peer in sync");
            }
            Msg::Load(l) => {
                let now = Instant::now();
                let at = now
                    .checked_sub(Duration::from_millis(l.age_ms.min(3_600_000)))
                    .unwrap_or(now);
                if l.age_ms != u64::MAX {
                    shared.fleet.set_load(&peer, l.load, at);
                }
                shared.fleet.set_healthy(&peer, l.healthy);
            }
            Msg::InFlight(counts) => {
                shared
                    .fleet
                    .set_remote_in_flight(&peer, counts.into_iter().collect());
            }
            Msg::Kv { model, batch } => {
                shared.prefix.apply(&peer, &model, &batch);
            }
            Msg::Stats(_) | Msg::Adapters(_) | Msg::Prefill(_) => {}
            Msg::Decision { pod, keys } => {
                if shared.prefix.mode() == crate::prefix::Mode::Approximate {
                    shared.prefix.approx().record(&pod, &keys);
                }
            }
        }
        Ok(())
    }

    async fn hello(&mut self, a: Announce) -> Result<(), StreamEnd> {
        let shared = self.shared;
        if a.id == shared.fleet.local_id() {
            return Err(StreamEnd::IsSelf);
        }
        if !shared
            .config
            .mesh
            .follow
            .follows(&shared.config.pod.models, &a.models)
        {
            return Err(StreamEnd::OtherModels(a.id));
        }
        let sidecar_addr = resolve(&a.id)
            .await
            .ok_or_else(|| StreamEnd::BadIdentity(a.id.clone()))?;
        if let Some(old) = self.known.take() {
            // A restarted or renamed peer: start from nothing.
            if old != a.id {
                shared.fleet.remove_peer(&old);
            }
            shared.prefix.remove_pod(&old);
        }
        let info = PodInfo {
            id: a.id.clone(),
            sidecar_addr: Some(sidecar_addr),
            role: a.role,
            models: a.models,
            lora_adapters: a.lora_adapters,
            labels: a.labels.into_iter().collect(),
        };
        let kv_agent = match a.kv_agent.as_str() {
            "" => None,
            agent => {
                let parsed = agent.parse().ok();
                if parsed.is_none() {
                    tracing::warn!(peer = %a.id, kv_agent = agent, "mesh: peer's KV agent is not ip:port; ignored");
                }
                parsed
            }
        };
        // Known before the peer becomes a target, so no forward finds it missing.
        shared.mesh.routes().set(sidecar_addr, self.addr, kv_agent);
        if let Err(e) = shared.fleet.upsert_peer(info) {
            tracing::warn!(peer = %a.id, error = %e, "mesh: peer not added");
            return Err(StreamEnd::BadIdentity(a.id));
        }
        *self.known = Some(a.id.clone());
        self.status.send_modify(|s| {
            s.id = Some(a.id.clone());
            s.other_models = false;
        });
        self.peer = Some(a.id);
        self.next_seq = None;
        Ok(())
    }
}

/// The announced `host:port` as a socket address (a name is resolved once).
async fn resolve(id: &str) -> Option<SocketAddr> {
    if let Ok(a) = id.parse() {
        return Some(a);
    }
    let found = tokio::time::timeout(Duration::from_secs(2), tokio::net::lookup_host(id)).await;
    found.ok()?.ok()?.next()
}

/// Frames of a stream body, for tests that read a stream by hand.
pub fn split_frames(buf: &mut BytesMut) -> Result<Vec<(u64, Msg)>, WireError> {
    let mut out = Vec::new();
    while let Some(h) = wire::header(buf)? {
        let total = wire::HEADER_LEN + h.len as usize;
        if buf.len() < total {
            break;
        }
        buf.advance(wire::HEADER_LEN);
        let payload = buf.split_to(h.len as usize);
        out.push((h.seq, wire::decode(h.kind, &payload)?));
    }
    Ok(out)
}
