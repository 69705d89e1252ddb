//! Scheduling: views, plugins, profiles, registry and the filter config.
//!
//! A request's cycle: the proxy builds a [`RequestView`] and one
//! [`EndpointView`] per candidate; [`Scheduler::schedule`] runs the profile
//! handler, which runs profiles (filters narrow the set, weighted scorers
//! rate it, a picker ranks it) and returns a [`Decision`]: a [`Route`] with
//! ordered fallbacks, and a [`DecisionTrace`] explaining it. The plugins a
//! config may name are registered in [`registry::register_builtin_plugins`].

pub mod config;
pub mod decider;
pub mod decision;
pub mod error;
pub mod filters;
pub mod params;
pub mod pickers;
pub mod plugin;
pub mod producer;
pub mod profile;
pub mod registry;
pub mod scheduler;
pub mod scorers;
pub mod view;

pub use config::{FilterConfig, PluginSpec, ProfileSpec};
pub use decision::{
    Choice, Decision, DecisionTrace, FilterTrace, ProfileTrace, Route, ScorerTrace,
};
pub use error::{ConfigError, ConfigErrorKind, ParamError, ScheduleError};
pub use registry::{register_builtin_plugins, PluginKind, PluginRegistry};
pub use scheduler::{Scheduler, TraceLevel};
pub use view::{
    prefix_anchor, EndpointView, LoadSnapshot, PathKind, PrefixMatch, RequestView, Role,
    ANCHOR_BLOCKS,
};
