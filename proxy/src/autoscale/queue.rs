//! The queue rule: a pool is short of pods when requests queue, and a decode
//! or aggregated pool also when its KV cache fills.
//!
//! For each pool, over its pods with a fresh load (`autoscale.max_load_age`,
//! healthy):
//!
//! - prefill: `ratio = mean waiting / target_waiting_per_pod`;
//! - decode and aggregated: `ratio = max(mean waiting / target_waiting_per_pod,
//!   mean KV usage / target_kv_usage)`.
//!
//! Requests the sidecars hold for the pool (flow control) wait too: they
//! count in its mean waiting, spread over its pods.
//!
//! As the HPA does, `desired = ceil(pods × ratio)`, unchanged while `ratio`
//! is within `tolerance` of 1, and bounded by `min_replicas..=max_replicas`.
//! A pool with pods but no fresh load keeps its size: a pause in the metrics
//! is no reason to scale. Without `autoscale.slo` this is the whole answer;
//! with it, this rule is the guard that still grows a pool whose queue or
//! KV says so.

use kvmesh_filters::sched::Role;

use super::PoolAnswer;
use crate::config::Autoscale;
use crate::fleet::PodSnapshot;

/// The pool's answer by its queue (its engines' and the `held` requests
/// sidecars hold for it) and KV usage.
pub(super) fn size(cfg: &Autoscale, role: Role, members: &[&PodSnapshot], held: u32) -> PoolAnswer {
    let max_age = u64::try_from(cfg.max_load_age.get().as_millis()).unwrap_or(u64::MAX);
    let fresh: Vec<&&PodSnapshot> = members
        .iter()
        .filter(|p| p.healthy && p.load_age_ms.is_some_and(|a| a <= max_age))
        .collect();
    let pods = u32::try_from(members.len()).unwrap_or(u32::MAX);
    let measured = u32::try_from(fresh.len()).unwrap_or(u32::MAX);
    let bound = |n: u32| n.clamp(cfg.min_replicas, cfg.max_replicas);
    if fresh.is_empty() {
        return PoolAnswer {
            pods,
            measured,
            desired: bound(pods),
            waiting_per_pod: 0.0,
            kv_usage: 0.0,
            ratio: 1.0,
            signal: "no_load",
            slo: None,
        };
    }
    let n = fresh.len() as f64;
    let waiting =
        (fresh.iter().map(|p| f64::from(p.load.waiting)).sum::<f64>() + f64::from(held)) / n;
    let kv = fresh
        .iter()
        // A load without a usable KV figure counts as empty, not as NaN.
        .map(|p| {
            let u = p.load.kv_usage;
            if u.is_finite() {
                u.clamp(0.0, 1.0)
            } else {
                0.0
            }
        })
        .sum::<f64>()
        / n;
    let by_queue = waiting / f64::from(cfg.target_waiting_per_pod);
    let by_kv = kv / cfg.target_kv_usage.get();
    let (ratio, signal) = if role != Role::Prefill && by_kv > by_queue {
        (by_kv, "kv_usage")
    } else {
        (by_queue, "waiting")
    };
    let desired = if (ratio - 1.0).abs() <= cfg.tolerance.get() {
        pods
    } else {
        // Finite and non-negative: means of finite loads over positive targets.
        let want = (f64::from(pods) * ratio).ceil();
        if want >= f64::from(u32::MAX) {
            u32::MAX
        } else {
            want as u32
        }
    };
    PoolAnswer {
        pods,
        measured,
        desired: bound(desired),
        waiting_per_pod: waiting,
        kv_usage: kv,
        ratio,
        signal,
        slo: None,
    }
}
