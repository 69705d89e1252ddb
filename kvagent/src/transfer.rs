//! Sending a transfer: validate, plan, then copy on the same node or push over a peer link, and
//! report the path, the bytes and the time. The sender's own blocks are the client's: the agent
//! only reads them and never frees them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::agent::Agent;
use crate::error::{Error, Result};
use crate::peer::link::{self, DataJob, PeerEvent, PeerLink};
use crate::peer::proto::Ctrl;
use crate::planner::{plan, MemKind, Path, PlanInput};
use crate::regions::{LeaseState, Region};
use crate::types::{BlockLayout, TransferId};

/// Most blocks in one transfer.
pub const MAX_TRANSFER_BLOCKS: usize = 65536;

/// What a client asks to send.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendArgs {
    /// Source region id (on this agent).
    pub region: u64,
    /// Transfer id both ends use.
    pub transfer: TransferId,
    /// Source block ids, in order.
    pub blocks: Vec<u32>,
    /// Destination agent: `host:port`, or `local` for this node.
    pub peer: String,
    /// Destination region name, if the sender knows it.
    #[serde(default)]
    pub dst_region: Option<String>,
}

/// How a send went.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SendReport {
    /// The path taken.
    pub path: Path,
    /// Why the planner chose it.
    pub reason: String,
    /// Bytes moved.
    pub bytes: u64,
    /// Wall time in microseconds.
    pub micros: u64,
}

/// Send `args` within `deadline`.
pub async fn send(agent: &Arc<Agent>, args: SendArgs, deadline: Duration) -> Result<SendReport> {
    let started = Instant::now();
    let res = send_inner(agent, &args, deadline, started).await;
    match &res {
        Ok(r) => {
            agent
                .metrics
                .transfer_done(r.path, r.bytes, started.elapsed());
            tracing::debug!(transfer = %args.transfer, path = r.path.as_str(), bytes = r.bytes, "sent");
        }
        Err(e) => {
            agent.metrics.failure(e.code(), "send");
            tracing::warn!(transfer = %args.transfer, peer = %args.peer, error = %e, "send failed");
        }
    }
    res
}

async fn send_inner(
    agent: &Arc<Agent>,
    args: &SendArgs,
    deadline: Duration,
    started: Instant,
) -> Result<SendReport> {
    if args.blocks.is_empty() || args.blocks.len() > MAX_TRANSFER_BLOCKS {
        return Err(Error::BadRequest(format!(
            "a transfer has 1..={MAX_TRANSFER_BLOCKS} blocks"
        )));
    }
    let src = agent.state.lock().reg.region(args.region)?;
    if let Some(b) = args.blocks.iter().find(|b| **b >= src.layout.blocks) {
        return Err(Error::BadRequest(format!(
            "block {b} outside region of {} blocks",
            src.layout.blocks
        )));
    }
    let same_node =
        args.peer == "local" || args.peer == agent.address || args.peer == agent.cfg.agent_id;
    let until = tokio::time::Instant::now() + deadline;
    let link = if same_node {
        None
    } else {
        let l = tokio::time::timeout_at(until, link::get(agent, &args.peer))
            .await
            .map_err(|_| Error::Timeout(format!("connecting to {}", args.peer)))??;
        Some(l)
    };
    let gpu = agent.gpu.get(src.id);
    let p = plan(&PlanInput {
        same_node,
        src: if gpu.is_some() {
            MemKind::Gpu
        } else {
            MemKind::Host
        },
        dst: same_node.then_some(MemKind::Host),
        local: agent.caps,
        peer: link.as_ref().map(|l| l.caps),
    });
    agent.metrics.plan(p.path, p.reason);
    tracing::info!(transfer = %args.transfer, path = p.path.as_str(), reason = p.reason, "planned");
    let bytes = src.layout.transfer_bytes(args.blocks.len());
    // A GPU source goes through its host shadow unless the RDMA WRITEs read the device directly.
    let gpu = match gpu {
        Some(g) if p.path == Path::RdmaGpuDirect => Some(g),
        Some(g) => {
            stage(&g, &src, args).await?;
            None
        }
        None => None,
    };
    let path = match link {
        None => {
            copy_local(agent, &src, args).await?;
            p.path
        }
        Some(l) => {
            let rdma = rdma_setup(agent, &src, args, p.path, gpu.clone()).await;
            if let (None, Some(g)) = (&rdma, &gpu) {
                // Planned GPU-direct but RDMA is off for this send: TCP reads the shadow.
                stage(g, &src, args).await?;
            }
            send_remote(agent, &l, &src, args, rdma, deadline, until).await?
        }
    };
    let reason = if path == p.path {
        p.reason.to_string()
    } else {
        format!("{} (fell back to {})", p.reason, path.as_str())
    };
    Ok(SendReport {
        path,
        reason,
        bytes,
        micros: started.elapsed().as_micros() as u64,
    })
}

async fn copy_local(agent: &Arc<Agent>, src: &Arc<Region>, args: &SendArgs) -> Result<()> {
    let n = args.blocks.len() as u32;
    let expires = Instant::now() + agent.cfg.hold_ttl;
    let (dst, dst_blocks) = {
        let mut st = agent.state.lock();
        st.reg.clear_failure(&args.transfer);
        let r = st.reg.land(
            &args.transfer,
            &src.layout,
            n,
            args.dst_region.as_deref(),
            Some(src.id),
            expires,
        );
        agent.update_usage(&st);
        r?
    };
    let (s, d, blocks) = (Arc::clone(src), Arc::clone(&dst), args.blocks.clone());
    let dbl = dst_blocks.clone();
    let copied = tokio::task::spawn_blocking(move || -> Result<()> {
        let len = s.layout.block_len();
        for layer in 0..s.layout.layers {
            for (sb, db) in blocks.iter().zip(&dbl) {
                s.map.copy_to(
                    s.layout.offset(layer, *sb),
                    &d.map,
                    d.layout.offset(layer, *db),
                    len,
                )?;
            }
        }
        Ok(())
    })
    .await
    .map_err(|e| Error::Io(std::io::Error::other(e.to_string())))
    .and_then(|r| r);
    let mut st = agent.state.lock();
    match copied {
        Ok(()) => {
            st.reg
                .set_state(dst.id, &args.transfer, LeaseState::Arrived, expires)?;
        }
        Err(e) => {
            st.reg.release(dst.id, &args.transfer);
            st.reg
                .record_failure(&args.transfer, e.code(), e.to_string());
            agent.update_usage(&st);
            drop(st);
            agent.notify.notify_waiters();
            return Err(e);
        }
    }
    drop(st);
    agent.notify.notify_waiters();
    Ok(())
}

/// Removes the transfer from the link's table however the send ends.
struct Pending<'a> {
    link: &'a PeerLink,
    seq: u64,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.link.pending.lock().remove(&self.seq);
    }
}

async fn next_event(
    rx: &mut mpsc::Receiver<PeerEvent>,
    until: tokio::time::Instant,
    peer: &str,
) -> Result<PeerEvent> {
    match tokio::time::timeout_at(until, rx.recv()).await {
        Ok(Some(ev)) => Ok(ev),
        Ok(None) => Err(Error::PeerLost(format!(
            "{peer} went away during the transfer"
        ))),
        Err(_) => Err(Error::Timeout("transfer deadline passed".into())),
    }
}

/// What the RDMA side of a send brings to the offer: our queue pair and the source's MR
/// (`device`: the GPU buffer itself, GPU-direct; else host memory).
struct RdmaSend {
    ep: crate::rdma::Endpoint,
    mr: crate::rdma::MrInfo,
    device: bool,
}

/// How an offer ended when it did not deliver: retry over TCP with a fresh offer (the RDMA
/// attempt failed after the receiver accepted; the reason is a metric label), or give up.
enum Undelivered {
    RetryTcp(&'static str, Error),
    Failed(Error),
}

impl From<Error> for Undelivered {
    fn from(e: Error) -> Self {
        Undelivered::Failed(e)
    }
}

/// Copy a GPU region's sent blocks into its host shadow.
async fn stage(
    gpu: &Arc<crate::cuda::GpuRegion>,
    src: &Arc<Region>,
    args: &SendArgs,
) -> Result<()> {
    crate::gpu::GpuRegions::stage(
        Arc::clone(gpu),
        Arc::clone(&src.map),
        src.layout,
        args.blocks.clone(),
    )
    .await
}

/// Our half of an RDMA transfer when the planner chose RDMA: the source's memory region (the
/// device buffer for GPU-direct, else host memory) and a queue pair in INIT. None (logged and
/// counted) when anything fails: the send then uses TCP.
async fn rdma_setup(
    agent: &Arc<Agent>,
    src: &Arc<Region>,
    args: &SendArgs,
    planned: Path,
    gpu: Option<Arc<crate::cuda::GpuRegion>>,
) -> Option<RdmaSend> {
    let engine = agent.rdma.clone()?;
    if !matches!(planned, Path::RdmaHost | Path::RdmaGpuDirect) {
        return None;
    }
    let device_mr = match &gpu {
        Some(g) => {
            let (engine, g, id) = (Arc::clone(&engine), Arc::clone(g), src.id);
            match blocking(move || engine.register_gpu(id, &g)).await {
                Ok(mr) => Some(mr),
                Err(e) => {
                    fallback(agent, args, "gpu_register", &e);
                    None
                }
            }
        }
        None => None,
    };
    if let (Some(g), None) = (&gpu, device_mr) {
        // GPU-direct registration failed: go through host memory instead.
        if let Err(e) = stage(g, src, args).await {
            fallback(agent, args, "gpu_stage", &e);
            return None;
        }
    }
    let (map, region) = (Arc::clone(&src.map), src.id);
    let setup = blocking(move || -> Result<RdmaSend> {
        let (mr, device) = match device_mr {
            Some(mr) => (mr, true),
            None => (engine.register(region, &map)?, false),
        };
        Ok(RdmaSend {
            ep: engine.endpoint()?,
            mr,
            device,
        })
    })
    .await;
    match setup {
        Ok(r) => Some(r),
        Err(e) => {
            fallback(agent, args, "endpoint", &e);
            None
        }
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Io(std::io::Error::other(e.to_string())))?
}

/// Send to a peer: by RDMA when `rdma` is set and everything on the way works, else TCP.
/// Every fallback is logged with its reason and counted (`kvagent_rdma_fallbacks_total`).
async fn send_remote(
    agent: &Arc<Agent>,
    link: &Arc<PeerLink>,
    src: &Arc<Region>,
    args: &SendArgs,
    rdma: Option<RdmaSend>,
    deadline: Duration,
    until: tokio::time::Instant,
) -> Result<Path> {
    let gpu_direct = rdma.as_ref().is_some_and(|r| r.device);
    match offer_and_move(agent, link, src, args, rdma, deadline, until).await {
        Ok(Path::RdmaHost) if gpu_direct => Ok(Path::RdmaGpuDirect),
        Ok(path) => Ok(path),
        Err(Undelivered::Failed(e)) => Err(e),
        Err(Undelivered::RetryTcp(reason, e)) => {
            fallback(agent, args, reason, &e);
            if let Some(g) = agent.gpu.get(src.id) {
                // The WRITEs read the device; TCP reads the shadow, which must be filled first.
                stage(&g, src, args).await?;
            }
            match offer_and_move(agent, link, src, args, None, deadline, until).await {
                Ok(path) => Ok(path),
                Err(Undelivered::Failed(e) | Undelivered::RetryTcp(_, e)) => Err(e),
            }
        }
    }
}

fn fallback(agent: &Agent, args: &SendArgs, reason: &'static str, e: &Error) {
    agent.metrics.rdma_fallback(reason);
    tracing::warn!(transfer = %args.transfer, peer = %args.peer, reason, error = %e, "RDMA failed; sending over TCP");
}

/// One offer and its data: RDMA WRITEs when `rdma` is set and the receiver answered with a
/// target, TCP data streams otherwise.
async fn offer_and_move(
    agent: &Arc<Agent>,
    link: &Arc<PeerLink>,
    src: &Arc<Region>,
    args: &SendArgs,
    rdma: Option<RdmaSend>,
    deadline: Duration,
    until: tokio::time::Instant,
) -> std::result::Result<Path, Undelivered> {
    let seq = agent.next_id();
    let (tx, mut rx) = mpsc::channel(4);
    link.pending.lock().insert(seq, tx);
    let _pending = Pending { link, seq };
    let layout = src.layout;
    let offer = Ctrl::Offer {
        seq,
        transfer: args.transfer.clone(),
        dst_region: args.dst_region.clone(),
        block_bytes: layout.block_bytes,
        layers: layout.layers,
        blocks: args.blocks.len() as u32,
        deadline_ms: deadline.as_millis() as u64,
        rdma: rdma.as_ref().map(|r| r.ep.info()),
    };
    send_ctrl(link, offer, until).await?;
    let target = match next_event(&mut rx, until, &link.addr).await? {
        PeerEvent::Accepted(target) => target,
        PeerEvent::Failed(e) => return Err(e.into()),
        PeerEvent::Done => return Err(Error::Protocol("done before accept".into()).into()),
    };
    match (rdma, target) {
        (Some(r), Some(target)) => {
            match rdma_write(r, src, args, *target, until).await {
                Ok(()) => {}
                Err(e) => {
                    let abort = Ctrl::Abort {
                        seq,
                        reason: format!("RDMA failed: {e}"),
                    };
                    let _ = link.ctrl_tx.try_send(abort);
                    let reason = if e.code() == crate::error::ErrorCode::Protocol {
                        "bad_target"
                    } else {
                        "write"
                    };
                    return Err(Undelivered::RetryTcp(reason, e));
                }
            }
            send_ctrl(link, Ctrl::RdmaWritten { seq }, until).await?;
            match next_event(&mut rx, until, &link.addr).await? {
                PeerEvent::Done => Ok(Path::RdmaHost),
                PeerEvent::Failed(e) => Err(e.into()),
                PeerEvent::Accepted(_) => Err(Error::Protocol("second accept".into()).into()),
            }
        }
        (None, Some(_)) => {
            let _ = link.ctrl_tx.try_send(Ctrl::Abort {
                seq,
                reason: "RDMA target for an offer without RDMA".into(),
            });
            Err(Error::Protocol("peer answered a TCP offer with an RDMA target".into()).into())
        }
        (rdma, None) => {
            if let Some(r) = &rdma {
                // The receiver could not set up RDMA for this transfer: the data goes over TCP
                // on this same offer, from host memory.
                let e = Error::RdmaUnavailable("the receiver declined RDMA".into());
                fallback(agent, args, "peer_declined", &e);
                if let (true, Some(g)) = (r.device, agent.gpu.get(src.id)) {
                    stage(&g, src, args).await?;
                }
            }
            push_tcp(link, src, args, seq, &mut rx, until).await?;
            Ok(Path::Tcp)
        }
    }
}

/// Connect our queue pair to the receiver's and WRITE every segment, on the blocking pool.
async fn rdma_write(
    mut r: RdmaSend,
    src: &Arc<Region>,
    args: &SendArgs,
    target: crate::rdma::wire::RdmaTarget,
    until: tokio::time::Instant,
) -> Result<()> {
    let max_msg = 1 << 30;
    let ops = crate::rdma::book::write_plan(&src.layout, &args.blocks, &target, max_msg)?;
    let keep = Arc::clone(src);
    let deadline = until.into_std();
    tokio::task::spawn_blocking(move || -> Result<()> {
        let _mapped = keep; // the source stays mapped while WRITEs read it
        r.ep.connect(&target.qp)?;
        r.ep.write(&ops, &r.mr, &target, deadline)
    })
    .await
    .map_err(|e| Error::Io(std::io::Error::other(e.to_string())))?
}

/// The TCP data of an accepted offer, then the receiver's `done`.
async fn push_tcp(
    link: &Arc<PeerLink>,
    src: &Arc<Region>,
    args: &SendArgs,
    seq: u64,
    rx: &mut mpsc::Receiver<PeerEvent>,
    until: tokio::time::Instant,
) -> Result<()> {
    let layout = src.layout;
    let cancel = CancellationToken::new();
    let result = async {
        for (i, job) in split(seq, src, &args.blocks, &layout, link.data_tx.len(), &cancel)
            .into_iter()
            .enumerate()
        {
            let tx = &link.data_tx[i % link.data_tx.len()];
            tokio::time::timeout_at(until, tx.send(job))
                .await
                .map_err(|_| Error::Timeout("data streams busy past the deadline".into()))?
                .map_err(|_| Error::PeerLost(format!("{} link closed", link.addr)))?;
        }
        match next_event(rx, until, &link.addr).await? {
            PeerEvent::Done => Ok(()),
            PeerEvent::Failed(e) => Err(e),
            PeerEvent::Accepted(_) => Err(Error::Protocol("second accept".into())),
        }
    }
    .await;
    if let Err(e) = &result {
        cancel.cancel();
        if !matches!(e, Error::PeerLost(_) | Error::Remote { .. }) {
            let abort = Ctrl::Abort {
                seq,
                reason: e.to_string(),
            };
            let _ = link.ctrl_tx.try_send(abort);
        }
    }
    result
}

async fn send_ctrl(link: &PeerLink, msg: Ctrl, until: tokio::time::Instant) -> Result<()> {
    tokio::time::timeout_at(until, link.ctrl_tx.send(msg))
        .await
        .map_err(|_| Error::Timeout("control queue full past the deadline".into()))?
        .map_err(|_| Error::PeerLost(format!("{} link closed", link.addr)))
}

/// Split a transfer's segments into contiguous runs, one per data stream.
fn split(
    seq: u64,
    src: &Arc<Region>,
    blocks: &[u32],
    layout: &BlockLayout,
    streams: usize,
    cancel: &CancellationToken,
) -> Vec<DataJob> {
    let mut segs = Vec::with_capacity(blocks.len() * layout.layers as usize);
    for layer in 0..layout.layers {
        for (i, b) in blocks.iter().enumerate() {
            segs.push((i as u32, layer, *b));
        }
    }
    let per = segs.len().div_ceil(streams.max(1));
    segs.chunks(per.max(1))
        .map(|c| DataJob {
            seq,
            map: Arc::clone(&src.map),
            layout: *layout,
            segs: c.to_vec(),
            cancel: cancel.clone(),
        })
        .collect()
}
