//! Built-in scorers: each rates every candidate in [0, 1]; a profile weights
//! and sums them. See each module for its type name, parameters and a YAML
//! example.

pub mod active;
pub mod affinity;
pub mod cost;
pub mod eviction;
pub mod kv_util;
pub mod load_aware;
pub mod lora;
pub mod no_hit_lru;
pub mod prefix;
pub mod queue;
pub mod session;

/// Min-max normalisation where lower is better: the least loaded candidate
/// scores 1, the most loaded 0; all equal scores 1 for everyone.
pub(crate) fn lower_is_better(values: impl Iterator<Item = f64> + Clone, out: &mut [f64]) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.clone() {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    let span = hi - lo;
    for (o, v) in out.iter_mut().zip(values) {
        *o = if span > 0.0 { (hi - v) / span } else { 1.0 };
    }
}
