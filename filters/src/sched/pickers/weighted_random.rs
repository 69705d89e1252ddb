//! `weighted-random-picker`: choose at random with probability proportional to
//! the weighted total (weighted sampling without replacement, so the fallbacks
//! are drawn the same way). Candidates scoring 0 come last; if all score 0
//! the choice is uniform. Useful to spread load when scores are close and
//! exact max-score would herd.
//!
//! Parameters: `maxNumOfEndpoints` (default 4), see [`super`].
//!
//! ```yaml
//! plugins:
//!   - type: weighted-random-picker
//! ```

use crate::sched::pickers::PickerParams;
use crate::sched::plugin::{PickCtx, Picker};
use crate::sched::view::EndpointView;

/// Type name.
pub const TYPE: &str = "weighted-random-picker";

/// Score-proportional random choice.
#[derive(Debug, Clone, Default)]
pub struct WeightedRandomPicker {
    /// Parameters.
    pub params: PickerParams,
}

impl Picker for WeightedRandomPicker {
    fn pick(
        &self,
        ctx: &mut PickCtx,
        _eps: &[EndpointView],
        _cands: &[usize],
        totals: &[f64],
        out: &mut Vec<usize>,
    ) {
        // Efraimidis–Spirakis: key = ln(u) / w, the largest keys win; that is
        // sampling without replacement proportional to w.
        let mut keyed: Vec<(f64, u64, usize)> = totals
            .iter()
            .enumerate()
            .map(|(pos, &w)| {
                let u = ctx.rng.next_f64().max(f64::MIN_POSITIVE);
                let key = if w > 0.0 && w.is_finite() {
                    u.ln() / w
                } else {
                    f64::NEG_INFINITY
                };
                (key, ctx.rng.next_u64(), pos)
            })
            .collect();
        keyed.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)));
        out.extend(
            keyed
                .iter()
                .take(self.params.max_num_of_endpoints)
                .map(|k| k.2),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::plugin::SchedRng;

    fn first(totals: &[f64], seed: u64) -> usize {
        let mut ctx = PickCtx {
            rng: SchedRng::new(seed),
            dry_run: false,
        };
        let cands: Vec<usize> = (0..totals.len()).collect();
        let mut out = Vec::new();
        WeightedRandomPicker::default().pick(&mut ctx, &[], &cands, totals, &mut out);
        assert_eq!(out.len(), totals.len().min(4));
        out[0]
    }

    #[test]
    fn proportional() {
        let mut counts = [0u32; 3];
        for seed in 0..3000 {
            counts[first(&[1.0, 3.0, 0.0], seed)] += 1;
        }
        assert_eq!(counts[2], 0);
        // Expect ~750 vs ~2250.
        assert!((600..900).contains(&counts[0]), "{counts:?}");
    }

    #[test]
    fn all_zero_is_uniform() {
        let firsts: std::collections::BTreeSet<usize> =
            (0..64).map(|s| first(&[0.0, 0.0, 0.0], s)).collect();
        assert_eq!(firsts.len(), 3);
    }
}
