//! The receiving side of the agent-to-agent protocol: accept connections, check hellos, run
//! control sessions (offers, aborts) and data streams that read payloads straight into the
//! landing blocks of the destination region.
//!
//! A session ends when its control connection ends; every transfer still arriving in it is
//! aborted with `peer_lost` and its blocks freed, so a sender that dies strands nothing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::agent::{abort_incoming_locked, Agent, Incoming};
use crate::error::{Error, ErrorCode, Result};
use crate::peer::proto::{self, Ctrl, DataHeader, Hello};
use crate::planner::Path;
use crate::rdma::wire::{QpInfo, RdmaTarget};
use crate::regions::LeaseState;
use crate::types::{BlockLayout, MAX_BLOCKS};

/// Accept peer connections until shutdown.
pub(crate) async fn serve(agent: Arc<Agent>, listener: TcpListener) {
    loop {
        let accepted = tokio::select! {
            () = agent.stop.cancelled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((sock, from)) => {
                let a = Arc::clone(&agent);
                agent.tasks.spawn(async move {
                    if let Err(e) = handle(&a, sock).await {
                        tracing::warn!(%from, error = %e, "peer connection ended");
                    }
                });
            }
            Err(e) => tracing::warn!(error = %e, "peer accept failed"),
        }
    }
}

async fn reply(sock: &mut TcpStream, status: u8, caps: u32, session: u64) -> Result<()> {
    let h = Hello {
        version: proto::VERSION,
        kind: status,
        caps,
        session,
    };
    sock.write_all(&h.encode()).await?;
    Ok(())
}

async fn handle(agent: &Arc<Agent>, mut sock: TcpStream) -> Result<()> {
    sock.set_nodelay(true)?;
    let mut buf = [0u8; proto::HELLO_LEN];
    tokio::time::timeout(agent.cfg.connect_timeout, sock.read_exact(&mut buf))
        .await
        .map_err(|_| Error::Timeout("hello".into()))??;
    let hello = match Hello::decode(&buf) {
        Ok(h) => h,
        Err(e) => {
            let _ = reply(&mut sock, proto::ST_BAD, 0, 0).await;
            return Err(e);
        }
    };
    let caps = agent.caps.0;
    if hello.version != proto::VERSION {
        agent
            .metrics
            .failure(ErrorCode::UnsupportedVersion, "receive");
        let _ = reply(&mut sock, proto::ST_VERSION, caps, 0).await;
        return Err(Error::VersionMismatch {
            ours: proto::VERSION,
            theirs: hello.version,
        });
    }
    match hello.kind {
        proto::KIND_CONTROL => {
            let opened = {
                let mut st = agent.state.lock();
                if st.sessions.len() >= agent.cfg.max_peer_sessions {
                    None
                } else {
                    let session = agent.next_id();
                    let (tx, rx) = mpsc::channel(1024);
                    st.sessions.insert(session, tx);
                    Some((session, rx))
                }
            };
            let Some((session, rx)) = opened else {
                let _ = reply(&mut sock, proto::ST_LIMIT, caps, 0).await;
                return Err(Error::Limit("peer sessions".into()));
            };
            reply(&mut sock, proto::ST_OK, caps, session).await?;
            let res = control(agent, sock, session, rx).await;
            end_session(agent, session);
            res
        }
        proto::KIND_DATA => {
            if !agent.state.lock().sessions.contains_key(&hello.session) {
                let _ = reply(&mut sock, proto::ST_SESSION, caps, 0).await;
                return Err(Error::Protocol(format!(
                    "data stream for unknown session {}",
                    hello.session
                )));
            }
            reply(&mut sock, proto::ST_OK, caps, hello.session).await?;
            data(agent, sock, hello.session).await
        }
        k => {
            let _ = reply(&mut sock, proto::ST_BAD, caps, 0).await;
            Err(Error::Protocol(format!("unknown connection kind {k}")))
        }
    }
}

fn end_session(agent: &Agent, session: u64) {
    let mut st = agent.state.lock();
    st.sessions.remove(&session);
    let keys: Vec<_> = st
        .incoming
        .keys()
        .filter(|(s, _)| *s == session)
        .copied()
        .collect();
    for k in keys {
        abort_incoming_locked(
            agent,
            &mut st,
            k,
            ErrorCode::PeerLost,
            "sending agent disconnected",
        );
    }
}

async fn control(
    agent: &Arc<Agent>,
    sock: TcpStream,
    session: u64,
    mut rx: mpsc::Receiver<Ctrl>,
) -> Result<()> {
    let (mut rd, mut wr) = sock.into_split();
    let stop = agent.stop.child_token();
    let writer_stop = stop.clone();
    agent.tasks.spawn(async move {
        loop {
            let msg = tokio::select! {
                () = writer_stop.cancelled() => return,
                m = rx.recv() => m,
            };
            let Some(msg) = msg else { return };
            if proto::write_ctrl(&mut wr, &msg).await.is_err() {
                writer_stop.cancel();
                return;
            }
        }
    });
    let _stop_writer = stop.clone().drop_guard();
    let mut buf = Vec::new();
    loop {
        let msg = tokio::select! {
            () = stop.cancelled() => return Ok(()),
            m = proto::read_ctrl(&mut rd, &mut buf) => m?,
        };
        match msg {
            None => {
                return Err(Error::PeerLost(
                    "sender closed the control connection".into(),
                ))
            }
            Some(Ctrl::Offer {
                seq,
                transfer,
                dst_region,
                block_bytes,
                layers,
                blocks,
                deadline_ms,
                rdma,
            }) => {
                let layout = BlockLayout {
                    block_bytes,
                    layers,
                    blocks,
                };
                let mut answer = offer(
                    agent,
                    session,
                    seq,
                    transfer,
                    dst_region,
                    layout,
                    deadline_ms,
                );
                if let (Ctrl::Accept { .. }, Some(qp)) = (&answer, rdma) {
                    answer = accept_rdma(agent, session, seq, qp).await;
                }
                let tx = agent.state.lock().sessions.get(&session).cloned();
                if let Some(tx) = tx {
                    let _ = tokio::time::timeout(agent.cfg.io_timeout, tx.send(answer)).await;
                }
            }
            Some(Ctrl::RdmaWritten { seq }) => rdma_written(agent, session, seq),
            Some(Ctrl::Abort { seq, reason }) => {
                let mut st = agent.state.lock();
                abort_incoming_locked(
                    agent,
                    &mut st,
                    (session, seq),
                    ErrorCode::Aborted,
                    &format!("sender aborted: {reason}"),
                );
            }
            Some(other) => {
                return Err(Error::Protocol(format!(
                    "unexpected {other:?} from a sender"
                )))
            }
        }
    }
}

fn offer(
    agent: &Agent,
    session: u64,
    seq: u64,
    tid: crate::types::TransferId,
    dst: Option<String>,
    layout: BlockLayout,
    deadline_ms: u64,
) -> Ctrl {
    let reject = |e: Error| {
        agent.metrics.failure(e.code(), "receive");
        tracing::info!(transfer = %tid, error = %e, "offer rejected");
        Ctrl::Reject {
            seq,
            code: e.code(),
            message: e.to_string(),
        }
    };
    if layout.blocks == 0
        || layout.blocks > MAX_BLOCKS
        || layout.block_bytes == 0
        || layout.block_bytes > u64::from(u32::MAX)
    {
        return reject(Error::BadRequest("offer out of bounds".into()));
    }
    let deadline = Duration::from_millis(deadline_ms).min(agent.cfg.max_deadline);
    let mut st = agent.state.lock();
    if st.incoming.len() >= agent.cfg.max_inflight {
        drop(st);
        return reject(Error::Limit("too many incoming transfers".into()));
    }
    if st.incoming.contains_key(&(session, seq)) {
        drop(st);
        return reject(Error::Protocol(format!("sequence {seq} reused")));
    }
    st.reg.clear_failure(&tid);
    let landed = st.reg.land(
        &tid,
        &layout,
        layout.blocks,
        dst.as_deref(),
        None,
        Instant::now() + deadline,
    );
    match landed {
        Ok((region, blocks)) => {
            let expected = region.layout.transfer_bytes(blocks.len());
            st.incoming.insert(
                (session, seq),
                Incoming {
                    region: region.id,
                    tid,
                    map: Arc::clone(&region.map),
                    layout: region.layout,
                    blocks,
                    expected,
                    received: 0,
                    writers: 0,
                    aborted: false,
                    started: Instant::now(),
                    rdma: None,
                },
            );
            agent.update_usage(&st);
            Ctrl::Accept { seq, rdma: None }
        }
        Err(e) => {
            drop(st);
            reject(e)
        }
    }
}

/// Where a data frame lands, or None when its transfer is gone (the payload is discarded).
fn begin_write(
    agent: &Agent,
    session: u64,
    h: &DataHeader,
) -> Result<Option<(Arc<crate::shm::Mapping>, usize)>> {
    let mut st = agent.state.lock();
    let Some(inc) = st.incoming.get_mut(&(session, h.seq)) else {
        return Ok(None);
    };
    if inc.aborted {
        return Ok(None);
    }
    let end = u64::from(h.offset) + u64::from(h.len);
    let Some(&block) = inc.blocks.get(h.block as usize) else {
        return Err(Error::Protocol(format!(
            "block index {} out of range",
            h.block
        )));
    };
    if h.layer >= inc.layout.layers || end > inc.layout.block_bytes {
        return Err(Error::Protocol("segment out of range".into()));
    }
    inc.writers += 1;
    Ok(Some((
        Arc::clone(&inc.map),
        inc.layout.offset(h.layer, block) + h.offset as usize,
    )))
}

fn end_write(agent: &Agent, session: u64, seq: u64, len: u64, ok: bool) {
    let mut st = agent.state.lock();
    let key = (session, seq);
    let Some(inc) = st.incoming.get_mut(&key) else {
        return;
    };
    inc.writers -= 1;
    if ok {
        inc.received += len;
    }
    if inc.aborted {
        if inc.writers == 0 {
            let (r, t) = (inc.region, inc.tid.clone());
            st.incoming.remove(&key);
            st.reg.release(r, &t);
            agent.update_usage(&st);
        }
        return;
    }
    if !ok {
        abort_incoming_locked(
            agent,
            &mut st,
            key,
            ErrorCode::PeerLost,
            "data stream broke mid-payload",
        );
        return;
    }
    if inc.received >= inc.expected && inc.writers == 0 {
        finish_locked(agent, st, session, seq, Path::Tcp);
    }
}

/// Every byte of incoming `(session, seq)` is in place: mark its blocks arrived, count it,
/// answer `done` and wake the waiters.
fn finish_locked(
    agent: &Agent,
    mut st: parking_lot::MutexGuard<'_, crate::agent::State>,
    session: u64,
    seq: u64,
    path: Path,
) {
    let Some(done) = st.incoming.remove(&(session, seq)) else {
        return;
    };
    let _ = st.reg.set_state(
        done.region,
        &done.tid,
        LeaseState::Arrived,
        Instant::now() + agent.cfg.hold_ttl,
    );
    agent
        .metrics
        .transfer_done(path, done.expected, done.started.elapsed());
    if let Some(tx) = st.sessions.get(&session) {
        let _ = tx.try_send(Ctrl::Done { seq });
    }
    drop(st);
    tracing::debug!(transfer = %done.tid, bytes = done.expected, path = path.as_str(), "transfer arrived");
    agent.notify.notify_waiters();
}

/// The offer carried the sender's queue pair: register the landing region, connect a queue pair
/// of our own to the sender's and answer where to write. Any failure answers a plain accept, so
/// the sender moves the data over TCP on the same offer (and counts the fallback).
async fn accept_rdma(agent: &Arc<Agent>, session: u64, seq: u64, qp: QpInfo) -> Ctrl {
    let plain = Ctrl::Accept { seq, rdma: None };
    let Some(engine) = agent.rdma.clone() else {
        // We do not announce RDMA, so a sender should not have asked; TCP it is.
        return plain;
    };
    let landing = {
        let st = agent.state.lock();
        st.incoming.get(&(session, seq)).map(|inc| {
            (
                inc.region,
                Arc::clone(&inc.map),
                inc.layout,
                inc.blocks.clone(),
            )
        })
    };
    let Some((region, map, layout, blocks)) = landing else {
        return plain;
    };
    let setup =
        tokio::task::spawn_blocking(move || -> Result<(crate::rdma::Endpoint, RdmaTarget)> {
            qp.validate()?;
            let mr = engine.register(region, &map)?;
            let mut ep = engine.endpoint()?;
            ep.connect(&qp)?;
            let target = RdmaTarget {
                qp: ep.info(),
                addr: mr.addr,
                rkey: mr.rkey,
                len: mr.len,
                layout,
                blocks,
            };
            Ok((ep, target))
        })
        .await
        .map_err(|e| Error::Io(std::io::Error::other(e.to_string())))
        .and_then(|r| r);
    match setup {
        Ok((ep, target)) => {
            let mut st = agent.state.lock();
            match st.incoming.get_mut(&(session, seq)) {
                Some(inc) if !inc.aborted => {
                    inc.rdma = Some(ep);
                    Ctrl::Accept {
                        seq,
                        rdma: Some(Box::new(target)),
                    }
                }
                _ => plain,
            }
        }
        Err(e) => {
            agent.metrics.rdma_fallback("receiver_setup");
            tracing::warn!(session, seq, error = %e, "RDMA set-up for an incoming transfer failed; asking for TCP");
            plain
        }
    }
}

/// The sender says every RDMA WRITE of `(session, seq)` completed.
fn rdma_written(agent: &Agent, session: u64, seq: u64) {
    let mut st = agent.state.lock();
    let Some(inc) = st.incoming.get_mut(&(session, seq)) else {
        return;
    };
    if inc.aborted {
        return;
    }
    if inc.rdma.is_none() {
        abort_incoming_locked(
            agent,
            &mut st,
            (session, seq),
            ErrorCode::Protocol,
            "rdma_written for a transfer accepted over TCP",
        );
        return;
    }
    inc.received = inc.expected;
    // The queue pair has done its job; destroy it now rather than with the entry.
    inc.rdma = None;
    finish_locked(agent, st, session, seq, Path::RdmaHost);
}

async fn data(agent: &Arc<Agent>, mut sock: TcpStream, session: u64) -> Result<()> {
    let mut hdr = [0u8; proto::HELLO_LEN];
    let mut scrap: Vec<u8> = Vec::new();
    let io = agent.cfg.io_timeout;
    loop {
        tokio::select! {
            () = agent.stop.cancelled() => return Ok(()),
            r = sock.read_exact(&mut hdr) => match r {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e.into()),
            },
        }
        let h = DataHeader::decode(&hdr);
        match begin_write(agent, session, &h)? {
            Some((map, off)) => {
                // SAFETY: the lease gives this frame's range to this reader alone (the sender
                // sends each segment once) and the slice ends with the read.
                let read = match unsafe { map.slice_mut(off, h.len as usize) } {
                    Ok(dst) => tokio::time::timeout(io, sock.read_exact(dst))
                        .await
                        .is_ok_and(|r| r.is_ok()),
                    Err(_) => false,
                };
                end_write(agent, session, h.seq, u64::from(h.len), read);
                if !read {
                    return Err(Error::PeerLost("data stream broke mid-payload".into()));
                }
            }
            None => {
                // A transfer that was aborted or timed out: read and drop its bytes, in a reused
                // buffer, so the stream stays in frame for the next transfer.
                let mut left = h.len as usize;
                scrap.resize(scrap.len().max(left.min(1 << 20)), 0);
                while left > 0 {
                    let n = left.min(scrap.len());
                    tokio::time::timeout(io, sock.read_exact(&mut scrap[..n]))
                        .await
                        .map_err(|_| Error::Timeout("discarding payload".into()))??;
                    left -= n;
                }
            }
        }
    }
}
