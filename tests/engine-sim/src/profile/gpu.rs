//! A [`LatencyProfile`] derived from a model's shape and a GPU's datasheet.
//!
//! Every formula and constant is explained, with its source, in
//! docs/gpu-profiles.md; the short form:
//!
//! ```text
//! weights/rank   = (dense params + experts touched * expert params) * dtype bytes / TP
//! step_base_ms   = weights/rank / (HBM B/s * HBM_EFFICIENCY) + 2 * layers * ALLREDUCE_LATENCY_MS
//!                + STEP_OVERHEAD_MS
//! per token      = 2 * active params / TP / (dense FLOP/s * PREFILL_MFU)
//!                + ring all-reduce of 2 * layers * hidden * dtype bytes over NVLink
//! attention      = 4 * layers * heads * head_dim FLOPs per token per context token
//! KV read        = KV bytes/token/rank per context token / (HBM B/s * HBM_EFFICIENCY)
//! KV capacity    = TP * (HBM * 0.9 - weights/rank - NON_KV_RESERVE_GIB) / KV bytes/token/rank
//! KV transfer    = KV bytes/token/rank / (link B/s * LINK_EFFICIENCY), ranks in parallel
//! ```
//!
//! The YAML form of a user's own model and GPU (all sizes as the datasheet
//! and the model's `config.json` give them):
//!
//! ```yaml
//! model:            # or a catalog name: llama-3.1-8b
//!   name: my-8b
//!   layers: 32
//!   hidden_size: 4096
//!   heads: 32
//!   kv_heads: 8
//!   head_dim: 128
//!   params_b: 8.03
//!   active_params_b: 8.03   # default: params_b; smaller for MoE
//!   dtype: bf16             # bf16 | fp16 | fp8
//!   experts: 0              # MoE: routed experts per layer
//!   experts_per_token: 0
//! gpu:              # or a catalog name: h100
//!   name: my-gpu
//!   dense_tflops: 989       # for the model's dtype, without sparsity
//!   hbm_tb_s: 3.35
//!   hbm_gib: 79.2           # as CUDA reports it
//!   interconnect_gb_s: 450  # GPU-to-GPU, one direction
//! tp: 1
//! link: rdma-400g           # nvlink | rdma-400g | tcp-100g
//! ```

use serde::{Deserialize, Serialize};
use serde_yaml_ng::Value;

use super::{catalog, LatencyProfile, MoeCost};
use crate::SimError;

/// vLLM's default `gpu_memory_utilization`.
pub const GPU_MEMORY_UTILIZATION: f64 = 0.9;
/// Share of peak HBM bandwidth a decode step's weight and KV reads reach.
pub const HBM_EFFICIENCY: f64 = 0.8;
/// Share of dense peak FLOP/s prefill reaches (model FLOPs utilization).
pub const PREFILL_MFU: f64 = 0.5;
/// Share of a link's bandwidth a bulk transfer or an all-reduce reaches.
pub const LINK_EFFICIENCY: f64 = 0.8;
/// Latency of one small all-reduce inside a node, ms.
pub const ALLREDUCE_LATENCY_MS: f64 = 0.01;
/// Per-step CPU work not hidden behind the GPU (scheduling, input preparation, sampling), ms.
pub const STEP_OVERHEAD_MS: f64 = 1.5;
/// The API server's share of TTFT (parse, tokenize), ms.
pub const API_OVERHEAD_MS: f64 = 3.0;
/// Per-GPU memory vLLM keeps out of the KV cache besides the weights
/// (activation peak, CUDA graphs, CUDA context, NCCL buffers), GiB.
pub const NON_KV_RESERVE_GIB: f64 = 3.0;
/// Fixed cost of one KV transfer (side-channel round trip, notification), ms.
pub const KV_TRANSFER_BASE_MS: f64 = 1.0;
/// vLLM's KV block size.
pub const BLOCK_SIZE: usize = 16;

const GIB: f64 = (1u64 << 30) as f64;

/// Weight and KV element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Bf16,
    Fp16,
    Fp8,
}

impl Dtype {
    pub fn bytes(self) -> f64 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2.0,
            Dtype::Fp8 => 1.0,
        }
    }
}

/// A model's shape, as its `config.json` gives it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub name: String,
    pub layers: usize,
    pub hidden_size: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Total parameters, billions.
    pub params_b: f64,
    /// Parameters one token uses, billions (default: all of them).
    #[serde(default)]
    pub active_params_b: Option<f64>,
    pub dtype: Dtype,
    /// Routed experts per layer (0: dense).
    #[serde(default)]
    pub experts: usize,
    #[serde(default)]
    pub experts_per_token: usize,
}

/// A GPU, as its datasheet gives it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    pub name: String,
    /// Dense tensor-core TFLOP/s for the model's dtype, without sparsity.
    pub dense_tflops: f64,
    pub hbm_tb_s: f64,
    /// Memory as CUDA reports it (what `gpu_memory_utilization` multiplies).
    pub hbm_gib: f64,
    /// GPU-to-GPU bandwidth, one direction, GB/s.
    pub interconnect_gb_s: f64,
}

/// Where a decode engine's KV comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
pub enum Link {
    /// The GPU's own interconnect (same node).
    #[serde(rename = "nvlink")]
    Nvlink,
    /// One 400 Gb/s RDMA NIC per GPU (DGX H100: 8x ConnectX-7).
    #[default]
    #[serde(rename = "rdma-400g")]
    Rdma400g,
    /// One 100 Gb/s TCP path per GPU.
    #[serde(rename = "tcp-100g")]
    Tcp100g,
}

impl Link {
    pub fn parse(s: &str) -> Result<Self, SimError> {
        match s {
            "nvlink" => Ok(Link::Nvlink),
            "rdma-400g" => Ok(Link::Rdma400g),
            "tcp-100g" => Ok(Link::Tcp100g),
            _ => Err(SimError::Config(format!(
                "unknown link {s:?}: nvlink, rdma-400g or tcp-100g"
            ))),
        }
    }

    /// Bytes per second one TP rank moves over this link.
    pub fn bytes_per_s(self, gpu: &GpuSpec) -> f64 {
        match self {
            Link::Nvlink => gpu.interconnect_gb_s * 1e9,
            Link::Rdma400g => 400e9 / 8.0,
            Link::Tcp100g => 100e9 / 8.0,
        }
    }
}

/// A model on a TP group of one GPU type, and the link KV arrives over.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuProfileSpec {
    pub model: ModelSpec,
    pub gpu: GpuSpec,
    pub tp: usize,
    pub link: Link,
}

impl GpuProfileSpec {
    /// `gpu:MODEL@GPU[xTP][/LINK]`, the form [`catalog::parse`] reads.
    pub fn name(&self) -> String {
        let tp = if self.tp == 1 {
            String::new()
        } else {
            format!("x{}", self.tp)
        };
        let link = match self.link {
            Link::Rdma400g => "",
            Link::Nvlink => "/nvlink",
            Link::Tcp100g => "/tcp-100g",
        };
        format!("gpu:{}@{}{tp}{link}", self.model.name, self.gpu.name)
    }
}

/// The YAML form of a [`GpuProfileSpec`]; `model` and `gpu` may name catalog entries.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuProfileFile {
    model: Value,
    gpu: Value,
    #[serde(default = "one")]
    tp: usize,
    #[serde(default)]
    link: Link,
}

fn one() -> usize {
    1
}

impl GpuProfileFile {
    /// The spec in `text` if it is the model + GPU form (has a `gpu:` key), else `None`.
    pub fn parse(text: &str, file: &str) -> Result<Option<GpuProfileSpec>, SimError> {
        let err = |e: String| SimError::Config(format!("profile file {file}: {e}"));
        let value: Value = serde_yaml_ng::from_str(text).map_err(|e| err(e.to_string()))?;
        if value.get("gpu").is_none() {
            return Ok(None);
        }
        let f: GpuProfileFile = serde_yaml_ng::from_value(value).map_err(|e| err(e.to_string()))?;
        let model = match f.model {
            Value::String(name) => catalog::model(&name).ok_or_else(|| {
                err(format!(
                    "model: unknown catalog model {name:?}; known: {}",
                    catalog::MODEL_NAMES.join(", ")
                ))
            })?,
            v => serde_yaml_ng::from_value(v).map_err(|e| err(format!("model: {e}")))?,
        };
        let gpu = match f.gpu {
            Value::String(name) => catalog::gpu(&name).ok_or_else(|| {
                err(format!(
                    "gpu: unknown catalog GPU {name:?}; known: {}",
                    catalog::GPU_NAMES.join(", ")
                ))
            })?,
            v => serde_yaml_ng::from_value(v).map_err(|e| err(format!("gpu: {e}")))?,
        };
        Ok(Some(GpuProfileSpec {
            model,
            gpu,
            tp: f.tp,
            link: f.link,
        }))
    }
}

/// The intermediate figures of a derivation, for `profile` and the docs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Derivation {
    pub model: String,
    pub gpu: String,
    pub tp: usize,
    pub link: Link,
    pub weights_gib_per_gpu: f64,
    pub kv_free_gib_per_gpu: f64,
    pub kv_bytes_per_token_per_gpu: u64,
    pub kv_cache_blocks: usize,
    pub decode_weight_read_ms: f64,
    pub allreduce_ms_per_step: f64,
    pub allreduce_ms_per_token: f64,
}

/// Expected distinct experts (of `experts`, `top_k` each) that `tokens` tokens
/// routed independently and uniformly touch in one layer.
pub fn experts_touched(experts: usize, top_k: usize, tokens: usize) -> f64 {
    if experts == 0 || tokens == 0 {
        return 0.0;
    }
    let miss = 1.0 - top_k as f64 / experts as f64;
    experts as f64 * (1.0 - miss.powi(tokens.min(i32::MAX as usize) as i32))
}

impl ModelSpec {
    fn active_b(&self) -> f64 {
        self.active_params_b.unwrap_or(self.params_b)
    }

    /// (parameters every token uses, parameters of one routed expert), billions.
    fn split_b(&self) -> (f64, f64) {
        if self.experts == 0 {
            return (self.params_b, 0.0);
        }
        let per_expert =
            (self.params_b - self.active_b()) / (self.experts - self.experts_per_token) as f64;
        (
            self.active_b() - self.experts_per_token as f64 * per_expert,
            per_expert,
        )
    }
}

/// Checks the spec makes an engine vLLM would start.
pub fn check(s: &GpuProfileSpec) -> Result<(), SimError> {
    let (m, g) = (&s.model, &s.gpu);
    let bad = |what: String| {
        Err(SimError::Config(format!(
            "gpu profile {}@{}: {what}",
            m.name, g.name
        )))
    };
    if [m.layers, m.hidden_size, m.heads, m.kv_heads, m.head_dim].contains(&0) {
        return bad("layers, hidden_size, heads, kv_heads and head_dim must be at least 1".into());
    }
    let positive = [
        m.params_b,
        g.dense_tflops,
        g.hbm_tb_s,
        g.hbm_gib,
        g.interconnect_gb_s,
    ];
    if positive.iter().any(|x| !x.is_finite() || *x <= 0.0) {
        return bad(
            "params_b, dense_tflops, hbm_tb_s, hbm_gib and interconnect_gb_s must be positive"
                .into(),
        );
    }
    if !(m.active_b() > 0.0 && m.active_b() <= m.params_b) {
        return bad("active_params_b must be in (0, params_b]".into());
    }
    if m.experts > 0 && !(m.experts_per_token >= 1 && m.experts_per_token < m.experts) {
        return bad("experts_per_token must be in 1..experts".into());
    }
    if m.experts > 0 && m.split_b().0 < 0.0 {
        return bad("active_params_b is too small for experts_per_token experts".into());
    }
    if s.tp == 0 || m.heads % s.tp != 0 {
        return bad(format!(
            "tp {} must divide the {} attention heads (vLLM's rule)",
            s.tp, m.heads
        ));
    }
    let (p, d) = derive_unchecked(s);
    if p.kv_cache_tokens.unwrap_or(0) < BLOCK_SIZE {
        return bad(format!(
            "the weights ({:.1} GiB per GPU) leave no KV cache in {:.0}% of {} GiB minus {} GiB reserve",
            d.weights_gib_per_gpu,
            GPU_MEMORY_UTILIZATION * 100.0,
            g.hbm_gib,
            NON_KV_RESERVE_GIB
        ));
    }
    Ok(())
}

/// The profile of a checked spec.
pub fn derive(s: &GpuProfileSpec) -> Result<(LatencyProfile, Derivation), SimError> {
    check(s)?;
    Ok(derive_unchecked(s))
}

/// The profile of a spec [`check`] would accept (built-ins, tests).
pub fn derive_unchecked(s: &GpuProfileSpec) -> (LatencyProfile, Derivation) {
    let (m, g, tp) = (&s.model, &s.gpu, s.tp.max(1) as f64);
    let bytes = m.dtype.bytes();
    let hbm = g.hbm_tb_s * 1e12 * HBM_EFFICIENCY;
    let flops = g.dense_tflops * 1e12 * PREFILL_MFU;
    let (dense_b, expert_b) = m.split_b();

    let decode_weight_read_ms = dense_b * 1e9 * bytes / tp / hbm * 1e3;
    let all_reduces = 2.0 * m.layers as f64;
    let (allreduce_ms_per_step, allreduce_ms_per_token) = if s.tp > 1 {
        let ring = 2.0 * (tp - 1.0) / tp;
        let link = g.interconnect_gb_s * 1e9 * LINK_EFFICIENCY;
        let per_token = all_reduces * m.hidden_size as f64 * bytes * ring / link * 1e3;
        (all_reduces * ALLREDUCE_LATENCY_MS, per_token)
    } else {
        (0.0, 0.0)
    };
    let compute_ms_per_token = 2.0 * m.active_b() * 1e9 / tp / flops * 1e3;
    let attn_flops_per_kctx = 4.0 * (m.layers * m.heads * m.head_dim) as f64 * 1000.0;

    // KV heads are split over TP ranks, and replicated when TP exceeds them. Every
    // rank holds its share of every token, so the group holds what one rank holds.
    let kv_heads_per_gpu = m.kv_heads.div_ceil(s.tp.max(1));
    let kv_per_gpu = (2 * m.layers * kv_heads_per_gpu * m.head_dim) as f64 * bytes;
    let weights_per_gpu = m.params_b * 1e9 * bytes / tp;
    let free =
        g.hbm_gib * GIB * GPU_MEMORY_UTILIZATION - weights_per_gpu - NON_KV_RESERVE_GIB * GIB;
    let tokens_per_gpu = (free.max(0.0) / kv_per_gpu).floor() as usize;
    let kv_cache_blocks = tokens_per_gpu / BLOCK_SIZE;

    // vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults (OpenAI API server).
    let big = g.hbm_gib >= 70.0 && !g.name.to_ascii_lowercase().contains("a100");
    let (max_num_batched_tokens, max_num_seqs) = if big { (8192, 1024) } else { (2048, 256) };

    let moe = (m.experts > 0).then(|| MoeCost {
        experts: m.experts,
        top_k: m.experts_per_token,
        ms_per_expert: expert_b * 1e9 * bytes / tp / hbm * 1e3,
    });
    let profile = LatencyProfile {
        name: s.name(),
        api_overhead_ms: API_OVERHEAD_MS,
        step_base_ms: decode_weight_read_ms + allreduce_ms_per_step + STEP_OVERHEAD_MS,
        prefill_ms_per_token: compute_ms_per_token + allreduce_ms_per_token,
        prefill_ms_per_token_kctx: attn_flops_per_kctx / tp / flops * 1e3,
        decode_ms_per_seq: compute_ms_per_token + allreduce_ms_per_token,
        decode_ms_per_kctx: kv_per_gpu * 1000.0 / hbm * 1e3,
        max_num_batched_tokens,
        kv_transfer_base_ms: KV_TRANSFER_BASE_MS,
        kv_transfer_ms_per_token: kv_per_gpu / (s.link.bytes_per_s(g) * LINK_EFFICIENCY) * 1e3,
        api_overhead_std_ms: 0.0,
        step_std_ratio: 0.0,
        kv_cache_tokens: Some(kv_cache_blocks * BLOCK_SIZE),
        kv_bytes_per_token: Some((kv_per_gpu * tp) as u64),
        max_num_seqs: Some(max_num_seqs),
        moe,
    };
    let derivation = Derivation {
        model: m.name.clone(),
        gpu: g.name.clone(),
        tp: s.tp,
        link: s.link,
        weights_gib_per_gpu: weights_per_gpu / GIB,
        kv_free_gib_per_gpu: free.max(0.0) / GIB,
        kv_bytes_per_token_per_gpu: kv_per_gpu as u64,
        kv_cache_blocks,
        decode_weight_read_ms,
        allreduce_ms_per_step,
        allreduce_ms_per_token,
    };
    (profile, derivation)
}

#[cfg(test)]
#[path = "gpu_tests.rs"]
mod tests;
