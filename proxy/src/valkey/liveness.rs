//! Peers gone without leaving, on the Valkey backend: the counterpart of the
//! mesh subscriber's silent stream (docs/migration.md, "Non-streamed
//! requests").
//!
//! A live pod's writer rewrites its record every `lease_interval`, each
//! time with a new lease expiry; one that leaves deletes it at once
//! ([`super::Writer::leave`]). So a record that stays the same past
//! [`Liveness::stale_after`] belongs to a pod that stopped renewing without
//! leaving (a host gone, a partition, a sidecar killed): its lease is about
//! to lapse. Such a peer is cut off ([`Fleet::cut_off_peer`]): the calls
//! waiting for its response head fail and go whole to a pod that answers,
//! instead of waiting out `timeouts.first_byte`. A record that vanishes
//! while it was still being renewed is a pod that left, and is only
//! forgotten later by the `forget` task (its calls in flight finish).
//!
//! Only the peers this sidecar has calls in flight to are watched: one
//! `HMGET` per records hash (model and stripe) every quarter lease, with
//! the members of those peers alone, so the cost follows this sidecar's
//! traffic, not the fleet's size, and a sidecar with nothing in flight asks
//! nothing. Comparing a record with itself over time needs no clock shared
//! with the server.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;
use redis::Value;
use tokio::time::Instant;

use crate::fleet::Fleet;
use crate::prefix::PrefixState;

use super::keys::{stripe_of, Tag};
use super::store::Store;
use super::StoreError;

/// Most peers whose record's place is remembered; past it the map starts
/// over from the next lookups.
const MAX_PEERS: usize = 1 << 16;

/// Where each peer of recent lookups has its record, what its record was
/// at the last check, and which peers were cut off lately.
#[derive(Debug, Default)]
pub struct Liveness {
    /// Pod id to its record's place, as lookups named it.
    places: Mutex<HashMap<String, Place>>,
    /// Pod id to the member it was cut off as, and when: a lookup that
    /// still names that member (its lease not lapsed yet) does not bring the
    /// pod back; one that names a new registration does.
    cut: Mutex<HashMap<String, (String, Instant)>>,
}

#[derive(Debug, Clone)]
struct Place {
    /// The records hash (`Tag::records`) and the member's field in it.
    records: String,
    member: String,
    /// The record as last read, since when it read so, and the last check
    /// that read it so.
    seen: Option<(Vec<u8>, Instant, Instant)>,
}

/// What a check found for one watched peer.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Renewed since the last check, or not yet seen long enough.
    Live,
    /// Not renewed past `stale_after`, or vanished after it had stopped
    /// being renewed (its lease lapsed and a lookup fenced it).
    Stale,
    /// Gone while it was being renewed: the pod deregistered.
    Left,
}

impl Liveness {
    /// How long a record may stay the same before its pod counts as gone:
    /// all but one renewal of its lease, so that it is cut off just before
    /// its lease lapses and lookups drop it anyway.
    pub fn stale_after(lease_ttl: Duration, lease_interval: Duration) -> Duration {
        lease_ttl.saturating_sub(lease_interval).max(lease_interval)
    }

    /// Notes that a lookup of `model` named peer `id` as `member`. Returns
    /// false when the peer was cut off as that member less than `hold`
    /// ago: its record is the stale one, not yet lapsed.
    pub fn named(
        &self,
        prefix: &str,
        stripes: u16,
        model: &str,
        id: &str,
        member: &str,
        hold: Duration,
    ) -> bool {
        {
            let mut cut = self.cut.lock();
            if let Some((m, at)) = cut.get(id) {
                if m == member && at.elapsed() < hold {
                    return false;
                }
                cut.remove(id);
            }
        }
        let mut places = self.places.lock();
        if places.get(id).is_some_and(|p| p.member == member) {
            return true;
        }
        if places.len() >= MAX_PEERS {
            places.clear();
        }
        let records = Tag::new(prefix, model, stripe_of(id, stripes)).records();
        places.insert(
            id.to_owned(),
            Place {
                records,
                member: member.to_owned(),
                seen: None,
            },
        );
        true
    }

    /// Forgets what is known of peer `id` (it left the fleet).
    pub fn forget(&self, id: &str) {
        self.places.lock().remove(id);
    }

    /// Judges the records read for `ids` (`None`: the field is gone) at
    /// `now`, recording what was read; a peer judged stale or gone is no
    /// longer watched.
    pub fn judge(
        &self,
        read: Vec<(String, Option<Vec<u8>>)>,
        now: Instant,
        stale_after: Duration,
        lease_interval: Duration,
    ) -> Vec<(String, Verdict)> {
        let mut places = self.places.lock();
        let mut out = Vec::new();
        for (id, value) in read {
            let Some(place) = places.get_mut(&id) else {
                continue;
            };
            let verdict = match (value, place.seen.as_mut()) {
                (Some(v), Some((old, since, same_at))) if *old == v => {
                    *same_at = now;
                    if now.saturating_duration_since(*since) >= stale_after {
                        Verdict::Stale
                    } else {
                        Verdict::Live
                    }
                }
                (Some(v), _) => {
                    place.seen = Some((v, now, now));
                    Verdict::Live
                }
                // Read the same over two renewals, then gone: it lapsed
                // and a lookup fenced it. (A pod that left was renewing.)
                (None, Some((_, since, same_at)))
                    if same_at.saturating_duration_since(*since) > 2 * lease_interval =>
                {
                    Verdict::Stale
                }
                (None, _) => Verdict::Left,
            };
            if verdict == Verdict::Stale {
                let mut cut = self.cut.lock();
                if cut.len() >= MAX_PEERS {
                    cut.clear();
                }
                cut.insert(id.clone(), (place.member.clone(), now));
            }
            if verdict != Verdict::Live {
                places.remove(&id);
            }
            out.push((id, verdict));
        }
        out
    }

    /// The watched peers among `ids`, grouped by records hash: (hash,
    /// [(pod id, member)]).
    fn grouped(&self, ids: &[String]) -> HashMap<String, Vec<(String, String)>> {
        let places = self.places.lock();
        let mut out: HashMap<String, Vec<(String, String)>> = HashMap::new();
        for id in ids {
            if let Some(p) = places.get(id) {
                out.entry(p.records.clone())
                    .or_default()
                    .push((id.clone(), p.member.clone()));
            }
        }
        out
    }
}

/// One check: reads the records of the peers with calls in flight, and
/// cuts off those gone without leaving. A hash that does not answer in
/// time is skipped until the next check.
pub async fn check(
    liveness: &Liveness,
    store: &Store,
    fleet: &Fleet,
    prefix: &PrefixState,
    stale_after: Duration,
) {
    let now = Instant::now();
    let local = fleet.local_id();
    let busy: Vec<String> = fleet
        .snapshot(now)
        .into_iter()
        .filter(|p| p.info.id != local && p.in_flight_local > 0)
        .map(|p| p.info.id)
        .collect();
    if busy.is_empty() {
        return;
    }
    let cfg = store.config();
    let deadline = cfg.lookup_deadline.get().max(Duration::from_millis(500));
    let mut read = Vec::new();
    for (records, peers) in liveness.grouped(&busy) {
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(&records);
        for (_, member) in &peers {
            cmd.arg(member);
        }
        let values: Result<Vec<Option<Vec<u8>>>, StoreError> =
            store.call::<Value>(&cmd, deadline).await.and_then(|v| {
                redis::from_redis_value(&v).map_err(|e| StoreError::Reply(e.to_string()))
            });
        let Ok(values) = values else { continue };
        read.extend(peers.into_iter().map(|(id, _)| id).zip(values));
    }
    let now = Instant::now();
    for (id, verdict) in liveness.judge(read, now, stale_after, cfg.lease_interval.get()) {
        if verdict == Verdict::Stale {
            tracing::info!(
                peer = id,
                "valkey: peer's record no longer renewed; cut off"
            );
            fleet.cut_off_peer(&id);
            prefix.remove_pod(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_millis(100);

    fn watched(l: &Liveness, id: &str) {
        assert!(l.named("p", 4, "m", id, &format!("member-{id}"), LEASE * 6));
    }

    #[test]
    fn a_record_that_stops_changing_is_stale_one_that_vanishes_while_renewed_left() {
        let l = Liveness::default();
        let stale = Liveness::stale_after(LEASE * 6, LEASE);
        assert_eq!(stale, LEASE * 5);
        for id in ["live", "dead", "left", "fenced"] {
            watched(&l, id);
        }
        let t0 = Instant::now();
        let read = |gen: u8, dead: Option<u8>, left: Option<u8>, fenced: Option<u8>| {
            vec![
                ("live".to_owned(), Some(vec![gen])),
                ("dead".to_owned(), dead.map(|v| vec![v])),
                ("left".to_owned(), left.map(|v| vec![v])),
                ("fenced".to_owned(), fenced.map(|v| vec![v])),
            ]
        };
        let verdicts = |r, at| {
            l.judge(r, at, stale, LEASE)
                .into_iter()
                .collect::<HashMap<_, _>>()
        };
        let v = verdicts(read(0, Some(0), Some(0), Some(0)), t0);
        assert!(v.values().all(|v| *v == Verdict::Live), "{v:?}");
        // "left" deregisters between two renewals; "fenced" stops.
        let v = verdicts(read(1, Some(0), None, Some(0)), t0 + LEASE * 3);
        assert_eq!(v["left"], Verdict::Left);
        assert_eq!(v["dead"], Verdict::Live);
        let v = verdicts(read(2, Some(0), None, None), t0 + LEASE * 4);
        assert_eq!(v["fenced"], Verdict::Stale, "unchanged, then gone");
        assert_eq!(v["dead"], Verdict::Live);
        assert!(!v.contains_key("left"), "no longer watched");
        let v = verdicts(read(3, Some(0), None, None), t0 + LEASE * 5);
        assert_eq!(v["dead"], Verdict::Stale);
        assert_eq!(v["live"], Verdict::Live);
        // A lookup naming the cut-off member does not bring it back; a new
        // registration does.
        assert!(!l.named("p", 4, "m", "dead", "member-dead", LEASE * 6));
        assert!(l.named("p", 4, "m", "dead", "member-dead-2", LEASE * 6));
    }

    #[test]
    fn a_record_gone_without_ever_being_seen_twice_is_a_pod_that_left() {
        let l = Liveness::default();
        watched(&l, "x");
        let t0 = Instant::now();
        let v = l.judge(vec![("x".into(), None)], t0, LEASE * 5, LEASE);
        assert_eq!(v, vec![("x".to_owned(), Verdict::Left)]);
    }
}
