//! The file's shape, exactly as written: what serde decodes before defaults
//! and cross-references are applied. Every struct rejects unknown keys.

use serde::Deserialize;
use serde_yaml_ng::Value;

/// The whole document.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct RawConfig {
    pub api_version: String,
    pub kind: String,
    #[serde(default)]
    pub feature_gates: Vec<String>,
    #[serde(default)]
    pub plugins: Vec<RawPlugin>,
    #[serde(default)]
    pub scheduling_profiles: Vec<RawProfile>,
    pub flow_control: Option<super::flow::RawFlowControl>,
}

/// One `plugins` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPlugin {
    pub name: Option<String>,
    #[serde(rename = "type")]
    pub type_name: String,
    #[serde(default)]
    pub parameters: Value,
}

/// One `schedulingProfiles` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawProfile {
    pub name: String,
    #[serde(default)]
    pub plugins: Vec<RawProfileRef>,
}

/// One plugin reference inside a profile.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct RawProfileRef {
    pub plugin_ref: String,
    pub weight: Option<f64>,
}
