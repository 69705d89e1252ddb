#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Every vector vLLM 0.32 published (hash_vectors.json) reproduces exactly.

use kvmesh_filters::prefix::hash::{digest_to_u64, VllmCborHasher, VLLM_NONE_HASH_SEED};

const VECTORS: &str = "../tests/fixtures/vllm-cpu/hash_vectors.json";

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn vectors() -> Vec<serde_json::Value> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(VECTORS);
    let text = std::fs::read_to_string(&path).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["vectors"].as_array().unwrap().clone()
}

fn salt_of(v: &serde_json::Value) -> Option<String> {
    let ek = &v["extra_keys_block0"];
    if ek.is_null() {
        return None;
    }
    let pairs = ek.as_array().unwrap();
    assert_eq!(pairs.len(), 1);
    assert_eq!(pairs[0][0], "cache_salt");
    Some(pairs[0][1].as_str().unwrap().to_owned())
}

#[test]
fn vllm_sha256_cbor_vectors_reproduce_digests_and_u64s() {
    let vs = vectors();
    assert!(vs.len() >= 4);
    let mut salted = 0;
    for v in &vs {
        assert_eq!(v["algo"], "sha256_cbor");
        let seed = v["seed"].as_str().unwrap();
        let hasher = VllmCborHasher::new((seed != VLLM_NONE_HASH_SEED).then_some(seed));
        let tokens: Vec<u32> = v["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
            .collect();
        let bs = usize::try_from(v["block_size"].as_u64().unwrap()).unwrap();
        let salt = salt_of(v);
        salted += usize::from(salt.is_some());
        let digests = hasher.block_digests(&tokens, bs, salt.as_deref());
        let want_hex: Vec<&str> = v["block_digests_hex"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_str().unwrap())
            .collect();
        let got_hex: Vec<String> = digests.iter().map(|d| hex(d)).collect();
        assert_eq!(got_hex, want_hex, "digests of {}", v["name"]);
        let want_u64: Vec<u64> = v["block_hashes_u64"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(hasher.block_hashes(&tokens, bs, salt.as_deref()), want_u64);
        assert_eq!(
            digests.len(),
            tokens.len() / bs,
            "partial tail is not hashed"
        );
        assert!(digests
            .iter()
            .zip(&want_u64)
            .all(|(d, &u)| digest_to_u64(d) == u));
    }
    assert!(salted >= 1, "the salted case is covered");
}

#[test]
fn a_set_seed_changes_the_root() {
    let unset = VllmCborHasher::new(None);
    assert_eq!(unset, VllmCborHasher::new(Some(VLLM_NONE_HASH_SEED)));
    assert_ne!(
        unset.root_digest(),
        VllmCborHasher::new(Some("42")).root_digest()
    );
}
