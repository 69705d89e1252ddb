//! The routing set-ups the demo compares. Each is a filter config from
//! `deploy/examples/` (compiled into the binary, so the demo needs no files)
//! plus the fleet shape it needs: every policy runs on ordinary engines
//! except `pd`, which splits the engines into prefill and decode pods.

use std::fmt;

use kvmesh_filters::sched::{ConfigError, FilterConfig};

/// One routing set-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Policy {
    /// What a Kubernetes Service does: every pod in turn, blind to caches and load.
    RoundRobin,
    /// Load only: shortest queue, then fewest in flight.
    LeastQueue,
    /// Prefix routing from where the mesh sent each prompt (text blocks; no
    /// tokenizer, no KV events).
    ApproxPrefix,
    /// kvmesh's default: the built-in filter config, precise prefix matches
    /// from the engines' KV events, weighed against load.
    Kvmesh,
    /// llm-d's default precise prefix-cache scheduling (its scorers and
    /// weights), run on kvmesh sidecars with the engines' KV events.
    LlmD,
    /// Prefill/decode disaggregation: long prompts are prefilled on a prefill
    /// pod and decoded on a decode pod.
    Pd,
}

impl Policy {
    /// Every policy, in table order.
    pub const ALL: [Policy; 6] = [
        Policy::RoundRobin,
        Policy::LeastQueue,
        Policy::ApproxPrefix,
        Policy::Kvmesh,
        Policy::LlmD,
        Policy::Pd,
    ];

    /// The name in tables and JSON (`round-robin`, `kvmesh`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::LeastQueue => "least-queue",
            Policy::ApproxPrefix => "approx-prefix",
            Policy::Kvmesh => "kvmesh",
            Policy::LlmD => "llm-d",
            Policy::Pd => "pd",
        }
    }

    /// Parses a [`Policy::name`].
    pub fn parse(s: &str) -> Option<Policy> {
        Policy::ALL.into_iter().find(|p| p.name() == s)
    }

    /// The example file the filter config comes from (for documentation and
    /// error messages).
    pub fn source(self) -> &'static str {
        match self {
            Policy::RoundRobin => "deploy/examples/filters-round-robin.yaml",
            Policy::LeastQueue => "deploy/examples/filters-least-queue.yaml",
            Policy::ApproxPrefix => "deploy/examples/filters-approx-prefix.yaml",
            Policy::Kvmesh => "<builtin default>",
            Policy::LlmD => "deploy/examples/filters-llm-d.yaml",
            Policy::Pd => "deploy/examples/filters-pd-disaggregated.yaml",
        }
    }

    /// The filter config the sidecars run with.
    pub fn filter_config(self) -> Result<FilterConfig, ConfigError> {
        let text = match self {
            Policy::RoundRobin => {
                include_str!("../../assets/deploy/examples/filters-round-robin.yaml")
            }
            Policy::LeastQueue => {
                include_str!("../../assets/deploy/examples/filters-least-queue.yaml")
            }
            Policy::ApproxPrefix => {
                include_str!("../../assets/deploy/examples/filters-approx-prefix.yaml")
            }
            Policy::Kvmesh => return Ok(FilterConfig::builtin_default()),
            Policy::LlmD => include_str!("../../assets/deploy/examples/filters-llm-d.yaml"),
            Policy::Pd => {
                include_str!("../../assets/deploy/examples/filters-pd-disaggregated.yaml")
            }
        };
        FilterConfig::from_yaml(text, self.source())
    }

    /// Where the sidecars' prefix matches come from under this policy.
    pub fn prefix_source(self) -> PrefixSource {
        match self {
            Policy::RoundRobin | Policy::LeastQueue => PrefixSource::Unused,
            Policy::ApproxPrefix => PrefixSource::Approximate,
            Policy::Kvmesh | Policy::LlmD | Policy::Pd => PrefixSource::KvEvents,
        }
    }

    /// Whether the fleet is split into prefill and decode pods.
    pub fn disaggregated(self) -> bool {
        self == Policy::Pd
    }
}

/// How a policy's sidecars learn what each engine has cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixSource {
    /// The policy ignores caches: no tokenizer, no KV events.
    Unused,
    /// Text blocks of the prompts each pod was sent (no tokenizer, no events).
    Approximate,
    /// The engines' KV events, prompts tokenized as the engine does.
    KvEvents,
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_policy_compiles_and_round_trips_its_name() {
        for p in Policy::ALL {
            let cfg = p.filter_config();
            assert!(cfg.is_ok(), "{p}: {:?}", cfg.err());
            assert!(kvmesh_proxy::routing::compile(&cfg.unwrap()).is_ok(), "{p}");
            assert_eq!(Policy::parse(p.name()), Some(p));
        }
        assert_eq!(Policy::parse("fastest"), None);
    }
}
