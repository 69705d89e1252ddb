//! Requests sidecars hold for a pool (flow control, `crate::flow`): counted
//! per pool role while held, and published to peers inside the mesh's
//! in-flight message under the pseudo-target `held:<role>`, which no pod id
//! takes (ids are host:port) and which older sidecars read as a pod they do
//! not know and skip. The autoscaling hook counts them as requests its pools
//! took on (`crate::autoscale::rates`): a burst that flow control holds is
//! still a burst.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use kvmesh_filters::sched::Role;
use serde::Serialize;

use super::InFlightGuard;

/// Requests held per pool role, for one pod's sidecar.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct HeldCounts {
    pub prefill: u32,
    pub decode: u32,
    pub both: u32,
}

impl HeldCounts {
    /// The count for the pool of `role`.
    pub fn of(&self, role: Role) -> u32 {
        match role {
            Role::Prefill => self.prefill,
            Role::Decode => self.decode,
            Role::Both => self.both,
        }
    }

    fn slot(&mut self, role: Role) -> &mut u32 {
        match role {
            Role::Prefill => &mut self.prefill,
            Role::Decode => &mut self.decode,
            Role::Both => &mut self.both,
        }
    }

    /// Each pool's count plus `other`'s.
    fn saturating_add(self, other: Self) -> Self {
        Self {
            prefill: self.prefill.saturating_add(other.prefill),
            decode: self.decode.saturating_add(other.decode),
            both: self.both.saturating_add(other.both),
        }
    }

    /// The counts a peer published among its in-flight targets.
    pub fn from_report<'a>(report: impl IntoIterator<Item = (&'a String, &'a u32)>) -> Self {
        let mut held = Self::default();
        for (target, n) in report {
            if let Some(role) = role_of(target) {
                *held.slot(role) = *n;
            }
        }
        held
    }
}

/// Every sidecar's counts, summed per pool.
impl std::iter::Sum for HeldCounts {
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::default(), Self::saturating_add)
    }
}

const ROLES: [Role; 3] = [Role::Prefill, Role::Decode, Role::Both];

/// The in-flight message's pseudo-target for requests held for `role`'s pool.
pub fn target(role: Role) -> &'static str {
    match role {
        Role::Prefill => "held:prefill",
        Role::Decode => "held:decode",
        Role::Both => "held:both",
    }
}

/// The pool role a pseudo-target names (`None`: a pod).
pub fn role_of(target: &str) -> Option<Role> {
    ROLES.into_iter().find(|r| self::target(*r) == target)
}

/// This sidecar's held requests, per pool role.
#[derive(Debug, Default)]
pub(super) struct Held([Arc<AtomicU32>; 3]);

impl Held {
    fn counter(&self, role: Role) -> &Arc<AtomicU32> {
        let [prefill, decode, both] = &self.0;
        match role {
            Role::Prefill => prefill,
            Role::Decode => decode,
            Role::Both => both,
        }
    }

    /// Counts one request held for `role`'s pool until the guard drops.
    pub(super) fn begin(&self, role: Role) -> InFlightGuard {
        let c = self.counter(role);
        c.fetch_add(1, Ordering::Relaxed);
        InFlightGuard::new(c.clone())
    }

    pub(super) fn counts(&self) -> HeldCounts {
        let mut held = HeldCounts::default();
        for role in ROLES {
            *held.slot(role) = self.counter(role).load(Ordering::Relaxed);
        }
        held
    }

    /// The pseudo-targets to publish: one per pool with requests held.
    pub(super) fn published(&self) -> impl Iterator<Item = (String, u32)> + '_ {
        ROLES
            .into_iter()
            .map(|r| {
                (
                    target(r).to_owned(),
                    self.counter(r).load(Ordering::Relaxed),
                )
            })
            .filter(|(_, n)| *n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pseudo_targets_round_trip_and_are_no_pod() {
        for role in ROLES {
            assert_eq!(role_of(target(role)), Some(role));
        }
        assert_eq!(role_of("10.0.0.1:8000"), None);
        let held = Held::default();
        let g = held.begin(Role::Prefill);
        let _h = held.begin(Role::Prefill);
        let published: Vec<_> = held.published().collect();
        assert_eq!(published, vec![("held:prefill".to_owned(), 2)]);
        let report: std::collections::HashMap<String, u32> = published.into_iter().collect();
        assert_eq!(HeldCounts::from_report(&report).of(Role::Prefill), 2);
        drop(g);
        assert_eq!(held.counts().prefill, 1);
    }
}
