//! Outlier ejection, as Envoy's consecutive-failure detector does it: a pod
//! whose upstream calls fail [`EJECT_AFTER`] times in a row (a refused
//! connection, a connection broken before the response head, a 500/502/503/
//! 504 head; for a peer, also its `x-kvmesh-unserved` answer) is ejected: the
//! scheduler skips it for [`EJECT_BASE`] times the number of times it was
//! ejected, at most [`EJECT_MAX`], after which it takes requests again. A
//! success resets the run of failures; a pod that stays un-ejected for
//! [`EJECT_MAX`] has its ejection count forgotten. At most half of the pods
//! are ejected at once (Envoy's `max_ejection_percent`), so a fault that hits
//! every pod cannot empty the fleet. Each sidecar judges by its own calls;
//! ejections show in `/debug/fleet` and in `kvmesh_outlier_ejections_total`
//! and `kvmesh_outlier_ejected_pods`.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

/// Consecutive failures that eject a pod.
pub const EJECT_AFTER: u32 = 5;
/// The first ejection's length; the n-th lasts n times this.
pub const EJECT_BASE: Duration = Duration::from_secs(1);
/// The longest ejection.
pub const EJECT_MAX: Duration = Duration::from_secs(30);

#[derive(Debug, Default, Clone, Copy)]
struct State {
    consecutive: u32,
    ejections: u32,
    until: Option<Instant>,
}

/// Ejection state per pod id.
#[derive(Debug, Default)]
pub struct Outliers {
    pods: Mutex<HashMap<String, State>>,
}

/// What a failure did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Counted; the pod stays in.
    Counted,
    /// The pod was ejected for this long.
    Ejected(Duration),
}

impl Outliers {
    /// Records a failed call to pod `id`; `pods` is how many pods the fleet
    /// has (for the ejected share).
    pub fn failure(&self, id: &str, pods: usize, now: Instant) -> Verdict {
        let mut all = self.pods.lock();
        let ejected_now = all
            .values()
            .filter(|s| s.until.is_some_and(|u| u > now))
            .count();
        let s = all.entry(id.to_owned()).or_default();
        if s.until.is_some_and(|u| u > now) {
            return Verdict::Counted;
        }
        s.consecutive = s.consecutive.saturating_add(1);
        if s.consecutive < EJECT_AFTER || (ejected_now + 1) * 2 > pods.max(1) {
            return Verdict::Counted;
        }
        s.consecutive = 0;
        s.ejections = s.ejections.saturating_add(1);
        let period = EJECT_BASE.saturating_mul(s.ejections).min(EJECT_MAX);
        s.until = Some(now + period);
        Verdict::Ejected(period)
    }

    /// Records a served call to pod `id`.
    pub fn success(&self, id: &str, now: Instant) {
        let mut all = self.pods.lock();
        let Some(s) = all.get_mut(id) else { return };
        s.consecutive = 0;
        if s.until
            .is_some_and(|u| now.saturating_duration_since(u) >= EJECT_MAX)
        {
            all.remove(id);
        }
    }

    /// How much longer pod `id` is ejected (`None`: it is not).
    pub fn ejected_for(&self, id: &str, now: Instant) -> Option<Duration> {
        let until = self.pods.lock().get(id)?.until?;
        (until > now).then(|| until - now)
    }

    /// How many times pod `id` was ejected (recently).
    pub fn ejections(&self, id: &str) -> u32 {
        self.pods.lock().get(id).map_or(0, |s| s.ejections)
    }

    /// Pods ejected now.
    pub fn ejected_count(&self, now: Instant) -> usize {
        self.pods
            .lock()
            .values()
            .filter(|s| s.until.is_some_and(|u| u > now))
            .count()
    }

    /// Forgets a pod that left the fleet.
    pub fn forget(&self, id: &str) {
        self.pods.lock().remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_failures_eject_for_a_growing_period() {
        let o = Outliers::default();
        let t0 = Instant::now();
        for _ in 1..EJECT_AFTER {
            assert_eq!(o.failure("a", 4, t0), Verdict::Counted);
        }
        assert_eq!(o.failure("a", 4, t0), Verdict::Ejected(EJECT_BASE));
        assert_eq!(o.ejected_for("a", t0), Some(EJECT_BASE));
        let t1 = t0 + EJECT_BASE;
        assert_eq!(o.ejected_for("a", t1), None, "back after its period");
        for _ in 1..EJECT_AFTER {
            o.failure("a", 4, t1);
        }
        assert_eq!(o.failure("a", 4, t1), Verdict::Ejected(EJECT_BASE * 2));
        assert_eq!(o.ejections("a"), 2);
    }

    #[test]
    fn a_success_resets_the_run_and_a_long_quiet_forgets_ejections() {
        let o = Outliers::default();
        let t0 = Instant::now();
        for _ in 1..EJECT_AFTER {
            o.failure("a", 4, t0);
        }
        o.success("a", t0);
        assert_eq!(o.failure("a", 4, t0), Verdict::Counted);
        for _ in 1..EJECT_AFTER {
            o.failure("a", 4, t0);
        }
        assert_eq!(o.ejections("a"), 1);
        o.success("a", t0 + EJECT_BASE + EJECT_MAX);
        assert_eq!(o.ejections("a"), 0);
    }

    #[test]
    fn at_most_half_the_pods_are_ejected() {
        let o = Outliers::default();
        let t0 = Instant::now();
        for id in ["a", "b", "c"] {
            for _ in 0..EJECT_AFTER {
                o.failure(id, 4, t0);
            }
        }
        assert_eq!(o.ejected_count(t0), 2);
        assert_eq!(o.ejected_for("c", t0), None);
    }
}
