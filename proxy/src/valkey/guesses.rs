//! Approximate mode on Valkey (`prefix.tokenizer: none`): engines without KV
//! events, so nobody knows what a pod cached, only where requests were sent.
//! Each sidecar writes its routing decisions to Valkey as *guesses*: for
//! each text block key of the prompt, the target pod's member holds it
//! until `approx_ttl` from now (`kvmesh_guess`, under the target's stripe
//! of the request's model, as that pod's own blocks would be). Every
//! sidecar's lookup reads them ([`super::Lookup::approximate`]), so a prefix
//! one sidecar sent to a pod draws the fleet's next requests for it there,
//! as the mesh's `Decision` frames do. A guess nobody renews expires.
//!
//! * The target is named by its member, which the lookups returned with its
//!   record (the local pod's is the writer's own). A pod no lookup has named
//!   yet gets no guess (`unknown_pod`): it was chosen without the index, and
//!   the next decision for the prompt is made with it.
//! * Decisions are gathered for `flush_interval` and written per (stripe,
//!   member), up to [`WRITE_BATCH`] keys a call.
//! * A key written for a member within the last quarter of `approx_ttl` is
//!   not written again: a prompt sent over and over costs a write per
//!   quarter, not per request, so its guess lives at least 3/4 of the TTL
//!   past its last decision. A decision's keys are written as a prefix of
//!   its chain (up to the last one not written lately), so that a pod's
//!   guesses expire tail first.
//! * Guesses are a hint: one that fails to be written is dropped (counted),
//!   and at most [`MAX_PENDING`] keys wait.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_filters::prefix::hash::BlockKey;
use tokio::sync::broadcast;
use tokio::time::Instant;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::keys::{stripe_of, Tag};
use super::lookup::MAX_LOOKUP_BLOCKS;
use super::Valkey;
use crate::prefix::ApproxDecision;
use crate::shutdown::Shutdown;

/// Most keys one `kvmesh_guess` carries.
const WRITE_BATCH: usize = 512;
/// Deadline of one write: nobody waits for it.
const WRITE_DEADLINE: Duration = Duration::from_millis(500);
/// Most keys waiting to be written; past it a decision is dropped.
const MAX_PENDING: usize = 1 << 16;
/// Most (member, key) pairs remembered as written lately.
const MAX_WRITTEN: usize = 1 << 17;

/// See the module docs.
struct Guesses {
    valkey: Arc<Valkey>,
    local_id: String,
    ttl: Duration,
    /// Keys to write, per (tag, member).
    pending: HashMap<(Tag, String), Vec<BlockKey>>,
    pending_keys: usize,
    /// When each (member, key) was last written (by [`pair`]).
    written: HashMap<u64, Instant>,
}

/// Writes the sidecar's approximate decisions from `decisions` until
/// shutdown (see the module docs).
pub async fn run(
    valkey: Arc<Valkey>,
    local_id: String,
    mut decisions: broadcast::Receiver<Arc<ApproxDecision>>,
    shutdown: Shutdown,
) {
    let cfg = valkey.store.config().clone();
    let mut g = Guesses {
        valkey,
        local_id,
        ttl: cfg.approx_ttl.get(),
        pending: HashMap::new(),
        pending_keys: 0,
        written: HashMap::new(),
    };
    let every = cfg.flush_interval.get();
    let mut flush_at: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = shutdown.triggered() => return,
            d = decisions.recv() => match d {
                Ok(d) => g.add(&d, Instant::now()),
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    let n = usize::try_from(n).unwrap_or(usize::MAX);
                    g.valkey.metrics.guesses("dropped", n);
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
            _ = super::sleep_until(flush_at) => {
                g.flush().await;
                flush_at = None;
            }
        }
        if flush_at.is_none() && g.pending_keys > 0 {
            flush_at = Some(Instant::now() + every);
        }
    }
}

impl Guesses {
    /// Queues decision `d`'s keys not written for its pod lately.
    fn add(&mut self, d: &ApproxDecision, now: Instant) {
        let m = &self.valkey.metrics;
        let keys = &d.keys[..d.keys.len().min(MAX_LOOKUP_BLOCKS)];
        let Some(member) = self.valkey.member_of(&d.pod, &self.local_id) else {
            m.guesses("unknown_pod", keys.len());
            return;
        };
        if self.pending_keys + keys.len() > MAX_PENDING {
            m.guesses("dropped", keys.len());
            return;
        }
        let fresh = self.ttl / 4;
        if self.written.len() + keys.len() > MAX_WRITTEN {
            self.written
                .retain(|_, at| now.saturating_duration_since(*at) < fresh);
            if self.written.len() + keys.len() > MAX_WRITTEN {
                self.written.clear();
            }
        }
        // Written as a prefix of the chain, up to the last key not written
        // lately: every write then gives its keys the newest expiry, so a
        // pod's guesses expire tail first, as a lookup's binary searches
        // assume (a pod holding a block holds the blocks before it).
        let seed = xxh3_64(member.as_bytes());
        let stale = |k: &BlockKey| {
            self.written
                .get(&pair(seed, *k))
                .is_none_or(|at| now.saturating_duration_since(*at) >= fresh)
        };
        let Some(last) = keys.iter().rposition(stale) else {
            m.guesses("skipped", keys.len());
            return;
        };
        let new = &keys[..=last];
        for &k in new {
            self.written.insert(pair(seed, k), now);
        }
        m.guesses("skipped", keys.len() - new.len());
        let cfg = self.valkey.store.config();
        let tag = Tag::new(&cfg.key_prefix, &d.model, stripe_of(&d.pod, cfg.stripes));
        self.pending_keys += new.len();
        self.pending
            .entry((tag, member))
            .or_default()
            .extend_from_slice(new);
    }

    /// Writes what waits; what fails is dropped (and may be written by the
    /// next decision that makes the guess).
    async fn flush(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        self.pending_keys = 0;
        let valkey = self.valkey.clone();
        let m = &valkey.metrics;
        let ttl = u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX);
        for ((tag, member), keys) in pending {
            for chunk in keys.chunks(WRITE_BATCH) {
                let mut names = Vec::with_capacity(chunk.len() + 1);
                names.push(tag.records());
                names.extend(chunk.iter().map(|&k| tag.guess(k)));
                let wrote = valkey
                    .store
                    .fcall::<i64, _>("kvmesh_guess", &names, (&member, ttl), WRITE_DEADLINE)
                    .await;
                match wrote {
                    Ok(-1) => {
                        // The member's record is gone: the pod registered
                        // again (or left); the next lookup names its new one.
                        m.guesses("fenced", chunk.len());
                        valkey.forget_member(&member);
                        self.unwrite(&member, &keys);
                        break;
                    }
                    Ok(_) => m.guesses("written", chunk.len()),
                    Err(e) => {
                        tracing::debug!(error = %e, "valkey: guesses not written");
                        m.guesses("error", chunk.len());
                        self.unwrite(&member, chunk);
                    }
                }
            }
        }
    }

    /// Forgets that `keys` were written for `member`, so the next decision
    /// writes them.
    fn unwrite(&mut self, member: &str, keys: &[BlockKey]) {
        let seed = xxh3_64(member.as_bytes());
        for &k in keys {
            self.written.remove(&pair(seed, k));
        }
    }
}

/// One (member, key) pair as a number: the key hashed with the member's
/// hash as the seed.
fn pair(member_seed: u64, key: BlockKey) -> u64 {
    xxh3_64_with_seed(&key.to_le_bytes(), member_seed)
}
