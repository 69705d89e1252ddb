//! `active-request-scorer`: prefer endpoints with fewer requests at them:
//! `(maxA − a) / maxA`, 1.0 for all when none has any. `a` is what this mesh
//! has in flight there (fresher than engine metrics, so a burst sent through
//! many sidecars spreads before the engines report it), or the engine's
//! running plus waiting count when that is larger (clients that bypass the
//! mesh): [`LoadSnapshot::requests`](crate::sched::LoadSnapshot::requests).
//!
//! Parameters: none.
//!
//! ```yaml
//! plugins:
//!   - type: active-request-scorer
//! ```

use crate::sched::plugin::Scorer;
use crate::sched::view::{EndpointView, RequestView};

/// Type name.
pub const TYPE: &str = "active-request-scorer";

/// Scores by in-flight requests.
#[derive(Debug, Clone, Default)]
pub struct ActiveRequestScorer;

impl Scorer for ActiveRequestScorer {
    fn score(&self, _r: &RequestView, eps: &[EndpointView], cands: &[usize], out: &mut [f64]) {
        let max = cands
            .iter()
            .map(|&i| eps[i].load.requests())
            .max()
            .unwrap_or(0);
        for (o, &i) in out.iter_mut().zip(cands) {
            *o = if max == 0 {
                1.0
            } else {
                f64::from(max - eps[i].load.requests()) / f64::from(max)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::view::LoadSnapshot;

    #[test]
    fn fewer_in_flight_scores_higher() {
        let eps: Vec<_> = [0u32, 2, 4]
            .iter()
            .map(|&n| EndpointView {
                load: LoadSnapshot {
                    in_flight: n,
                    ..LoadSnapshot::default()
                },
                ..EndpointView::new("e")
            })
            .collect();
        let mut out = [0.0; 3];
        ActiveRequestScorer.score(&RequestView::default(), &eps, &[0, 1, 2], &mut out);
        assert_eq!(out, [1.0, 0.5, 0.0]);
        ActiveRequestScorer.score(&RequestView::default(), &eps, &[0], &mut out[..1]);
        assert_eq!(out[0], 1.0);
    }

    #[test]
    fn an_engine_queue_larger_than_the_mesh_count_counts() {
        let eps: Vec<_> = [(0u32, 0u32), (1, 8)]
            .iter()
            .map(|&(in_flight, waiting)| EndpointView {
                load: LoadSnapshot {
                    in_flight,
                    waiting,
                    ..LoadSnapshot::default()
                },
                ..EndpointView::new("e")
            })
            .collect();
        let mut out = [0.0; 2];
        ActiveRequestScorer.score(&RequestView::default(), &eps, &[0, 1], &mut out);
        assert_eq!(out, [1.0, 0.0]);
    }
}
