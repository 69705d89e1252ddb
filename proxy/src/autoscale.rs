//! The autoscaling hook: how many pods each pool should run, from the load
//! every sidecar already sees (its own engine's, scraped, and its peers',
//! over the mesh), for KEDA or an HPA to act on (docs/autoscaling.md).
//!
//! Pools are the pods of one role: `prefill`, `decode`, and `aggregated`
//! (role `both`), so a P/D deployment scales its two pools independently.
//! For each pool, over its pods with a fresh load (`autoscale.max_load_age`,
//! healthy):
//!
//! - prefill is short of pods when requests queue: `ratio = mean waiting /
//!   target_waiting_per_pod`;
//! - decode and aggregated pools also run out of KV cache: `ratio = max(mean
//!   waiting / target_waiting_per_pod, mean KV usage / target_kv_usage)`.
//!
//! As the HPA does, `desired = ceil(pods × ratio)`, unchanged while `ratio`
//! is within `tolerance` of 1, and bounded by `min_replicas..=max_replicas`.
//! A pool with pods but no fresh load keeps its size: a pause in the metrics
//! is no reason to scale. Stabilization over time (scale down slowly) is left
//! to the HPA's `behavior`, which KEDA passes through.
//!
//! Pools span every model the sidecar follows: where several models share a
//! mesh, run it with `mesh.follow: same-models` so each model's sidecars
//! answer for that model's pools only.
//!
//! Every sidecar of a mesh sees the same fleet, so any of them answers, at
//! `GET /autoscale` on the admin port (JSON) and as
//! `kvmesh_autoscale_desired_replicas{pool}` in `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Serialize;

use crate::config::Autoscale;
use crate::fleet::PodSnapshot;
use kvmesh_filters::sched::Role;

/// The pools, by their names in the JSON and the metric label.
pub const POOLS: [(&str, Role); 3] = [
    ("prefill", Role::Prefill),
    ("decode", Role::Decode),
    ("aggregated", Role::Both),
];

/// One pool's answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolAnswer {
    /// Pods of the pool in the fleet, and how many of them have a fresh load.
    pub pods: u32,
    pub measured: u32,
    /// How many pods the pool should run.
    pub desired: u32,
    /// Means over the measured pods.
    pub waiting_per_pod: f64,
    pub kv_usage: f64,
    /// Load over target: above 1 the pool is short of pods.
    pub ratio: f64,
    /// What set the ratio: `waiting`, `kv_usage`, or `no_load` (nothing measured).
    pub signal: &'static str,
}

/// Every pool's answer, keyed by pool name (`prefill`, `decode`, `aggregated`),
/// so KEDA's `metrics-api` scaler reads e.g. `decode.desired`.
pub type Answer = std::collections::BTreeMap<&'static str, PoolAnswer>;

/// Sizes every pool from `pods` (a fleet snapshot).
pub fn answer(cfg: &Autoscale, pods: &[PodSnapshot]) -> Answer {
    POOLS
        .iter()
        .map(|&(name, role)| {
            let members: Vec<&PodSnapshot> = pods.iter().filter(|p| p.info.role == role).collect();
            (name, size(cfg, role, &members))
        })
        .collect()
}

fn size(cfg: &Autoscale, role: Role, members: &[&PodSnapshot]) -> PoolAnswer {
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
        };
    }
    let n = fresh.len() as f64;
    let waiting = fresh.iter().map(|p| f64::from(p.load.waiting)).sum::<f64>() / n;
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
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PoolLabels {
    pool: &'static str,
}

/// `kvmesh_autoscale_*`, set from an [`Answer`] when `/metrics` is scraped.
pub struct AutoscaleMetrics {
    desired: Family<PoolLabels, Gauge>,
    pods: Family<PoolLabels, Gauge>,
    ratio: Family<PoolLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
}

impl AutoscaleMetrics {
    /// Creates the metrics and registers them in `r` (prefix `kvmesh`).
    pub fn register(r: &mut Registry) -> Self {
        let m = Self {
            desired: Family::default(),
            pods: Family::default(),
            ratio: Family::default(),
        };
        r.register(
            "autoscale_desired_replicas",
            "Pods each pool should run (prefill, decode, aggregated), from the load of the whole fleet",
            m.desired.clone(),
        );
        r.register(
            "autoscale_pods",
            "Pods of each pool in the fleet",
            m.pods.clone(),
        );
        r.register(
            "autoscale_load_ratio",
            "Each pool's load over its target (above 1: short of pods)",
            m.ratio.clone(),
        );
        m
    }

    pub fn set(&self, answer: &Answer) {
        for (&pool, a) in answer {
            let l = PoolLabels { pool };
            self.desired.get_or_create(&l).set(i64::from(a.desired));
            self.pods.get_or_create(&l).set(i64::from(a.pods));
            self.ratio.get_or_create(&l).set(a.ratio);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::fleet::{EngineLoad, PodInfo};

    fn pod(role: Role, waiting: u32, kv_usage: f64, age_ms: Option<u64>) -> PodSnapshot {
        PodSnapshot {
            info: PodInfo {
                id: format!("10.0.0.{waiting}:8000"),
                sidecar_addr: None,
                role,
                models: vec![],
                lora_adapters: vec![],
                labels: Default::default(),
            },
            load: EngineLoad {
                waiting,
                kv_usage,
                ..EngineLoad::default()
            },
            load_age_ms: age_ms,
            healthy: true,
            in_flight_local: 0,
            in_flight_mesh: 0,
            ejected_ms: None,
            ejections: 0,
        }
    }

    #[test]
    fn a_queueing_prefill_pool_grows_by_its_queue_and_ignores_kv_usage() {
        let cfg = Autoscale::default(); // 2 waiting per pod, 75% KV
        let pods = [
            pod(Role::Prefill, 6, 0.99, Some(100)),
            pod(Role::Prefill, 4, 0.99, Some(100)),
        ];
        let a = &answer(&cfg, &pods)["prefill"];
        assert_eq!((a.pods, a.measured, a.signal), (2, 2, "waiting"));
        assert!((a.ratio - 2.5).abs() < 1e-9, "{a:?}");
        assert_eq!(a.desired, 5);
    }

    #[test]
    fn a_decode_pool_grows_by_the_tighter_of_queue_and_kv_cache() {
        let cfg = Autoscale::default();
        let pods = [
            pod(Role::Decode, 1, 0.9, Some(100)),
            pod(Role::Decode, 1, 0.9, Some(100)),
            pod(Role::Decode, 1, 0.9, Some(100)),
        ];
        let a = &answer(&cfg, &pods)["decode"];
        assert_eq!(a.signal, "kv_usage");
        assert!((a.ratio - 1.2).abs() < 1e-9, "{a:?}");
        assert_eq!(a.desired, 4); // ceil(3 × 1.2)
    }

    #[test]
    fn within_the_tolerance_the_pool_keeps_its_size_and_idle_pools_shrink_to_the_minimum() {
        let mut cfg = Autoscale::default();
        let near = [
            pod(Role::Both, 2, 0.5, Some(100)),
            pod(Role::Both, 2, 0.5, Some(100)),
        ];
        assert_eq!(answer(&cfg, &near)["aggregated"].desired, 2); // ratio 1.0
        let idle = [
            pod(Role::Both, 0, 0.0, Some(100)),
            pod(Role::Both, 0, 0.0, Some(100)),
        ];
        assert_eq!(answer(&cfg, &idle)["aggregated"].desired, 1);
        cfg.min_replicas = 2;
        assert_eq!(answer(&cfg, &idle)["aggregated"].desired, 2);
        cfg.max_replicas = 3;
        let busy = [pod(Role::Both, 20, 0.5, Some(100))];
        assert_eq!(answer(&cfg, &busy)["aggregated"].desired, 3);
    }

    #[test]
    fn stale_and_unhealthy_pods_are_not_measured_and_an_unmeasured_pool_keeps_its_size() {
        let cfg = Autoscale::default();
        let mut sick = pod(Role::Decode, 50, 1.0, Some(100));
        sick.healthy = false;
        let pods = [
            pod(Role::Decode, 50, 1.0, Some(60_000)),
            pod(Role::Decode, 50, 1.0, None),
            sick,
        ];
        let nan = [
            pod(Role::Decode, 1, f64::NAN, Some(100)),
            pod(Role::Decode, 1, 0.9, Some(100)),
        ];
        let a = &answer(&cfg, &nan)["decode"];
        assert!(
            a.kv_usage.is_finite() && (a.kv_usage - 0.45).abs() < 1e-9,
            "{a:?}"
        );
        let a = &answer(&cfg, &pods)["decode"];
        assert_eq!(
            (a.pods, a.measured, a.desired, a.signal),
            (3, 0, 3, "no_load")
        );
        // A pool the fleet has no pod of answers its minimum.
        assert_eq!(answer(&cfg, &pods)["prefill"].desired, 1);
    }

    #[test]
    fn the_keda_example_reads_values_the_hook_answers() {
        let yaml = include_str!("../assets/deploy/autoscaling/keda-scaledobjects.yaml");
        let locations: Vec<&str> = yaml
            .lines()
            .filter_map(|l| l.trim().strip_prefix("valueLocation:"))
            .map(|v| v.trim().trim_matches('"'))
            .collect();
        assert_eq!(locations, ["prefill.desired", "decode.desired"]);
        let json = serde_json::to_value(answer(&Autoscale::default(), &[])).unwrap();
        for loc in locations {
            let (pool, field) = loc.split_once('.').unwrap();
            assert!(json[pool][field].is_u64(), "{loc} in {json}");
        }
    }
}
