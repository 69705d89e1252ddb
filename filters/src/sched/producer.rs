//! Prefix-match producers: they do not schedule; they tell the proxy how to
//! fill `EndpointView::prefix` (the prefix index lives outside this module).
//! Declared in `filters.yaml` like any plugin so that llm-d users recognise
//! the shape, and so that `prefix-cache-scorer` can name its producer.
//!
//! `approx-prefix-cache-producer`: the mesh records which endpoint it sent
//! each prompt prefix to (text blocks, no tokenizer, no KV events).
//!
//! The sidecar reads `maxPrefixBlocksToMatch`; the other parameters of both
//! producers load so that llm-d's files do, and have their setting in
//! proxy.yaml or no use (`proxy/src/routing/producers.rs` says which, and
//! notes each one a file sets).
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `blockSizeTokens` | `16` | tokens per block |
//! | `maxPrefixBlocksToMatch` | `256` | longest prefix considered, in blocks (llm-d's `DefaultMaxPrefixBlocks`) |
//! | `lruCapacityPerServer` | `31250` | blocks remembered per endpoint |
//! | `autoTune` | `true` | take block size and capacity from the engine's metrics |
//!
//! `precise-prefix-cache-producer`: the index is fed by the engines' KV events
//! and requests are tokenized as the engine does.
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `blockSizeTokens` | `16` | tokens per block (when the engine does not say) |
//! | `hashSeed` | `""` | `PYTHONHASHSEED` of the engines (vLLM-exact hashing) |
//! | `hashAlgorithm` | `local` | `local` (kvmesh block keys) or `vllm-sha256-cbor` |
//!
//! ```yaml
//! plugins:
//!   - type: precise-prefix-cache-producer
//!     parameters:
//!       blockSizeTokens: 16
//!       hashAlgorithm: local
//! ```

use serde::Deserialize;

use crate::sched::error::ParamError;

/// Type name of the approximate producer.
pub const APPROX_TYPE: &str = "approx-prefix-cache-producer";
/// Type name of the precise producer.
pub const PRECISE_TYPE: &str = "precise-prefix-cache-producer";

/// Parameters of `approx-prefix-cache-producer`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct ApproxProducerParams {
    /// Tokens per block.
    pub block_size_tokens: u32,
    /// Longest prefix considered, in blocks.
    pub max_prefix_blocks_to_match: u32,
    /// Blocks remembered per endpoint.
    pub lru_capacity_per_server: u32,
    /// Learn block size and capacity from metrics.
    pub auto_tune: bool,
}

impl Default for ApproxProducerParams {
    fn default() -> Self {
        ApproxProducerParams {
            block_size_tokens: 16,
            max_prefix_blocks_to_match: 256,
            lru_capacity_per_server: 31250,
            auto_tune: true,
        }
    }
}

/// Block hashing of the precise producer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HashAlgorithm {
    /// kvmesh's own chained block keys.
    #[default]
    Local,
    /// vLLM's `sha256_cbor` block hashes.
    VllmSha256Cbor,
}

/// Parameters of `precise-prefix-cache-producer`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct PreciseProducerParams {
    /// Tokens per block when the engine does not say.
    pub block_size_tokens: u32,
    /// The engines' `PYTHONHASHSEED`.
    pub hash_seed: String,
    /// Block hashing.
    pub hash_algorithm: HashAlgorithm,
}

impl Default for PreciseProducerParams {
    fn default() -> Self {
        PreciseProducerParams {
            block_size_tokens: 16,
            hash_seed: String::new(),
            hash_algorithm: HashAlgorithm::Local,
        }
    }
}

/// A configured producer, for the proxy to act on.
#[derive(Debug, Clone, PartialEq)]
pub enum ProducerSpec {
    /// Approximate (decision-recording) mode.
    Approx(ApproxProducerParams),
    /// Precise (KV-event) mode.
    Precise(PreciseProducerParams),
}

/// Block sizes must be positive.
pub fn check_block_size(v: u32) -> Result<(), ParamError> {
    if v == 0 {
        return Err(ParamError::invalid("blockSizeTokens", "must be at least 1"));
    }
    Ok(())
}

impl ApproxProducerParams {
    /// Positive block size and window (a window of 0 blocks would match nothing).
    pub fn validate(&self) -> Result<(), ParamError> {
        check_block_size(self.block_size_tokens)?;
        if self.max_prefix_blocks_to_match == 0 {
            return Err(ParamError::invalid(
                "maxPrefixBlocksToMatch",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}
