//! Sequence tracking of one KV event stream (docs/wire-formats.md §1.2, §1.5):
//! what to do with each live batch given what was applied so far. Pure, so
//! every path is unit-tested without sockets.
//!
//! * the next sequence number: apply;
//! * one already applied (it arrived by replay first): skip;
//! * a jump forward: the batches in between are lost; replay them;
//! * a sequence at or below the last *live* one: the engine restarted (its
//!   sequence starts at 0 per process); clear the pod and resync.

/// What to do with a live batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Apply,
    /// Already applied (by a replay); skip it.
    Duplicate,
    /// Batches `from..seq` are missing.
    Gap {
        from: u64,
    },
    /// The engine restarted: forget the pod, then resync from 0.
    Restart,
}

/// See the module docs.
#[derive(Debug, Clone, Default)]
pub struct Tracker {
    /// Highest sequence applied since the last (re)start of the engine.
    applied: Option<u64>,
    /// Highest sequence seen on the live stream.
    live: Option<u64>,
}

impl Tracker {
    /// Classifies live batch `seq` (and remembers it as seen).
    pub fn on_live(&mut self, seq: u64) -> Step {
        let restarted = matches!(self.live, Some(l) if seq <= l);
        self.live = Some(seq);
        if restarted {
            self.applied = None;
            return Step::Restart;
        }
        match self.applied {
            None => Step::Apply,
            Some(a) if seq <= a => Step::Duplicate,
            Some(a) if seq == a + 1 => Step::Apply,
            Some(a) => Step::Gap { from: a + 1 },
        }
    }

    /// Whether a replayed batch `seq` is new.
    pub fn wants(&self, seq: u64) -> bool {
        self.applied.is_none_or(|a| seq > a)
    }

    /// Marks `seq` applied.
    pub fn applied(&mut self, seq: u64) {
        self.applied = Some(self.applied.map_or(seq, |a| a.max(seq)));
    }

    /// The next sequence a replay should start from.
    pub fn next(&self) -> u64 {
        self.applied.map_or(0, |a| a + 1)
    }

    pub fn last_applied(&self) -> Option<u64> {
        self.applied
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_then_gap_then_duplicate() {
        let mut t = Tracker::default();
        assert_eq!(t.on_live(5), Step::Apply);
        t.applied(5);
        assert_eq!(t.on_live(6), Step::Apply);
        t.applied(6);
        assert_eq!(t.on_live(9), Step::Gap { from: 7 });
        // The replay brought 7..=9; 9 arrives live later only in theory, and
        // a replayed batch already applied is not wanted again.
        for s in 7..=9 {
            assert!(t.wants(s));
            t.applied(s);
        }
        assert!(!t.wants(8));
        assert_eq!(t.next(), 10);
        assert_eq!(t.on_live(10), Step::Apply);
    }

    #[test]
    fn first_join_replay_makes_live_batches_duplicates() {
        let mut t = Tracker::default();
        for s in 0..=3 {
            t.applied(s);
        }
        assert_eq!(t.on_live(2), Step::Duplicate);
        assert_eq!(t.on_live(3), Step::Duplicate);
        assert_eq!(t.on_live(4), Step::Apply);
    }

    #[test]
    fn sequence_going_back_is_a_restart() {
        let mut t = Tracker::default();
        assert_eq!(t.on_live(0), Step::Apply);
        t.applied(0);
        assert_eq!(t.on_live(1), Step::Apply);
        t.applied(1);
        assert_eq!(t.on_live(0), Step::Restart);
        assert_eq!(t.last_applied(), None);
        assert!(t.wants(0));
        assert_eq!(t.next(), 0);
    }
}
