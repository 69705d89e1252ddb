//! Built-in models and GPUs for `gpu:MODEL@GPU[xTP][/LINK]` profiles.
//!
//! Models: the values of each model's Hugging Face `config.json`
//! (`num_hidden_layers`, `hidden_size`, `num_attention_heads`,
//! `num_key_value_heads`, `head_dim` or hidden/heads, `num_experts` /
//! `num_local_experts`, `num_experts_per_tok`), parameter counts from the model
//! cards. GPUs: NVIDIA datasheets (dense BF16 tensor FLOP/s, i.e. half the
//! "with sparsity" figure; HBM bandwidth; NVLink bandwidth per direction, half
//! the bidirectional total); memory as CUDA reports it, which is what vLLM's
//! `gpu_memory_utilization` multiplies. Sources in docs/gpu-profiles.md.

use super::gpu::{Dtype, GpuProfileSpec, GpuSpec, Link, ModelSpec};
use crate::SimError;

/// Catalog model names.
pub const MODEL_NAMES: &[&str] = &[
    "llama-3.1-8b",
    "llama-3.1-70b",
    "qwen3-32b",
    "qwen3-30b-a3b",
    "mixtral-8x7b",
];

/// Catalog GPU names.
pub const GPU_NAMES: &[&str] = &["h100", "h200", "a100", "a100-40gb"];

/// The profiles the docs compare against published figures, and the list.
pub const NAMED: &[&str] = &[
    "llama-3.1-8b@h100",
    "llama-3.1-70b@h100x4",
    "llama-3.1-70b@h100x8",
    "llama-3.1-70b@a100x8",
    "qwen3-32b@h200x2",
    "qwen3-30b-a3b@h100",
    "mixtral-8x7b@h200x2",
];

fn dense(
    name: &str,
    layers: usize,
    hidden: usize,
    heads: usize,
    kv: usize,
    params_b: f64,
) -> ModelSpec {
    ModelSpec {
        name: name.to_string(),
        layers,
        hidden_size: hidden,
        heads,
        kv_heads: kv,
        head_dim: 128,
        params_b,
        active_params_b: None,
        dtype: Dtype::Bf16,
        experts: 0,
        experts_per_token: 0,
    }
}

/// meta-llama/Llama-3.1-8B: 32 layers, 4096 hidden, 32 heads, 8 KV heads; 8.03B.
fn llama_3_1_8b() -> ModelSpec {
    dense("llama-3.1-8b", 32, 4096, 32, 8, 8.03)
}

/// meta-llama/Llama-3.1-70B: 80 layers, 8192 hidden, 64 heads, 8 KV heads; 70.6B.
fn llama_3_1_70b() -> ModelSpec {
    dense("llama-3.1-70b", 80, 8192, 64, 8, 70.6)
}

/// A catalog model by name.
pub fn model(name: &str) -> Option<ModelSpec> {
    let moe = |m: ModelSpec, active_b: f64, experts: usize, k: usize| ModelSpec {
        active_params_b: Some(active_b),
        experts,
        experts_per_token: k,
        ..m
    };
    Some(match name {
        "llama-3.1-8b" => llama_3_1_8b(),
        "llama-3.1-70b" => llama_3_1_70b(),
        // Qwen/Qwen3-32B: 64 layers, 5120 hidden, 64 heads, 8 KV heads, head_dim 128; 32.8B.
        "qwen3-32b" => dense(name, 64, 5120, 64, 8, 32.8),
        // Qwen/Qwen3-30B-A3B: 48 layers, 2048 hidden, 32 heads, 4 KV heads, head_dim 128,
        // 128 experts, 8 per token; 30.5B total, 3.3B active.
        "qwen3-30b-a3b" => moe(dense(name, 48, 2048, 32, 4, 30.5), 3.3, 128, 8),
        // mistralai/Mixtral-8x7B-v0.1: 32 layers, 4096 hidden, 32 heads, 8 KV heads,
        // 8 experts, 2 per token; 46.7B total, 12.9B active.
        "mixtral-8x7b" => moe(dense(name, 32, 4096, 32, 8, 46.7), 12.9, 8, 2),
        _ => return None,
    })
}

fn gpu_spec(name: &str, tflops: f64, tb_s: f64, gib: f64, nvlink_gb_s: f64) -> GpuSpec {
    GpuSpec {
        name: name.to_string(),
        dense_tflops: tflops,
        hbm_tb_s: tb_s,
        hbm_gib: gib,
        interconnect_gb_s: nvlink_gb_s,
    }
}

/// H100 SXM5 80GB: BF16 1,979 TFLOPS with sparsity, 3.35 TB/s HBM3, NVLink 900 GB/s.
fn h100() -> GpuSpec {
    gpu_spec("h100", 989.5, 3.35, 79.2, 450.0)
}

/// A catalog GPU by name.
pub fn gpu(name: &str) -> Option<GpuSpec> {
    let g = |tflops: f64, tb_s: f64, gib: f64, nvlink_gb_s: f64| {
        gpu_spec(name, tflops, tb_s, gib, nvlink_gb_s)
    };
    Some(match name {
        "h100" => h100(),
        // H200 SXM 141GB: BF16 1,979 TFLOPS with sparsity, 4.8 TB/s HBM3e, NVLink 900 GB/s.
        "h200" => g(989.5, 4.8, 139.8, 450.0),
        // A100 SXM4 80GB: BF16 312 TFLOPS dense, 2,039 GB/s HBM2e, NVLink 600 GB/s.
        "a100" => g(312.0, 2.039, 79.2, 300.0),
        // A100 SXM4 40GB: BF16 312 TFLOPS dense, 1,555 GB/s HBM2, NVLink 600 GB/s.
        "a100-40gb" => g(312.0, 1.555, 39.4, 300.0),
        _ => return None,
    })
}

/// Parses `MODEL@GPU[xTP][/LINK]` (the part after `gpu:`).
pub fn parse(spec: &str) -> Result<GpuProfileSpec, SimError> {
    let err = |what: String| {
        SimError::Config(format!(
            "profile gpu:{spec}: {what} (form: gpu:MODEL@GPU[xTP][/LINK]; models: {}; GPUs: {}; links: nvlink, rdma-400g, tcp-100g)",
            MODEL_NAMES.join(", "),
            GPU_NAMES.join(", ")
        ))
    };
    let (rest, link) = match spec.split_once('/') {
        Some((rest, link)) => (rest, Link::parse(link).map_err(|e| err(e.to_string()))?),
        None => (spec, Link::default()),
    };
    let (model_name, gpu_part) = rest.split_once('@').ok_or_else(|| err("no '@'".into()))?;
    let (gpu_name, tp) = match gpu_part.rsplit_once('x') {
        Some((g, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
            (g, n.parse().map_err(|_| err(format!("bad TP {n:?}")))?)
        }
        _ => (gpu_part, 1),
    };
    let model = model(model_name).ok_or_else(|| err(format!("unknown model {model_name:?}")))?;
    let gpu = gpu(gpu_name).ok_or_else(|| err(format!("unknown GPU {gpu_name:?}")))?;
    Ok(GpuProfileSpec {
        model,
        gpu,
        tp,
        link,
    })
}

fn builtin(model: ModelSpec, gpu: GpuSpec, tp: usize) -> GpuProfileSpec {
    GpuProfileSpec {
        model,
        gpu,
        tp,
        link: Link::default(),
    }
}

/// `small-gpu`: Llama 3.1 8B on one H100.
pub fn small_gpu_spec() -> GpuProfileSpec {
    builtin(llama_3_1_8b(), h100(), 1)
}

/// `large-gpu`: Llama 3.1 70B on eight H100s (TP 8).
pub fn large_gpu_spec() -> GpuProfileSpec {
    builtin(llama_3_1_70b(), h100(), 8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::gpu::check;

    #[test]
    fn every_named_profile_and_alias_is_valid() {
        for name in NAMED {
            check(&parse(name).unwrap()).unwrap();
        }
        assert_eq!(small_gpu_spec(), parse("llama-3.1-8b@h100").unwrap());
        assert_eq!(large_gpu_spec(), parse("llama-3.1-70b@h100x8").unwrap());
        for m in MODEL_NAMES {
            assert!(model(m).is_some(), "{m}");
        }
        for g in GPU_NAMES {
            assert!(gpu(g).is_some(), "{g}");
        }
    }

    #[test]
    fn names_parse_with_tp_and_link() {
        let s = parse("llama-3.1-70b@a100-40gbx8/tcp-100g").unwrap();
        assert_eq!(
            (s.gpu.name.as_str(), s.tp, s.link),
            ("a100-40gb", 8, Link::Tcp100g)
        );
        assert_eq!(s.name(), "gpu:llama-3.1-70b@a100-40gbx8/tcp-100g");
        assert_eq!(parse("qwen3-32b@h200").unwrap().tp, 1);
        for bad in [
            "llama-3.1-8b",
            "gpt-5@h100",
            "llama-3.1-8b@b300",
            "llama-3.1-8b@h100/pigeon",
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains("gpu:MODEL@GPU"), "{bad}: {e}");
        }
    }
}
