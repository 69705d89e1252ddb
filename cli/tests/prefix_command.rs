//! `kvmesh prefix` against what a real vLLM 0.32 published: the token
//! ids of its `/tokenize` and the block hashes of its `BlockStored` events
//! (`tests/fixtures/vllm-cpu/hash_vectors.json`, `sha256_cbor`, block size
//! 32), with the repo's `tests/fixtures/tiny-llama` tokenizer.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn run(args: &[&str], body: &[u8]) -> (i32, serde_json::Value, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .arg("prefix")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(body).unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let v = serde_json::from_str(&stdout).unwrap_or(serde_json::Value::Null);
    (
        out.status.code().unwrap_or(-1),
        v,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn vllm_mode_reproduces_the_published_hashes() {
    let vectors_path = repo().join("tests/fixtures/vllm-cpu/hash_vectors.json");
    let text = std::fs::read_to_string(&vectors_path)
        .unwrap_or_else(|e| panic!("{}: {e}", vectors_path.display()));
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let tok = repo().join("tests/fixtures/tiny-llama");
    let vectors = doc["vectors"].as_array().unwrap();
    assert!(vectors.len() >= 4);
    let mut salted = 0;
    for v in vectors {
        let name = v["name"].as_str().unwrap();
        let block_size = v["block_size"].to_string();
        let body = serde_json::to_vec(&v["request"]).unwrap();
        let (code, out, err) = run(
            &[
                "--tokenizer",
                tok.to_str().unwrap(),
                "--block-size",
                &block_size,
                "--hash",
                "vllm-sha256-cbor",
            ],
            &body,
        );
        assert_eq!(code, 0, "{name}: {err}");
        assert_eq!(out["token_ids"], v["token_ids"], "{name}: token ids");
        assert_eq!(
            out["block_hashes"], v["block_hashes_u64"],
            "{name}: block hashes"
        );
        if v["request"].get("cache_salt").is_some() {
            salted += 1;
        }
    }
    assert!(salted >= 1, "a salted vector is checked");
}

#[test]
fn local_mode_keys_depend_on_model_and_seed_and_bad_input_fails() {
    let body =
        br#"{"model":"m","prompt":"alpha beta gamma delta epsilon zeta eta theta iota kappa"}"#;
    let args = ["--tokenizer", "builtin", "--block-size", "4"];
    let (code, a, _) = run(&args, body);
    assert_eq!(code, 0);
    let n_tokens = a["token_ids"].as_array().unwrap().len();
    assert_eq!(a["block_hashes"].as_array().unwrap().len(), n_tokens / 4);
    let (_, b, _) = run(&[&args[..], &["--model", "other"]].concat(), body);
    assert_eq!(a["token_ids"], b["token_ids"]);
    assert_ne!(a["block_hashes"], b["block_hashes"]);
    let (_, c, _) = run(&[&args[..], &["--hash-seed", "7"]].concat(), body);
    assert_ne!(a["block_hashes"], c["block_hashes"]);
    let (code, _, err) = run(&args, b"{not json");
    assert_eq!(code, 2);
    assert!(err.contains("not a valid request"), "{err}");
}
