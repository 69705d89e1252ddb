//! `load-ceiling-filter`: drop endpoints whose waiting queue exceeds
//! `maxWaiting`, unless every candidate does (then all are kept, so an
//! overloaded pool still serves instead of failing every request).
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `maxWaiting` | `128` | largest acceptable engine waiting queue |
//!
//! ```yaml
//! plugins:
//!   - type: load-ceiling-filter
//!     parameters:
//!       maxWaiting: 32
//! ```

use serde::Deserialize;

use crate::sched::plugin::Filter;
use crate::sched::view::{EndpointView, RequestView};

/// Type name.
pub const TYPE: &str = "load-ceiling-filter";

/// Parameters of `load-ceiling-filter`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct LoadCeilingParams {
    /// Largest acceptable waiting queue.
    pub max_waiting: u32,
}

impl Default for LoadCeilingParams {
    fn default() -> Self {
        LoadCeilingParams { max_waiting: 128 }
    }
}

/// Drops endpoints over the queue ceiling unless all are.
#[derive(Debug, Clone)]
pub struct LoadCeilingFilter {
    /// Parameters.
    pub params: LoadCeilingParams,
}

impl Filter for LoadCeilingFilter {
    fn filter(&self, _req: &RequestView, endpoints: &[EndpointView], candidates: &mut Vec<usize>) {
        let max = self.params.max_waiting;
        if candidates.iter().any(|&i| endpoints[i].load.waiting <= max) {
            candidates.retain(|&i| endpoints[i].load.waiting <= max);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::view::LoadSnapshot;

    fn ep(id: &str, waiting: u32) -> EndpointView {
        EndpointView {
            load: LoadSnapshot {
                waiting,
                ..LoadSnapshot::default()
            },
            ..EndpointView::new(id)
        }
    }

    fn f(max_waiting: u32) -> LoadCeilingFilter {
        LoadCeilingFilter {
            params: LoadCeilingParams { max_waiting },
        }
    }

    #[test]
    fn drops_over_ceiling() {
        let eps = vec![ep("a", 3), ep("b", 11), ep("c", 10)];
        let mut c = vec![0, 1, 2];
        f(10).filter(&RequestView::default(), &eps, &mut c);
        assert_eq!(c, vec![0, 2]);
    }

    #[test]
    fn keeps_all_when_all_over() {
        let eps = vec![ep("a", 30), ep("b", 11)];
        let mut c = vec![0, 1];
        f(10).filter(&RequestView::default(), &eps, &mut c);
        assert_eq!(c, vec![0, 1]);
    }
}
