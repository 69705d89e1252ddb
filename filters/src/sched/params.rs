//! Typed plugin parameters: every plugin declares a `serde` struct with
//! `deny_unknown_fields` and a `Default` impl (the one place its defaults
//! live); [`parse`] turns the free-form `parameters` block into it and keeps
//! the field path of any mistake.

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_yaml_ng::Value;

use crate::sched::error::{ConfigErrorKind, ParamError};

/// Parameters of plugins that take none: only an empty block is accepted.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

/// Decode `value` (the plugin's `parameters`, `Null` when absent) into `T`.
pub fn parse<T: DeserializeOwned + Default>(value: &Value) -> Result<T, ParamError> {
    if value.is_null() {
        return Ok(T::default());
    }
    serde_path_to_error::deserialize::<_, T>(value.clone()).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let message = inner.to_string();
        ParamError {
            path: if path == "." { String::new() } else { path },
            kind: ConfigErrorKind::of_serde_message(&message),
            message,
        }
    })
}

/// Reject NaN, infinities and values outside `[lo, hi]`.
pub fn check_range(path: &str, value: f64, lo: f64, hi: f64) -> Result<(), ParamError> {
    if value.is_finite() && value >= lo && value <= hi {
        Ok(())
    } else {
        Err(ParamError::invalid(
            path,
            format!("must be between {lo} and {hi}, got {value}"),
        ))
    }
}
