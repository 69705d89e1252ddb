//! Typed errors: [`ConfigError`] for a filter config that cannot be loaded
//! (always with file, line, column and field path; the one config error type,
//! shared with the sidecar's `proxy.yaml` loader, lives in [`crate::yaml`]),
//! [`ScheduleError`] for a request that cannot be placed, and [`ParamError`]
//! for plugin parameters (turned into a `ConfigError` with a location by the
//! loader).

pub use crate::yaml::{ConfigError, ConfigErrorKind};

/// A bad plugin parameter, relative to the plugin's `parameters` block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ParamError {
    /// Path inside `parameters` (empty for the block itself).
    pub path: String,
    /// What is wrong.
    pub message: String,
    /// The category.
    pub kind: ConfigErrorKind,
}

impl ParamError {
    /// An out-of-range or inconsistent value at `path`.
    pub fn invalid(path: impl Into<String>, message: impl Into<String>) -> Self {
        ParamError {
            path: path.into(),
            message: message.into(),
            kind: ConfigErrorKind::Invalid,
        }
    }
}

/// A request that cannot be placed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// No endpoint survived the filters; `filter` names the plugin that
    /// removed the last ones (`<none>` when there were no endpoints at all).
    #[error("no endpoint for model {model:?}: filter {filter:?} in profile {profile:?} removed the last candidates")]
    NoEndpoint {
        /// The requested model.
        model: String,
        /// The filter that emptied the set.
        filter: String,
        /// The profile it ran in.
        profile: String,
    },
    /// A handler asked for a profile the config does not have (a bug: the
    /// loader checks handler profiles).
    #[error("profile {0:?} is not configured")]
    UnknownProfile(String),
}
