//! The filter config (`filters.yaml`), shaped like llm-d's
//! `EndpointPickerConfig`: `plugins` (named, typed instances with
//! parameters) and `schedulingProfiles` (lists of `pluginRef` with a
//! `weight` for scorers). Loading is strict decode (serde, unknown keys
//! rejected), then defaults, then cross-reference checks, then a trial build
//! of every plugin (so bad parameters fail at load, not at the first
//! request). Every error names the file, line, column and field path.
//!
//! Defaults, as in llm-d: a plugin's `name` defaults to its `type`; a profile
//! without a picker gets `max-score-picker`; no profiles at all gives one
//! profile `default` with every filter, scorer (weight 1) and picker; no
//! handler gives `single-profile-handler`. [`FilterConfig::builtin_default`]
//! is the config used when there is no file.

pub mod flow;
mod raw;

use std::collections::HashMap;
use std::sync::Arc;

use serde_yaml_ng::Value;

use crate::sched::error::{ConfigError, ConfigErrorKind, ParamError};
use crate::sched::producer::ProducerSpec;
use crate::sched::registry::{BuildCtx, Plugin, PluginKind, PluginRegistry};
use raw::{RawConfig, RawProfile};

/// Accepted `apiVersion` values (kvmesh's own and llm-d's, so llm-d files load).
pub const API_VERSIONS: [&str; 3] = [
    "kvmesh.dev/v1alpha1",
    "llm-d.ai/v1alpha1",
    "inference.networking.x-k8s.io/v1alpha1",
];
/// The only accepted `kind`.
pub const KIND: &str = "EndpointPickerConfig";
/// Name of the profile made when the file defines none.
pub const DEFAULT_PROFILE: &str = "default";

/// A validated filter config.
#[derive(Debug, Clone)]
pub struct FilterConfig {
    /// The `apiVersion` written.
    pub api_version: String,
    /// `featureGates`, as written (`flowControl` is the one read).
    pub feature_gates: Vec<String>,
    /// `flowControl`, when its gate is on ([`flow`]).
    pub flow_control: Option<flow::FlowControl>,
    /// Every plugin instance, including the implicit ones (default picker, handler).
    pub plugins: Vec<PluginSpec>,
    /// The scheduling profiles.
    pub profiles: Vec<ProfileSpec>,
    /// The profile handler's plugin name.
    pub handler: String,
    file: String,
    source: Option<Arc<str>>,
}

/// One plugin instance.
#[derive(Debug, Clone, PartialEq)]
pub struct PluginSpec {
    /// Unique name (defaults to the type).
    pub name: String,
    /// Registered type name.
    pub type_name: String,
    /// Its kind.
    pub kind: PluginKind,
    /// Raw `parameters` (`Null` when absent); decoded by the plugin.
    pub parameters: Value,
    /// `plugins[i]` when written in the file; `None` when implied by a default.
    pub path: Option<String>,
}

/// One scheduling profile, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileSpec {
    /// Profile name.
    pub name: String,
    /// Filter plugin names, in order.
    pub filters: Vec<String>,
    /// Scorer plugin names and weights.
    pub scorers: Vec<(String, f64)>,
    /// Picker plugin name.
    pub picker: String,
}

/// Plugin instances by name, as built by [`FilterConfig::build`].
pub struct BuiltPlugins {
    /// By plugin name.
    pub by_name: HashMap<String, Plugin>,
}

impl FilterConfig {
    /// Parse and validate `text`; `file` names it in errors.
    pub fn from_yaml(text: &str, file: &str) -> Result<FilterConfig, ConfigError> {
        FilterConfig::from_yaml_with(text, file, &PluginRegistry::builtin())
    }

    /// [`FilterConfig::from_yaml`] with a custom registry.
    pub fn from_yaml_with(
        text: &str,
        file: &str,
        registry: &PluginRegistry,
    ) -> Result<FilterConfig, ConfigError> {
        let errs = Errs {
            file,
            text: Some(text),
        };
        let raw = parse_raw(text, file)?;
        if !API_VERSIONS.contains(&raw.api_version.as_str()) {
            return Err(errs.at(
                "apiVersion",
                ConfigErrorKind::UnknownValue,
                format!(
                    "unsupported apiVersion {:?}; expected one of {API_VERSIONS:?}",
                    raw.api_version
                ),
            ));
        }
        if raw.kind != KIND {
            return Err(errs.at(
                "kind",
                ConfigErrorKind::UnknownValue,
                format!("kind must be {KIND:?}, got {:?}", raw.kind),
            ));
        }
        let mut plugins = Vec::with_capacity(raw.plugins.len() + 2);
        for (i, p) in raw.plugins.into_iter().enumerate() {
            let path = format!("plugins[{i}]");
            let Some(kind) = registry.kind(&p.type_name) else {
                let known: Vec<_> = registry.type_names().collect();
                return Err(errs.at(
                    &format!("{path}.type"),
                    ConfigErrorKind::UnknownPluginType,
                    format!(
                        "unknown plugin type {:?}; known types: {}",
                        p.type_name,
                        known.join(", ")
                    ),
                ));
            };
            let named = p.name.is_some();
            let name = p.name.unwrap_or_else(|| p.type_name.clone());
            let field = if named { "name" } else { "type" };
            if name.is_empty() {
                return Err(errs.at(
                    &format!("{path}.name"),
                    ConfigErrorKind::Invalid,
                    "empty name",
                ));
            }
            if plugins.iter().any(|q: &PluginSpec| q.name == name) {
                return Err(errs.at(
                    &format!("{path}.{field}"),
                    ConfigErrorKind::Duplicate,
                    format!("a plugin named {name:?} is already defined (give this one a `name`)"),
                ));
            }
            plugins.push(PluginSpec {
                name,
                type_name: p.type_name,
                kind,
                parameters: p.parameters,
                path: Some(path),
            });
        }
        let profiles = if raw.scheduling_profiles.is_empty() {
            vec![default_profile(&mut plugins, &errs)?]
        } else {
            resolve_profiles(&raw.scheduling_profiles, &mut plugins, &errs)?
        };
        let handler = resolve_handler(&mut plugins, &profiles, &errs)?;
        let flow_control = flow::resolve(raw.flow_control, &raw.feature_gates, &errs)?;
        let cfg = FilterConfig {
            api_version: raw.api_version,
            feature_gates: raw.feature_gates,
            flow_control,
            plugins,
            profiles,
            handler,
            file: file.to_owned(),
            source: Some(Arc::from(text)),
        };
        cfg.build(registry)?;
        Ok(cfg)
    }

    /// The config used without a file: filters `healthy-fresh-filter`,
    /// `model-filter`, `decode-filter`; scorers `prefix-cache-scorer` ×3,
    /// `prefix-affinity-scorer` ×2, `active-request-scorer` ×1,
    /// `token-cost-scorer` ×2 (its KV term alone); `max-score-picker`
    /// (`deploy/examples/filters-default.yaml` writes it out).
    /// Why these weights is in `docs/filters.md`.
    pub fn builtin_default() -> FilterConfig {
        let spec = |t: &str, kind| PluginSpec {
            name: t.to_owned(),
            type_name: t.to_owned(),
            kind,
            parameters: Value::Null,
            path: None,
        };
        use PluginKind::{Filter, Picker, ProfileHandler, Scorer};
        let filters = ["healthy-fresh-filter", "model-filter", "decode-filter"];
        let scorers = [
            ("prefix-cache-scorer", 3.0),
            ("prefix-affinity-scorer", 2.0),
            ("active-request-scorer", 1.0),
            ("token-cost-scorer", 2.0),
        ];
        let mut plugins: Vec<PluginSpec> = filters.iter().map(|f| spec(f, Filter)).collect();
        plugins.extend(scorers.iter().map(|(s, _)| spec(s, Scorer)));
        // Only its KV term: a pod whose cache cannot admit what it is sent
        // (docs/filters.md, "The built-in default").
        if let Some(cost) = plugins.iter_mut().find(|p| p.name == "token-cost-scorer") {
            let mut params = serde_yaml_ng::Mapping::new();
            params.insert(Value::from("prefillWeight"), Value::from(0.0));
            cost.parameters = Value::Mapping(params);
        }
        plugins.push(spec("max-score-picker", Picker));
        plugins.push(spec("single-profile-handler", ProfileHandler));
        FilterConfig {
            api_version: API_VERSIONS[0].to_owned(),
            feature_gates: Vec::new(),
            flow_control: None,
            plugins,
            profiles: vec![ProfileSpec {
                name: DEFAULT_PROFILE.to_owned(),
                filters: filters.iter().map(|f| (*f).to_owned()).collect(),
                scorers: scorers.iter().map(|(s, w)| ((*s).to_owned(), *w)).collect(),
                picker: "max-score-picker".to_owned(),
            }],
            handler: "single-profile-handler".to_owned(),
            file: "<builtin>".to_owned(),
            source: None,
        }
    }

    /// The file name given at load (`<builtin>` for the built-in default).
    pub fn file(&self) -> &str {
        &self.file
    }

    /// The configured prefix-match producers, by plugin name.
    pub fn producers(&self, registry: &PluginRegistry) -> Vec<(String, ProducerSpec)> {
        let ctx = BuildCtx::default();
        self.plugins
            .iter()
            .filter(|p| p.kind == PluginKind::Producer)
            .filter_map(
                |p| match registry.build(&p.type_name, &p.parameters, &ctx) {
                    Ok(Plugin::Producer(spec)) => Some((p.name.clone(), spec)),
                    _ => None,
                },
            )
            .collect()
    }

    /// Construct fresh instances of every plugin (stateful plugins start
    /// empty). Deciders and producers first, handlers last, since handlers
    /// and scorers look them up.
    pub fn build(&self, registry: &PluginRegistry) -> Result<BuiltPlugins, ConfigError> {
        let errs = Errs {
            file: &self.file,
            text: self.source.as_deref(),
        };
        let mut ctx = BuildCtx {
            profiles: self.profiles.iter().map(|p| p.name.clone()).collect(),
            producers: self
                .plugins
                .iter()
                .filter(|p| p.kind == PluginKind::Producer)
                .map(|p| p.name.clone())
                .collect(),
            ..BuildCtx::default()
        };
        let mut by_name = HashMap::with_capacity(self.plugins.len());
        for pass in [0, 1, 2] {
            for spec in &self.plugins {
                let stage = match spec.kind {
                    PluginKind::Decider | PluginKind::Producer => 0,
                    PluginKind::ProfileHandler => 2,
                    _ => 1,
                };
                if stage != pass {
                    continue;
                }
                let plugin = registry
                    .build(&spec.type_name, &spec.parameters, &ctx)
                    .map_err(|e| errs.param(spec, e))?;
                if let Plugin::Decider(d) = &plugin {
                    ctx.deciders.insert(spec.name.clone(), d.clone());
                }
                by_name.insert(spec.name.clone(), plugin);
            }
        }
        Ok(BuiltPlugins { by_name })
    }

    pub(crate) fn errs(&self) -> Errs<'_> {
        Errs {
            file: &self.file,
            text: self.source.as_deref(),
        }
    }
}

/// Makes located errors for one file.
pub(crate) struct Errs<'a> {
    file: &'a str,
    text: Option<&'a str>,
}

impl Errs<'_> {
    pub(crate) fn at(
        &self,
        path: &str,
        kind: ConfigErrorKind,
        message: impl Into<String>,
    ) -> ConfigError {
        let pos = self.text.and_then(|t| crate::yaml::locate(t, path));
        ConfigError {
            file: self.file.to_owned(),
            line: pos.map(|p| p.0),
            column: pos.map(|p| p.1),
            path: path.to_owned(),
            message: message.into(),
            kind,
        }
    }

    fn param(&self, spec: &PluginSpec, e: ParamError) -> ConfigError {
        let base = match &spec.path {
            Some(p) => format!("{p}.parameters"),
            None => format!("<implicit plugin {:?}>", spec.name),
        };
        let path = if e.path.is_empty() {
            base
        } else {
            format!("{base}.{}", e.path)
        };
        self.at(&path, e.kind, e.message)
    }
}

fn parse_raw(text: &str, file: &str) -> Result<RawConfig, ConfigError> {
    let de = serde_yaml_ng::Deserializer::from_str(text);
    serde_path_to_error::deserialize::<_, RawConfig>(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let loc = inner.location();
        let message = inner.to_string();
        // serde_yaml_ng appends " at line L column C"; the prefix says it.
        let message = match message.find(" at line ") {
            Some(p) => message[..p].to_owned(),
            None => message,
        };
        // serde_yaml_ng may also prefix the path, which Display adds anyway.
        let message = match message.strip_prefix(&format!("{path}: ")) {
            Some(m) => m.to_owned(),
            None => message,
        };
        let fallback = crate::yaml::locate(text, &path);
        ConfigError {
            file: file.to_owned(),
            line: loc.as_ref().map(|l| l.line()).or(fallback.map(|p| p.0)),
            column: loc.as_ref().map(|l| l.column()).or(fallback.map(|p| p.1)),
            kind: ConfigErrorKind::of_serde_message(&message),
            path,
            message,
        }
    })
}

fn default_picker(plugins: &mut Vec<PluginSpec>) -> String {
    const T: &str = "max-score-picker";
    match plugins.iter().find(|p| p.name == T) {
        Some(p) if p.kind == PluginKind::Picker => p.name.clone(),
        Some(_) => {
            let name = "kvmesh-default-max-score-picker".to_owned();
            if !plugins.iter().any(|p| p.name == name) {
                plugins.push(implicit(&name, T, PluginKind::Picker));
            }
            name
        }
        None => {
            plugins.push(implicit(T, T, PluginKind::Picker));
            T.to_owned()
        }
    }
}

fn implicit(name: &str, type_name: &str, kind: PluginKind) -> PluginSpec {
    PluginSpec {
        name: name.to_owned(),
        type_name: type_name.to_owned(),
        kind,
        parameters: Value::Null,
        path: None,
    }
}

fn default_profile(
    plugins: &mut Vec<PluginSpec>,
    errs: &Errs<'_>,
) -> Result<ProfileSpec, ConfigError> {
    let of = |k| plugins.iter().filter(move |p| p.kind == k);
    let filters = of(PluginKind::Filter).map(|p| p.name.clone()).collect();
    let scorers = of(PluginKind::Scorer)
        .map(|p| (p.name.clone(), 1.0))
        .collect();
    let pickers: Vec<&PluginSpec> = of(PluginKind::Picker).collect();
    if let Some(second) = pickers.get(1) {
        return Err(errs.at(
            second.path.as_deref().unwrap_or("plugins"),
            ConfigErrorKind::Invalid,
            "several pickers but no schedulingProfiles: add profiles that say which picker each uses",
        ));
    }
    let picker = match pickers.first() {
        Some(p) => p.name.clone(),
        None => default_picker(plugins),
    };
    Ok(ProfileSpec {
        name: DEFAULT_PROFILE.to_owned(),
        filters,
        scorers,
        picker,
    })
}

fn resolve_profiles(
    raw: &[RawProfile],
    plugins: &mut Vec<PluginSpec>,
    errs: &Errs<'_>,
) -> Result<Vec<ProfileSpec>, ConfigError> {
    let mut out: Vec<ProfileSpec> = Vec::with_capacity(raw.len());
    for (i, rp) in raw.iter().enumerate() {
        let base = format!("schedulingProfiles[{i}]");
        if rp.name.is_empty() {
            return Err(errs.at(
                &format!("{base}.name"),
                ConfigErrorKind::Invalid,
                "empty name",
            ));
        }
        if out.iter().any(|p| p.name == rp.name) {
            return Err(errs.at(
                &format!("{base}.name"),
                ConfigErrorKind::Duplicate,
                format!("a profile named {:?} is already defined", rp.name),
            ));
        }
        let mut prof = ProfileSpec {
            name: rp.name.clone(),
            filters: Vec::new(),
            scorers: Vec::new(),
            picker: String::new(),
        };
        for (j, r) in rp.plugins.iter().enumerate() {
            let at = format!("{base}.plugins[{j}]");
            let Some(spec) = plugins.iter().find(|p| p.name == r.plugin_ref) else {
                return Err(errs.at(
                    &format!("{at}.pluginRef"),
                    ConfigErrorKind::DanglingRef,
                    format!("no plugin named {:?}", r.plugin_ref),
                ));
            };
            if spec.kind != PluginKind::Scorer && r.weight.is_some() {
                return Err(errs.at(
                    &format!("{at}.weight"),
                    ConfigErrorKind::Invalid,
                    format!(
                        "weight applies to scorers only; {:?} is a {:?}",
                        spec.name, spec.kind
                    ),
                ));
            }
            match spec.kind {
                PluginKind::Filter => prof.filters.push(spec.name.clone()),
                PluginKind::Scorer => {
                    let w = r.weight.unwrap_or(1.0);
                    if !w.is_finite() || w < 0.0 {
                        return Err(errs.at(
                            &format!("{at}.weight"),
                            ConfigErrorKind::Invalid,
                            format!("weight must be a finite number >= 0, got {w}"),
                        ));
                    }
                    prof.scorers.push((spec.name.clone(), w));
                }
                PluginKind::Picker if prof.picker.is_empty() => prof.picker = spec.name.clone(),
                PluginKind::Picker => {
                    return Err(errs.at(
                        &format!("{at}.pluginRef"),
                        ConfigErrorKind::Invalid,
                        format!("profile already has picker {:?}; one picker per profile", prof.picker),
                    ))
                }
                other => {
                    return Err(errs.at(
                        &format!("{at}.pluginRef"),
                        ConfigErrorKind::Invalid,
                        format!(
                            "{:?} is a {other:?}, not a filter, scorer or picker; it does not go in a profile",
                            spec.name
                        ),
                    ))
                }
            }
        }
        if prof.picker.is_empty() {
            prof.picker = default_picker(plugins);
        }
        out.push(prof);
    }
    Ok(out)
}

fn resolve_handler(
    plugins: &mut Vec<PluginSpec>,
    profiles: &[ProfileSpec],
    errs: &Errs<'_>,
) -> Result<String, ConfigError> {
    let handlers: Vec<&PluginSpec> = plugins
        .iter()
        .filter(|p| p.kind == PluginKind::ProfileHandler)
        .collect();
    if let Some(second) = handlers.get(1) {
        return Err(errs.at(
            &format!("{}.type", second.path.as_deref().unwrap_or("plugins")),
            ConfigErrorKind::Duplicate,
            format!(
                "only one profile handler per config; {:?} is already one",
                handlers[0].name
            ),
        ));
    }
    if let Some(h) = handlers.first() {
        return Ok(h.name.clone());
    }
    if profiles.len() > 1 {
        return Err(errs.at(
            "schedulingProfiles",
            ConfigErrorKind::Invalid,
            format!(
                "{} profiles but no profile handler: add one, e.g. disagg-profile-handler",
                profiles.len()
            ),
        ));
    }
    const T: &str = "single-profile-handler";
    plugins.push(implicit(T, T, PluginKind::ProfileHandler));
    Ok(T.to_owned())
}
