//! `load-aware-scorer`: an absolute (not relative) queue penalty, llm-d's
//! formula: 0.5 when the waiting queue is empty, `0.5 · (1 − q / threshold)`
//! below the threshold, 0 at or above it. Its range is [0, 0.5], so at equal
//! weight it counts half as much as the relative `queue-scorer`; it keeps
//! penalising when every candidate is busy, where `queue-scorer` cannot.
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `threshold` | `128` | queue length that scores 0 (must be ≥ 1) |
//!
//! ```yaml
//! plugins:
//!   - type: load-aware-scorer
//!     parameters:
//!       threshold: 64
//! ```

use serde::Deserialize;

use crate::sched::error::ParamError;
use crate::sched::plugin::Scorer;
use crate::sched::view::{EndpointView, RequestView};

/// Type name.
pub const TYPE: &str = "load-aware-scorer";

/// Parameters of `load-aware-scorer`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct LoadAwareParams {
    /// Queue length scoring 0.
    pub threshold: u32,
}

impl Default for LoadAwareParams {
    fn default() -> Self {
        LoadAwareParams { threshold: 128 }
    }
}

impl LoadAwareParams {
    /// `threshold` must be positive.
    pub fn validate(&self) -> Result<(), ParamError> {
        if self.threshold == 0 {
            return Err(ParamError::invalid("threshold", "must be at least 1"));
        }
        Ok(())
    }
}

/// Absolute queue penalty.
#[derive(Debug, Clone)]
pub struct LoadAwareScorer {
    /// Parameters.
    pub params: LoadAwareParams,
}

impl Scorer for LoadAwareScorer {
    fn score(&self, _r: &RequestView, eps: &[EndpointView], cands: &[usize], out: &mut [f64]) {
        let t = f64::from(self.params.threshold.max(1));
        for (o, &i) in out.iter_mut().zip(cands) {
            let q = f64::from(eps[i].load.waiting);
            *o = if q >= t { 0.0 } else { 0.5 * (1.0 - q / t) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::view::LoadSnapshot;

    #[test]
    fn formula() {
        let eps: Vec<_> = [0u32, 32, 128, 500]
            .iter()
            .map(|&q| EndpointView {
                load: LoadSnapshot {
                    waiting: q,
                    ..LoadSnapshot::default()
                },
                ..EndpointView::new("e")
            })
            .collect();
        let s = LoadAwareScorer {
            params: LoadAwareParams { threshold: 128 },
        };
        let mut out = [9.0; 4];
        s.score(&RequestView::default(), &eps, &[0, 1, 2, 3], &mut out);
        assert_eq!(out, [0.5, 0.375, 0.0, 0.0]);
        assert!(LoadAwareParams { threshold: 0 }.validate().is_err());
    }
}
