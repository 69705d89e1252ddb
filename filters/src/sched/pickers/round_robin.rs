//! `round-robin-picker`: ignore the scores and take the candidates in turn
//! (ordered by endpoint id, so the rotation is stable however the caller
//! orders its slice). The baseline the benchmarks compare against; the
//! fallbacks are the next candidates in the rotation. A `/debug/route`
//! what-if does not advance the rotation.
//!
//! Parameters: `maxNumOfEndpoints` (default 4), see [`super`].
//!
//! ```yaml
//! plugins:
//!   - type: round-robin-picker
//! ```

use std::sync::atomic::{AtomicU64, Ordering};

use crate::sched::pickers::PickerParams;
use crate::sched::plugin::{PickCtx, Picker};
use crate::sched::view::EndpointView;

/// Type name.
pub const TYPE: &str = "round-robin-picker";

/// Takes candidates in turn.
#[derive(Debug, Default)]
pub struct RoundRobinPicker {
    params: PickerParams,
    next: AtomicU64,
}

impl RoundRobinPicker {
    /// A picker starting at the first endpoint.
    pub fn new(params: PickerParams) -> Self {
        RoundRobinPicker {
            params,
            next: AtomicU64::new(0),
        }
    }
}

impl Picker for RoundRobinPicker {
    fn pick(
        &self,
        ctx: &mut PickCtx,
        eps: &[EndpointView],
        cands: &[usize],
        _totals: &[f64],
        out: &mut Vec<usize>,
    ) {
        let n = cands.len();
        if n == 0 {
            return;
        }
        let turn = if ctx.dry_run {
            self.next.load(Ordering::Relaxed)
        } else {
            self.next.fetch_add(1, Ordering::Relaxed)
        };
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_unstable_by(|&a, &b| eps[cands[a]].id.cmp(&eps[cands[b]].id));
        let start = (turn % n as u64) as usize;
        let take = self.params.max_num_of_endpoints.min(n);
        out.extend((0..take).map(|k| order[(start + k) % n]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::plugin::SchedRng;

    #[test]
    fn rotates_by_id_and_dry_run_does_not_advance() {
        let eps: Vec<_> = ["c", "a", "b"]
            .iter()
            .map(|id| EndpointView::new(*id))
            .collect();
        let p = RoundRobinPicker::new(PickerParams::default());
        let mut seen = Vec::new();
        for dry_run in [false, false, true, false, false] {
            let mut ctx = PickCtx {
                rng: SchedRng::new(0),
                dry_run,
            };
            let mut out = Vec::new();
            p.pick(&mut ctx, &eps, &[0, 1, 2], &[0.0; 3], &mut out);
            assert_eq!(out.len(), 3);
            seen.push(eps[out[0]].id.clone());
        }
        assert_eq!(seen, vec!["a", "b", "c", "c", "a"]);
    }
}
