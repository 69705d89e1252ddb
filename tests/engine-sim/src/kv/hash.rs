//! Engine-side block hashes: vLLM's own `sha256_cbor` chain with
//! `PYTHONHASHSEED` unset (seed string `vllm-none-hash`), from
//! `kvmesh_filters::prefix::hash::VllmCborHasher`, so the simulator publishes
//! the very values a real vLLM 0.32 (`--prefix-caching-hash-algo sha256_cbor`)
//! would for the same token ids. Only full blocks are hashed; `cache_salt`
//! changes block 0 and so every block after it.
//!
//! A request run with a LoRA adapter (`crate::http::lora`): vLLM puts the
//! adapter's name in every block's extra keys, so its blocks never match the
//! base model's. The shared hasher takes a salt only, so the simulator mixes
//! the name in through block 0's salt: the chain keeps an adapter's blocks
//! apart as vLLM's cache does, but their hash values are not vLLM's (kvmesh
//! keys blocks by their tokens and the event's `lora_name`, not by these).

use std::sync::OnceLock;

use kvmesh_filters::prefix::hash::VllmCborHasher;

/// Extra keys that change a block's identity, as vLLM's `extra_keys`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockExtras {
    pub cache_salt: Option<String>,
    pub lora_name: Option<String>,
}

fn hasher() -> &'static VllmCborHasher {
    static H: OnceLock<VllmCborHasher> = OnceLock::new();
    H.get_or_init(|| VllmCborHasher::new(None))
}

/// The u64 hashes vLLM publishes for every full block of `tokens`.
pub fn block_hashes(tokens: &[u32], block_size: usize, extras: &BlockExtras) -> Vec<u64> {
    match &extras.lora_name {
        None => hasher().block_hashes(tokens, block_size, extras.cache_salt.as_deref()),
        Some(lora) => {
            let salt = format!(
                "{}\u{1f}lora={lora}",
                extras.cache_salt.as_deref().unwrap_or("")
            );
            hasher().block_hashes(tokens, block_size, Some(&salt))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_and_separates_salts() {
        let toks: Vec<u32> = (0..64).collect();
        let plain = block_hashes(&toks, 16, &BlockExtras::default());
        assert_eq!(plain.len(), 4);
        let longer: Vec<u32> = (0..70).collect();
        assert_eq!(block_hashes(&longer, 16, &BlockExtras::default()), plain);
        let salted = BlockExtras {
            cache_salt: Some("a".into()),
            lora_name: None,
        };
        let s = block_hashes(&toks, 16, &salted);
        assert!(
            s.iter().zip(&plain).all(|(a, b)| a != b),
            "salt changes every chained block"
        );
    }

    #[test]
    fn an_adapter_keeps_its_blocks_apart() {
        let toks: Vec<u32> = (0..64).collect();
        let of = |lora: Option<&str>| {
            let extras = BlockExtras {
                cache_salt: None,
                lora_name: lora.map(str::to_owned),
            };
            block_hashes(&toks, 16, &extras)
        };
        let (base, sql, chat) = (of(None), of(Some("sql")), of(Some("chat")));
        assert!(sql.iter().zip(&base).all(|(a, b)| a != b));
        assert!(sql.iter().zip(&chat).all(|(a, b)| a != b));
        assert_eq!(of(Some("sql")), sql);
    }

    #[test]
    fn equals_what_real_vllm_published() {
        // fixtures/vllm-cpu/hash_vectors.json, first vector's first blocks.
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fixtures/vllm-cpu/hash_vectors.json"
        );
        let text = std::fs::read_to_string(path).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let vec0 = &v["vectors"][0];
        let toks: Vec<u32> = vec0["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let want: Vec<u64> = vec0["block_hashes_u64"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect();
        let bs = vec0["block_size"].as_u64().unwrap_or(32) as usize;
        assert_eq!(block_hashes(&toks, bs, &BlockExtras::default()), want);
    }
}
