//! The `autoscale` section of `proxy.yaml`: the targets the autoscaling hook
//! sizes each pool against (docs/autoscaling.md).

use serde::{Deserialize, Serialize};

use super::units::Fraction;
use super::Duration;

/// See the module docs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Autoscale {
    /// Requests waiting per pod that a pool should average (queue depth).
    pub target_waiting_per_pod: u32,
    /// KV-cache usage a pool should average.
    pub target_kv_usage: Fraction,
    /// No change while the pool's load is within this fraction of its target
    /// (as the HPA's tolerance), so small swings do not flap.
    pub tolerance: Fraction,
    /// Bounds of every pool's answer.
    pub min_replicas: u32,
    pub max_replicas: u32,
    /// Pods whose load is older than this are left out (not counted, not averaged).
    pub max_load_age: Duration,
}

impl Default for Autoscale {
    fn default() -> Self {
        Self {
            target_waiting_per_pod: 2,
            target_kv_usage: Fraction::new(0.75).unwrap_or(Fraction::ONE),
            tolerance: Fraction::new(0.1).unwrap_or(Fraction::ONE),
            min_replicas: 1,
            max_replicas: 64,
            max_load_age: Duration::from_secs(10),
        }
    }
}

impl Autoscale {
    /// Rules that span fields; `(field, message)` on the first broken one.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.target_waiting_per_pod == 0 {
            return Err((
                "autoscale.target_waiting_per_pod".to_owned(),
                "must be at least 1".to_owned(),
            ));
        }
        if self.min_replicas == 0 {
            return Err((
                "autoscale.min_replicas".to_owned(),
                "must be at least 1: a pool scaled to zero has no load to scale it up again"
                    .to_owned(),
            ));
        }
        if self.min_replicas > self.max_replicas {
            return Err((
                "autoscale.min_replicas".to_owned(),
                format!(
                    "{} is above max_replicas ({})",
                    self.min_replicas, self.max_replicas
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use crate::config::from_yaml_str;

    #[test]
    fn targets_load_and_bad_values_name_their_field() {
        let c = from_yaml_str(
            "autoscale:\n  target_kv_usage: 0.8\n  max_replicas: 8\n",
            "proxy.yaml",
        )
        .unwrap();
        assert!((c.autoscale.target_kv_usage.get() - 0.8).abs() < 1e-12);
        assert_eq!(c.autoscale.max_replicas, 8);
        for (yaml, field) in [
            (
                "autoscale:\n  target_kv_usage: 1.5\n",
                "autoscale.target_kv_usage",
            ),
            ("autoscale:\n  tolerance: 0\n", "autoscale.tolerance"),
            (
                "autoscale:\n  target_waiting_per_pod: 0\n",
                "autoscale.target_waiting_per_pod",
            ),
            (
                "autoscale:\n  min_replicas: 9\n  max_replicas: 8\n",
                "autoscale.min_replicas",
            ),
            ("autoscale:\n  min_replicas: 0\n", "autoscale.min_replicas"),
        ] {
            let e = from_yaml_str(yaml, "proxy.yaml").unwrap_err().to_string();
            assert!(e.contains(field), "{yaml}: {e}");
        }
    }
}
