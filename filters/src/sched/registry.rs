//! The plugin registry: plugin type name → kind and constructor. Filled in
//! one explicit function, [`register_builtin_plugins`], so the full list of
//! what a `filters.yaml` may name is in one place; no global state. Each
//! constructor decodes its typed parameters (strict, defaults in the
//! parameter struct's `Default`) and validates them.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde_yaml_ng::Value;

use crate::sched::decider::{self, AlwaysDisaggDecider, PrefixBasedDecider};
use crate::sched::error::{ConfigErrorKind, ParamError};
use crate::sched::filters::{health, label, load_ceiling, model, role};
use crate::sched::params::{parse, NoParams};
use crate::sched::pickers::{max_score, power_of_two, round_robin, weighted_random, PickerParams};
use crate::sched::plugin::{Filter, PdDecider, Picker, ProfileHandler, Scorer};
use crate::sched::producer::{self, ProducerSpec};
use crate::sched::profile::{self, DisaggParams, DisaggProfileHandler, SingleProfileHandler};
use crate::sched::scorers::{
    active, affinity, cost, eviction, kv_util, load_aware, lora, no_hit_lru, prefix, queue, session,
};
use crate::sched::view::Role;

/// What a plugin does, which decides where a config may reference it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PluginKind {
    /// Narrows candidates; goes in profiles.
    Filter,
    /// Rates candidates; goes in profiles, with a weight.
    Scorer,
    /// Ranks candidates; one per profile.
    Picker,
    /// Runs profiles; one per config.
    ProfileHandler,
    /// Decides P/D; referenced by a handler.
    Decider,
    /// Describes the prefix-match source; referenced by `prefix-cache-scorer`.
    Producer,
}

/// A constructed plugin instance.
pub enum Plugin {
    /// A filter.
    Filter(Arc<dyn Filter>),
    /// A scorer.
    Scorer(Arc<dyn Scorer>),
    /// A picker.
    Picker(Arc<dyn Picker>),
    /// A profile handler.
    ProfileHandler(Arc<dyn ProfileHandler>),
    /// A P/D decider.
    Decider(Arc<dyn PdDecider>),
    /// A prefix-match producer.
    Producer(ProducerSpec),
}

/// What constructors may look up: plugins built before them and the profiles.
#[derive(Default)]
pub struct BuildCtx {
    /// Deciders by plugin name (built before handlers).
    pub deciders: HashMap<String, Arc<dyn PdDecider>>,
    /// Names of producer plugins.
    pub producers: Vec<String>,
    /// Names of the scheduling profiles.
    pub profiles: Vec<String>,
}

/// Builds one plugin from its `parameters` (`Null` when absent).
pub type Constructor = fn(&Value, &BuildCtx) -> Result<Plugin, ParamError>;

/// Type name → kind and constructor.
#[derive(Default)]
pub struct PluginRegistry {
    entries: BTreeMap<&'static str, (PluginKind, Constructor)>,
}

impl PluginRegistry {
    /// An empty registry (add plugins with [`PluginRegistry::register`]).
    pub fn new() -> Self {
        PluginRegistry::default()
    }

    /// A registry holding every built-in plugin.
    pub fn builtin() -> Self {
        let mut r = PluginRegistry::new();
        register_builtin_plugins(&mut r);
        r
    }

    /// Add (or replace) a plugin type.
    pub fn register(&mut self, type_name: &'static str, kind: PluginKind, ctor: Constructor) {
        self.entries.insert(type_name, (kind, ctor));
    }

    /// The kind of `type_name`, if registered.
    pub fn kind(&self, type_name: &str) -> Option<PluginKind> {
        self.entries.get(type_name).map(|e| e.0)
    }

    /// Every registered type name, sorted.
    pub fn type_names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.entries.keys().copied()
    }

    /// Construct a `type_name` plugin from `params`.
    pub fn build(
        &self,
        type_name: &str,
        params: &Value,
        ctx: &BuildCtx,
    ) -> Result<Plugin, ParamError> {
        match self.entries.get(type_name) {
            Some((_, ctor)) => ctor(params, ctx),
            None => Err(ParamError {
                path: String::new(),
                message: format!("unknown plugin type {type_name:?}"),
                kind: ConfigErrorKind::UnknownPluginType,
            }),
        }
    }
}

/// Register every built-in plugin. The one list of what a config may name.
pub fn register_builtin_plugins(r: &mut PluginRegistry) {
    use PluginKind as K;
    // Filters.
    r.register(role::DECODE_TYPE, K::Filter, |p, _| {
        parse::<NoParams>(p)?;
        Ok(Plugin::Filter(Arc::new(role::RoleFilter {
            keep: Role::Decode,
        })))
    });
    r.register(role::PREFILL_TYPE, K::Filter, |p, _| {
        parse::<NoParams>(p)?;
        Ok(Plugin::Filter(Arc::new(role::RoleFilter {
            keep: Role::Prefill,
        })))
    });
    r.register(model::TYPE, K::Filter, |p, _| {
        let params = parse(p)?;
        Ok(Plugin::Filter(Arc::new(model::ModelFilter { params })))
    });
    r.register(label::TYPE, K::Filter, |p, _| {
        let params: label::LabelSelectorParams = parse(p)?;
        params.validate()?;
        Ok(Plugin::Filter(Arc::new(label::LabelSelectorFilter {
            params,
        })))
    });
    r.register(health::TYPE, K::Filter, |p, _| {
        let params = parse(p)?;
        Ok(Plugin::Filter(Arc::new(health::HealthyFreshFilter {
            params,
        })))
    });
    r.register(load_ceiling::TYPE, K::Filter, |p, _| {
        let params = parse(p)?;
        Ok(Plugin::Filter(Arc::new(load_ceiling::LoadCeilingFilter {
            params,
        })))
    });
    // Scorers.
    r.register(queue::TYPE, K::Scorer, |p, _| {
        parse::<NoParams>(p)?;
        Ok(Plugin::Scorer(Arc::new(queue::QueueScorer)))
    });
    r.register(kv_util::TYPE, K::Scorer, |p, _| {
        parse::<NoParams>(p)?;
        Ok(Plugin::Scorer(Arc::new(kv_util::KvUtilScorer)))
    });
    r.register(active::TYPE, K::Scorer, |p, _| {
        parse::<NoParams>(p)?;
        Ok(Plugin::Scorer(Arc::new(active::ActiveRequestScorer)))
    });
    r.register(load_aware::TYPE, K::Scorer, |p, _| {
        let params: load_aware::LoadAwareParams = parse(p)?;
        params.validate()?;
        Ok(Plugin::Scorer(Arc::new(load_aware::LoadAwareScorer {
            params,
        })))
    });
    r.register(prefix::TYPE, K::Scorer, |p, ctx| {
        let params: prefix::PrefixCacheParams = parse(p)?;
        params.validate()?;
        if let Some(name) = &params.prefix_match_info_producer_name {
            if !ctx.producers.contains(name) {
                return Err(ParamError {
                    path: "prefixMatchInfoProducerName".to_owned(),
                    message: format!("no producer plugin named {name:?}"),
                    kind: ConfigErrorKind::DanglingRef,
                });
            }
        }
        Ok(Plugin::Scorer(Arc::new(prefix::PrefixCacheScorer {
            params,
        })))
    });
    r.register(no_hit_lru::TYPE, K::Scorer, |p, _| {
        let params: no_hit_lru::NoHitLruParams = parse(p)?;
        params.validate()?;
        Ok(Plugin::Scorer(Arc::new(no_hit_lru::NoHitLruScorer::new(
            params,
        ))))
    });
    r.register(affinity::TYPE, K::Scorer, |p, _| {
        let params: affinity::AffinityParams = parse(p)?;
        params.validate()?;
        Ok(Plugin::Scorer(Arc::new(affinity::AffinityScorer {
            params,
        })))
    });
    r.register(cost::TYPE, K::Scorer, |p, _| {
        let params: cost::TokenCostParams = parse(p)?;
        params.validate()?;
        Ok(Plugin::Scorer(Arc::new(cost::TokenCostScorer { params })))
    });
    r.register(eviction::TYPE, K::Scorer, |p, _| {
        let params: eviction::EvictionCostParams = parse(p)?;
        params.validate()?;
        Ok(Plugin::Scorer(Arc::new(eviction::EvictionCostScorer::new(
            params,
        ))))
    });
    r.register(session::TYPE, K::Scorer, |p, _| {
        parse::<NoParams>(p)?;
        Ok(Plugin::Scorer(Arc::new(session::SessionAffinityScorer)))
    });
    r.register(lora::TYPE, K::Scorer, |p, _| {
        let params: lora::LoraAffinityParams = parse(p)?;
        params.validate()?;
        Ok(Plugin::Scorer(Arc::new(lora::LoraAffinityScorer {
            params,
        })))
    });
    // Pickers.
    r.register(max_score::TYPE, K::Picker, |p, _| {
        let params = picker_params(p)?;
        Ok(Plugin::Picker(Arc::new(max_score::MaxScorePicker {
            params,
        })))
    });
    r.register(weighted_random::TYPE, K::Picker, |p, _| {
        let params = picker_params(p)?;
        Ok(Plugin::Picker(Arc::new(
            weighted_random::WeightedRandomPicker { params },
        )))
    });
    r.register(power_of_two::TYPE, K::Picker, |p, _| {
        let params = picker_params(p)?;
        Ok(Plugin::Picker(Arc::new(power_of_two::PowerOfTwoPicker {
            params,
        })))
    });
    r.register(round_robin::TYPE, K::Picker, |p, _| {
        let params = picker_params(p)?;
        Ok(Plugin::Picker(Arc::new(
            round_robin::RoundRobinPicker::new(params),
        )))
    });
    // Deciders.
    r.register(decider::PREFIX_BASED_TYPE, K::Decider, |p, _| {
        let params = parse(p)?;
        Ok(Plugin::Decider(Arc::new(PrefixBasedDecider { params })))
    });
    r.register(decider::ALWAYS_TYPE, K::Decider, |p, _| {
        parse::<NoParams>(p)?;
        Ok(Plugin::Decider(Arc::new(AlwaysDisaggDecider)))
    });
    // Profile handlers.
    r.register(profile::SINGLE_TYPE, K::ProfileHandler, |p, ctx| {
        parse::<NoParams>(p)?;
        match ctx.profiles.as_slice() {
            [one] => Ok(Plugin::ProfileHandler(Arc::new(SingleProfileHandler::new(
                one.clone(),
            )))),
            many => Err(ParamError::invalid(
                "",
                format!(
                    "single-profile-handler runs exactly one profile, {} are defined",
                    many.len()
                ),
            )),
        }
    });
    r.register(profile::DISAGG_TYPE, K::ProfileHandler, |p, ctx| {
        let params: DisaggParams = parse(p)?;
        for (path, name) in [
            ("profiles.decode", &params.profiles.decode),
            ("profiles.prefill", &params.profiles.prefill),
        ] {
            if !ctx.profiles.contains(name) {
                return Err(ParamError {
                    path: path.to_owned(),
                    message: format!("no scheduling profile named {name:?}"),
                    kind: ConfigErrorKind::DanglingRef,
                });
            }
        }
        let Some(decider) = ctx.deciders.get(&params.deciders.prefill).cloned() else {
            return Err(ParamError {
                path: "deciders.prefill".to_owned(),
                message: format!("no decider plugin named {:?}", params.deciders.prefill),
                kind: ConfigErrorKind::DanglingRef,
            });
        };
        Ok(Plugin::ProfileHandler(Arc::new(DisaggProfileHandler {
            params,
            decider,
        })))
    });
    // Producers.
    r.register(producer::APPROX_TYPE, K::Producer, |p, _| {
        let params: producer::ApproxProducerParams = parse(p)?;
        params.validate()?;
        Ok(Plugin::Producer(ProducerSpec::Approx(params)))
    });
    r.register(producer::PRECISE_TYPE, K::Producer, |p, _| {
        let params: producer::PreciseProducerParams = parse(p)?;
        producer::check_block_size(params.block_size_tokens)?;
        Ok(Plugin::Producer(ProducerSpec::Precise(params)))
    });
}

fn picker_params(p: &Value) -> Result<PickerParams, ParamError> {
    let params: PickerParams = parse(p)?;
    params.validate()?;
    Ok(params)
}
