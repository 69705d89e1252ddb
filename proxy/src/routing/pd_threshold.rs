//! `pd.min_uncached_tokens` (`--pd-min-uncached-tokens N`): the one P/D knob
//! a user sets on the command line. Whether to disaggregate is the filter
//! config's decision (its `prefix-based-pd-decider`), so the knob becomes that
//! decider's `nonCachedTokens`. A filter config without a decider gets the
//! built-in P/D config (`deploy/examples/filters-pd-disaggregated.yaml`,
//! compiled in from its copy under `proxy/assets/`) with that threshold:
//! `--role decode --pd-min-uncached-tokens 2048` alone turns P/D on. Applied
//! on every load, reloads included.

use kvmesh_filters::sched::FilterConfig;
use serde_yaml_ng::Value;

use super::FiltersError;

const DECIDER: &str = "prefix-based-pd-decider";
const BUILTIN_PD: &str = include_str!("../../assets/deploy/examples/filters-pd-disaggregated.yaml");

/// `cfg` with every P/D decider's threshold set to `threshold` (unchanged when `None`).
pub fn apply(cfg: FilterConfig, threshold: Option<u32>) -> Result<FilterConfig, FiltersError> {
    let Some(n) = threshold else {
        return Ok(cfg);
    };
    let mut cfg = if cfg.plugins.iter().any(|p| p.type_name == DECIDER) {
        cfg
    } else {
        FilterConfig::from_yaml(BUILTIN_PD, "<built-in P/D filter config>")?
    };
    for p in cfg.plugins.iter_mut().filter(|p| p.type_name == DECIDER) {
        if !matches!(p.parameters, Value::Mapping(_)) {
            p.parameters = Value::Mapping(Default::default());
        }
        if let Value::Mapping(m) = &mut p.parameters {
            m.insert(Value::from("nonCachedTokens"), Value::from(n));
            // A prompt with `n` uncached tokens has at least `n` tokens: a
            // prompt floor above the threshold would overrule the knob.
            let floor = m.get("promptTokens").and_then(Value::as_u64);
            if floor.is_some_and(|f| f > u64::from(n)) {
                m.insert(Value::from("promptTokens"), Value::from(n));
            }
        }
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use kvmesh_filters::sched::Scheduler;

    use super::*;

    fn threshold_of(cfg: &FilterConfig) -> Option<u64> {
        let p = cfg.plugins.iter().find(|p| p.type_name == DECIDER)?;
        p.parameters.get("nonCachedTokens")?.as_u64()
    }

    fn floor_of(cfg: &FilterConfig) -> Option<u64> {
        let p = cfg.plugins.iter().find(|p| p.type_name == DECIDER)?;
        p.parameters.get("promptTokens")?.as_u64()
    }

    #[test]
    fn a_threshold_below_the_prompt_floor_lowers_the_floor() {
        // The built-in P/D config splits prompts of 1024 tokens and more.
        let low = apply(FilterConfig::builtin_default(), Some(256)).unwrap();
        assert_eq!((threshold_of(&low), floor_of(&low)), (Some(256), Some(256)));
        let high = apply(FilterConfig::builtin_default(), Some(4096)).unwrap();
        assert_eq!(
            (threshold_of(&high), floor_of(&high)),
            (Some(4096), Some(1024))
        );
    }

    #[test]
    fn no_threshold_leaves_the_config_alone() {
        let cfg = apply(FilterConfig::builtin_default(), None).unwrap();
        assert_eq!(threshold_of(&cfg), None);
        assert_eq!(cfg.plugins, FilterConfig::builtin_default().plugins);
    }

    #[test]
    fn a_config_without_a_decider_gets_the_builtin_pd_one() {
        let cfg = apply(FilterConfig::builtin_default(), Some(512)).unwrap();
        assert_eq!(threshold_of(&cfg), Some(512));
        assert!(Scheduler::new(&cfg).is_ok());
    }

    #[test]
    fn an_existing_decider_keeps_its_config_with_the_new_threshold() {
        let base = FilterConfig::from_yaml(BUILTIN_PD, "pd.yaml").unwrap();
        assert_eq!(threshold_of(&base), Some(2048));
        let cfg = apply(base, Some(64)).unwrap();
        assert_eq!(threshold_of(&cfg), Some(64));
        assert_eq!(cfg.file(), "pd.yaml");
        assert!(Scheduler::new(&cfg).is_ok());
    }
}
