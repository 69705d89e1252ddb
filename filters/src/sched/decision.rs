//! The result of one scheduling cycle: a [`Route`] (one endpoint, or a
//! prefill and a decode endpoint), each with its ordered fallbacks, and a
//! serializable [`DecisionTrace`] that explains it for logs, metrics and
//! `/debug/route`.

use serde::Serialize;

/// One chosen endpoint with its fallbacks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Choice {
    /// The chosen endpoint's id.
    pub id: String,
    /// Its index in the endpoint slice passed to `schedule`.
    pub index: usize,
    /// Endpoint ids to try next if this one refuses before any byte was sent,
    /// best first; never contains `id`, never a filtered-out endpoint.
    pub fallbacks: Vec<String>,
}

/// Where the request goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Route {
    /// One endpoint serves prefill and decode.
    Aggregated {
        /// The endpoint.
        target: Choice,
    },
    /// Prefill on one endpoint, then decode on another.
    Disaggregated {
        /// The prefill endpoint.
        prefill: Choice,
        /// The decode endpoint.
        decode: Choice,
    },
}

impl Route {
    /// The endpoint that streams the answer (target, or decode).
    pub fn primary(&self) -> &Choice {
        match self {
            Route::Aggregated { target } => target,
            Route::Disaggregated { decode, .. } => decode,
        }
    }

    /// The prefill endpoint, when disaggregated.
    pub fn prefill(&self) -> Option<&Choice> {
        match self {
            Route::Aggregated { .. } => None,
            Route::Disaggregated { prefill, .. } => Some(prefill),
        }
    }

    /// `"aggregated"` or `"disaggregated"`, for a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Route::Aggregated { .. } => "aggregated",
            Route::Disaggregated { .. } => "disaggregated",
        }
    }
}

/// A route and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    /// Where the request goes.
    pub route: Route,
    /// Why.
    pub trace: DecisionTrace,
}

/// Why a decision was made.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecisionTrace {
    /// The request id.
    pub request_id: String,
    /// The requested model.
    pub model: String,
    /// The profile handler's plugin name.
    pub handler: String,
    /// The handler's reason, e.g. `uncached 4100 >= nonCachedTokens 2048`.
    pub reason: String,
    /// Each profile run, in order.
    pub profiles: Vec<ProfileTrace>,
}

/// One profile run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProfileTrace {
    /// The profile name.
    pub profile: String,
    /// How many endpoints entered the profile.
    pub endpoints_in: usize,
    /// Each filter and what it removed, in order.
    pub filters: Vec<FilterTrace>,
    /// The filter that removed the last candidates, when the run failed.
    pub emptied_by: Option<String>,
    /// Ids of the candidates that survived the filters; the score vectors
    /// below are aligned with this list.
    pub candidates: Vec<String>,
    /// Each scorer's raw scores and weight.
    pub scorers: Vec<ScorerTrace>,
    /// Σ weight × score per candidate.
    pub totals: Vec<f64>,
    /// The picker's plugin name.
    pub picker: String,
    /// What the picker returned, best first (choice, then fallbacks).
    pub picked: Vec<String>,
}

/// What one filter removed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FilterTrace {
    /// Plugin name.
    pub filter: String,
    /// Ids removed.
    pub removed: Vec<String>,
}

/// One scorer's contribution.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScorerTrace {
    /// Plugin name.
    pub scorer: String,
    /// Weight in this profile.
    pub weight: f64,
    /// Raw scores in [0, 1], aligned with `ProfileTrace::candidates`.
    pub scores: Vec<f64>,
}

impl ProfileTrace {
    /// The raw score `scorer` gave endpoint `id`, if both are in this trace.
    pub fn score_of(&self, scorer: &str, id: &str) -> Option<f64> {
        let pos = self.candidates.iter().position(|c| c == id)?;
        let s = self.scorers.iter().find(|s| s.scorer == scorer)?;
        s.scores.get(pos).copied()
    }

    /// The weighted total of endpoint `id`.
    pub fn total_of(&self, id: &str) -> Option<f64> {
        let pos = self.candidates.iter().position(|c| c == id)?;
        self.totals.get(pos).copied()
    }
}
