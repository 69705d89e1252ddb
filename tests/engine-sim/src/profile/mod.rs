//! The latency model's parameters: what one engine step costs.
//!
//! The scheduler (`core`) runs vLLM-style steps; a step's simulated duration is
//!
//! ```text
//! step_ms = step_base_ms
//!         + prefill_ms_per_token      * (uncached prompt tokens scheduled this step)
//!         + prefill_ms_per_token_kctx * (the context those tokens attend to, in thousands)
//!         + decode_ms_per_seq         * (sequences decoding this step)
//!         + decode_ms_per_kctx        * (their total context, in thousands of tokens)
//!         + moe.ms_per_expert         * (experts the step's tokens touch, MoE models only)
//! ```
//!
//! so a long prefill sharing a step with decodes lengthens every decode's
//! inter-token gap, and a bigger batch decodes slower. `api_overhead_ms` is
//! the API server's share of TTFT (parsing, tokenizing), paid before a request
//! reaches the scheduler and not blocking other requests. A decode engine that
//! receives KV from a prefill engine pays `kv_transfer_base_ms +
//! kv_transfer_ms_per_token * tokens` instead of the prefill, off the step path.
//!
//! `api_overhead_std_ms` and `step_std_ratio` spread both around their modelled
//! values (`core::jitter`); the built-in profiles have no spread.
//!
//! Profiles: `gpu:MODEL@GPU[xTP][/LINK]` derives one from a model's shape and a
//! GPU's datasheet ([`gpu`], [`catalog`], docs/gpu-profiles.md); `small-gpu`
//! is `gpu:llama-3.1-8b@h100`, `large-gpu` is `gpu:llama-3.1-70b@h100x8`;
//! `vllm-cpu-tiny` is calibrated to the real vLLM CPU captures. A YAML file
//! holds either these fields or a model + GPU description (`gpu::GpuProfileFile`).

pub mod catalog;
pub mod gpu;
pub mod report;

use serde::{Deserialize, Serialize};

use crate::SimError;

/// Costs of one engine, in simulated milliseconds.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LatencyProfile {
    #[serde(default)]
    pub name: String,
    pub api_overhead_ms: f64,
    pub step_base_ms: f64,
    pub prefill_ms_per_token: f64,
    /// Attention's share of prefill: ms per prefilled token per thousand tokens of
    /// context it attends to (its own position plus any cached prefix).
    #[serde(default)]
    pub prefill_ms_per_token_kctx: f64,
    pub decode_ms_per_seq: f64,
    #[serde(default)]
    pub decode_ms_per_kctx: f64,
    /// Token budget of one step (vLLM `max_num_batched_tokens`): chunked prefill.
    pub max_num_batched_tokens: usize,
    pub kv_transfer_base_ms: f64,
    pub kv_transfer_ms_per_token: f64,
    /// Standard deviation of each request's API-server time, in ms (llm-d-inference-sim's
    /// `time-to-first-token-std-dev`); draws are cut at 3 standard deviations and floored at 0.
    #[serde(default)]
    pub api_overhead_std_ms: f64,
    /// Standard deviation of each step's duration, relative to it (0.1 = 10%); cut the same way.
    #[serde(default)]
    pub step_std_ratio: f64,
    /// KV capacity of the whole engine (all TP ranks), in tokens; the binary's
    /// `--num-blocks` defaults to it when set.
    #[serde(default)]
    pub kv_cache_tokens: Option<usize>,
    /// KV bytes of one token, whole model (summed over TP ranks); informative.
    #[serde(default)]
    pub kv_bytes_per_token: Option<u64>,
    /// vLLM's default `max_num_seqs` on this hardware; the binary's
    /// `--max-num-seqs` defaults to it when set.
    #[serde(default)]
    pub max_num_seqs: Option<usize>,
    /// Mixture-of-experts weight reads, when the model has experts.
    #[serde(default)]
    pub moe: Option<MoeCost>,
}

/// What reading routed experts' weights costs a step.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MoeCost {
    /// Routed experts per layer.
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// ms to read one expert's weights, all layers, on one TP rank.
    pub ms_per_expert: f64,
}

/// The work of one step, as the scheduler planned it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepLoad {
    /// Uncached prompt tokens computed this step.
    pub prefill_tokens: usize,
    /// Sum over those tokens of the context each attends to (its position + 1).
    pub prefill_ctx_tokens: usize,
    /// Sequences decoding one token this step.
    pub decode_seqs: usize,
    /// Their total context, in tokens.
    pub decode_ctx_tokens: usize,
}

impl StepLoad {
    /// A step that only prefills `tokens` prompt tokens from position 0.
    pub fn prefill(tokens: usize) -> Self {
        Self::default().with_chunk(0, tokens)
    }

    /// A step that only decodes `seqs` sequences with `ctx_tokens` of context in all.
    pub fn decode(seqs: usize, ctx_tokens: usize) -> Self {
        Self {
            decode_seqs: seqs,
            decode_ctx_tokens: ctx_tokens,
            ..Self::default()
        }
    }

    /// Adds a prefill chunk of `len` tokens starting at position `start`: its
    /// tokens attend to `start + 1 ..= start + len` tokens.
    pub fn with_chunk(mut self, start: usize, len: usize) -> Self {
        self.prefill_tokens += len;
        self.prefill_ctx_tokens += len * start + len * (len + 1) / 2;
        self
    }
}

impl LatencyProfile {
    /// An 8B model on one H100: `gpu:llama-3.1-8b@h100` under its old name.
    pub fn small_gpu() -> Self {
        Self::alias("small-gpu", catalog::small_gpu_spec())
    }

    /// A 70B model with tensor parallelism 8: `gpu:llama-3.1-70b@h100x8`.
    pub fn large_gpu() -> Self {
        Self::alias("large-gpu", catalog::large_gpu_spec())
    }

    fn alias(name: &str, spec: gpu::GpuProfileSpec) -> Self {
        let mut p = gpu::derive_unchecked(&spec).0;
        p.name = name.to_string();
        p
    }

    /// Real vLLM 0.32 CPU with the tiny model (`fixtures/vllm-cpu/probe/
    /// latency_probe.txt`): 500-token prefill 36 ms cold, ~22 ms with 384
    /// tokens cached, ~3.2 ms per decoded token.
    ///
    /// Fit: cold = api + base + 500 p = 36, cached = api + base + 116 p = 22
    /// gives p = 0.0365 ms/token and api + base = 17.8 ms; the per-token decode
    /// step is base + 1 seq = 3.2 ms.
    pub fn vllm_cpu_tiny() -> Self {
        Self {
            name: "vllm-cpu-tiny".into(),
            api_overhead_ms: 14.8,
            step_base_ms: 3.0,
            prefill_ms_per_token: 0.0365,
            prefill_ms_per_token_kctx: 0.0,
            decode_ms_per_seq: 0.2,
            decode_ms_per_kctx: 0.0,
            max_num_batched_tokens: 4096,
            kv_transfer_base_ms: 20.0,
            kv_transfer_ms_per_token: 0.01,
            api_overhead_std_ms: 0.0,
            step_std_ratio: 0.0,
            kv_cache_tokens: None,
            kv_bytes_per_token: None,
            max_num_seqs: None,
            moe: None,
        }
    }

    /// A built-in profile by name (not the `gpu:` ones).
    pub fn builtin(name: &str) -> Option<Self> {
        match name {
            "small-gpu" => Some(Self::small_gpu()),
            "large-gpu" => Some(Self::large_gpu()),
            "vllm-cpu-tiny" => Some(Self::vllm_cpu_tiny()),
            _ => None,
        }
    }

    /// A built-in name, `gpu:MODEL@GPU[xTP][/LINK]`, or a YAML file with either
    /// the fields above or a `model:` + `gpu:` description.
    pub fn load(name_or_path: &str) -> Result<Self, SimError> {
        Self::load_explained(name_or_path).map(|(p, _)| p)
    }

    /// [`load`](Self::load), with the derivation when the profile comes from a model and a GPU.
    pub fn load_explained(name_or_path: &str) -> Result<(Self, Option<gpu::Derivation>), SimError> {
        let derived = |spec: gpu::GpuProfileSpec, name: Option<&str>| {
            gpu::derive(&spec).map(|(mut p, d)| {
                if let Some(name) = name {
                    p.name = name.to_string();
                }
                (p, Some(d))
            })
        };
        match name_or_path {
            "small-gpu" => return derived(catalog::small_gpu_spec(), Some("small-gpu")),
            "large-gpu" => return derived(catalog::large_gpu_spec(), Some("large-gpu")),
            _ => {}
        }
        if let Some(p) = Self::builtin(name_or_path) {
            return Ok((p, None));
        }
        if let Some(spec) = name_or_path.strip_prefix("gpu:") {
            return derived(catalog::parse(spec)?, None);
        }
        let text = std::fs::read_to_string(name_or_path).map_err(|e| {
            SimError::Config(format!(
                "profile {name_or_path:?} is neither a built-in (small-gpu, large-gpu, vllm-cpu-tiny, \
                 gpu:MODEL@GPU[xTP]) nor a readable file: {e}"
            ))
        })?;
        if let Some(spec) = gpu::GpuProfileFile::parse(&text, name_or_path)? {
            return derived(spec, None);
        }
        let mut p: Self = serde_yaml_ng::from_str(&text)
            .map_err(|e| SimError::Config(format!("profile file {name_or_path}: {e}")))?;
        if p.name.is_empty() {
            p.name = name_or_path.to_string();
        }
        p.validate()?;
        Ok((p, None))
    }

    /// All costs finite and non-negative; a step budget of at least one token.
    pub fn validate(&self) -> Result<(), SimError> {
        let moe = self.moe.map(|m| m.ms_per_expert).unwrap_or(0.0);
        let costs = [
            self.api_overhead_ms,
            self.step_base_ms,
            self.prefill_ms_per_token,
            self.prefill_ms_per_token_kctx,
            self.decode_ms_per_seq,
            self.decode_ms_per_kctx,
            self.kv_transfer_base_ms,
            self.kv_transfer_ms_per_token,
            self.api_overhead_std_ms,
            self.step_std_ratio,
            moe,
        ];
        let bad = |what: &str| Err(SimError::Config(format!("profile {}: {what}", self.name)));
        if costs.iter().any(|c| !c.is_finite() || *c < 0.0) {
            return bad("every cost must be a finite, non-negative number of ms");
        }
        if self.max_num_batched_tokens == 0 {
            return bad("max_num_batched_tokens must be at least 1");
        }
        if matches!(self.moe, Some(m) if m.top_k == 0 || m.top_k > m.experts) {
            return bad("moe.top_k must be in 1..=moe.experts");
        }
        Ok(())
    }

    /// Simulated seconds of one step.
    pub fn step_seconds(&self, load: &StepLoad) -> f64 {
        let mut ms = self.step_base_ms
            + self.prefill_ms_per_token * load.prefill_tokens as f64
            + self.prefill_ms_per_token_kctx * load.prefill_ctx_tokens as f64 / 1000.0
            + self.decode_ms_per_seq * load.decode_seqs as f64
            + self.decode_ms_per_kctx * load.decode_ctx_tokens as f64 / 1000.0;
        if let Some(moe) = self.moe {
            let tokens = load.prefill_tokens + load.decode_seqs;
            ms += moe.ms_per_expert * gpu::experts_touched(moe.experts, moe.top_k, tokens);
        }
        ms / 1000.0
    }

    /// Simulated seconds to receive `tokens` of KV from a prefill engine.
    pub fn transfer_seconds(&self, tokens: usize) -> f64 {
        (self.kv_transfer_base_ms + self.kv_transfer_ms_per_token * tokens as f64) / 1000.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_tiny_matches_the_real_probe() {
        let p = LatencyProfile::vllm_cpu_tiny();
        let api = p.api_overhead_ms / 1000.0;
        let cold = api + p.step_seconds(&StepLoad::prefill(500));
        let warm = api + p.step_seconds(&StepLoad::prefill(116));
        assert!((cold * 1000.0 - 36.0).abs() < 1.5, "cold {cold}");
        assert!((20.5..=23.5).contains(&(warm * 1000.0)), "warm {warm}");
        let itl = p.step_seconds(&StepLoad::decode(1, 0)) * 1000.0;
        assert!((2.5..=3.5).contains(&itl), "itl {itl}");
    }

    #[test]
    fn a_chunk_attends_to_its_prefix() {
        // Tokens 10..13 attend to 11, 12 and 13 tokens.
        let l = StepLoad::default().with_chunk(10, 3);
        assert_eq!((l.prefill_tokens, l.prefill_ctx_tokens), (3, 36));
    }

    #[test]
    fn aliases_keep_their_names_and_derived_costs() {
        let small = LatencyProfile::small_gpu();
        assert_eq!(small.name, "small-gpu");
        let derived = LatencyProfile::load("gpu:llama-3.1-8b@h100").unwrap();
        assert_eq!(small.step_base_ms, derived.step_base_ms);
        assert_eq!(LatencyProfile::large_gpu().name, "large-gpu");
    }

    #[test]
    fn yaml_profiles_are_strict() {
        let dir = std::env::temp_dir().join(format!("sim-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.yaml");
        std::fs::write(
            &good,
            "api_overhead_ms: 1\nstep_base_ms: 2\nprefill_ms_per_token: 0.1\n\
             decode_ms_per_seq: 0.1\nmax_num_batched_tokens: 512\n\
             kv_transfer_base_ms: 1\nkv_transfer_ms_per_token: 0.01\n",
        )
        .unwrap();
        let p = LatencyProfile::load(good.to_str().unwrap()).unwrap();
        assert_eq!(p.max_num_batched_tokens, 512);
        let bad = dir.join("bad.yaml");
        std::fs::write(&bad, "step_base_ms: 2\nturbo: true\n").unwrap();
        assert!(LatencyProfile::load(bad.to_str().unwrap()).is_err());
        assert!(LatencyProfile::load("no-such-profile").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
