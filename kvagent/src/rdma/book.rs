//! The bookkeeping of an RDMA transfer that needs no hardware, so it is tested on any machine:
//! which RDMA WRITEs move a transfer ([`write_plan`]), the RC queue-pair state machine
//! ([`QpStateMachine`]), and the completion accounting with its deadline ([`Completions`]).
//! The verbs layer (`verbs.rs`, feature `rdma`) only executes what these decide.

use std::time::Instant;

use crate::error::{Error, Result};
use crate::rdma::wire::RdmaTarget;
use crate::types::BlockLayout;

/// One RDMA WRITE: `len` bytes from `local` (offset in the sender's region) to `remote` (offset in
/// the receiver's region).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOp {
    /// Offset in the source region.
    pub local: u64,
    /// Offset in the destination region.
    pub remote: u64,
    /// Bytes.
    pub len: u32,
}

/// The WRITEs that move `blocks` of a region with layout `src` into `target`'s landing blocks:
/// one segment per (layer, block), runs that are contiguous on both sides merged, every WRITE at
/// most `max_msg` bytes (the device's limit; verbs lengths are 32-bit). Every remote range is
/// checked against the target's registered length.
pub fn write_plan(
    src: &BlockLayout,
    blocks: &[u32],
    target: &RdmaTarget,
    max_msg: u32,
) -> Result<Vec<WriteOp>> {
    target.validate(src, blocks.len())?;
    if max_msg == 0 {
        return Err(Error::BadRequest("max_msg must be positive".into()));
    }
    let seg = src.block_bytes;
    let mut runs: Vec<(u64, u64, u64)> = Vec::new();
    for layer in 0..src.layers {
        for (sb, db) in blocks.iter().zip(&target.blocks) {
            let local = src.offset(layer, *sb) as u64;
            let remote = target.layout.offset(layer, *db) as u64;
            if remote.checked_add(seg).is_none_or(|end| end > target.len) {
                return Err(Error::Protocol(format!(
                    "segment at {remote} outside the {}-byte remote region",
                    target.len
                )));
            }
            match runs.last_mut() {
                Some((l, r, n)) if *l + *n == local && *r + *n == remote => *n += seg,
                _ => runs.push((local, remote, seg)),
            }
        }
    }
    let mut ops = Vec::with_capacity(runs.len());
    for (local, remote, len) in runs {
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(u64::from(max_msg));
            ops.push(WriteOp {
                local: local + done,
                remote: remote + done,
                len: u32::try_from(n).unwrap_or(max_msg),
            });
            done += n;
        }
    }
    Ok(ops)
}

/// RC queue-pair states, as verbs names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Just created.
    Reset,
    /// Bound to a port and access flags.
    Init,
    /// Ready to receive: knows the remote QPN, PSN and route.
    Rtr,
    /// Ready to send.
    Rts,
    /// Broken (a failed transition or a failed completion); only destruction follows.
    Error,
}

/// Tracks a queue pair's state so that every `modify` follows the RC sequence
/// Reset → Init → RTR → RTS, and a failure anywhere parks it in `Error`.
#[derive(Debug, Clone)]
pub struct QpStateMachine {
    state: QpState,
}

impl Default for QpStateMachine {
    fn default() -> Self {
        Self {
            state: QpState::Reset,
        }
    }
}

impl QpStateMachine {
    /// Current state.
    pub fn state(&self) -> QpState {
        self.state
    }

    /// Check that `to` is the next RC state (call before the verbs `modify`).
    pub fn check(&self, to: QpState) -> Result<()> {
        let ok = matches!(
            (self.state, to),
            (QpState::Reset, QpState::Init)
                | (QpState::Init, QpState::Rtr)
                | (QpState::Rtr, QpState::Rts)
        );
        if ok {
            Ok(())
        } else {
            Err(Error::Protocol(format!(
                "queue pair cannot go from {:?} to {to:?}",
                self.state
            )))
        }
    }

    /// Record the outcome of a `modify` to `to`: the new state, or `Error` on failure.
    pub fn record(&mut self, to: QpState, ok: bool) {
        self.state = if ok { to } else { QpState::Error };
    }

    /// Park the queue pair in `Error` (a failed work completion).
    pub fn fail(&mut self) {
        self.state = QpState::Error;
    }

    /// Whether WRITEs may be posted.
    pub fn can_send(&self) -> bool {
        self.state == QpState::Rts
    }
}

/// Outstanding signalled WRITEs of one transfer and its deadline. Work requests are numbered from
/// 0; at most `window` are posted and unfinished at once (bounded send queue).
#[derive(Debug)]
pub struct Completions {
    total: usize,
    posted: usize,
    done: usize,
    window: usize,
    deadline: Instant,
    failed: Option<String>,
}

impl Completions {
    /// `total` WRITEs, at most `window` in flight, all complete by `deadline`.
    pub fn new(total: usize, window: usize, deadline: Instant) -> Self {
        Self {
            total,
            posted: 0,
            done: 0,
            window: window.max(1),
            deadline,
            failed: None,
        }
    }

    /// How many more WRITEs may be posted now (the next ids start at [`Completions::posted`]).
    pub fn room(&self) -> usize {
        if self.failed.is_some() {
            return 0;
        }
        let in_flight = self.posted - self.done;
        (self.window - in_flight).min(self.total - self.posted)
    }

    /// Ids posted so far.
    pub fn posted(&self) -> usize {
        self.posted
    }

    /// Record that `n` more WRITEs were posted.
    pub fn on_posted(&mut self, n: usize) {
        self.posted = (self.posted + n).min(self.total);
    }

    /// Record one work completion: `wr_id` and whether its status was success (`detail` names the
    /// status otherwise). A completion for an id never posted is a protocol error.
    pub fn on_completion(&mut self, wr_id: u64, ok: bool, detail: &str) -> Result<()> {
        let id = usize::try_from(wr_id).unwrap_or(usize::MAX);
        if id >= self.posted {
            self.failed = Some(format!("completion for unposted work request {wr_id}"));
            return Err(Error::Protocol(format!(
                "completion for unposted work request {wr_id}"
            )));
        }
        if !ok {
            self.failed = Some(format!("work request {wr_id}: {detail}"));
            return Err(Error::Io(std::io::Error::other(format!(
                "RDMA WRITE {wr_id} failed: {detail}"
            ))));
        }
        self.done += 1;
        Ok(())
    }

    /// Whether every WRITE completed.
    pub fn finished(&self) -> bool {
        self.failed.is_none() && self.done == self.total
    }

    /// Check the deadline (call between polls): a timeout error once it passed unfinished.
    pub fn check_deadline(&self, now: Instant) -> Result<()> {
        if !self.finished() && now >= self.deadline {
            return Err(Error::Timeout(format!(
                "RDMA WRITEs: {} of {} completed by the deadline",
                self.done, self.total
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::rdma::wire::QpInfo;
    use std::time::Duration;

    fn layout(blocks: u32) -> BlockLayout {
        BlockLayout {
            block_bytes: 1000,
            layers: 2,
            blocks,
        }
    }

    fn target(blocks: Vec<u32>) -> RdmaTarget {
        RdmaTarget {
            qp: QpInfo {
                qpn: 7,
                psn: 1,
                lid: 3,
                gid: std::net::Ipv6Addr::UNSPECIFIED,
                mtu: 1024,
            },
            addr: 0,
            rkey: 1,
            len: 2 * 8 * 1000,
            layout: layout(8),
            blocks,
        }
    }

    #[test]
    fn contiguous_runs_merge_and_scattered_blocks_do_not() {
        // Source blocks 2,3 land in 5,6: both sides contiguous within a layer -> one WRITE per layer.
        let ops = write_plan(&layout(4), &[2, 3], &target(vec![5, 6]), 1 << 20).unwrap();
        assert_eq!(
            ops,
            vec![
                WriteOp {
                    local: 2000,
                    remote: 5000,
                    len: 2000
                },
                WriteOp {
                    local: 6000,
                    remote: 13000,
                    len: 2000
                },
            ]
        );
        // Reversed landing order: nothing merges, every byte still planned once.
        let ops = write_plan(&layout(4), &[2, 3], &target(vec![6, 5]), 1 << 20).unwrap();
        assert_eq!(ops.len(), 4);
        assert_eq!(ops.iter().map(|o| u64::from(o.len)).sum::<u64>(), 4 * 1000);
        assert_eq!(
            ops[0],
            WriteOp {
                local: 2000,
                remote: 6000,
                len: 1000
            }
        );
    }

    #[test]
    fn large_runs_split_at_the_message_limit() {
        let ops = write_plan(&layout(4), &[0, 1, 2], &target(vec![0, 1, 2]), 1024).unwrap();
        assert!(ops.iter().all(|o| o.len <= 1024));
        assert_eq!(
            ops.iter().map(|o| u64::from(o.len)).sum::<u64>(),
            2 * 3 * 1000
        );
        assert_eq!(ops[1].local, 1024);
        assert!(write_plan(&layout(4), &[0], &target(vec![0]), 0).is_err());
    }

    #[test]
    fn a_target_that_does_not_fit_is_refused_before_any_write() {
        let mut t = target(vec![7]);
        t.len = 7000; // the layer-1 copy of block 7 would end past the registered bytes
        assert!(write_plan(&layout(4), &[0], &t, 4096).is_err());
        assert!(write_plan(&layout(4), &[0, 1], &target(vec![0]), 4096).is_err());
    }

    #[test]
    fn the_queue_pair_follows_the_rc_sequence() {
        let mut qp = QpStateMachine::default();
        assert!(qp.check(QpState::Rtr).is_err(), "RTR before INIT");
        for s in [QpState::Init, QpState::Rtr, QpState::Rts] {
            assert!(!qp.can_send());
            qp.check(s).unwrap();
            qp.record(s, true);
        }
        assert!(qp.can_send());
        assert!(qp.check(QpState::Init).is_err());
        qp.fail();
        assert_eq!(qp.state(), QpState::Error);
        assert!(!qp.can_send());
        let mut qp = QpStateMachine::default();
        qp.record(QpState::Init, false);
        assert_eq!(qp.state(), QpState::Error);
        assert!(qp.check(QpState::Rtr).is_err());
    }

    #[test]
    fn completions_are_windowed_counted_and_bounded_in_time() {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut c = Completions::new(5, 2, deadline);
        assert_eq!(c.room(), 2);
        c.on_posted(2);
        assert_eq!(c.room(), 0, "window full");
        c.on_completion(0, true, "").unwrap();
        assert_eq!(c.room(), 1);
        assert!(c.on_completion(4, true, "").is_err(), "never posted");
        let mut c = Completions::new(3, 8, deadline);
        c.on_posted(c.room());
        for id in 0..3 {
            c.on_completion(id, true, "").unwrap();
        }
        assert!(c.finished());
        c.check_deadline(deadline + Duration::from_secs(1)).unwrap();
        let mut c = Completions::new(2, 8, deadline);
        c.on_posted(2);
        let e = c
            .on_completion(1, false, "remote access error")
            .unwrap_err();
        assert!(e.to_string().contains("remote access error"), "{e}");
        assert!(!c.finished());
        assert_eq!(c.room(), 0);
        let c = Completions::new(1, 1, deadline);
        let e = c.check_deadline(deadline).unwrap_err();
        assert_eq!(e.code(), crate::error::ErrorCode::Timeout);
    }
}
