//! `decode-filter` and `prefill-filter`: keep endpoints by serving role.
//!
//! * `decode-filter` keeps endpoints whose role is `decode` or `both`.
//! * `prefill-filter` keeps endpoints whose role is `prefill` or `both`.
//!
//! Parameters: none. (llm-d reads the role from the `llm-d.ai/role` label; in
//! kvmesh each sidecar announces its role, which the proxy puts in
//! `EndpointView::role`.)
//!
//! ```yaml
//! plugins:
//!   - type: decode-filter
//!   - type: prefill-filter
//! ```

use crate::sched::plugin::Filter;
use crate::sched::view::{EndpointView, RequestView, Role};

/// Type name of [`RoleFilter`] keeping decoders.
pub const DECODE_TYPE: &str = "decode-filter";
/// Type name of [`RoleFilter`] keeping prefillers.
pub const PREFILL_TYPE: &str = "prefill-filter";

/// Keeps endpoints that can play one role.
#[derive(Debug, Clone, Copy)]
pub struct RoleFilter {
    /// The role kept: `Prefill` or `Decode` (`Both`-role endpoints always pass).
    pub keep: Role,
}

impl Filter for RoleFilter {
    fn filter(&self, _req: &RequestView, endpoints: &[EndpointView], candidates: &mut Vec<usize>) {
        candidates.retain(|&i| match self.keep {
            Role::Prefill => endpoints[i].role.can_prefill(),
            Role::Decode => endpoints[i].role.can_decode(),
            Role::Both => true,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eps() -> Vec<EndpointView> {
        [Role::Prefill, Role::Decode, Role::Both]
            .iter()
            .enumerate()
            .map(|(i, r)| EndpointView {
                role: *r,
                ..EndpointView::new(format!("e{i}"))
            })
            .collect()
    }

    #[test]
    fn decode_keeps_decode_and_both() {
        let mut c = vec![0, 1, 2];
        let f = RoleFilter { keep: Role::Decode };
        f.filter(&RequestView::default(), &eps(), &mut c);
        assert_eq!(c, vec![1, 2]);
    }

    #[test]
    fn prefill_keeps_prefill_and_both() {
        let mut c = vec![0, 1, 2];
        let f = RoleFilter {
            keep: Role::Prefill,
        };
        f.filter(&RequestView::default(), &eps(), &mut c);
        assert_eq!(c, vec![0, 2]);
    }
}
