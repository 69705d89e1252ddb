//! `queue-scorer`: prefer short engine waiting queues, relative to the other
//! candidates: `(maxQ − q) / (maxQ − minQ)`, 1.0 for all when all are equal
//! (llm-d's formula).
//!
//! Parameters: none.
//!
//! ```yaml
//! plugins:
//!   - type: queue-scorer
//! schedulingProfiles:
//!   - name: default
//!     plugins:
//!       - pluginRef: queue-scorer
//!         weight: 2
//! ```

use crate::sched::plugin::Scorer;
use crate::sched::scorers::lower_is_better;
use crate::sched::view::{EndpointView, RequestView};

/// Type name.
pub const TYPE: &str = "queue-scorer";

/// Scores by waiting queue depth.
#[derive(Debug, Clone, Default)]
pub struct QueueScorer;

impl Scorer for QueueScorer {
    fn score(&self, _r: &RequestView, eps: &[EndpointView], cands: &[usize], out: &mut [f64]) {
        lower_is_better(cands.iter().map(|&i| f64::from(eps[i].load.waiting)), out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::view::LoadSnapshot;

    fn ep(waiting: u32) -> EndpointView {
        EndpointView {
            load: LoadSnapshot {
                waiting,
                ..LoadSnapshot::default()
            },
            ..EndpointView::new("e")
        }
    }

    #[test]
    fn min_max() {
        let eps = vec![ep(0), ep(5), ep(10)];
        let mut out = [0.0; 3];
        QueueScorer.score(&RequestView::default(), &eps, &[0, 1, 2], &mut out);
        assert_eq!(out, [1.0, 0.5, 0.0]);
    }

    #[test]
    fn all_equal_is_one() {
        let eps = vec![ep(4), ep(4)];
        let mut out = [0.0; 2];
        QueueScorer.score(&RequestView::default(), &eps, &[0, 1], &mut out);
        assert_eq!(out, [1.0, 1.0]);
    }
}
