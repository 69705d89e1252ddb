#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The Hugging Face tokenizer and chat template give vLLM's own `/tokenize`
//! ids for the fixture model, and the token prefix cache never changes them.

use std::sync::OnceLock;

use kvmesh_filters::prefix::hash::VllmCborHasher;
use kvmesh_filters::prefix::tokenize::{
    CachedTokenizer, ChatInput, ChatMessage, HfTokenizer, Inexact, Json, TokenCacheConfig,
    Tokenizer,
};
use proptest::prelude::*;

fn fixtures() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn hf() -> &'static HfTokenizer {
    static TOK: OnceLock<HfTokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = fixtures().join("tiny-llama");
        let json = std::fs::read(dir.join("tokenizer.json")).unwrap();
        let cfg = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
        let tpl = std::fs::read_to_string(dir.join("chat_template.jinja")).unwrap();
        HfTokenizer::from_parts(&json, Some(&cfg), Some(&tpl)).unwrap()
    })
}

/// (request body, token ids vLLM returned) from both fixture files.
fn cases() -> Vec<(serde_json::Value, Vec<u32>)> {
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    let mut out = Vec::new();
    let hv: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("vllm-cpu/hash_vectors.json")).unwrap(),
    )
    .unwrap();
    for v in hv["vectors"].as_array().unwrap() {
        out.push((v["request"].clone(), ids(&v["token_ids"])));
    }
    let reqs =
        std::fs::read_to_string(fixtures().join("vllm-cpu/capture-1/requests.jsonl")).unwrap();
    for line in reqs.lines() {
        let r: serde_json::Value = serde_json::from_str(line).unwrap();
        if r["step"]["path"] == "/tokenize" {
            let resp: serde_json::Value =
                serde_json::from_str(r["response"].as_str().unwrap()).unwrap();
            out.push((r["step"]["body"].clone(), ids(&resp["tokens"])));
        }
    }
    out
}

fn encode_request(t: &dyn Tokenizer, body: &serde_json::Value) -> Vec<u32> {
    if let Some(prompt) = body["prompt"].as_str() {
        return t.encode(prompt, true).unwrap();
    }
    let msgs: Vec<ChatMessage> = body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| ChatMessage {
            role: m["role"].as_str().unwrap().into(),
            content: m["content"].as_str().unwrap().into(),
        })
        .collect();
    let gen = body["add_generation_prompt"].as_bool().unwrap_or(true);
    t.encode_chat(&msgs, gen).unwrap()
}

#[test]
fn ids_equal_vllm_tokenize_for_completions_and_chat() {
    let t = hf();
    assert!(t.chat_template_adds_bos());
    let cases = cases();
    let (chats, prompts) = cases.iter().fold((0, 0), |(c, p), (b, _)| {
        if b.get("messages").is_some() {
            (c + 1, p)
        } else {
            (c, p + 1)
        }
    });
    assert!(
        chats >= 4 && prompts >= 3,
        "{chats} chat, {prompts} completion cases"
    );
    for (body, want) in &cases {
        assert_eq!(
            &encode_request(t, body),
            want,
            "{}",
            &body.to_string()[..80]
        );
    }
}

#[test]
fn tokenize_then_hash_gives_the_published_block_hashes() {
    let hv: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("vllm-cpu/hash_vectors.json")).unwrap(),
    )
    .unwrap();
    for v in hv["vectors"].as_array().unwrap() {
        let ids = encode_request(hf(), &v["request"]);
        let salt = v["request"]["cache_salt"].as_str();
        let want: Vec<u64> = v["block_hashes_u64"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect();
        assert_eq!(VllmCborHasher::new(None).block_hashes(&ids, 32, salt), want);
    }
}

#[test]
fn the_prefix_cache_gives_identical_ids_and_reuses_the_shared_part() {
    let c = CachedTokenizer::new(
        hf(),
        TokenCacheConfig {
            max_bytes: 1 << 20,
            min_piece_bytes: 64,
        },
    );
    for _ in 0..2 {
        for (body, want) in &cases() {
            assert_eq!(&encode_request(&c, body), want);
        }
    }
    let s = c.stats();
    assert!(s.reused_bytes > s.tokenized_bytes / 2, "{s:?}");
    assert_eq!(hf().boundary_tokens().len(), 6);
}

fn piece() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("<|eot_id|>".to_owned()),
        Just("<|start_header_id|>".to_owned()),
        Just("<|end_header_id|>".to_owned()),
        Just("<|begin_of_text|>".to_owned()),
        Just("<|".to_owned()),
        Just("\n\n".to_owned()),
        Just(" ".to_owned()),
        Just("  ".to_owned()),
        Just("\t".to_owned()),
        "[a-zA-Z0-9 .,'!?]{0,40}",
        "\\PC{0,8}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Cutting before special tokens never changes the ids, whatever surrounds them.
    #[test]
    fn cached_ids_equal_whole_text_ids(pieces in proptest::collection::vec(piece(), 1..40), special in any::<bool>()) {
        let c = CachedTokenizer::new(hf(), TokenCacheConfig { max_bytes: 1 << 16, min_piece_bytes: 1 });
        let text: String = pieces.concat();
        let want = hf().encode(&text, special).unwrap();
        prop_assert_eq!(&c.encode(&text, special).unwrap(), &want);
        // Again, now from the cache, and a variant sharing its prefix.
        prop_assert_eq!(&c.encode(&text, special).unwrap(), &want);
        let longer = format!("{text}<|eot_id|> tail");
        prop_assert_eq!(c.encode(&longer, special).unwrap(), hf().encode(&longer, special).unwrap());
    }
}

/// The tiny-llama tokenizer with one of the fixture templates under
/// `tests/fixtures/chat-templates/` (modelled on Llama 3.1's and Qwen3's).
fn with_template(name: &str) -> HfTokenizer {
    let dir = fixtures().join("tiny-llama");
    let json = std::fs::read(dir.join("tokenizer.json")).unwrap();
    let cfg = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
    let tpl =
        std::fs::read_to_string(fixtures().join(format!("chat-templates/{name}.jinja"))).unwrap();
    HfTokenizer::from_parts(&json, Some(&cfg), Some(&tpl)).unwrap()
}

/// Every request shape of `chat-templates/shapes.json` (tools, a tool-call
/// history, `enable_thinking`, `reasoning_effort`, documents,
/// `continue_final_message`, `/v1/responses` input as a string and as items
/// with instructions) gives the ids vLLM 0.32 gave for it
/// (`vllm-tokenize.json`, captured by `capture.py` from a real server).
#[test]
fn every_request_shape_keys_as_vllm_renders_it() {
    let dir = fixtures().join("chat-templates");
    let shapes: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("shapes.json")).unwrap()).unwrap();
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("vllm-tokenize.json")).unwrap())
            .unwrap();
    let qwen = with_template("qwen3-tools");
    let llama = with_template("llama31-tools");
    // Read with `Json`, which keeps the key order `tojson` prints (serde_json sorts).
    let ordered = Json::parse(&std::fs::read_to_string(dir.join("shapes.json")).unwrap()).unwrap();
    let mut checked = 0;
    for (s, o) in shapes
        .as_array()
        .unwrap()
        .iter()
        .zip(ordered.as_array().unwrap())
    {
        let template = s["template"].as_str().unwrap();
        let key = format!("{template}/{}", s["name"].as_str().unwrap());
        let t = if template == "qwen3-tools" {
            &qwen
        } else {
            &llama
        };
        let body = o.get("body").unwrap();
        let input = if s["kind"] == "responses" {
            ChatInput::from_responses_body(body)
        } else {
            ChatInput::from_chat_body(body)
        };
        if s["refused"] == true {
            // vLLM answers 400: kvmesh must not claim exact keys either.
            assert!(want[&key]["refused"].is_string(), "{key}: vLLM accepted it");
            assert_eq!(input.unwrap_err(), Inexact::Unsupported, "{key}");
            checked += 1;
            continue;
        }
        let input = input.unwrap_or_else(|e| panic!("{key}: not keyed exactly: {e:?}"));
        let ours = t
            .encode_chat_input(&input)
            .unwrap_or_else(|e| panic!("{key}: {e}"));
        let reference = match s["same_as"].as_str() {
            Some(other) => format!("{template}/{other}"),
            None => key.clone(),
        };
        let theirs: Vec<u32> = want[&reference]
            .as_array()
            .unwrap_or_else(|| panic!("{reference}: not captured"))
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            ours,
            theirs,
            "{key}: ids differ from vLLM's\n ours as text: {:?}",
            t.render_chat_input(&input).unwrap()
        );
        checked += 1;
    }
    assert_eq!(checked, shapes.as_array().unwrap().len());
    assert!(checked >= 20, "{checked}");
}

/// The plain shape through the rich path equals the messages-only path, so a
/// request that gains no field keeps its keys.
#[test]
fn plain_chat_through_either_path_is_the_same() {
    let t = with_template("qwen3-tools");
    let body = Json::parse(
        r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"u"}]}"#,
    )
    .unwrap();
    let input = ChatInput::from_chat_body(&body).unwrap();
    let msgs = input.flat();
    assert_eq!(
        t.encode_chat_input(&input).unwrap(),
        t.encode_chat(&msgs, true).unwrap()
    );
}

/// Shapes that cannot be keyed exactly say why.
#[test]
fn unkeyable_shapes_name_their_reason() {
    let reason = |body: &str, responses: bool| {
        let b = Json::parse(body).unwrap();
        if responses {
            ChatInput::from_responses_body(&b).unwrap_err()
        } else {
            ChatInput::from_chat_body(&b).unwrap_err()
        }
    };
    let image = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}}]}]}"#;
    assert_eq!(reason(image, false), Inexact::Multimodal);
    let both = r#"{"messages":[{"role":"user","content":"a"}],"add_generation_prompt":true,"continue_final_message":true}"#;
    assert_eq!(reason(both, false), Inexact::Unsupported);
    let own = r#"{"messages":[{"role":"user","content":"a"}],"chat_template":"{{ 1 }}"}"#;
    assert_eq!(reason(own, false), Inexact::Unsupported);
    let prev = r#"{"input":"a","previous_response_id":"resp_1"}"#;
    assert_eq!(reason(prev, true), Inexact::PreviousResponse);
    let search = r#"{"input":[{"type":"web_search_call","id":"w"}]}"#;
    assert_eq!(reason(search, true), Inexact::ResponsesItem);
    let audio =
        r#"{"input":[{"role":"user","content":[{"type":"input_audio","input_audio":{}}]}]}"#;
    assert_eq!(reason(audio, true), Inexact::Multimodal);
    // A template that rejects the request fails to render; the caller keys it approximately.
    let t = with_template("llama31-tools");
    let two_calls = Json::parse(r#"{"messages":[{"role":"user","content":"a"},{"role":"assistant","tool_calls":[{"id":"1","function":{"name":"f","arguments":"{}"}},{"id":"2","function":{"name":"g","arguments":"{}"}}]}],"tools":[{"type":"function","function":{"name":"f"}}]}"#).unwrap();
    let input = ChatInput::from_chat_body(&two_calls).unwrap();
    assert!(t.render_chat_input(&input).is_err());
}

/// Any JSON value, a few levels deep (object keys from the fields the
/// template input reads, so that they are hit).
fn any_json() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::Bool),
        any::<i64>().prop_map(|n| serde_json::json!(n)),
        "[a-z {}\"]{0,12}".prop_map(serde_json::Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
            proptest::collection::vec(
                (
                    prop_oneof![
                        Just("role"),
                        Just("content"),
                        Just("tool_calls"),
                        Just("function"),
                        Just("arguments"),
                        Just("name"),
                        Just("type"),
                        Just("text"),
                        Just("tools"),
                        Just("documents"),
                        Just("chat_template_kwargs"),
                        Just("messages"),
                        Just("input"),
                        Just("instructions"),
                        Just("output"),
                        Just("call_id"),
                        Just("status"),
                        Just("reasoning"),
                        Just("tool_call_id"),
                        Just("continue_final_message"),
                        Just("add_generation_prompt"),
                    ],
                    inner,
                ),
                0..5
            )
            .prop_map(|kv| serde_json::Value::Object(
                kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
            )),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Whatever a chat or Responses body holds, building its template input
    /// and rendering it with either fixture template answers (ids or an
    /// error the caller keys approximately), never panics.
    #[test]
    fn any_body_renders_or_errs(v in any_json(), roles in proptest::collection::vec(prop_oneof![Just("user"), Just("assistant"), Just("tool"), Just("system"), Just("developer")], 1..4)) {
        static TEMPLATES: OnceLock<[HfTokenizer; 2]> = OnceLock::new();
        let ts = TEMPLATES.get_or_init(|| [with_template("qwen3-tools"), with_template("llama31-tools")]);
        let messages: Vec<serde_json::Value> = roles
            .iter()
            .map(|r| serde_json::json!({"role": r, "content": "x", "tool_calls": v.clone(), "tool_call_id": v.clone()}))
            .collect();
        let bodies = [
            serde_json::json!({"messages": messages, "tools": v.clone(), "documents": v.clone(), "chat_template_kwargs": v.clone()}),
            serde_json::json!({"input": v.clone(), "instructions": "i", "tools": v.clone()}),
            v.clone(),
        ];
        for b in bodies {
            let j = Json::parse(&b.to_string()).unwrap();
            for input in [ChatInput::from_chat_body(&j), ChatInput::from_responses_body(&j)].into_iter().flatten() {
                for t in ts {
                    let _ = t.encode_chat_input(&input);
                }
            }
        }
    }
}
