//! `kvmesh prefix`: what the sidecar (or the engine) computes for one
//! request body, for when a request lands somewhere unexpected.
//!
//! Reads an OpenAI request body on stdin and prints
//! `{"token_ids": [...], "block_hashes": [...]}`. `--hash local` gives the
//! sidecar's own block keys (what its index matches); `--hash
//! vllm-sha256-cbor` gives exactly the u64 values vLLM publishes in its
//! `BlockStored` events when it runs with `--prefix-caching-hash-algo
//! sha256_cbor` (with `--hash-seed` = its `PYTHONHASHSEED`, if set), the
//! body's `cache_salt` included.

use std::io::Read;
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use kvmesh_filters::prefix::hash::{LocalHasher, VllmCborHasher};

use kvmesh_proxy::path::view::Shape;
use kvmesh_proxy::path::RequestView;
use kvmesh_proxy::prefix::LocalTokenizer;

/// Largest body read from stdin.
const MAX_BODY: u64 = 64 * 1024 * 1024;

/// Arguments of `kvmesh prefix`.
#[derive(Debug, Clone, Args)]
pub struct PrefixArgs {
    /// `builtin` (the simulator's tokenizer) or a Hugging Face model directory.
    #[arg(long, value_name = "DIR|builtin")]
    pub tokenizer: String,
    /// Treat the body as a chat request (default: chat when it has `messages`).
    #[arg(long)]
    pub chat: bool,
    /// Tokens per KV block (the engine's `--block-size`).
    #[arg(long, value_name = "N")]
    pub block_size: usize,
    /// Which block hash to print.
    #[arg(long, value_enum, default_value_t = HashKind::Local)]
    pub hash: HashKind,
    /// `local`: the mesh's `prefix.hash_seed`; `vllm-sha256-cbor`: the
    /// engine's `PYTHONHASHSEED` (unset: vLLM's `vllm-none-hash`).
    #[arg(long, value_name = "S")]
    pub hash_seed: Option<String>,
    /// The model (or LoRA) name local keys are seeded by (default: the body's `model`).
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
}

/// The block hash recipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HashKind {
    /// kvmesh's chained xxh3 key.
    Local,
    /// vLLM's `sha256_cbor`, as published in its KV events.
    VllmSha256Cbor,
}

/// Why the command failed.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("--tokenizer: {0}")]
    Tokenizer(#[from] kvmesh_proxy::prefix::PrefixError),
    #[error("--block-size must be at least 1")]
    BlockSize,
    #[error("the body is not a valid request: {0}")]
    Body(#[from] serde_json::Error),
    #[error("the body has no prompt or messages to tokenize")]
    NoPrompt,
    #[error("reading stdin: {0}")]
    Stdin(#[from] std::io::Error),
}

/// Token ids and block hashes of `body`.
pub fn compute(args: &PrefixArgs, body: &[u8]) -> Result<serde_json::Value, CommandError> {
    if args.block_size == 0 {
        return Err(CommandError::BlockSize);
    }
    let tok = match args.tokenizer.as_str() {
        "builtin" => LocalTokenizer::builtin(1 << 20),
        dir => LocalTokenizer::from_dir(std::path::Path::new(dir), 1 << 20)?,
    };
    let raw: serde_json::Value = serde_json::from_slice(body)?;
    let chat = args.chat || raw.get("messages").is_some();
    // A body with `input` and no `prompt` is a `/v1/responses` request.
    let responses = !chat && raw.get("input").is_some() && raw.get("prompt").is_none();
    let shape = match (chat, responses) {
        (true, _) => Shape::Chat,
        (false, true) => Shape::Responses,
        (false, false) => Shape::Completion,
    };
    let view = RequestView::parse(body, shape)?;
    let add_gen = raw
        .get("add_generation_prompt")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(true);
    // Tools, documents, template kwargs and the rest reach the template as
    // the request path renders them (`RequestView::chat`).
    let ids = match view.chat.as_deref() {
        Some(input) => tok.tokenize_chat_input(input, usize::MAX)?.ids,
        None => {
            tok.tokenize(&view.prompt, add_gen, usize::MAX)?
                .ok_or(CommandError::NoPrompt)?
                .ids
        }
    };
    let salt = view.cache_salt.as_deref();
    let hashes = match args.hash {
        HashKind::Local => {
            let model = args
                .model
                .as_deref()
                .or(view.model.as_deref())
                .unwrap_or("");
            LocalHasher::new(args.hash_seed.as_deref().unwrap_or("")).block_keys(
                model,
                salt,
                &ids,
                args.block_size,
            )
        }
        HashKind::VllmSha256Cbor => {
            VllmCborHasher::new(args.hash_seed.as_deref()).block_hashes(&ids, args.block_size, salt)
        }
    };
    Ok(serde_json::json!({ "token_ids": ids, "block_hashes": hashes }))
}

/// The subcommand: body on stdin, JSON on stdout, errors on stderr (exit 2).
pub fn main(args: &PrefixArgs) -> ExitCode {
    let mut body = Vec::new();
    let read = std::io::stdin().take(MAX_BODY).read_to_end(&mut body);
    let result = read
        .map_err(CommandError::from)
        .and_then(|_| compute(args, &body));
    match result {
        Ok(v) => {
            println!("{v}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvmesh prefix: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kvmesh_filters::prefix::tokenize::{Builtin, Tokenizer};

    fn args(hash: HashKind) -> PrefixArgs {
        PrefixArgs {
            tokenizer: "builtin".into(),
            chat: false,
            block_size: 4,
            hash,
            hash_seed: None,
            model: None,
        }
    }

    #[test]
    fn builtin_completion_with_both_recipes() {
        let body = br#"{"model":"m","prompt":"one two three four five six seven eight nine","cache_salt":"t"}"#;
        let v = compute(&args(HashKind::Local), body).unwrap();
        let ids = Builtin
            .encode("one two three four five six seven eight nine", true)
            .unwrap();
        let got: Vec<u32> = serde_json::from_value(v["token_ids"].clone()).unwrap();
        assert_eq!(got, ids);
        let keys: Vec<u64> = serde_json::from_value(v["block_hashes"].clone()).unwrap();
        assert_eq!(
            keys,
            LocalHasher::new("").block_keys("m", Some("t"), &ids, 4)
        );
        let v = compute(&args(HashKind::VllmSha256Cbor), body).unwrap();
        let hashes: Vec<u64> = serde_json::from_value(v["block_hashes"].clone()).unwrap();
        assert_eq!(
            hashes,
            VllmCborHasher::new(None).block_hashes(&ids, 4, Some("t"))
        );
        assert_eq!(hashes.len(), ids.len() / 4);
    }

    /// A chat request with tools and a `/v1/responses` request give the ids
    /// real vLLM 0.32 gave for them (the request shapes' fixtures, captured
    /// by tests/fixtures/chat-templates/capture.py): the command renders what
    /// the request path renders, not the messages alone.
    #[test]
    fn request_shapes_give_the_ids_vllm_gave() {
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
        let model = tempfile::tempdir().unwrap();
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(fixtures.join("tiny-llama").join(f), model.path().join(f)).unwrap();
        }
        std::fs::copy(
            fixtures.join("chat-templates/qwen3-tools.jinja"),
            model.path().join("chat_template.jinja"),
        )
        .unwrap();
        let read = |f: &str| -> serde_json::Value {
            serde_json::from_str(
                &std::fs::read_to_string(fixtures.join("chat-templates").join(f)).unwrap(),
            )
            .unwrap()
        };
        let (shapes, captured) = (read("shapes.json"), read("vllm-tokenize.json"));
        // The bodies as written, key order kept (a tool schema prints in it).
        let ordered = kvmesh_filters::prefix::tokenize::Json::parse(
            &std::fs::read_to_string(fixtures.join("chat-templates/shapes.json")).unwrap(),
        )
        .unwrap();
        let mut a = args(HashKind::Local);
        a.tokenizer = model.path().to_str().unwrap().to_owned();
        let mut checked = 0;
        for name in ["tools", "tool_call_history", "responses_input_items"] {
            let at = shapes.as_array().unwrap().iter().position(|s| {
                s["template"] == "qwen3-tools" && s["name"] == name && s.get("same_as").is_none()
            });
            let shape = &ordered.as_array().unwrap()[at.unwrap()];
            let body = serde_json::to_vec(shape.get("body").unwrap()).unwrap();
            let v = compute(&a, &body).unwrap();
            assert_eq!(
                v["token_ids"],
                captured[format!("qwen3-tools/{name}")],
                "qwen3-tools/{name}"
            );
            checked += 1;
        }
        assert_eq!(checked, 3);
    }

    #[test]
    fn bad_input_is_an_error() {
        assert!(matches!(
            compute(&args(HashKind::Local), b"{}"),
            Err(CommandError::NoPrompt)
        ));
        assert!(compute(&args(HashKind::Local), b"{").is_err());
        let mut a = args(HashKind::Local);
        a.block_size = 0;
        assert!(matches!(compute(&a, b"{}"), Err(CommandError::BlockSize)));
    }
}
