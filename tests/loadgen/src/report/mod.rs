//! Reports: results per workload and policy (and per stage of a ladder),
//! rendered as a text table with ratios to a named baseline, as JSON, and as
//! a PNG plot ([`plot`]).
//!
//! The JSON shape is the one the demo prints:
//! `{"baseline": "...", "workloads": [{"name": "shared-prefix", "policies":
//! [{"policy": "round-robin", "ttft_p50_ms": ..., "hit_rate": ...,
//! "throughput_tok_s": ..., "stages": [...]}, ...]}]}`: every field of
//! [`Summary`] sits flat in each policy (and each stage) object.

mod font;
pub mod plot;
pub mod sweep_plot;
mod table;

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::LoadgenError;
use crate::runner::RunResult;
use crate::stats::Summary;

/// Results of one or more workloads under one or more policies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The policy ratios are taken against (the first policy of a workload
    /// when no policy has this name).
    pub baseline: String,
    pub workloads: Vec<WorkloadReport>,
}

/// One workload's results.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkloadReport {
    pub name: String,
    pub policies: Vec<PolicyResult>,
}

/// One policy (routing set-up, proxy, ...) on one workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyResult {
    pub policy: String,
    #[serde(flatten)]
    pub summary: Summary,
    /// Per stage of the load (one entry for a single-stage load).
    pub stages: Vec<StagePoint>,
}

/// One stage of a policy's run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StagePoint {
    pub label: String,
    /// Rate (req/s) or concurrency.
    pub level: f64,
    #[serde(flatten)]
    pub summary: Summary,
}

impl Default for Report {
    fn default() -> Self {
        Report::new("round-robin")
    }
}

impl Report {
    /// An empty report whose ratios are against `baseline`.
    pub fn new(baseline: &str) -> Report {
        Report {
            baseline: baseline.to_string(),
            workloads: Vec::new(),
        }
    }

    /// Adds `policy`'s `result` on `workload` (the workload entry is created
    /// on first use; policies keep their insertion order).
    pub fn add(&mut self, workload: &str, policy: &str, result: &RunResult) {
        let stages = result
            .stage_summaries()
            .into_iter()
            .map(|(st, summary)| StagePoint {
                label: st.label,
                level: st.level,
                summary,
            })
            .collect();
        self.add_summary(workload, policy, result.summary(), stages);
    }

    /// Adds precomputed figures (for results that did not come from
    /// [`crate::runner::run`]).
    pub fn add_summary(
        &mut self,
        workload: &str,
        policy: &str,
        summary: Summary,
        stages: Vec<StagePoint>,
    ) {
        let idx = match self.workloads.iter().position(|w| w.name == workload) {
            Some(i) => i,
            None => {
                self.workloads.push(WorkloadReport {
                    name: workload.to_string(),
                    policies: Vec::new(),
                });
                self.workloads.len() - 1
            }
        };
        self.workloads[idx].policies.push(PolicyResult {
            policy: policy.to_string(),
            summary,
            stages,
        });
    }

    /// The text table (see [`table`]).
    pub fn table(&self) -> String {
        table::render(self)
    }

    /// Pretty JSON.
    pub fn to_json(&self) -> Result<String, LoadgenError> {
        Ok(serde_json::to_string_pretty(self)?)
    }

    /// Writes the JSON to `path`.
    pub fn write_json(&self, path: &Path) -> Result<(), LoadgenError> {
        std::fs::write(path, self.to_json()?).map_err(|source| LoadgenError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Draws the PNG plot to `path` (see [`plot`]).
    pub fn write_png(&self, path: &Path) -> Result<(), LoadgenError> {
        plot::write_png(self, path)
    }
}

impl WorkloadReport {
    /// The baseline policy of this workload: the one named `baseline`, else
    /// the first.
    pub fn baseline<'a>(&'a self, baseline: &str) -> Option<&'a PolicyResult> {
        self.policies
            .iter()
            .find(|p| p.policy == baseline)
            .or_else(|| self.policies.first())
    }
}

/// `value / base`, when both exist and the base is not zero.
pub fn ratio(value: Option<f64>, base: Option<f64>) -> Option<f64> {
    match (value, base) {
        (Some(v), Some(b)) if b != 0.0 => Some(v / b),
        _ => None,
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
