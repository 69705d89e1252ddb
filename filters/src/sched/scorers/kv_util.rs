//! `kv-cache-utilization-scorer`: prefer endpoints with free KV cache:
//! `1 − kvUsage` (usage clamped to [0, 1]; llm-d's formula).
//!
//! Parameters: none.
//!
//! ```yaml
//! plugins:
//!   - type: kv-cache-utilization-scorer
//! ```

use crate::sched::plugin::Scorer;
use crate::sched::view::{EndpointView, RequestView};

/// Type name.
pub const TYPE: &str = "kv-cache-utilization-scorer";

/// Scores by free KV cache.
#[derive(Debug, Clone, Default)]
pub struct KvUtilScorer;

impl Scorer for KvUtilScorer {
    fn score(&self, _r: &RequestView, eps: &[EndpointView], cands: &[usize], out: &mut [f64]) {
        for (o, &i) in out.iter_mut().zip(cands) {
            let u = eps[i].load.kv_usage;
            // NaN from a broken metric counts as full: never prefer unknown.
            *o = if u.is_nan() {
                0.0
            } else {
                1.0 - u.clamp(0.0, 1.0)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::view::LoadSnapshot;

    #[test]
    fn one_minus_usage() {
        let eps: Vec<_> = [0.25, 1.5, f64::NAN, -1.0]
            .iter()
            .map(|&u| EndpointView {
                load: LoadSnapshot {
                    kv_usage: u,
                    ..LoadSnapshot::default()
                },
                ..EndpointView::new("e")
            })
            .collect();
        let mut out = [9.0; 4];
        KvUtilScorer.score(&RequestView::default(), &eps, &[0, 1, 2, 3], &mut out);
        assert_eq!(out, [0.75, 0.0, 0.0, 1.0]);
    }
}
