//! `lora-affinity-scorer`: for requests that name a LoRA adapter, prefer
//! endpoints that have it loaded (1.0), then endpoints with room to load it
//! (fewer than `maxLoras` adapters loaded: `canLoadScore`), then the rest (0).
//! Requests without an adapter score 0 everywhere (neutral).
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `maxLoras` | `1` | adapters an engine holds at once (vLLM `--max-loras`) |
//! | `canLoadScore` | `0.5` | score of an endpoint that could load the adapter, 0..=1 |
//!
//! ```yaml
//! plugins:
//!   - type: lora-affinity-scorer
//!     parameters:
//!       maxLoras: 4
//! ```

use serde::Deserialize;

use crate::sched::error::ParamError;
use crate::sched::params::check_range;
use crate::sched::plugin::Scorer;
use crate::sched::view::{EndpointView, RequestView};

/// Type name.
pub const TYPE: &str = "lora-affinity-scorer";

/// Parameters of `lora-affinity-scorer`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct LoraAffinityParams {
    /// Adapters an engine holds at once.
    pub max_loras: u32,
    /// Score of an endpoint with room for the adapter.
    pub can_load_score: f64,
}

impl Default for LoraAffinityParams {
    fn default() -> Self {
        LoraAffinityParams {
            max_loras: 1,
            can_load_score: 0.5,
        }
    }
}

impl LoraAffinityParams {
    /// Ranges.
    pub fn validate(&self) -> Result<(), ParamError> {
        check_range("canLoadScore", self.can_load_score, 0.0, 1.0)
    }
}

/// Prefers endpoints with the adapter loaded.
#[derive(Debug, Clone)]
pub struct LoraAffinityScorer {
    /// Parameters.
    pub params: LoraAffinityParams,
}

impl Scorer for LoraAffinityScorer {
    fn score(&self, req: &RequestView, eps: &[EndpointView], cands: &[usize], out: &mut [f64]) {
        let Some(adapter) = req.lora_adapter.as_deref() else {
            out.fill(0.0);
            return;
        };
        for (o, &i) in out.iter_mut().zip(cands) {
            let loaded = &eps[i].lora_adapters;
            *o = if loaded.iter().any(|l| l == adapter) {
                1.0
            } else if loaded.len() < self.params.max_loras as usize {
                self.params.can_load_score
            } else {
                0.0
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loaded_then_room_then_full() {
        let eps = vec![
            EndpointView {
                lora_adapters: vec!["other".into()],
                ..EndpointView::new("full")
            },
            EndpointView::new("room"),
            EndpointView {
                lora_adapters: vec!["sql".into()],
                ..EndpointView::new("loaded")
            },
        ];
        let s = LoraAffinityScorer {
            params: LoraAffinityParams::default(),
        };
        let req = RequestView {
            lora_adapter: Some("sql".into()),
            ..RequestView::default()
        };
        let mut out = [9.0; 3];
        s.score(&req, &eps, &[0, 1, 2], &mut out);
        assert_eq!(out, [0.0, 0.5, 1.0]);
        s.score(&RequestView::default(), &eps, &[0, 1, 2], &mut out);
        assert_eq!(out, [0.0, 0.0, 0.0]);
    }
}
