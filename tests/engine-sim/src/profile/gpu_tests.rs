use super::*;
use crate::profile::catalog::parse;

fn derived(name: &str) -> (LatencyProfile, Derivation) {
    derive(&parse(name).unwrap()).unwrap()
}

#[test]
fn kv_bytes_per_token_follow_the_model_shape() {
    // 2 (K, V) * layers * KV heads * head_dim * 2 bytes, summed over ranks.
    assert_eq!(
        derived("llama-3.1-8b@h100").0.kv_bytes_per_token,
        Some(131_072)
    );
    assert_eq!(
        derived("llama-3.1-70b@h100x8").0.kv_bytes_per_token,
        Some(327_680)
    );
    // 4 KV heads on 8 ranks: each rank keeps a replica of one head.
    let (p, d) = derived("qwen3-30b-a3b@h100x8");
    assert_eq!(d.kv_bytes_per_token_per_gpu, 2 * 48 * 128 * 2);
    assert_eq!(p.kv_bytes_per_token, Some(8 * 2 * 48 * 128 * 2));
}

#[test]
fn capacity_is_what_the_weights_leave() {
    let (p, d) = derived("llama-3.1-8b@h100");
    // 79.2 GiB * 0.9 - 14.96 GiB weights - 3 GiB reserve = 53.3 GiB.
    assert!((d.kv_free_gib_per_gpu - 53.32).abs() < 0.05, "{d:?}");
    assert_eq!(p.kv_cache_tokens, Some(d.kv_cache_blocks * BLOCK_SIZE));
    // TP splits the weights: more room per rank, the same KV per token on the group.
    let tp4 = derived("llama-3.1-70b@h100x4").0.kv_cache_tokens.unwrap();
    let tp8 = derived("llama-3.1-70b@h100x8").0.kv_cache_tokens.unwrap();
    assert!(tp8 > 2 * tp4, "tp4 {tp4} tp8 {tp8}");
    let e = derive(&parse("llama-3.1-70b@a100-40gb").unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("leave no KV cache"), "{e}");
}

#[test]
fn vllm_picks_the_step_budget_by_gpu() {
    assert_eq!(derived("llama-3.1-8b@h100").0.max_num_batched_tokens, 8192);
    assert_eq!(
        derived("llama-3.1-70b@a100x8").0.max_num_batched_tokens,
        2048
    );
    assert_eq!(derived("llama-3.1-8b@a100-40gb").0.max_num_seqs, Some(256));
}

#[test]
fn tensor_parallelism_adds_all_reduces() {
    let (tp1, d1) = derived("qwen3-32b@h200");
    let (tp4, d4) = derived("qwen3-32b@h200x4");
    assert_eq!(d1.allreduce_ms_per_step, 0.0);
    // 2 per layer, 128 all-reduces per step, each 10 µs.
    assert!((d4.allreduce_ms_per_step - 1.28).abs() < 1e-9);
    assert!(tp4.step_base_ms < tp1.step_base_ms / 2.0);
    assert!(tp4.prefill_ms_per_token > tp1.prefill_ms_per_token / 4.0);
}

#[test]
fn moe_reads_the_experts_a_batch_touches() {
    let p = derived("mixtral-8x7b@h200x2").0;
    let moe = p.moe.unwrap();
    assert_eq!((moe.experts, moe.top_k), (8, 2));
    assert!((experts_touched(8, 2, 1) - 2.0).abs() < 1e-9);
    assert!(experts_touched(8, 2, 64) > 7.99);
    let one = p.step_seconds(&crate::profile::StepLoad::decode(1, 0));
    let many = p.step_seconds(&crate::profile::StepLoad::decode(64, 0));
    // From 2 to ~8 experts read: more than the per-sequence compute explains.
    assert!(
        many - one > 4.0 * moe.ms_per_expert / 1000.0,
        "{one} {many}"
    );
}

#[test]
fn the_link_sets_the_transfer_cost() {
    let rdma = derived("llama-3.1-8b@h100").0.kv_transfer_ms_per_token;
    let tcp = derived("llama-3.1-8b@h100/tcp-100g")
        .0
        .kv_transfer_ms_per_token;
    let nvlink = derived("llama-3.1-8b@h100/nvlink")
        .0
        .kv_transfer_ms_per_token;
    // 131072 bytes over 400 Gb/s at 80%.
    assert!((rdma - 131_072.0 / 40e9 * 1e3).abs() < 1e-12);
    assert!((tcp / rdma - 4.0).abs() < 1e-9);
    assert!(nvlink < rdma);
}

#[test]
fn the_yaml_form_is_strict_and_names_the_field() {
    let own =
        "model:\n  name: my-8b\n  layers: 32\n  hidden_size: 4096\n  heads: 32\n  kv_heads: 8\n  \
               head_dim: 128\n  params_b: 8.03\n  dtype: bf16\ngpu: h100\ntp: 1\nlink: tcp-100g\n";
    let spec = GpuProfileFile::parse(own, "own.yaml").unwrap().unwrap();
    let mine = derive(&spec).unwrap().0;
    let builtin = derived("llama-3.1-8b@h100/tcp-100g").0;
    assert_eq!(mine.step_base_ms, builtin.step_base_ms);
    assert_eq!(
        mine.kv_transfer_ms_per_token,
        builtin.kv_transfer_ms_per_token
    );
    assert!(GpuProfileFile::parse("step_base_ms: 1\n", "f")
        .unwrap()
        .is_none());
    let cases = [
        (
            own.replace("dtype: bf16", "dtype: bf16\n  turbo: 1"),
            "turbo",
        ),
        (own.replace("dtype: bf16", "dtype: int3"), "int3"),
        (own.replace("gpu: h100", "gpu: b300"), "b300"),
        (own.replace("tp: 1", "tp: 1\nspeed: 2"), "speed"),
        (
            own.replace("link: tcp-100g", "link: carrier-pigeon"),
            "carrier-pigeon",
        ),
    ];
    for (text, what) in cases {
        let e = GpuProfileFile::parse(&text, "own.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("own.yaml") && e.contains(what), "{what}: {e}");
    }
    let spec = GpuProfileFile::parse(&own.replace("tp: 1", "tp: 3"), "own.yaml")
        .unwrap()
        .unwrap();
    assert!(derive(&spec).unwrap_err().to_string().contains("divide"));
}
