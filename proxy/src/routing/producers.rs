//! What the prefix producers declared in `filters.yaml` mean to this sidecar.
//!
//! A producer (`approx-prefix-cache-producer`, `precise-prefix-cache-producer`)
//! does not schedule: it says how the prefix scorer's match is made. Which of
//! the two runs is fixed at start by proxy.yaml's `prefix.tokenizer`
//! (docs/prefix.md); from the producer the sidecar reads:
//!
//! * `maxPrefixBlocksToMatch` of the approximate producer: at most this many
//!   leading text blocks of a prompt are hashed, matched and recorded (llm-d's
//!   default of 256 when the file declares no producer, or there is no file).
//!
//! The other parameters have a proxy.yaml equivalent or no use here; a file
//! that sets one to other than its default loads (llm-d's files must), and
//! gets a note saying where the setting lives ([`PrefixSettings::notes`]),
//! logged at load and printed by `kvmesh-proxy check-config`.

use kvmesh_filters::sched::producer::{
    ApproxProducerParams, PreciseProducerParams, ProducerSpec, APPROX_TYPE, PRECISE_TYPE,
};
use kvmesh_filters::sched::{FilterConfig, PluginRegistry};

/// The prefix settings a filter config carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixSettings {
    /// Most leading blocks of a prompt the approximate index reads.
    pub approx_max_blocks: usize,
    /// Producer parameters set in the file that this sidecar does not read,
    /// each with where its setting lives instead.
    pub notes: Vec<String>,
}

impl Default for PrefixSettings {
    fn default() -> Self {
        Self {
            approx_max_blocks: max_blocks(&ApproxProducerParams::default()),
            notes: Vec::new(),
        }
    }
}

impl PrefixSettings {
    /// The settings of `cfg`'s producers (the defaults where it declares none;
    /// with two approximate producers, the first).
    pub fn of(cfg: &FilterConfig) -> Self {
        let mut out = Self::default();
        let mut approx_seen = false;
        for (name, spec) in cfg.producers(&PluginRegistry::builtin()) {
            match spec {
                ProducerSpec::Approx(p) => {
                    if !approx_seen {
                        out.approx_max_blocks = max_blocks(&p);
                        approx_seen = true;
                    }
                    approx_notes(&name, &p, &mut out.notes);
                }
                ProducerSpec::Precise(p) => precise_notes(&name, &p, &mut out.notes),
            }
        }
        out
    }
}

fn max_blocks(p: &ApproxProducerParams) -> usize {
    usize::try_from(p.max_prefix_blocks_to_match).unwrap_or(usize::MAX)
}

fn approx_notes(name: &str, p: &ApproxProducerParams, notes: &mut Vec<String>) {
    let d = ApproxProducerParams::default();
    let mut note = |field: &str, instead: &str| {
        notes.push(format!(
            "{APPROX_TYPE} {name:?}: {field} is not read by kvmesh; {instead}"
        ));
    };
    if p.block_size_tokens != d.block_size_tokens {
        note(
            "blockSizeTokens",
            "approximate blocks are prefix.approx_chunk_chars characters (proxy.yaml)",
        );
    }
    if p.lru_capacity_per_server != d.lru_capacity_per_server {
        note(
            "lruCapacityPerServer",
            "set prefix.approx_blocks_per_pod (proxy.yaml)",
        );
    }
    if p.auto_tune != d.auto_tune {
        note(
            "autoTune",
            "the approximate index keeps prefix.approx_blocks_per_pod blocks per pod (proxy.yaml)",
        );
    }
}

fn precise_notes(name: &str, p: &PreciseProducerParams, notes: &mut Vec<String>) {
    let d = PreciseProducerParams::default();
    let mut note = |field: &str, instead: &str| {
        notes.push(format!(
            "{PRECISE_TYPE} {name:?}: {field} is not read by kvmesh; {instead}"
        ));
    };
    if p.block_size_tokens != d.block_size_tokens {
        note(
            "blockSizeTokens",
            "the block size is the engine's (its KV events or metrics), else prefix.block_size (proxy.yaml)",
        );
    }
    let keys = "blocks are keyed by the token ids in the engine's KV events, so the engine's hashing does not matter";
    if p.hash_seed != d.hash_seed {
        note("hashSeed", keys);
    }
    if p.hash_algorithm != d.hash_algorithm {
        note("hashAlgorithm", keys);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(yaml: &str) -> PrefixSettings {
        PrefixSettings::of(&FilterConfig::from_yaml(yaml, "filters.yaml").unwrap())
    }

    const HEAD: &str = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n";

    #[test]
    fn no_producer_reads_llm_d_defaults() {
        assert_eq!(
            PrefixSettings::of(&FilterConfig::builtin_default()),
            PrefixSettings {
                approx_max_blocks: 256,
                notes: vec![],
            }
        );
        let s = settings(&format!(
            "{HEAD}plugins:\n  - type: queue-scorer\n  - type: max-score-picker\n"
        ));
        assert_eq!(s.approx_max_blocks, 256);
    }

    #[test]
    fn the_approximate_producer_sets_the_window_and_notes_what_it_does_not_set() {
        let s = settings(&format!(
            "{HEAD}plugins:\n  - type: approx-prefix-cache-producer\n    parameters:\n      \
             maxPrefixBlocksToMatch: 64\n      lruCapacityPerServer: 1000\n      blockSizeTokens: 16\n"
        ));
        assert_eq!(s.approx_max_blocks, 64);
        assert_eq!(s.notes.len(), 1, "{:?}", s.notes);
        assert!(s.notes[0].contains("lruCapacityPerServer"), "{:?}", s.notes);
        assert!(
            s.notes[0].contains("prefix.approx_blocks_per_pod"),
            "{:?}",
            s.notes
        );
    }

    #[test]
    fn precise_parameters_the_engine_decides_are_noted() {
        let s = settings(&format!(
            "{HEAD}plugins:\n  - type: precise-prefix-cache-producer\n    parameters:\n      \
             blockSizeTokens: 64\n      hashSeed: \"42\"\n      hashAlgorithm: vllm-sha256-cbor\n"
        ));
        assert_eq!(s.approx_max_blocks, 256);
        let fields: Vec<&str> = ["blockSizeTokens", "hashSeed", "hashAlgorithm"]
            .into_iter()
            .filter(|f| s.notes.iter().any(|n| n.contains(f)))
            .collect();
        assert_eq!(fields.len(), 3, "{:?}", s.notes);
    }
}
