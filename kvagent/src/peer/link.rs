//! The sending side of a peer session: one control connection (TCP_NODELAY) plus N data
//! connections to one peer agent, their writer and reader tasks, and the table of transfers
//! waiting for the peer's answer.
//!
//! A link is dead once any of its connections fails; every transfer waiting on it then fails with
//! `peer_lost` (its event channel closes) and the next send opens a new link.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::agent::Agent;
use crate::error::{Error, Result};
use crate::peer::proto::{self, Ctrl, DataHeader, Hello};
use crate::planner::Caps;
use crate::rdma::wire::RdmaTarget;
use crate::shm::Mapping;
use crate::types::BlockLayout;

/// What the peer said about one transfer.
#[derive(Debug)]
pub(crate) enum PeerEvent {
    /// Send the data: over TCP (None) or by RDMA WRITE into this target.
    Accepted(Option<Box<RdmaTarget>>),
    Done,
    Failed(Error),
}

/// A slice of a transfer for one data stream: segments `(index in transfer, layer, source block)`.
pub(crate) struct DataJob {
    pub seq: u64,
    pub map: Arc<Mapping>,
    pub layout: BlockLayout,
    pub segs: Vec<(u32, u32, u32)>,
    pub cancel: CancellationToken,
}

/// A live session with one peer agent.
pub struct PeerLink {
    /// `host:port` of the peer.
    pub addr: String,
    /// Session id the peer assigned.
    pub session: u64,
    /// The peer's capabilities.
    pub caps: Caps,
    pub(crate) ctrl_tx: mpsc::Sender<Ctrl>,
    pub(crate) data_tx: Vec<mpsc::Sender<DataJob>>,
    pub(crate) pending: Mutex<HashMap<u64, mpsc::Sender<PeerEvent>>>,
    pub(crate) dead: CancellationToken,
    closed: AtomicBool,
}

impl PeerLink {
    /// Whether the link can still carry transfers.
    pub fn alive(&self) -> bool {
        !self.dead.is_cancelled()
    }

    fn close(&self, why: &str) {
        if !self.closed.swap(true, Ordering::SeqCst) {
            tracing::warn!(peer = %self.addr, why, "peer link closed");
        }
        self.dead.cancel();
        // Dropping the senders fails every waiting transfer with peer_lost.
        self.pending.lock().clear();
    }
}

/// Open a connection and exchange hellos; a version mismatch is [`Error::VersionMismatch`].
pub async fn handshake(
    addr: &str,
    kind: u8,
    caps: Caps,
    session: u64,
    timeout: Duration,
) -> Result<(TcpStream, Hello)> {
    let fut = async {
        let mut s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        let hello = Hello {
            version: proto::VERSION,
            kind,
            caps: caps.0,
            session,
        };
        s.write_all(&hello.encode()).await?;
        let mut buf = [0u8; proto::HELLO_LEN];
        s.read_exact(&mut buf).await?;
        let reply = Hello::decode(&buf)?;
        if reply.version != proto::VERSION || reply.kind == proto::ST_VERSION {
            return Err(Error::VersionMismatch {
                ours: proto::VERSION,
                theirs: reply.version,
            });
        }
        match reply.kind {
            proto::ST_OK => Ok((s, reply)),
            proto::ST_SESSION => Err(Error::Protocol("peer does not know our session".into())),
            proto::ST_LIMIT => Err(Error::Limit("peer is at its session limit".into())),
            other => Err(Error::Protocol(format!(
                "peer refused the hello (status {other})"
            ))),
        }
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(Error::Io(e))) => Err(Error::PeerLost(format!("{addr}: {e}"))),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(Error::Timeout(format!("connecting to peer {addr}"))),
    }
}

/// The live link to `addr`, opening one if needed.
pub(crate) async fn get(agent: &Arc<Agent>, addr: &str) -> Result<Arc<PeerLink>> {
    let mut peers = agent.peers.lock().await;
    if let Some(l) = peers.get(addr) {
        if l.alive() {
            return Ok(Arc::clone(l));
        }
    }
    peers.remove(addr);
    let link = connect(agent, addr).await?;
    peers.insert(addr.to_string(), Arc::clone(&link));
    Ok(link)
}

async fn connect(agent: &Arc<Agent>, addr: &str) -> Result<Arc<PeerLink>> {
    let t = agent.cfg.connect_timeout;
    let (ctrl, reply) = handshake(addr, proto::KIND_CONTROL, agent.caps, 0, t).await?;
    let mut data = Vec::with_capacity(agent.cfg.data_streams);
    for _ in 0..agent.cfg.data_streams {
        data.push(
            handshake(addr, proto::KIND_DATA, agent.caps, reply.session, t)
                .await?
                .0,
        );
    }
    let (ctrl_tx, ctrl_rx) = mpsc::channel(1024);
    let mut data_tx = Vec::with_capacity(data.len());
    let mut data_rx = Vec::with_capacity(data.len());
    for _ in 0..data.len() {
        let (tx, rx) = mpsc::channel::<DataJob>(64);
        data_tx.push(tx);
        data_rx.push(rx);
    }
    let link = Arc::new(PeerLink {
        addr: addr.to_string(),
        session: reply.session,
        caps: Caps(reply.caps),
        ctrl_tx,
        data_tx,
        pending: Mutex::new(HashMap::new()),
        dead: agent.stop.child_token(),
        closed: AtomicBool::new(false),
    });
    tracing::info!(peer = addr, session = reply.session, caps = ?link.caps.names(), "peer link open");
    let (rd, wr) = ctrl.into_split();
    agent
        .tasks
        .spawn(ctrl_writer(Arc::clone(&link), wr, ctrl_rx));
    agent.tasks.spawn(ctrl_reader(Arc::clone(&link), rd));
    for (stream, rx) in data.into_iter().zip(data_rx) {
        let stall = agent.cfg.faults.stall_data_after_bytes;
        agent.tasks.spawn(data_writer(
            Arc::clone(&link),
            stream,
            rx,
            stall,
            agent.cfg.io_timeout,
        ));
    }
    Ok(link)
}

async fn ctrl_writer(
    link: Arc<PeerLink>,
    mut wr: tokio::net::tcp::OwnedWriteHalf,
    mut rx: mpsc::Receiver<Ctrl>,
) {
    loop {
        let msg = tokio::select! {
            () = link.dead.cancelled() => return,
            m = rx.recv() => m,
        };
        let Some(msg) = msg else { return };
        if let Err(e) = proto::write_ctrl(&mut wr, &msg).await {
            link.close(&format!("control write: {e}"));
            return;
        }
    }
}

async fn ctrl_reader(link: Arc<PeerLink>, mut rd: tokio::net::tcp::OwnedReadHalf) {
    let mut buf = Vec::new();
    loop {
        let msg = tokio::select! {
            () = link.dead.cancelled() => return,
            m = proto::read_ctrl(&mut rd, &mut buf) => m,
        };
        let (seq, ev) = match msg {
            Ok(Some(Ctrl::Accept { seq, rdma })) => (seq, PeerEvent::Accepted(rdma)),
            Ok(Some(Ctrl::Done { seq })) => (seq, PeerEvent::Done),
            Ok(Some(Ctrl::Reject { seq, code, message } | Ctrl::Failed { seq, code, message })) => {
                (seq, PeerEvent::Failed(Error::remote(code, message)))
            }
            Ok(Some(other)) => {
                link.close(&format!("unexpected control message {other:?}"));
                return;
            }
            Ok(None) => {
                link.close("peer closed the control connection");
                return;
            }
            Err(e) => {
                link.close(&format!("control read: {e}"));
                return;
            }
        };
        if let Some(tx) = link.pending.lock().get(&seq) {
            let _ = tx.try_send(ev);
        }
    }
}

async fn data_writer(
    link: Arc<PeerLink>,
    stream: TcpStream,
    mut rx: mpsc::Receiver<DataJob>,
    stall: Option<u64>,
    io: Duration,
) {
    // Large segments bypass the buffer (BufWriter writes them straight through); small ones and
    // headers are coalesced into 256 KiB writes.
    let mut w = BufWriter::with_capacity(256 * 1024, stream);
    loop {
        let job = tokio::select! {
            () = link.dead.cancelled() => return,
            j = rx.recv() => j,
        };
        let Some(job) = job else { return };
        if let Err(e) = write_job(&link, &mut w, &job, stall, io).await {
            link.close(&format!("data write: {e}"));
            return;
        }
    }
}

async fn write_job(
    link: &PeerLink,
    w: &mut BufWriter<TcpStream>,
    job: &DataJob,
    stall: Option<u64>,
    io: Duration,
) -> Result<()> {
    let len = job.layout.block_len();
    let mut sent = 0u64;
    for &(idx, layer, block) in &job.segs {
        if job.cancel.is_cancelled() {
            break;
        }
        if stall.is_some_and(|s| sent >= s) {
            w.flush().await?;
            tokio::select! {
                () = link.dead.cancelled() => {}
                () = job.cancel.cancelled() => {}
            }
            break;
        }
        let off = job.layout.offset(layer, block);
        // SAFETY: the bytes are only copied to the socket (see `Mapping::slice`).
        let payload = unsafe { job.map.slice(off, len)? };
        let hdr = DataHeader {
            seq: job.seq,
            block: idx,
            layer,
            offset: 0,
            len: len as u32,
        };
        let write = async {
            w.write_all(&hdr.encode()).await?;
            w.write_all(payload).await
        };
        tokio::time::timeout(io, write)
            .await
            .map_err(|_| Error::Timeout("data write stalled".into()))??;
        sent += len as u64;
    }
    tokio::time::timeout(io, w.flush())
        .await
        .map_err(|_| Error::Timeout("data flush stalled".into()))??;
    Ok(())
}
