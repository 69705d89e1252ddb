//! Engine-side block hashes: a chained 64-bit content hash over full blocks.
//!
//! Routers treat engine hashes as opaque (they re-hash `token_ids` from the
//! events), so the simulator only needs hashes that chain like vLLM's: block i
//! depends on block i-1's hash, its own token ids and its extra keys
//! (`cache_salt` on block 0, the LoRA name on every block). It is not vLLM's
//! `sha256_cbor` value; see the README.

/// Extra keys that change a block's identity, as vLLM's `extra_keys`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockExtras {
    pub cache_salt: Option<String>,
    pub lora_name: Option<String>,
}

const ROOT: u64 = 0x766c_6c6d_2d6e_6f6e; // "vllm-non": the chain's seed

fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn finish(mut z: u64) -> u64 {
    // splitmix64's finaliser: spreads FNV's weak high bits.
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Hash of one full block given its parent's hash (`None` for block 0).
pub fn block_hash(parent: Option<u64>, tokens: &[u32], index: usize, extras: &BlockExtras) -> u64 {
    let mut h = fnv(0xcbf2_9ce4_8422_2325, &parent.unwrap_or(ROOT).to_le_bytes());
    for t in tokens {
        h = fnv(h, &t.to_le_bytes());
    }
    if index == 0 {
        if let Some(salt) = &extras.cache_salt {
            h = fnv(fnv(h, b"\x00salt"), salt.as_bytes());
        }
    }
    if let Some(lora) = &extras.lora_name {
        h = fnv(fnv(h, b"\x00lora"), lora.as_bytes());
    }
    finish(h)
}

/// Hashes of every full block of `tokens`, chained from the root.
pub fn block_hashes(tokens: &[u32], block_size: usize, extras: &BlockExtras) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut parent = None;
    for (i, chunk) in tokens.chunks_exact(block_size.max(1)).enumerate() {
        let h = block_hash(parent, chunk, i, extras);
        out.push(h);
        parent = Some(h);
    }
    out
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
        let salted = BlockExtras { cache_salt: Some("a".into()), lora_name: None };
        let s = block_hashes(&toks, 16, &salted);
        assert!(s.iter().zip(&plain).all(|(a, b)| a != b), "salt changes every chained block");
        let mut other: Vec<u32> = toks.clone();
        other[0] = 999;
        let o = block_hashes(&other, 16, &BlockExtras::default());
        assert!(o.iter().zip(&plain).all(|(a, b)| a != b));
    }
}
