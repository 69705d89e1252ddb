//! Typed errors: [`ConfigError`] for a filter config that cannot be loaded
//! (always with file, line, column and field path), [`ScheduleError`] for a
//! request that cannot be placed, and [`ParamError`] for plugin parameters
//! (turned into a `ConfigError` with a location by the loader).

use std::fmt;

/// What kind of config mistake it was; tests and metrics match on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigErrorKind {
    /// Not YAML, or not the expected shape at that point.
    Syntax,
    /// A key the schema does not have.
    UnknownField,
    /// A value of the wrong type.
    WrongType,
    /// A required key is missing.
    MissingField,
    /// A value outside its allowed set (enum variant, apiVersion, kind).
    UnknownValue,
    /// A plugin `type` the registry does not know.
    UnknownPluginType,
    /// A `pluginRef` (or a handler's profile / decider) naming nothing.
    DanglingRef,
    /// Two plugins or two profiles with the same name.
    Duplicate,
    /// A parameter or weight with a value out of range, or a plugin in the wrong place.
    Invalid,
}

/// A config that cannot be loaded. Displays as `file:line:col: path: message`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// The file name given to the loader.
    pub file: String,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// 1-based column, when known.
    pub column: Option<usize>,
    /// Field path, e.g. `schedulingProfiles[0].plugins[1].pluginRef`.
    pub path: String,
    /// What is wrong.
    pub message: String,
    /// The category.
    pub kind: ConfigErrorKind,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file)?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(col) = self.column {
                write!(f, ":{col}")?;
            }
        }
        write!(f, ": {}: {}", self.path, self.message)
    }
}

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
