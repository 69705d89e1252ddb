//! `label-selector-filter`: keep endpoints whose labels match a Kubernetes
//! label selector (`matchLabels` and `matchExpressions`, all terms ANDed).
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `matchLabels` | `{}` | every `key: value` must be present |
//! | `matchExpressions` | `[]` | `{key, operator, values}`; operator `In`, `NotIn` (non-empty `values`), `Exists`, `DoesNotExist` (no `values`) |
//!
//! ```yaml
//! plugins:
//!   - type: label-selector-filter
//!     parameters:
//!       matchLabels:
//!         pool: gpu-a100
//!       matchExpressions:
//!         - key: zone
//!           operator: In
//!           values: [us-east-1a, us-east-1b]
//! ```

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::sched::error::ParamError;
use crate::sched::plugin::Filter;
use crate::sched::view::{EndpointView, RequestView};

/// Type name.
pub const TYPE: &str = "label-selector-filter";

/// A selector operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Operator {
    /// The label is one of `values`.
    In,
    /// The label is absent or not one of `values`.
    NotIn,
    /// The label is present.
    Exists,
    /// The label is absent.
    DoesNotExist,
}

/// One `matchExpressions` term.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expression {
    /// Label key.
    pub key: String,
    /// Operator.
    pub operator: Operator,
    /// Values for `In` / `NotIn`.
    #[serde(default)]
    pub values: Vec<String>,
}

/// Parameters of `label-selector-filter`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct LabelSelectorParams {
    /// Exact matches.
    pub match_labels: BTreeMap<String, String>,
    /// Set-based terms.
    pub match_expressions: Vec<Expression>,
}

impl LabelSelectorParams {
    /// Check the Kubernetes rules on `values`.
    pub fn validate(&self) -> Result<(), ParamError> {
        for (i, e) in self.match_expressions.iter().enumerate() {
            let needs_values = matches!(e.operator, Operator::In | Operator::NotIn);
            if needs_values && e.values.is_empty() {
                return Err(ParamError::invalid(
                    format!("matchExpressions[{i}].values"),
                    format!("operator {:?} needs at least one value", e.operator),
                ));
            }
            if !needs_values && !e.values.is_empty() {
                return Err(ParamError::invalid(
                    format!("matchExpressions[{i}].values"),
                    format!("operator {:?} takes no values", e.operator),
                ));
            }
        }
        Ok(())
    }

    /// Whether `labels` satisfy every term.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|e| {
                let got = labels.get(&e.key);
                match e.operator {
                    Operator::In => got.is_some_and(|g| e.values.contains(g)),
                    Operator::NotIn => !got.is_some_and(|g| e.values.contains(g)),
                    Operator::Exists => got.is_some(),
                    Operator::DoesNotExist => got.is_none(),
                }
            })
    }
}

/// Keeps endpoints matching the selector.
#[derive(Debug, Clone)]
pub struct LabelSelectorFilter {
    /// Parameters.
    pub params: LabelSelectorParams,
}

impl Filter for LabelSelectorFilter {
    fn filter(&self, _req: &RequestView, endpoints: &[EndpointView], candidates: &mut Vec<usize>) {
        candidates.retain(|&i| self.params.matches(&endpoints[i].labels));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(id: &str, labels: &[(&str, &str)]) -> EndpointView {
        EndpointView {
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..EndpointView::new(id)
        }
    }

    fn run(p: LabelSelectorParams) -> Vec<usize> {
        let eps = vec![
            ep("a", &[("pool", "x"), ("zone", "1")]),
            ep("b", &[("pool", "y"), ("zone", "2")]),
            ep("c", &[("pool", "x")]),
        ];
        let mut c = vec![0, 1, 2];
        LabelSelectorFilter { params: p }.filter(&RequestView::default(), &eps, &mut c);
        c
    }

    fn expr(key: &str, operator: Operator, values: &[&str]) -> Expression {
        Expression {
            key: key.into(),
            operator,
            values: values.iter().map(|v| (*v).to_owned()).collect(),
        }
    }

    fn with_expr(e: Expression) -> LabelSelectorParams {
        LabelSelectorParams {
            match_expressions: vec![e],
            ..LabelSelectorParams::default()
        }
    }

    #[test]
    fn match_labels() {
        let p = LabelSelectorParams {
            match_labels: [("pool".to_owned(), "x".to_owned())].into(),
            ..LabelSelectorParams::default()
        };
        assert_eq!(run(p), vec![0, 2]);
    }

    #[test]
    fn operators() {
        assert_eq!(
            run(with_expr(expr("zone", Operator::In, &["2", "3"]))),
            vec![1]
        );
        assert_eq!(
            run(with_expr(expr("zone", Operator::NotIn, &["2"]))),
            vec![0, 2]
        );
        assert_eq!(
            run(with_expr(expr("zone", Operator::Exists, &[]))),
            vec![0, 1]
        );
        assert_eq!(
            run(with_expr(expr("zone", Operator::DoesNotExist, &[]))),
            vec![2]
        );
    }

    #[test]
    fn validate_values() {
        assert!(with_expr(expr("z", Operator::In, &[])).validate().is_err());
        assert!(with_expr(expr("z", Operator::Exists, &["1"]))
            .validate()
            .is_err());
        assert!(with_expr(expr("z", Operator::NotIn, &["1"]))
            .validate()
            .is_ok());
    }
}
