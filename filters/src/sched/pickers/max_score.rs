//! `max-score-picker`: the highest weighted total wins; ties are broken at
//! random (seeded by the caller), so equal endpoints share the load; the
//! fallbacks follow in score order.
//!
//! Parameters: `maxNumOfEndpoints` (default 4), see [`super`].
//!
//! ```yaml
//! plugins:
//!   - type: max-score-picker
//!     parameters:
//!       maxNumOfEndpoints: 3
//! ```

use crate::sched::pickers::{ranked_by_score, PickerParams};
use crate::sched::plugin::{PickCtx, Picker};
use crate::sched::view::EndpointView;

/// Type name.
pub const TYPE: &str = "max-score-picker";

/// Highest score first.
#[derive(Debug, Clone, Default)]
pub struct MaxScorePicker {
    /// Parameters.
    pub params: PickerParams,
}

impl Picker for MaxScorePicker {
    fn pick(
        &self,
        ctx: &mut PickCtx,
        _eps: &[EndpointView],
        _cands: &[usize],
        totals: &[f64],
        out: &mut Vec<usize>,
    ) {
        ranked_by_score(
            &mut ctx.rng,
            totals,
            &[],
            self.params.max_num_of_endpoints,
            out,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::plugin::SchedRng;

    fn pick(totals: &[f64], seed: u64, max: usize) -> Vec<usize> {
        let p = MaxScorePicker {
            params: PickerParams {
                max_num_of_endpoints: max,
            },
        };
        let mut ctx = PickCtx {
            rng: SchedRng::new(seed),
            dry_run: false,
        };
        let cands: Vec<usize> = (0..totals.len()).collect();
        let mut out = Vec::new();
        p.pick(&mut ctx, &[], &cands, totals, &mut out);
        out
    }

    #[test]
    fn best_first_then_fallbacks() {
        assert_eq!(pick(&[0.1, 0.9, 0.5, 0.7], 1, 3), vec![1, 3, 2]);
        assert_eq!(pick(&[0.1, f64::NAN, 0.5], 1, 4), vec![2, 0, 1]);
    }

    #[test]
    fn ties_are_random() {
        let firsts: std::collections::BTreeSet<usize> = (0..64)
            .map(|seed| pick(&[1.0, 1.0, 1.0, 0.0], seed, 1)[0])
            .collect();
        assert_eq!(firsts, [0, 1, 2].into());
    }
}
