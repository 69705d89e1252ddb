//! Profile handlers: which profiles run for a request, and how their results
//! become a route.
//!
//! `single-profile-handler` runs the config's one profile and routes to its
//! choice. No parameters. It is what a config without a handler gets; a
//! config with several profiles must name another handler.
//!
//! `disagg-profile-handler` runs the decode profile first; then asks its
//! prefill decider about the chosen decode endpoint; when the decider says
//! yes it runs the prefill profile too. The route stays aggregated (on the
//! decode choice) when the decider says no, when no prefill endpoint
//! survives the prefill profile's filters, or when both profiles chose the
//! same endpoint; the trace's reason says which.
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `profiles.decode` | `decode` | the decode profile's name |
//! | `profiles.prefill` | `prefill` | the prefill profile's name |
//! | `deciders.prefill` | `prefix-based-pd-decider` | name of the decider plugin |
//! | `stageOrder` | `decode-first` | only `decode-first` is supported |
//!
//! ```yaml
//! plugins:
//!   - type: prefix-based-pd-decider
//!     parameters: {nonCachedTokens: 2048}
//!   - type: disagg-profile-handler
//!     parameters:
//!       profiles: {decode: decode, prefill: prefill}
//!       deciders: {prefill: prefix-based-pd-decider}
//! ```

use std::sync::Arc;

use serde::Deserialize;

use crate::sched::error::ScheduleError;
use crate::sched::plugin::{HandlerOutcome, PdDecider, ProfileHandler, ProfileRunner};
use crate::sched::view::{EndpointView, RequestView};

/// Type name of [`SingleProfileHandler`].
pub const SINGLE_TYPE: &str = "single-profile-handler";
/// Type name of [`DisaggProfileHandler`].
pub const DISAGG_TYPE: &str = "disagg-profile-handler";

/// Runs one profile.
#[derive(Debug, Clone)]
pub struct SingleProfileHandler {
    profile: String,
    /// The trace's reason, the same every cycle: formatted once, not per
    /// request (a `{:?}` of the name was 1.5% of a paced request's CPU).
    reason: String,
}

impl SingleProfileHandler {
    /// The handler of `profile`.
    pub fn new(profile: String) -> Self {
        let reason = format!("single profile {profile:?}");
        Self { profile, reason }
    }
}

impl ProfileHandler for SingleProfileHandler {
    fn profiles(&self) -> Vec<String> {
        vec![self.profile.clone()]
    }

    fn handle(
        &self,
        runner: &mut dyn ProfileRunner,
        _req: &RequestView,
        _eps: &[EndpointView],
    ) -> Result<HandlerOutcome, ScheduleError> {
        let r = runner.run(&self.profile)?;
        Ok(HandlerOutcome::Aggregated {
            ranked: r.ranked,
            reason: self.reason.clone(),
        })
    }
}

/// Profile names of `disagg-profile-handler`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DisaggProfiles {
    /// Decode profile.
    pub decode: String,
    /// Prefill profile.
    pub prefill: String,
}

impl Default for DisaggProfiles {
    fn default() -> Self {
        DisaggProfiles {
            decode: "decode".to_owned(),
            prefill: "prefill".to_owned(),
        }
    }
}

/// Decider names of `disagg-profile-handler`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DisaggDeciders {
    /// The prefill decider plugin's name.
    pub prefill: String,
}

impl Default for DisaggDeciders {
    fn default() -> Self {
        DisaggDeciders {
            prefill: crate::sched::decider::PREFIX_BASED_TYPE.to_owned(),
        }
    }
}

/// Stage order; only decode-first exists in kvmesh.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum StageOrder {
    /// Choose the decode endpoint first (its cache decides whether P/D pays).
    #[default]
    DecodeFirst,
}

/// Parameters of `disagg-profile-handler`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct DisaggParams {
    /// Profile names.
    pub profiles: DisaggProfiles,
    /// Decider plugin names.
    pub deciders: DisaggDeciders,
    /// Stage order.
    pub stage_order: StageOrder,
}

/// Decode first, then prefill when the decider says so.
pub struct DisaggProfileHandler {
    /// Parameters.
    pub params: DisaggParams,
    /// The resolved prefill decider.
    pub decider: Arc<dyn PdDecider>,
}

impl ProfileHandler for DisaggProfileHandler {
    fn profiles(&self) -> Vec<String> {
        vec![
            self.params.profiles.decode.clone(),
            self.params.profiles.prefill.clone(),
        ]
    }

    fn handle(
        &self,
        runner: &mut dyn ProfileRunner,
        req: &RequestView,
        eps: &[EndpointView],
    ) -> Result<HandlerOutcome, ScheduleError> {
        let decode = runner.run(&self.params.profiles.decode)?;
        let Some(&best) = decode.ranked.first() else {
            return Err(ScheduleError::UnknownProfile(
                self.params.profiles.decode.clone(),
            ));
        };
        let verdict = self.decider.decide(req, &eps[best]);
        if !verdict.disaggregate {
            return Ok(HandlerOutcome::Aggregated {
                ranked: decode.ranked,
                reason: verdict.reason,
            });
        }
        match runner.run(&self.params.profiles.prefill) {
            Err(ScheduleError::NoEndpoint { filter, .. }) => Ok(HandlerOutcome::Aggregated {
                ranked: decode.ranked,
                reason: format!(
                    "{}; no prefill endpoint ({filter} removed the last), aggregated",
                    verdict.reason
                ),
            }),
            Err(e) => Err(e),
            Ok(prefill) if prefill.ranked.first() == Some(&best) => {
                Ok(HandlerOutcome::Aggregated {
                    ranked: decode.ranked,
                    reason: format!(
                        "{}; prefill chose the decode endpoint, aggregated",
                        verdict.reason
                    ),
                })
            }
            Ok(prefill) => Ok(HandlerOutcome::Disaggregated {
                prefill: prefill.ranked,
                decode: decode.ranked,
                reason: verdict.reason,
            }),
        }
    }
}
