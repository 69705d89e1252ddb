//! The autoscaling hook: how many pods each pool should run, for KEDA or an
//! HPA to act on (docs/autoscaling.md), from what every sidecar already sees
//! (its own engine's load, scraped, and its peers', over the mesh or from
//! Valkey).
//!
//! Pools are the pods of one role: `prefill`, `decode`, and `aggregated`
//! (role `both`), so a P/D deployment scales its two pools independently.
//! Two ways to size a pool:
//!
//! - **By queue** ([`queue`], the only one without `autoscale.slo`): the
//!   pool grows by how far its queue and KV usage are above their targets.
//! - **By SLO** (`autoscale.slo`): the pool runs the pods a queueing model
//!   ([`slo`]) says meet TTFT p90 and ITL p99, at the arrival rate and
//!   tokens per request measured over the last window ([`rates`]; the last
//!   few samples' rate when it is past the rate before them by more than
//!   their noise, so a burst counts at once), on pods that cost what
//!   `autoscale.slo.pod` says. The queue rule stays as a guard (a queue or
//!   a full KV cache still grows the pool; on a prefill pool the queue
//!   counts in prefill time instead), and the pool never drops below what
//!   its requests in flight hold.
//!
//! Every sidecar samples the fleet every `sample_interval` whether polled or
//! not ([`run`]), so whichever sidecar a poller reaches answers from the
//! same window; one that has watched less than a window keeps the pool's
//! size. With an SLO the hook slows scale-down itself: the window's rate
//! falls a window after the load, and a pool shrinks only to a size that
//! holds one standard error above it; the HPA's `behavior.scaleDown`
//! window (the shipped ScaledObjects set one rate window) smooths the
//! sidecars' answers. The queue rule keeps no history: there, slowing it
//! is the HPA's.
//! Each answer explains itself: `GET /autoscale` on the admin port (JSON)
//! and `kvmesh_autoscale_*` in `/metrics`.
//!
//! Pools span every model the sidecar follows: where several models share a
//! mesh, run it with `mesh.follow: same-models` so each model's sidecars
//! answer for that model's pools only.

mod queue;
pub mod rates;
pub mod slo;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Serialize;
use tokio::time::Instant;

use crate::config::{Autoscale, Config};
use crate::fleet::{Fleet, HeldCounts, PodSnapshot};
use crate::shutdown::Shutdown;
use kvmesh_filters::sched::Role;
use rates::{History, Workload};
use slo::{Prediction, Targets};

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
    /// Load over what the pool's pods hold: above 1 the pool is short of pods.
    pub ratio: f64,
    /// What set `desired`: `waiting` or `kv_usage` (the queue rule), `no_load`
    /// (nothing measured: the pool keeps its size); with an SLO also `slo`
    /// (the model), `in_flight` (the requests the pool holds), `warming`
    /// (this sidecar has watched less than a window: it keeps the pool's
    /// size) and `no_rate` (nothing finished in the window yet: the queue
    /// rule answers).
    pub signal: &'static str,
    /// How the SLO model sized the pool (with `autoscale.slo`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slo: Option<SloAnswer>,
}

/// The SLO model's working, for `GET /autoscale`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SloAnswer {
    /// What the pool was asked to serve over the window (the rate over the
    /// last seconds instead, `window_s` of them, where it jumped past the
    /// noise).
    pub workload: Workload,
    /// The pool is sized for this many times the workload's rate.
    pub headroom: f64,
    /// The fewest pods the model says meet the SLO at that workload.
    pub needed: u32,
    /// The model at `needed` pods (`limit` set when even `max_replicas` fail).
    pub predicted: Prediction,
    /// The highest rate one pod sustains within the SLO at that size, req/s.
    pub rate_per_pod: f64,
    /// Pods the requests the pool runs and queues now need: on a prefill
    /// pool, their mean prefill time over the TTFT target; elsewhere, their
    /// number over the batch a pod holds within the SLO.
    pub in_flight_floor: u32,
    /// The queue rule's answer, which `desired` never goes below when it
    /// asks for more pods than the pool has (except on a prefill pool,
    /// whose queue the in-flight floor counts in prefill time).
    pub queue_desired: u32,
}

/// Every pool's answer, keyed by pool name (`prefill`, `decode`, `aggregated`),
/// so KEDA's `metrics-api` scaler reads e.g. `decode.desired`.
pub type Answer = BTreeMap<&'static str, PoolAnswer>;

/// Sizes every pool from `pods` by the queue rule alone.
pub fn answer(cfg: &Autoscale, pods: &[PodSnapshot]) -> Answer {
    POOLS
        .iter()
        .map(|&(name, role)| {
            let answer = queue::size(cfg, role, &members(pods, role), held(pods, role));
            (name, answer)
        })
        .collect()
}

fn members(pods: &[PodSnapshot], role: Role) -> Vec<&PodSnapshot> {
    pods.iter().filter(|p| p.info.role == role).collect()
}

/// The requests every pod's sidecar holds for the pool of `role` (flow
/// control): they wait for it as its engines' queues do.
fn held(pods: &[PodSnapshot], role: Role) -> u32 {
    pods.iter().map(|p| p.held).sum::<HeldCounts>().of(role)
}

/// The spans, in sample intervals, whose rate counts at once when it is
/// past the rate of the window before them: the last two intervals up to
/// half the window's (at least four). A burst passes the test over the
/// shortest span it is clear in, a smaller jump over a longer one.
fn recent_spans(slo: &crate::config::autoscale::Slo) -> std::ops::RangeInclusive<usize> {
    let sample = slo.sample_interval.get().as_secs_f64();
    let per_window = if sample > 0.0 {
        (slo.window.get().as_secs_f64() / sample).floor()
    } else {
        0.0
    };
    2..=((per_window / 2.0) as usize).clamp(4, 64)
}

/// The hook: the config, the samples of the last window, and the metrics
/// the answers set.
pub struct Hook {
    cfg: Autoscale,
    metrics: AutoscaleMetrics,
    state: Mutex<State>,
}

struct State {
    history: History,
    /// Each pool's last measured workload, used while a window sees nothing finish.
    last: [Option<Workload>; 3],
}

impl Hook {
    /// A hook for `cfg`, its metrics registered in `r` (prefix `kvmesh`).
    pub fn new(cfg: &Autoscale, r: &mut Registry) -> Self {
        let window = cfg
            .slo
            .as_ref()
            .map_or(std::time::Duration::from_secs(60), |s| s.window.get());
        Self {
            cfg: cfg.clone(),
            metrics: AutoscaleMetrics::register(r),
            state: Mutex::new(State {
                history: History::new(window),
                last: [None; 3],
            }),
        }
    }

    /// Every pool's answer for `pods` at `now`. Records a sample of the
    /// pods' counters when `sample_interval` has passed since the last one.
    pub fn answer(&self, pods: &[PodSnapshot], now: Instant) -> Answer {
        let Some(slo) = &self.cfg.slo else {
            let a = answer(&self.cfg, pods);
            self.metrics.set(&a);
            return a;
        };
        // A poisoned lock only means a panic mid-answer; the samples stay usable.
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let due = st
            .history
            .last_at()
            .is_none_or(|t| now.saturating_duration_since(t) >= slo.sample_interval.get());
        if due {
            st.history.record(now, pods);
        }
        let warming = !st.history.is_full();
        let mut a = Answer::new();
        for (i, &(name, role)) in POOLS.iter().enumerate() {
            let measured = st.history.workload(role).map(|mut w| {
                // Up at once: a rate that jumped counts before the window's
                // average catches up (the last few samples' rate), when it
                // is past the noise of so few arrivals; the highest such
                // rate, with the seconds it spans.
                let (rate, window) = (w.arrival_rate, w.window_s);
                for intervals in recent_spans(slo) {
                    if let Some((recent, span)) = st.history.recent_rate(role, intervals + 1) {
                        // Against the rate of the window before the span:
                        // the window's own average holds the span's
                        // arrivals, so a jump would raise what it is
                        // tested against.
                        let before = if window > span {
                            ((rate * window - recent * span) / (window - span)).max(0.0)
                        } else {
                            rate
                        };
                        if burst(before, recent, span) && recent > w.arrival_rate {
                            (w.arrival_rate, w.window_s) = (recent, span);
                        }
                    }
                }
                w
            });
            if measured.is_some() {
                st.last[i] = measured;
            }
            let members = members(pods, role);
            let held = held(pods, role);
            a.insert(
                name,
                self.size_for_slo(slo, role, &members, held, st.last[i], warming),
            );
        }
        drop(st);
        self.metrics.set(&a);
        a
    }

    /// One pool's answer under the SLO. A sidecar `warming` (it has watched
    /// less than a window: it just started) does not know the rate its
    /// peers measured, so it never answers below the pool's size. `held`:
    /// the requests sidecars hold for the pool (flow control), which its
    /// in-flight floor counts as queued.
    fn size_for_slo(
        &self,
        slo: &crate::config::autoscale::Slo,
        role: Role,
        members: &[&PodSnapshot],
        held: u32,
        workload: Option<Workload>,
        warming: bool,
    ) -> PoolAnswer {
        let cfg = &self.cfg;
        let by_queue = queue::size(cfg, role, members, held);
        let keep = if warming { by_queue.pods } else { 0 };
        let Some(w) = workload.filter(|_| !members.is_empty()) else {
            let (desired, signal) = if members.is_empty() {
                (by_queue.desired, by_queue.signal)
            } else if keep > by_queue.desired {
                (keep, "warming")
            } else {
                (by_queue.desired, "no_rate")
            };
            return PoolAnswer {
                desired,
                signal,
                ..by_queue
            };
        };
        let profile = match (role, &slo.decode_pod) {
            (Role::Decode, Some(p)) => p,
            _ => &slo.pod,
        };
        let (ttft, ttft_quantile) = slo.ttft();
        let targets = Targets {
            ttft_ms: ttft.get().as_secs_f64() * 1000.0,
            ttft_quantile,
            itl_p99_ms: slo.itl_p99.get().as_secs_f64() * 1000.0,
            kv_usage: cfg.target_kv_usage.get(),
        };
        // Sized for the headroom over the measured rate; the answer shows
        // the rate measured.
        let measured = w;
        let w = Workload {
            arrival_rate: w.arrival_rate * slo.headroom,
            ..w
        };
        let (mut needed, mut predicted) = slo::pods_needed(profile, &targets, &w, cfg.max_replicas);
        // Down only past the noise: a smaller pool must also hold at one
        // standard error above the rate (Poisson, over the seconds it
        // spans), so a rate that wobbles around a size's limit does not
        // flap the pool.
        if needed < by_queue.pods && w.window_s > 0.0 {
            let high = Workload {
                arrival_rate: w.arrival_rate + (w.arrival_rate.max(0.0) / w.window_s).sqrt(),
                ..w
            };
            let (n, _) = slo::pods_needed(profile, &targets, &high, cfg.max_replicas);
            if n > needed {
                needed = n.min(by_queue.pods);
                predicted = slo::predict(profile, &targets, &w, needed);
            }
        }
        let rate_per_pod = slo::rate_per_pod(profile, &targets, &w, needed);
        let in_system: f64 = members
            .iter()
            .filter(|p| p.load_age_ms.is_some())
            .map(|p| f64::from(p.load.waiting) + f64::from(p.load.running))
            .sum::<f64>()
            + f64::from(held);
        let in_flight_floor = if role == Role::Prefill {
            // A prefill pod holds a request only until its first token: what
            // the pool holds is prefill time, and it needs the pods that
            // compute it within the TTFT target.
            let work_ms = in_system * slo::mean_prefill_ms(profile, &w);
            saturating_u32((work_ms / targets.ttft_ms.max(1.0)).ceil())
        } else {
            // The batch a pod holds within the SLO: what its KV share and
            // max_num_seqs allow.
            let per_seq = (w.prompt_tokens + w.output_tokens / 2.0).max(1.0);
            let batch = (targets.kv_usage * profile.kv_cache_tokens as f64 / per_seq)
                .min(f64::from(profile.max_num_seqs))
                .max(1.0);
            saturating_u32((in_system / batch).ceil())
        };
        let queue_desired = by_queue.desired;
        // A prefill pool's queue counts in prefill time (the floor above),
        // not in requests per pod: a queue of short prompts is not one of
        // long ones.
        let queue_guard = if queue_desired > by_queue.pods && role != Role::Prefill {
            queue_desired
        } else {
            0
        };
        let (mut desired, mut signal) = (needed, "slo");
        for (n, why) in [
            (in_flight_floor, "in_flight"),
            (queue_guard, by_queue.signal),
            (keep, "warming"),
        ] {
            if n > desired {
                (desired, signal) = (n, why);
            }
        }
        PoolAnswer {
            desired: desired.clamp(cfg.min_replicas, cfg.max_replicas),
            ratio: f64::from(needed) / f64::from(by_queue.pods.max(1)),
            signal,
            slo: Some(SloAnswer {
                workload: measured,
                headroom: slo.headroom,
                needed,
                predicted,
                rate_per_pod,
                in_flight_floor,
                queue_desired,
            }),
            ..by_queue
        }
    }
}

/// Whether the arrivals at `recent_rate` over the last `span_s` seconds are
/// a burst against the window's `rate`: more than three standard deviations
/// (Poisson) above what that rate brings in the same time. Tested every
/// sample, two would pass by chance every forty samples or so, and so few
/// arrivals' rate is far off the window's when they do.
fn burst(rate: f64, recent_rate: f64, span_s: f64) -> bool {
    let expected = rate.max(0.0) * span_s;
    recent_rate * span_s > expected + 3.0 * expected.sqrt() + 1.0
}

fn saturating_u32(v: f64) -> u32 {
    if v.is_nan() || v <= 0.0 {
        0
    } else if v >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        v as u32
    }
}

/// Where the hook reads the fleet: on the mesh, every pod this sidecar
/// follows; on Valkey, every pod registered for its models
/// (`Valkey::fleet_view`), or the pods it knows when Valkey does not answer.
pub struct FleetSource {
    pub config: Arc<Config>,
    pub fleet: Arc<Fleet>,
    pub index: Option<Arc<crate::valkey::Valkey>>,
}

impl FleetSource {
    pub async fn pods(&self) -> Vec<PodSnapshot> {
        if let Some(index) = &self.index {
            match index.fleet_view(&self.config, &self.fleet).await {
                Ok(pods) => return pods.as_ref().clone(),
                Err(e) => {
                    tracing::debug!(error = %e, "autoscale: the fleet could not be read from valkey; sizing from the pods this sidecar knows");
                }
            }
        }
        self.fleet.snapshot(Instant::now())
    }
}

/// Samples the fleet every `autoscale.slo.sample_interval` until shutdown
/// (nothing to do without an SLO: the queue rule keeps no history).
pub async fn run(hook: Arc<Hook>, source: FleetSource, shutdown: Shutdown) {
    let Some(slo) = &hook.cfg.slo else {
        return;
    };
    let mut tick = tokio::time::interval(slo.sample_interval.get());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.triggered() => return,
            _ = tick.tick() => {
                let pods = source.pods().await;
                hook.answer(&pods, Instant::now());
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PoolLabels {
    pool: &'static str,
}

/// `kvmesh_autoscale_*`, set from every [`Answer`] the hook makes.
struct AutoscaleMetrics {
    desired: Family<PoolLabels, Gauge>,
    pods: Family<PoolLabels, Gauge>,
    ratio: Family<PoolLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
}

impl AutoscaleMetrics {
    /// Creates the metrics and registers them in `r` (prefix `kvmesh`).
    fn register(r: &mut Registry) -> Self {
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

    fn set(&self, answer: &Answer) {
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

    /// A pod of `role` with this queue and KV usage, its load `age_ms` old.
    pub(super) fn pod(role: Role, waiting: u32, kv_usage: f64, age_ms: Option<u64>) -> PodSnapshot {
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
            held: Default::default(),
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
    fn requests_sidecars_hold_for_a_pool_count_in_its_queue() {
        // 2 waiting per pod.
        let cfg = Autoscale::default();
        // Flow control keeps the engines' queues short and holds the rest:
        // 12 held for the aggregated pool, by a sidecar of another pool.
        let mut holder = pod(Role::Decode, 0, 0.1, Some(100));
        holder.held.both = 12;
        let pods = [
            pod(Role::Both, 1, 0.1, Some(100)),
            pod(Role::Both, 1, 0.1, Some(100)),
            holder,
        ];
        let a = &answer(&cfg, &pods)["aggregated"];
        assert!(
            (a.waiting_per_pod - 7.0).abs() < 1e-9,
            "(1 + 1 + 12) / 2: {a:?}"
        );
        assert_eq!(a.desired, 7);
        assert_eq!(
            answer(&cfg, &pods)["decode"].desired,
            1,
            "held for another pool"
        );
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
        let yaml = include_str!("../../assets/deploy/autoscaling/keda-scaledobjects.yaml");
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

    fn slo_config() -> Autoscale {
        crate::config::from_yaml_str(
            "autoscale:\n  max_replicas: 16\n  slo:\n    ttft_p90: 2s\n    itl_p99: 250ms\n    window: 20s\n    sample_interval: 5s\n    pod: {step_base_ms: 26, prefill_ms_per_token: 0.1326, prefill_ms_per_token_kctx: 0.0042, decode_ms_per_seq: 0.1326, decode_ms_per_kctx: 0.0978, kv_cache_tokens: 29424}\n",
            "proxy.yaml",
        )
        .unwrap()
        .autoscale
    }

    /// An aggregated pod `i` that has finished `finished` requests of 1155
    /// prompt and 211 generated tokens, with `in_system` running.
    fn busy(i: u32, finished: u64, in_system: u32) -> PodSnapshot {
        let mut p = pod(Role::Both, 0, 0.3, Some(50));
        p.info.id = format!("10.0.1.{i}:8000");
        p.load.running = in_system;
        p.load.work = Some(crate::fleet::EngineWork {
            finished,
            prompt_tokens: finished * 1155,
            cached_tokens: 0,
            generation_tokens: finished * 211,
            prompt_spread: None,
        });
        p
    }

    #[test]
    fn headroom_sizes_the_pool_for_a_multiple_of_the_rate_it_measured() {
        let t0 = Instant::now();
        let s = |n: u64| t0 + std::time::Duration::from_secs(n);
        let sized = |headroom: f64| {
            let mut cfg = slo_config();
            cfg.slo.as_mut().unwrap().headroom = headroom;
            let hook = Hook::new(&cfg, &mut Registry::default());
            hook.answer(&[busy(1, 0, 2), busy(2, 0, 2)], s(0));
            // 10 req/s for 10 s over two pods.
            hook.answer(&[busy(1, 50, 2), busy(2, 50, 2)], s(10))["aggregated"].clone()
        };
        let (plain, roomy) = (sized(1.0), sized(1.5));
        let (p, r) = (plain.slo.unwrap(), roomy.slo.unwrap());
        // The answer shows the rate measured, and the headroom over it.
        assert!((r.workload.arrival_rate - 10.0).abs() < 1e-9, "{r:?}");
        assert_eq!((p.headroom, r.headroom), (1.0, 1.5));
        // Sized as the plain hook sizes 15 req/s.
        let profile = &slo_config().slo.unwrap().pod;
        let targets = Targets {
            ttft_ms: 2000.0,
            ttft_quantile: 0.9,
            itl_p99_ms: 250.0,
            kv_usage: slo_config().target_kv_usage.get(),
        };
        let at_15 = Workload {
            arrival_rate: 15.0,
            ..p.workload
        };
        let (expected, _) = slo::pods_needed(profile, &targets, &at_15, 16);
        assert!(expected > p.needed, "{expected} against {p:?}");
        assert_eq!((r.needed, roomy.desired), (expected, expected), "{r:?}");
    }

    #[test]
    fn the_slo_hook_sizes_by_the_measured_rate_and_explains_itself() {
        let r = &mut Registry::default();
        let hook = Hook::new(&slo_config(), r);
        let t0 = Instant::now();
        let s = |n: u64| t0 + std::time::Duration::from_secs(n);
        // The first sample measures no rate: the queue rule answers, and a
        // sidecar that has not watched a whole window keeps the pool's size.
        let a = &hook.answer(&[busy(1, 0, 2), busy(2, 0, 2)], s(0))["aggregated"];
        assert_eq!(
            (a.signal, a.desired, a.slo.is_none()),
            ("warming", 2, true),
            "{a:?}"
        );
        // 10 req/s for 10 s over two pods: more than two pods' worth.
        let a = hook.answer(&[busy(1, 50, 2), busy(2, 50, 2)], s(10))["aggregated"].clone();
        let slo = a.slo.clone().unwrap();
        assert!((slo.workload.arrival_rate - 10.0).abs() < 1e-9, "{slo:?}");
        assert_eq!(a.signal, "slo");
        assert!(a.desired > 2 && a.desired == slo.needed, "{a:?}");
        assert_eq!(slo.predicted.limit, None);
        assert!(slo.rate_per_pod * f64::from(slo.needed) >= 10.0);
        let json = serde_json::to_value(&a).unwrap();
        for field in ["arrival_rate", "uncached_tokens", "output_tokens"] {
            assert!(json["slo"]["workload"][field].is_number(), "{json}");
        }
        assert!(json["slo"]["predicted"]["ttft_ms"].is_number(), "{json}");
        // The rate falls to 0.4 req/s: once the window has passed the high
        // rate, the model asks for one pod (well past the rate's noise).
        let mut finished = 50;
        for n in [15, 20, 25, 30] {
            finished += 1;
            hook.answer(&[busy(1, finished, 0), busy(2, finished, 0)], s(n));
        }
        let a = &hook.answer(&[busy(1, finished + 1, 0), busy(2, finished + 1, 0)], s(35))
            ["aggregated"];
        assert_eq!((a.desired, a.signal), (1, "slo"), "{a:?}");
        // Requests in flight floor the pool: 160 running need 160 / the
        // batch a pod holds (0.75 of 29424 KV tokens over 1260.5 per
        // sequence = 17.5), once the rate they arrived at has left the
        // window and the model asks for fewer.
        for n in [40, 45, 50, 55, 60] {
            finished += 1;
            hook.answer(&[busy(1, finished, 80), busy(2, finished, 80)], s(n));
        }
        let a = &hook.answer(
            &[busy(1, finished + 1, 80), busy(2, finished + 1, 80)],
            s(65),
        )["aggregated"];
        let slo = a.slo.as_ref().unwrap();
        assert_eq!(slo.in_flight_floor, 10, "{a:?}");
        assert!(slo.needed < 10, "{a:?}");
        assert_eq!((a.desired, a.signal), (10, "in_flight"), "{a:?}");
    }

    #[test]
    fn a_burst_is_a_rate_past_the_noise_of_a_few_samples() {
        // 3 req/s expect 6 arrivals in 2 s: 18 are a 3x burst, 10 are noise.
        assert!(burst(3.0, 9.0, 2.0));
        assert!(!burst(3.0, 5.0, 2.0));
        // Over a longer span a smaller surge is past the noise.
        assert!(burst(3.0, 4.5, 20.0));
        assert!(
            !burst(0.0, 0.4, 2.0),
            "one arrival after none is not a burst"
        );
    }

    #[test]
    fn a_rate_that_jumped_by_less_than_a_burst_counts_against_the_rate_before_it() {
        // The shipped window (60 s sampled every 5 s): spans of 2 to 6
        // intervals are tested.
        let mut cfg = slo_config();
        if let Some(slo) = cfg.slo.as_mut() {
            slo.window = crate::config::Duration::from_secs(60);
        }
        assert_eq!(recent_spans(cfg.slo.as_ref().unwrap()), 2..=6);
        let hook = Hook::new(&cfg, &mut Registry::default());
        let t0 = Instant::now();
        let two = |n: u64| [busy(1, n / 2, 0), busy(2, n - n / 2, 0)];
        let mut finished = 0;
        let mut last = None;
        // 3 req/s for a minute, then 4.8 req/s for 15 s.
        for i in 0..=15u64 {
            finished += match i {
                0 => 0,
                1..=12 => 15,
                _ => 24,
            };
            let at = t0 + std::time::Duration::from_secs(5 * i);
            last = Some(hook.answer(&two(finished), at)["aggregated"].clone());
        }
        let a = last.unwrap();
        let w = a.slo.as_ref().unwrap().workload;
        // The window's average is 3.45 req/s. The last 15 s (72 arrivals)
        // against the 3 req/s before them (45 expected) are past three
        // standard deviations; against the window's own average, which
        // holds them (52 expected), they would not be, nor would any span.
        assert!((w.arrival_rate - 4.8).abs() < 1e-9, "{a:?}");
        assert!((w.window_s - 15.0).abs() < 1e-9, "{a:?}");
    }

    #[test]
    fn a_pool_shrinks_only_to_a_size_that_holds_past_the_noise_of_its_rate() {
        let cfg = slo_config();
        let slo = cfg.slo.clone().unwrap();
        let targets = Targets {
            ttft_ms: 2000.0,
            ttft_quantile: 0.9,
            itl_p99_ms: 250.0,
            kv_usage: cfg.target_kv_usage.get(),
        };
        let conv = Workload {
            arrival_rate: 1.0,
            prompt_tokens: 1155.0,
            uncached_tokens: 1155.0,
            output_tokens: 211.0,
            prompt_tokens_sq: None,
            window_s: 20.0,
        };
        // The most two pods hold, by the model.
        let two = slo::rate_per_pod(&slo.pod, &targets, &conv, 2) * 2.0;
        // Three pods that finished `total` requests over the 20 s window.
        let answer = |total: u64| {
            let hook = Hook::new(&cfg, &mut Registry::default());
            let t0 = Instant::now();
            hook.answer(&[busy(1, 0, 0), busy(2, 0, 0), busy(3, 0, 0)], t0);
            let (a, b) = (total / 3, total / 3);
            let later = [busy(1, a, 0), busy(2, b, 0), busy(3, total - a - b, 0)];
            let at = t0 + std::time::Duration::from_secs(20);
            hook.answer(&later, at)["aggregated"].clone()
        };
        // Just under what two pods hold: within the rate's noise of it.
        let near = (two * 0.97 * 20.0).floor() as u64;
        let a = answer(near);
        assert_eq!((a.desired, a.signal), (3, "slo"), "{two} req/s: {a:?}");
        // Well under it: the pool shrinks.
        let a = answer((two * 0.6 * 20.0).floor() as u64);
        assert!(a.desired <= 2, "{a:?}");
    }

    /// A prefill pod `i` that has prefilled `finished` prompts of 2048
    /// tokens (one token out each), with `waiting` queued.
    fn prefilling(i: u32, finished: u64, waiting: u32) -> PodSnapshot {
        let mut p = pod(Role::Prefill, waiting, 0.2, Some(50));
        p.info.id = format!("10.0.2.{i}:8000");
        p.load.work = Some(crate::fleet::EngineWork {
            finished,
            prompt_tokens: finished * 2048,
            cached_tokens: 0,
            generation_tokens: finished,
            prompt_spread: None,
        });
        p
    }

    #[test]
    fn a_prefill_pool_counts_its_backlog_in_prefill_time_not_in_requests_per_pod() {
        let cfg = slo_config(); // TTFT p90 2 s, 2 waiting per pod
        let hook = Hook::new(&cfg, &mut Registry::default());
        let t0 = Instant::now();
        hook.answer(&[prefilling(1, 0, 0), prefilling(2, 0, 0)], t0);
        // 1 req/s over the 20 s window, and 15 queued on each pod at its end.
        let a = &hook.answer(
            &[prefilling(1, 10, 15), prefilling(2, 10, 15)],
            t0 + std::time::Duration::from_secs(20),
        )["prefill"];
        let slo = a.slo.as_ref().unwrap();
        let prefill_ms = slo::mean_prefill_ms(&cfg.slo.as_ref().unwrap().pod, &slo.workload);
        assert!(prefill_ms > 200.0 && prefill_ms < 400.0, "{prefill_ms}");
        // 30 prompts of ~0.28 s each prefill within 2 s on 5 pods.
        let floor = (30.0 * prefill_ms / 2000.0).ceil() as u32;
        assert_eq!(slo.in_flight_floor, floor, "{a:?}");
        // The queue rule (7.5 per pod against 2) asks for 15: not applied.
        assert_eq!(slo.queue_desired, 15, "{a:?}");
        assert!(slo.needed < floor, "{a:?}");
        assert_eq!((a.desired, a.signal), (floor, "in_flight"), "{a:?}");
    }

    #[test]
    fn a_sidecar_that_just_started_does_not_shrink_the_pool() {
        let hook = Hook::new(&slo_config(), &mut Registry::default());
        let t0 = Instant::now();
        let pods: Vec<PodSnapshot> = (1..=6).map(|i| busy(i, 0, 0)).collect();
        hook.answer(&pods, t0);
        // 0.6 req/s over 10 s: one pod would do, but 10 s is half a window.
        let later: Vec<PodSnapshot> = (1..=6).map(|i| busy(i, 1, 0)).collect();
        let a = &hook.answer(&later, t0 + std::time::Duration::from_secs(10))["aggregated"];
        assert_eq!((a.desired, a.signal), (6, "warming"), "{a:?}");
        assert_eq!(a.slo.as_ref().unwrap().needed, 1);
    }
}
