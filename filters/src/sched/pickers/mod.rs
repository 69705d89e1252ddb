//! Built-in pickers: each ranks the filtered, scored candidates; the first is
//! the choice and the next ones (up to `maxNumOfEndpoints` in all) are the
//! fallbacks the execute stage tries when the first refuses before any byte
//! was sent. See each module for its type name, parameters and a YAML example.
//!
//! All pickers share one parameter:
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `maxNumOfEndpoints` | `4` | the choice plus up to this many − 1 fallbacks (≥ 1) |
//!
//! (llm-d's `max-score-picker` defaults to 1 because Envoy retries on its own;
//! kvmesh's execute stage uses the fallbacks, so the default keeps three.)

use serde::Deserialize;

use crate::sched::error::ParamError;
use crate::sched::plugin::SchedRng;

pub mod max_score;
pub mod power_of_two;
pub mod round_robin;
pub mod weighted_random;

/// Parameters shared by every picker.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct PickerParams {
    /// Endpoints returned: the choice plus fallbacks.
    pub max_num_of_endpoints: usize,
}

impl Default for PickerParams {
    fn default() -> Self {
        PickerParams {
            max_num_of_endpoints: 4,
        }
    }
}

impl PickerParams {
    /// At least one endpoint.
    pub fn validate(&self) -> Result<(), ParamError> {
        if self.max_num_of_endpoints == 0 {
            return Err(ParamError::invalid(
                "maxNumOfEndpoints",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}

/// Sort key for "higher total first, random among equals"; NaN sorts last.
pub(crate) fn ranked_by_score(
    rng: &mut SchedRng,
    totals: &[f64],
    skip: &[usize],
    limit: usize,
    out: &mut Vec<usize>,
) {
    let mut keyed: Vec<(f64, u64, usize)> = totals
        .iter()
        .enumerate()
        .filter(|(pos, _)| !skip.contains(pos))
        .map(|(pos, &t)| {
            (
                if t.is_nan() { f64::NEG_INFINITY } else { t },
                rng.next_u64(),
                pos,
            )
        })
        .collect();
    let better =
        |a: &(f64, u64, usize), b: &(f64, u64, usize)| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1));
    let limit = limit.min(keyed.len());
    if limit == 0 {
        return;
    }
    // Partial selection: O(n) to find the top `limit`, then sort only those.
    if limit < keyed.len() {
        keyed.select_nth_unstable_by(limit - 1, better);
        keyed.truncate(limit);
    }
    keyed.sort_unstable_by(better);
    out.extend(keyed.iter().map(|k| k.2));
}
