//! `healthy-fresh-filter`: drop endpoints marked unhealthy or whose load and
//! health data is older than `maxStalenessMs` (a peer whose state stream went
//! quiet may be gone; routing to it risks a timeout).
//!
//! Staleness is judged against the freshest healthy endpoint of the fleet, not
//! against zero: an endpoint is dropped when its data is more than
//! `maxStalenessMs` older than that one's. When one peer's stream goes quiet
//! while the others' keep coming, that peer is dropped, as before. When every
//! endpoint's data is old by about the same amount, the sidecar itself is the
//! one falling behind (a starved CPU delays its scrapes and the mesh frames
//! it reads alike), and the data says nothing against any one pod: refusing
//! every request then (a 503 "removed the last candidates") would lose
//! requests the pods could serve.
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `maxStalenessMs` | `5000` | how much older than the fleet's freshest healthy endpoint an endpoint's data may be, in ms (0 = only data as fresh as that one's) |
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

/// Keeps healthy endpoints whose data is about as fresh as the fleet's freshest.
#[derive(Debug, Clone)]
pub struct HealthyFreshFilter {
    /// Parameters.
    pub params: HealthyFreshParams,
}

impl HealthyFreshFilter {
    /// The oldest data kept: `maxStalenessMs` past the freshest healthy
    /// endpoint's in `endpoints` (the whole fleet, not only this profile's
    /// candidates: a pool whose every pod went quiet while the rest of the
    /// fleet kept reporting is dropped).
    pub fn oldest_kept_ms(&self, endpoints: &[EndpointView]) -> u64 {
        let freshest = endpoints
            .iter()
            .filter(|e| e.healthy)
            .map(|e| e.staleness_ms)
            .min()
            .unwrap_or(0);
        freshest.saturating_add(self.params.max_staleness_ms)
    }
}

impl Filter for HealthyFreshFilter {
    fn filter(&self, _req: &RequestView, endpoints: &[EndpointView], candidates: &mut Vec<usize>) {
        let oldest = self.oldest_kept_ms(endpoints);
        candidates.retain(|&i| endpoints[i].healthy && endpoints[i].staleness_ms <= oldest);
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

    fn aged(id: &str, staleness_ms: u64) -> EndpointView {
        EndpointView {
            staleness_ms,
            ..EndpointView::new(id)
        }
    }

    /// A sidecar that fell behind sees every pod's data old by about the same
    /// amount: it keeps them all and drops only the one far behind the rest.
    #[test]
    fn staleness_counts_from_the_freshest_healthy_endpoint() {
        let f = HealthyFreshFilter {
            params: HealthyFreshParams::default(),
        };
        let eps = vec![
            aged("a", 140_000),
            aged("b", 142_500),
            aged("quiet", 150_000),
            EndpointView {
                healthy: false,
                ..aged("down-but-fresh", 0)
            },
        ];
        let mut c = vec![0, 1, 2, 3];
        f.filter(&RequestView::default(), &eps, &mut c);
        assert_eq!(c, vec![0, 1], "the unhealthy pod's fresh data sets no bar");
        // Only the given candidates are filtered; the bar comes from all.
        let mut c = vec![2];
        f.filter(&RequestView::default(), &eps, &mut c);
        assert!(c.is_empty(), "a pool whose every pod went quiet is dropped");
        // Nothing ever reported anywhere: no data speaks against any pod.
        let never = vec![aged("x", u64::MAX), aged("y", u64::MAX)];
        let mut c = vec![0, 1];
        f.filter(&RequestView::default(), &never, &mut c);
        assert_eq!(c, vec![0, 1]);
    }
}
