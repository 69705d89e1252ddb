//! The scaling policies compared, and the controller that applies them the
//! way KEDA and the HorizontalPodAutoscaler do.
//!
//! Every reactive policy goes through the same [`Hpa`]: it polls its
//! trigger every `poll`, skips changes within 10% (the HPA's tolerance),
//! scales up at once but by at most `max(100%, 4 pods)` a poll (the HPA's
//! default scale-up policies), and scales down only to the largest
//! recommendation of the last `stabilization` (the HPA's default
//! `scaleDown.stabilizationWindowSeconds` is 300 s, which the queue policies
//! keep; `kvmesh-slo` runs with the window the shipped ScaledObjects set for
//! the hook, which slows scale-down itself).

use std::collections::VecDeque;

use serde::Serialize;

/// A way to size the fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScalePolicy {
    /// A fixed fleet, sized for the trace's peak rate.
    FixedPeak,
    /// A fixed fleet, sized for the trace's mean rate.
    FixedMean,
    /// KEDA's Prometheus scaler on `vllm:num_requests_waiting`, threshold 5
    /// per replica (vLLM production-stack's example).
    QueueHpa,
    /// KEDA's metrics-api scaler on kvmesh's hook without an SLO (its queue
    /// and KV-usage rule: the hook before issue 41).
    KvmeshQueue,
    /// The same scaler on kvmesh's hook with `autoscale.slo`.
    KvmeshSlo,
    /// Not a policy anyone can run: the hook's model at the highest rate
    /// the trace will reach before the pods asked for now can serve (a pod
    /// start-up and a poll ahead, read off the schedule), scaled down at
    /// once. The bound on what sizing by the model can reach when the rate
    /// is known in time; run on request only (`--policies clairvoyant`).
    Clairvoyant,
    /// Not a policy anyone can run either: the hook's model at the rate
    /// the trace runs at now, known the moment it changes (no window, no
    /// noise, no detection lag), scaled down at once. The bound on every
    /// scaler that reacts to the rate, however fast it reads it: what a
    /// pod start-up behind a step costs whatever the scaler
    /// (`--policies reactive-bound`).
    ReactiveBound,
}

impl ScalePolicy {
    pub const ALL: [ScalePolicy; 5] = [
        ScalePolicy::FixedPeak,
        ScalePolicy::FixedMean,
        ScalePolicy::QueueHpa,
        ScalePolicy::KvmeshQueue,
        ScalePolicy::KvmeshSlo,
    ];

    /// Every policy `--policies` accepts: the compared ones and the bounds.
    pub const KNOWN: [ScalePolicy; 7] = [
        ScalePolicy::FixedPeak,
        ScalePolicy::FixedMean,
        ScalePolicy::QueueHpa,
        ScalePolicy::KvmeshQueue,
        ScalePolicy::KvmeshSlo,
        ScalePolicy::Clairvoyant,
        ScalePolicy::ReactiveBound,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ScalePolicy::FixedPeak => "fixed-peak",
            ScalePolicy::FixedMean => "fixed-mean",
            ScalePolicy::QueueHpa => "queue-hpa",
            ScalePolicy::KvmeshQueue => "kvmesh-queue",
            ScalePolicy::KvmeshSlo => "kvmesh-slo",
            ScalePolicy::Clairvoyant => "clairvoyant",
            ScalePolicy::ReactiveBound => "reactive-bound",
        }
    }

    pub fn parse(s: &str) -> Option<ScalePolicy> {
        Self::KNOWN.into_iter().find(|p| p.name() == s)
    }

    /// Whether the fleet's size follows a trigger.
    pub fn reactive(self) -> bool {
        !matches!(self, ScalePolicy::FixedPeak | ScalePolicy::FixedMean)
    }
}

/// The HorizontalPodAutoscaler's arithmetic for one pool (see the module docs).
#[derive(Debug)]
pub struct Hpa {
    pub min: u32,
    pub max: u32,
    /// Seconds (simulated) a scale-down waits for lower recommendations.
    pub stabilization_s: f64,
    /// (simulated second, recommendation) of the last window.
    history: VecDeque<(f64, u32)>,
}

/// The HPA's tolerance: no change while `desired / current` is within 10% of 1.
const TOLERANCE: f64 = 0.1;

impl Hpa {
    /// An HPA that has been recommending `current` (the Deployment's size
    /// when it was created).
    pub fn new(min: u32, max: u32, stabilization_s: f64, current: u32) -> Self {
        Self {
            min,
            max,
            stabilization_s,
            history: VecDeque::from([(0.0, current)]),
        }
    }

    /// The replicas for a pool of `current` whose trigger asks for
    /// `wanted` (a replica count: the metric's value over its target).
    pub fn decide(&mut self, now_s: f64, current: u32, wanted: f64) -> u32 {
        let current = current.max(1);
        let ratio = wanted / f64::from(current);
        let recommendation = if (ratio - 1.0).abs() <= TOLERANCE {
            current
        } else {
            (wanted.ceil().max(0.0) as u32).clamp(self.min, self.max)
        };
        self.history.push_back((now_s, recommendation));
        while self
            .history
            .front()
            .is_some_and(|(t, _)| *t < now_s - self.stabilization_s)
        {
            self.history.pop_front();
        }
        if recommendation > current {
            let limit = (current * 2).max(current + 4);
            recommendation.min(limit)
        } else {
            // Down only to the highest recommendation in the window.
            let held = self
                .history
                .iter()
                .map(|(_, r)| *r)
                .max()
                .unwrap_or(current);
            held.min(current)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hpa_tolerates_ten_percent_scales_up_at_once_and_down_after_its_window() {
        let mut h = Hpa::new(1, 20, 300.0, 10);
        assert_eq!(h.decide(0.0, 10, 10.9), 10, "within the tolerance");
        let mut fresh = Hpa::new(1, 20, 300.0, 10);
        assert_eq!(fresh.decide(1.0, 10, 2.0), 10, "it had been asking for 10");
        assert_eq!(h.decide(15.0, 10, 14.0), 14);
        assert_eq!(h.decide(30.0, 2, 30.0), 6, "at most +4 or 100% a poll");
        // The rate falls: the last 300 s held 14, so the pool stays at 14.
        assert_eq!(h.decide(45.0, 14, 3.0), 14);
        assert_eq!(h.decide(200.0, 14, 3.0), 14);
        // 300 s after the last high recommendation it goes.
        assert_eq!(h.decide(331.0, 14, 3.0), 3);
        assert_eq!(h.decide(346.0, 3, 0.0), 3, "the window still holds 3");
        assert_eq!(h.decide(640.0, 3, 0.0), 1, "bounded by min");
    }

    #[test]
    fn the_slo_hook_runs_with_the_window_the_shipped_scaledobjects_set() {
        let yaml = include_str!("../../assets/deploy/autoscaling/keda-scaledobjects.yaml");
        let set: Vec<&str> = yaml
            .lines()
            .filter(|l| l.contains("stabilizationWindowSeconds: 60}"))
            .collect();
        assert_eq!(set.len(), 2, "one per pool: {set:?}");
        let secs = |d: std::time::Duration| d.as_secs_f64();
        assert_eq!(secs(super::super::shipped_scale_down_window()), 60.0);
        let t = super::super::Timing::compressed(5);
        assert_eq!(
            (secs(t.hook_stabilization), secs(t.stabilization)),
            (12.0, 60.0)
        );
    }

    #[test]
    fn policies_have_their_contract_names() {
        let names: Vec<&str> = ScalePolicy::ALL.iter().map(|p| p.name()).collect();
        assert_eq!(
            names,
            [
                "fixed-peak",
                "fixed-mean",
                "queue-hpa",
                "kvmesh-queue",
                "kvmesh-slo"
            ]
        );
        for p in ScalePolicy::KNOWN {
            assert_eq!(ScalePolicy::parse(p.name()), Some(p));
            assert_eq!(serde_json::to_value(p).unwrap(), p.name());
        }
    }
}
