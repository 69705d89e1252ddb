//! The latency model's parameters: what one engine step costs.
//!
//! The scheduler (`core`) runs vLLM-style steps; a step's simulated duration is
//!
//! ```text
//! step_ms = step_base_ms
//!         + prefill_ms_per_token  * (uncached prompt tokens scheduled this step)
//!         + decode_ms_per_seq     * (sequences decoding this step)
//!         + decode_ms_per_kctx    * (their total context, in thousands of tokens)
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
//! Built-in profiles: `small-gpu` (8B on one H100-class GPU), `large-gpu`
//! (70B with TP8), `vllm-cpu-tiny` (calibrated to the real vLLM CPU captures).

use serde::Deserialize;

use crate::SimError;

/// Costs of one engine, in simulated milliseconds.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatencyProfile {
    #[serde(default)]
    pub name: String,
    pub api_overhead_ms: f64,
    pub step_base_ms: f64,
    pub prefill_ms_per_token: f64,
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
}

impl LatencyProfile {
    /// An 8B model on one H100-class GPU: ~10k prompt tokens/s, ~10 ms ITL at
    /// batch 1 growing to ~25 ms at batch 256.
    pub fn small_gpu() -> Self {
        Self {
            name: "small-gpu".into(),
            api_overhead_ms: 3.0,
            step_base_ms: 9.0,
            prefill_ms_per_token: 0.1,
            decode_ms_per_seq: 0.05,
            decode_ms_per_kctx: 0.01,
            max_num_batched_tokens: 8192,
            kv_transfer_base_ms: 2.0,
            kv_transfer_ms_per_token: 0.003,
            api_overhead_std_ms: 0.0,
            step_std_ratio: 0.0,
        }
    }

    /// A 70B model with tensor parallelism 8: ~3k prompt tokens/s, ~22 ms ITL.
    pub fn large_gpu() -> Self {
        Self {
            name: "large-gpu".into(),
            api_overhead_ms: 5.0,
            step_base_ms: 20.0,
            prefill_ms_per_token: 0.3,
            decode_ms_per_seq: 0.1,
            decode_ms_per_kctx: 0.03,
            max_num_batched_tokens: 8192,
            kv_transfer_base_ms: 2.0,
            kv_transfer_ms_per_token: 0.008,
            api_overhead_std_ms: 0.0,
            step_std_ratio: 0.0,
        }
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
            decode_ms_per_seq: 0.2,
            decode_ms_per_kctx: 0.0,
            max_num_batched_tokens: 4096,
            kv_transfer_base_ms: 20.0,
            kv_transfer_ms_per_token: 0.01,
            api_overhead_std_ms: 0.0,
            step_std_ratio: 0.0,
        }
    }

    /// A built-in profile by name.
    pub fn builtin(name: &str) -> Option<Self> {
        match name {
            "small-gpu" => Some(Self::small_gpu()),
            "large-gpu" => Some(Self::large_gpu()),
            "vllm-cpu-tiny" => Some(Self::vllm_cpu_tiny()),
            _ => None,
        }
    }

    /// A built-in name, or a YAML file with the fields above.
    pub fn load(name_or_path: &str) -> Result<Self, SimError> {
        if let Some(p) = Self::builtin(name_or_path) {
            return Ok(p);
        }
        let text = std::fs::read_to_string(name_or_path).map_err(|e| {
            SimError::Config(format!(
                "profile {name_or_path:?} is neither a built-in (small-gpu, large-gpu, vllm-cpu-tiny) nor a readable file: {e}"
            ))
        })?;
        let mut p: Self = serde_yaml_ng::from_str(&text)
            .map_err(|e| SimError::Config(format!("profile file {name_or_path}: {e}")))?;
        if p.name.is_empty() {
            p.name = name_or_path.to_string();
        }
        p.validate()?;
        Ok(p)
    }

    /// All costs finite and non-negative; a step budget of at least one token.
    pub fn validate(&self) -> Result<(), SimError> {
        let costs = [
            self.api_overhead_ms,
            self.step_base_ms,
            self.prefill_ms_per_token,
            self.decode_ms_per_seq,
            self.decode_ms_per_kctx,
            self.kv_transfer_base_ms,
            self.kv_transfer_ms_per_token,
            self.api_overhead_std_ms,
            self.step_std_ratio,
        ];
        if costs.iter().any(|c| !c.is_finite() || *c < 0.0) {
            return Err(SimError::Config(format!(
                "profile {}: every cost must be a finite, non-negative number of ms",
                self.name
            )));
        }
        if self.max_num_batched_tokens == 0 {
            return Err(SimError::Config(format!(
                "profile {}: max_num_batched_tokens must be at least 1",
                self.name
            )));
        }
        Ok(())
    }

    /// Simulated seconds of one step.
    pub fn step_seconds(
        &self,
        prefill_tokens: usize,
        decode_seqs: usize,
        decode_ctx: usize,
    ) -> f64 {
        let ms = self.step_base_ms
            + self.prefill_ms_per_token * prefill_tokens as f64
            + self.decode_ms_per_seq * decode_seqs as f64
            + self.decode_ms_per_kctx * decode_ctx as f64 / 1000.0;
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
        let cold = api + p.step_seconds(500, 0, 0);
        let warm = api + p.step_seconds(116, 0, 0);
        assert!((cold * 1000.0 - 36.0).abs() < 1.5, "cold {cold}");
        assert!((20.5..=23.5).contains(&(warm * 1000.0)), "warm {warm}");
        let itl = p.step_seconds(0, 1, 0) * 1000.0;
        assert!((2.5..=3.5).contains(&itl), "itl {itl}");
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
