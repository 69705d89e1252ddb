//! Block keys: the chained content hashes that name a cached prefix.
//!
//! Two recipes live here:
//!
//! * [`LocalHasher`], kvmesh's own key (docs/wire-formats.md §2.4, option A):
//!   per full block of `block_size` tokens, `key_i = xxh3_64(parent_key as LE
//!   u64 ‖ the block's tokens as LE u32)`. The chain starts from a root derived
//!   from the hash seed and the model (or LoRA) name, and a request's
//!   `cache_salt` is mixed into the parent of block 0 only, so it changes every
//!   key after it, exactly as vLLM's chaining does. Partial tail blocks are
//!   never hashed. It is on the hot path, so it costs one xxh3 call per block
//!   and one allocation per call.
//! * [`VllmCborHasher`], vLLM's own `sha256_cbor` chain (docs/wire-formats.md
//!   §2.2, checked against the digests a real vLLM 0.32 published): root =
//!   SHA-256 of the canonical CBOR text string of the seed (`PYTHONHASHSEED`,
//!   else `vllm-none-hash`), block = SHA-256 of canonical CBOR `[parent digest
//!   (bstr 32), [token ids], extra_keys | null]`, where block 0 of a salted
//!   request carries `[["cache_salt", SALT]]`; the published u64 is the
//!   digest's last 8 bytes read big-endian. Use it only to reproduce what an
//!   engine publishes (the `prefix` debugging command, direct matching): the
//!   local key never depends on the engine's recipe.

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_64;

/// A block key: a 64-bit chained content hash.
pub type BlockKey = u64;

/// The seed vLLM uses for its root hash when `PYTHONHASHSEED` is unset in
/// `sha256_cbor` mode (observed in vLLM 0.32).
pub const VLLM_NONE_HASH_SEED: &str = "vllm-none-hash";

/// Domain tags keep a salt that happens to equal a model name from colliding.
const ROOT_TAG: &[u8] = b"kvmesh-root-v1\0";
const SALT_TAG: &[u8] = b"\0cache_salt\0";

/// kvmesh's local chained block hash (option A). Cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalHasher {
    seed: String,
}

impl Default for LocalHasher {
    fn default() -> Self {
        Self::new("")
    }
}

impl LocalHasher {
    /// A hasher whose keys depend on `hash_seed` (all routers of one mesh must
    /// use the same seed; it need not match the engine's).
    pub fn new(hash_seed: &str) -> Self {
        Self {
            seed: hash_seed.to_owned(),
        }
    }

    /// The parent key of block 0 for `model` (or the LoRA name when the request
    /// names an adapter), with `cache_salt` mixed in when present.
    pub fn root(&self, model: &str, cache_salt: Option<&str>) -> BlockKey {
        let mut buf = Vec::with_capacity(
            ROOT_TAG.len() + self.seed.len() + model.len() + 1 + SALT_TAG.len() + 64,
        );
        buf.extend_from_slice(ROOT_TAG);
        buf.extend_from_slice(self.seed.as_bytes());
        buf.push(0);
        buf.extend_from_slice(model.as_bytes());
        let root = xxh3_64(&buf);
        match cache_salt {
            None => root,
            Some(salt) => {
                buf.clear();
                buf.extend_from_slice(&root.to_le_bytes());
                buf.extend_from_slice(SALT_TAG);
                buf.extend_from_slice(salt.as_bytes());
                xxh3_64(&buf)
            }
        }
    }

    /// Keys of every full block of `tokens` for `model`.
    pub fn block_keys(
        &self,
        model: &str,
        cache_salt: Option<&str>,
        tokens: &[u32],
        block_size: usize,
    ) -> Vec<BlockKey> {
        let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
        extend_keys(self.root(model, cache_salt), tokens, block_size, &mut out);
        out
    }
}

/// The key of one block given its parent's key (`parent` is the root for block 0).
pub fn chain_key(parent: BlockKey, block: &[u32]) -> BlockKey {
    let mut buf = Vec::with_capacity(8 + 4 * block.len());
    chain_into(parent, block, &mut buf)
}

/// Appends the keys of every full block of `tokens`, chained from `parent`, to
/// `out`, and returns the last key (or `parent` when there is no full block).
/// `block_size` 0 hashes nothing.
pub fn extend_keys(
    parent: BlockKey,
    tokens: &[u32],
    block_size: usize,
    out: &mut Vec<BlockKey>,
) -> BlockKey {
    if block_size == 0 {
        return parent;
    }
    let mut buf = Vec::with_capacity(8 + 4 * block_size);
    let mut key = parent;
    for block in tokens.chunks_exact(block_size) {
        key = chain_into(key, block, &mut buf);
        out.push(key);
    }
    key
}

fn chain_into(parent: BlockKey, block: &[u32], buf: &mut Vec<u8>) -> BlockKey {
    buf.clear();
    buf.extend_from_slice(&parent.to_le_bytes());
    for t in block {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64(buf)
}

/// The u64 vLLM publishes for a digest: its last 8 bytes read big-endian
/// (shorter inputs are left-padded with zeros).
pub fn digest_to_u64(digest: &[u8]) -> u64 {
    let tail = &digest[digest.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
}

/// vLLM's `sha256_cbor` block hash chain, byte for byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmCborHasher {
    root: [u8; 32],
}

impl VllmCborHasher {
    /// The chain vLLM builds with `PYTHONHASHSEED` set to `python_hash_seed`
    /// (`None`: unset, which vLLM 0.32 treats as the seed `vllm-none-hash`).
    pub fn new(python_hash_seed: Option<&str>) -> Self {
        let seed = python_hash_seed.unwrap_or(VLLM_NONE_HASH_SEED);
        let mut cbor = Vec::with_capacity(seed.len() + 9);
        cbor::text(&mut cbor, seed);
        Self {
            root: Sha256::digest(&cbor).into(),
        }
    }

    /// The root digest (vLLM's `NONE_HASH`).
    pub fn root_digest(&self) -> [u8; 32] {
        self.root
    }

    /// Full digests of every full block of `tokens`.
    pub fn block_digests(
        &self,
        tokens: &[u32],
        block_size: usize,
        cache_salt: Option<&str>,
    ) -> Vec<[u8; 32]> {
        if block_size == 0 {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(tokens.len() / block_size);
        let mut buf = Vec::with_capacity(64 + 5 * block_size);
        let mut parent = self.root;
        for (i, block) in tokens.chunks_exact(block_size).enumerate() {
            buf.clear();
            cbor::array_header(&mut buf, 3);
            cbor::bytes(&mut buf, &parent);
            cbor::array_header(&mut buf, block.len() as u64);
            for &t in block {
                cbor::uint(&mut buf, u64::from(t));
            }
            match cache_salt {
                // vLLM's extra keys for a salted block 0: a tuple holding one
                // tagged tuple ("cache_salt", SALT).
                Some(salt) if i == 0 => {
                    cbor::array_header(&mut buf, 1);
                    cbor::array_header(&mut buf, 2);
                    cbor::text(&mut buf, "cache_salt");
                    cbor::text(&mut buf, salt);
                }
                _ => cbor::null(&mut buf),
            }
            parent = Sha256::digest(&buf).into();
            out.push(parent);
        }
        out
    }

    /// The u64 values vLLM publishes in `BlockStored.block_hashes`.
    pub fn block_hashes(
        &self,
        tokens: &[u32],
        block_size: usize,
        cache_salt: Option<&str>,
    ) -> Vec<u64> {
        self.block_digests(tokens, block_size, cache_salt)
            .iter()
            .map(|d| digest_to_u64(d))
            .collect()
    }
}

/// The few canonical CBOR (RFC 8949 §4.2.1) items the chain needs: heads in
/// their shortest form, definite lengths only.
mod cbor {
    fn head(out: &mut Vec<u8>, major: u8, value: u64) {
        let m = major << 5;
        if value < 24 {
            out.push(m | value as u8);
        } else if value <= u64::from(u8::MAX) {
            out.push(m | 24);
            out.push(value as u8);
        } else if value <= u64::from(u16::MAX) {
            out.push(m | 25);
            out.extend_from_slice(&(value as u16).to_be_bytes());
        } else if value <= u64::from(u32::MAX) {
            out.push(m | 26);
            out.extend_from_slice(&(value as u32).to_be_bytes());
        } else {
            out.push(m | 27);
            out.extend_from_slice(&value.to_be_bytes());
        }
    }

    pub(super) fn uint(out: &mut Vec<u8>, v: u64) {
        head(out, 0, v);
    }

    pub(super) fn bytes(out: &mut Vec<u8>, b: &[u8]) {
        head(out, 2, b.len() as u64);
        out.extend_from_slice(b);
    }

    pub(super) fn text(out: &mut Vec<u8>, s: &str) {
        head(out, 3, s.len() as u64);
        out.extend_from_slice(s.as_bytes());
    }

    pub(super) fn array_header(out: &mut Vec<u8>, len: u64) {
        head(out, 4, len);
    }

    pub(super) fn null(out: &mut Vec<u8>) {
        out.push(0xf6);
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn heads_use_the_shortest_form() {
            let mut b = Vec::new();
            uint(&mut b, 23);
            uint(&mut b, 24);
            uint(&mut b, 255);
            uint(&mut b, 256);
            uint(&mut b, 65_536);
            uint(&mut b, 1 << 32);
            assert_eq!(
                b,
                [
                    0x17, 0x18, 24, 0x18, 255, 0x19, 1, 0, 0x1a, 0, 1, 0, 0, 0x1b, 0, 0, 0, 1, 0,
                    0, 0, 0
                ]
            );
            let mut t = Vec::new();
            text(&mut t, "ab");
            bytes(&mut t, &[7]);
            array_header(&mut t, 2);
            null(&mut t);
            assert_eq!(t, [0x62, b'a', b'b', 0x41, 7, 0x82, 0xf6]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_and_skip_the_partial_tail() {
        let h = LocalHasher::new("s");
        let tokens: Vec<u32> = (0..70).collect();
        let keys = h.block_keys("m", None, &tokens, 32);
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0], chain_key(h.root("m", None), &tokens[..32]));
        assert_eq!(keys[1], chain_key(keys[0], &tokens[32..64]));
        // A shared prefix gives shared leading keys.
        let mut other = tokens.clone();
        other[40] = 9_999;
        let k2 = h.block_keys("m", None, &other, 32);
        assert_eq!(k2[0], keys[0]);
        assert_ne!(k2[1], keys[1]);
    }

    #[test]
    fn model_seed_and_salt_change_every_key() {
        let tokens: Vec<u32> = (0..64).collect();
        let base = LocalHasher::new("").block_keys("m", None, &tokens, 16);
        for other in [
            LocalHasher::new("").block_keys("lora-a", None, &tokens, 16),
            LocalHasher::new("42").block_keys("m", None, &tokens, 16),
            LocalHasher::new("").block_keys("m", Some("t"), &tokens, 16),
        ] {
            assert!(base.iter().zip(&other).all(|(a, b)| a != b));
        }
        assert_eq!(
            LocalHasher::new("").block_keys("m", None, &tokens, 0),
            Vec::<u64>::new()
        );
    }

    #[test]
    fn digest_projection_is_last_eight_bytes_big_endian() {
        let mut d = [0u8; 32];
        d[24..].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(digest_to_u64(&d), 0x0102_0304_0506_0708);
        assert_eq!(digest_to_u64(&[0xab, 0xcd]), 0xabcd);
        assert_eq!(digest_to_u64(&[]), 0);
    }
}
