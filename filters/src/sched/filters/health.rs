//! `healthy-fresh-filter`: drop endpoints marked unhealthy or whose load and
//! health data is older than `maxStalenessMs` (a peer whose state stream went
//! quiet may be gone; routing to it risks a timeout).
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `maxStalenessMs` | `5000` | oldest acceptable data, in ms (0 = only perfectly fresh data) |
//!
//! ```yaml
//! plugins:
//!   - type: healthy-fresh-filter
//!     parameters:
//!       maxStalenessMs: 3000
//! ```

use serde::Deserialize;

use crate::sched::plugin::Filter;
use crate::sched::view::{EndpointView, RequestView};

/// Type name.
pub const TYPE: &str = "healthy-fresh-filter";

/// Parameters of `healthy-fresh-filter`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct HealthyFreshParams {
    /// Oldest acceptable data age in ms.
    pub max_staleness_ms: u64,
}

impl Default for HealthyFreshParams {
    fn default() -> Self {
        HealthyFreshParams {
            max_staleness_ms: 5000,
        }
    }
}

/// Keeps healthy endpoints with fresh data.
#[derive(Debug, Clone)]
pub struct HealthyFreshFilter {
    /// Parameters.
    pub params: HealthyFreshParams,
}

impl Filter for HealthyFreshFilter {
    fn filter(&self, _req: &RequestView, endpoints: &[EndpointView], candidates: &mut Vec<usize>) {
        let max = self.params.max_staleness_ms;
        candidates.retain(|&i| endpoints[i].healthy && endpoints[i].staleness_ms <= max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_unhealthy_and_stale() {
        let eps = vec![
            EndpointView::new("ok"),
            EndpointView {
                healthy: false,
                ..EndpointView::new("down")
            },
            EndpointView {
                staleness_ms: 5001,
                ..EndpointView::new("stale")
            },
            EndpointView {
                staleness_ms: 5000,
                ..EndpointView::new("edge")
            },
        ];
        let f = HealthyFreshFilter {
            params: HealthyFreshParams::default(),
        };
        let mut c = vec![0, 1, 2, 3];
        f.filter(&RequestView::default(), &eps, &mut c);
        assert_eq!(c, vec![0, 3]);
    }
}
