//! `model-filter`: keep endpoints that can serve the requested model: the
//! model is among `EndpointView::models`, or the request names a LoRA adapter
//! that the endpoint has loaded. Endpoints that announce no models at all
//! pass when `passUnknown` is true (their sidecar has not told us yet, and the
//! engine will answer a clear 404 if it cannot serve).
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `passUnknown` | `true` | keep endpoints whose model list is empty |
//!
//! ```yaml
//! plugins:
//!   - type: model-filter
//!     parameters:
//!       passUnknown: false
//! ```

use serde::Deserialize;

use crate::sched::plugin::Filter;
use crate::sched::view::{EndpointView, RequestView};

/// Type name.
pub const TYPE: &str = "model-filter";

/// Parameters of `model-filter`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct ModelFilterParams {
    /// Keep endpoints with an empty model list.
    pub pass_unknown: bool,
}

impl Default for ModelFilterParams {
    fn default() -> Self {
        ModelFilterParams { pass_unknown: true }
    }
}

/// Keeps endpoints serving the model or its adapter.
#[derive(Debug, Clone)]
pub struct ModelFilter {
    /// Parameters.
    pub params: ModelFilterParams,
}

impl ModelFilter {
    fn serves(&self, req: &RequestView, ep: &EndpointView) -> bool {
        if ep.models.is_empty() && ep.lora_adapters.is_empty() {
            return self.params.pass_unknown;
        }
        if ep.models.contains(&req.model) {
            return true;
        }
        req.lora_adapter
            .as_ref()
            .is_some_and(|a| ep.lora_adapters.iter().any(|l| l == a))
    }
}

impl Filter for ModelFilter {
    fn filter(&self, req: &RequestView, endpoints: &[EndpointView], candidates: &mut Vec<usize>) {
        candidates.retain(|&i| self.serves(req, &endpoints[i]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eps() -> Vec<EndpointView> {
        vec![
            EndpointView {
                models: vec!["llama".into()],
                ..EndpointView::new("base")
            },
            EndpointView {
                models: vec!["llama".into()],
                lora_adapters: vec!["sql".into()],
                ..EndpointView::new("lora")
            },
            EndpointView {
                models: vec!["qwen".into()],
                ..EndpointView::new("other")
            },
            EndpointView::new("unknown"),
        ]
    }

    #[test]
    fn keeps_serving_endpoints() {
        let f = ModelFilter {
            params: ModelFilterParams::default(),
        };
        let mut c = vec![0, 1, 2, 3];
        f.filter(&RequestView::new("r", "llama"), &eps(), &mut c);
        assert_eq!(c, vec![0, 1, 3]);
    }

    #[test]
    fn adapter_needs_it_loaded() {
        let f = ModelFilter {
            params: ModelFilterParams {
                pass_unknown: false,
            },
        };
        let req = RequestView {
            lora_adapter: Some("sql".into()),
            ..RequestView::new("r", "sql")
        };
        let mut c = vec![0, 1, 2, 3];
        f.filter(&req, &eps(), &mut c);
        assert_eq!(c, vec![1]);
    }
}
