//! `power-of-two-picker`: draw two candidates at random and take the one with
//! the higher weighted total (the other is the first fallback; further
//! fallbacks follow in score order). Cheap, and it avoids the herding of
//! max-score when many routers act on the same stale scores.
//!
//! Parameters: `maxNumOfEndpoints` (default 4), see [`super`].
//!
//! ```yaml
//! plugins:
//!   - type: power-of-two-picker
//! ```

use crate::sched::pickers::{ranked_by_score, PickerParams};
use crate::sched::plugin::{PickCtx, Picker};
use crate::sched::view::EndpointView;

/// Type name.
pub const TYPE: &str = "power-of-two-picker";

/// Best of two random candidates.
#[derive(Debug, Clone, Default)]
pub struct PowerOfTwoPicker {
    /// Parameters.
    pub params: PickerParams,
}

impl Picker for PowerOfTwoPicker {
    fn pick(
        &self,
        ctx: &mut PickCtx,
        _eps: &[EndpointView],
        _cands: &[usize],
        totals: &[f64],
        out: &mut Vec<usize>,
    ) {
        let n = totals.len();
        let max = self.params.max_num_of_endpoints;
        if n <= 1 || max == 0 {
            out.extend((0..n).take(max));
            return;
        }
        let a = ctx.rng.below(n);
        let mut b = ctx.rng.below(n - 1);
        if b >= a {
            b += 1;
        }
        let score = |p: usize| {
            if totals[p].is_nan() {
                f64::NEG_INFINITY
            } else {
                totals[p]
            }
        };
        let (first, second) = if score(b) > score(a) { (b, a) } else { (a, b) };
        out.push(first);
        if max >= 2 {
            out.push(second);
            ranked_by_score(&mut ctx.rng, totals, &[first, second], max - 2, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::plugin::SchedRng;

    #[test]
    fn never_picks_the_worst_of_many_and_fills_fallbacks() {
        let totals = [0.0, 0.3, 0.6, 0.9];
        let cands = [0, 1, 2, 3];
        for seed in 0..200 {
            let mut ctx = PickCtx {
                rng: SchedRng::new(seed),
                dry_run: false,
            };
            let mut out = Vec::new();
            PowerOfTwoPicker::default().pick(&mut ctx, &[], &cands, &totals, &mut out);
            assert_ne!(out[0], 0, "the lowest score can never win a pair");
            let mut sorted = out.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, vec![0, 1, 2, 3]);
        }
    }
}
