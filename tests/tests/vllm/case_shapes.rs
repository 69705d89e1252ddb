//! Case 8: every request shape is keyed as vLLM keys it (issue 40, item 4).
//!
//! One engine serves tiny-llama with the Qwen3-style fixture template
//! (`tests/fixtures/chat-templates/qwen3-tools.jinja`), takes per-request templates
//! (`--trust-request-chat-template`, for the Llama-3.1-style shapes) and tool choice `auto`
//! (`--enable-auto-tool-choice --tool-call-parser hermes`). For each shape of `shapes.json`
//! (tools, a tool-call history, `enable_thinking: false`, `reasoning_effort`, documents,
//! `continue_final_message`, `/v1/responses` with a string input and with items and instructions):
//!
//! * the token ids kvmesh computes (the body read into a `ChatInput`, rendered and encoded as the
//!   sidecar does) equal the prompt ids vLLM itself used for the real request (`return_token_ids`
//!   on chat completions, `enable_response_messages` on `/v1/responses`);
//! * for chat shapes they also equal vLLM's `/tokenize` given the same fields, and for every
//!   shape, `/tokenize` given the body a sidecar with `tokenizer: engine` sends;
//! * the blocks vLLM reported for the request (read back from its replay socket) carry the
//!   `sha256_cbor` hashes of kvmesh's ids and exactly their tokens;
//! * a shape vLLM refuses (tool-call arguments as an object) is refused by vLLM and not claimed
//!   as exact by kvmesh.
//!
//! Then through a sidecar (KV events, the same template in its model directory): a `/v1/responses`
//! request is tokenized by the prefix stage and routed, the sidecar's index holds its blocks
//! under the keys kvmesh computes for that body, and `/debug/route` for the same body finds the
//! local pod holding all of them; an image and a `previous_response_id` are counted in
//! `kvmesh_prefix_inexact_keys_total` by reason.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use kvmesh_filters::prefix::hash::VllmCborHasher;
use kvmesh_filters::prefix::tokenize::{ChatInput, HfTokenizer, Json, Tokenizer};

use super::case_mesh::reported;
use super::engine::Engine;
use super::http::Http;
use super::report::note;
use super::sidecar::SidecarUnderTest;
use super::{model_dir, repo_root, BLOCK_SIZE, MODEL};

/// The template the engine serves by default.
pub const SERVED: &str = "qwen3-tools";

/// How long the sidecar's index may take to show what the engine published.
const SYNC_DEADLINE: Duration = Duration::from_secs(45);

/// One request shape of `shapes.json`.
pub struct Shape {
    pub name: String,
    pub template: String,
    pub responses: bool,
    /// The body, keys in the file's order.
    pub body: Json,
    /// vLLM answers it with 400.
    pub refused: bool,
}

impl Shape {
    fn key(&self) -> String {
        format!("{}/{}", self.template, self.name)
    }
}

fn templates() -> PathBuf {
    repo_root().join("tests/fixtures/chat-templates")
}

/// The `vllm serve` flags of the group.
pub fn engine_args() -> Vec<String> {
    let served = templates().join(format!("{SERVED}.jinja"));
    [
        "--chat-template",
        &served.display().to_string(),
        "--trust-request-chat-template",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// A model directory for the sidecar: tiny-llama's tokenizer with the served template.
pub fn sidecar_model_dir(work: &Path) -> Result<PathBuf> {
    let dir = work.join("tiny-llama-qwen3-template");
    std::fs::create_dir_all(&dir)?;
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(model_dir().join(f), dir.join(f)).with_context(|| format!("copying {f}"))?;
    }
    std::fs::copy(
        templates().join(format!("{SERVED}.jinja")),
        dir.join("chat_template.jinja"),
    )?;
    Ok(dir)
}

/// `proxy.yaml` of the sidecar: KV events from `engine` on `events` (the sidecar binds it) and
/// the model directory `dir`.
pub fn sidecar_yaml(engine: &Engine, events: &str, dir: &Path) -> Result<String> {
    let replay = engine
        .replay_endpoint
        .as_deref()
        .context("the engine publishes no KV events")?;
    Ok(format!(
        "engine:\n  url: {url}\n  kind: vllm\n  health_interval: 200ms\n  kv_events:\n    endpoint: {events}\n    \
         replay_endpoint: {replay}\n    topic: \"{topic}\"\n    socket: bind\n    replay_timeout: 5s\n\
         pod:\n  models: [{MODEL}]\n\
         prefix:\n  tokenizer: {dir}\n  block_size: {BLOCK_SIZE}\n\
         logging:\n  level: warn\n",
        url = engine.base_url,
        topic = engine.topic,
        dir = dir.display(),
    ))
}

/// Every shape of `shapes.json`.
pub fn shapes() -> Result<Vec<Shape>> {
    let text = std::fs::read_to_string(templates().join("shapes.json"))?;
    let all = Json::parse(&text)?;
    let mut out = Vec::new();
    for s in all.as_array().context("shapes.json: not a list")? {
        let field = |k: &str| {
            s.get(k)
                .and_then(Json::as_str)
                .map(str::to_owned)
                .with_context(|| format!("shapes.json: no {k}"))
        };
        out.push(Shape {
            name: field("name")?,
            template: field("template")?,
            responses: field("kind")? == "responses",
            body: s.get("body").cloned().context("shapes.json: no body")?,
            refused: s.get("refused") == Some(&Json::Bool(true)),
        });
    }
    Ok(out)
}

/// tiny-llama's tokenizer with fixture template `name`, as the sidecar loads a model directory.
pub fn tokenizer(name: &str) -> Result<HfTokenizer> {
    let dir = model_dir();
    let json = std::fs::read(dir.join("tokenizer.json"))?;
    let config = std::fs::read_to_string(dir.join("tokenizer_config.json"))?;
    let template = std::fs::read_to_string(templates().join(format!("{name}.jinja")))?;
    Ok(HfTokenizer::from_parts(
        &json,
        Some(&config),
        Some(&template),
    )?)
}

/// The template input kvmesh reads from a shape's body.
fn input(
    shape: &Shape,
) -> std::result::Result<ChatInput, kvmesh_filters::prefix::tokenize::Inexact> {
    if shape.responses {
        ChatInput::from_responses_body(&shape.body)
    } else {
        ChatInput::from_chat_body(&shape.body)
    }
}

/// kvmesh's ids for a shape.
pub fn ours(tokenizer: &HfTokenizer, shape: &Shape) -> Result<Vec<u32>> {
    let input =
        input(shape).map_err(|r| anyhow::anyhow!("{}: not keyed exactly: {r:?}", shape.key()))?;
    Ok(tokenizer.encode_chat_input(&input)?)
}

/// `body` with `extra` fields appended, as JSON bytes in order.
fn with(body: &Json, extra: Vec<(&str, Json)>) -> Result<Vec<u8>> {
    let mut fields = body.as_object().context("body is not an object")?.to_vec();
    fields.extend(extra.into_iter().map(|(k, v)| (k.to_owned(), v)));
    Ok(serde_json::to_vec(&Json::Object(fields))?)
}

fn num(n: u64) -> Json {
    Json::Number(n.into())
}

fn ids(v: &serde_json::Value, what: &str) -> Result<Vec<u32>> {
    v.as_array()
        .with_context(|| format!("no {what} in the reply"))?
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .context("token id")
        })
        .collect()
}

/// The real request of a shape, sent to vLLM: its status and body.
async fn real_request(http: &Http, engine: &Engine, shape: &Shape) -> Result<super::http::Reply> {
    let mut extra = vec![("model", Json::from(MODEL))];
    let path = if shape.responses {
        extra.push(("max_output_tokens", num(1)));
        extra.push(("enable_response_messages", Json::Bool(true)));
        "/v1/responses"
    } else {
        extra.push(("max_tokens", num(1)));
        extra.push(("return_token_ids", Json::Bool(true)));
        if shape.template != SERVED {
            let src =
                std::fs::read_to_string(templates().join(format!("{}.jinja", shape.template)))?;
            extra.push(("chat_template", Json::String(src)));
        }
        "/v1/chat/completions"
    };
    extra.push(("temperature", num(0)));
    http.post_bytes(
        &format!("{}{path}", engine.base_url),
        with(&shape.body, extra)?,
    )
    .await
}

/// The prompt ids vLLM used for the real request.
pub async fn theirs(http: &Http, engine: &Engine, shape: &Shape) -> Result<Vec<u32>> {
    let reply = real_request(http, engine, shape).await?.json()?;
    if shape.responses {
        ids(
            &reply["input_messages"][0]["tokens"],
            "input_messages[0].tokens",
        )
    } else {
        ids(&reply["prompt_token_ids"], "prompt_token_ids")
    }
}

/// vLLM's `/tokenize` for a chat shape, given the same fields. It has no `documents`,
/// `reasoning_effort` or `tool_choice` field: the first two travel as `chat_template_kwargs`,
/// as the chat path passes them; `tool_choice` changes nothing.
pub async fn tokenize(http: &Http, engine: &Engine, shape: &Shape) -> Result<Vec<u32>> {
    let b = &shape.body;
    let mut kwargs: Vec<(String, Json)> = b
        .field("chat_template_kwargs")
        .and_then(Json::as_object)
        .map(<[_]>::to_vec)
        .unwrap_or_default();
    if let Some(d) = b.field("documents") {
        kwargs.push(("documents".into(), d.clone()));
    }
    if let Some(e) = b.field("reasoning_effort") {
        kwargs.push(("reasoning_effort".into(), e.clone()));
        if !kwargs.iter().any(|(k, _)| k == "enable_thinking") {
            kwargs.push((
                "enable_thinking".into(),
                Json::Bool(e.as_str() != Some("none")),
            ));
        }
    }
    let mut body = vec![
        ("model".to_owned(), Json::from(MODEL)),
        (
            "messages".to_owned(),
            b.get("messages").cloned().unwrap_or_default(),
        ),
    ];
    for k in ["tools", "add_generation_prompt", "continue_final_message"] {
        if let Some(v) = b.field(k) {
            body.push((k.to_owned(), v.clone()));
        }
    }
    if !kwargs.is_empty() {
        body.push(("chat_template_kwargs".to_owned(), Json::Object(kwargs)));
    }
    if shape.template != SERVED {
        let src = std::fs::read_to_string(templates().join(format!("{}.jinja", shape.template)))?;
        body.push(("chat_template".to_owned(), Json::String(src)));
    }
    let reply = http
        .post_bytes(
            &format!("{}/tokenize", engine.base_url),
            serde_json::to_vec(&Json::Object(body))?,
        )
        .await?
        .json()?;
    ids(&reply["tokens"], "tokens")
}

/// The ids vLLM's `/tokenize` gives for the body a sidecar with `tokenizer: engine` sends it
/// (`kvmesh_proxy::prefix::tokenize::engine_chat_body`); the per-request template is added for
/// the shapes of the template the engine does not serve.
async fn engine_mode(http: &Http, engine: &Engine, shape: &Shape) -> Result<Vec<u32>> {
    let input = input(shape).map_err(|r| anyhow::anyhow!("not keyed exactly: {r:?}"))?;
    let mut body = kvmesh_proxy::prefix::tokenize::engine_chat_body(Some(MODEL), &input);
    if shape.template != SERVED {
        let src = std::fs::read_to_string(templates().join(format!("{}.jinja", shape.template)))?;
        if let Json::Object(fields) = &mut body {
            fields.push(("chat_template".to_owned(), Json::String(src)));
        }
    }
    let reply = http
        .post_bytes(
            &format!("{}/tokenize", engine.base_url),
            serde_json::to_vec(&body)?,
        )
        .await?
        .json()?;
    ids(&reply["tokens"], "tokens")
}

/// Every full block of `tokens` is among the blocks vLLM reports as held, under the hash
/// `hasher` computes, with exactly these tokens.
async fn blocks_reported(
    engine: &Engine,
    hasher: &VllmCborHasher,
    tokens: &[u32],
) -> Result<usize> {
    let want = hasher.block_hashes(tokens, BLOCK_SIZE, None);
    ensure!(!want.is_empty(), "prompt shorter than one block");
    let end = Instant::now() + Duration::from_secs(15);
    loop {
        let live = reported(engine).await?.live;
        let missing = want.iter().position(|h| !live.contains_key(h));
        match missing {
            None => {
                for (i, h) in want.iter().enumerate() {
                    let chain = &live[h];
                    ensure!(
                        chain[..] == tokens[..(i + 1) * BLOCK_SIZE],
                        "block {i}: vLLM's tokens differ from kvmesh's"
                    );
                }
                return Ok(want.len());
            }
            Some(i) if Instant::now() >= end => {
                bail!(
                    "block {i} of {} ({:016x}) not reported by vLLM",
                    want.len(),
                    want[i]
                )
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// The whole per-shape check (see the module docs); the number of shapes checked.
pub async fn every_shape(http: &Http, engine: &Engine, hasher: &VllmCborHasher) -> Result<usize> {
    let shapes = shapes()?;
    let mut tokenizers = std::collections::HashMap::new();
    for s in &shapes {
        if !tokenizers.contains_key(&s.template) {
            tokenizers.insert(s.template.clone(), tokenizer(&s.template)?);
        }
    }
    for shape in &shapes {
        let key = shape.key();
        if shape.refused {
            let reply = real_request(http, engine, shape).await?;
            ensure!(
                reply.status.as_u16() == 400,
                "{key}: vLLM answered {} (kvmesh refuses to key it exactly)",
                reply.status
            );
            ensure!(
                input(shape).is_err(),
                "{key}: kvmesh keys a request vLLM refuses"
            );
            note(&format!(
                "shapes: {key}: refused by vLLM and not keyed exactly"
            ));
            continue;
        }
        let tokenizer = &tokenizers[&shape.template];
        let ours = ours(tokenizer, shape)?;
        let theirs = theirs(http, engine, shape)
            .await
            .with_context(|| format!("{key}: the real request"))?;
        ensure!(
            ours == theirs,
            "{key}: kvmesh's ids differ from the prompt vLLM ran\n ours: {ours:?}\n vllm: {theirs:?}"
        );
        let asked = engine_mode(http, engine, shape)
            .await
            .with_context(|| format!("{key}: /tokenize as tokenizer: engine asks it"))?;
        ensure!(
            ours == asked,
            "{key}: the sidecar's /tokenize body (tokenizer: engine) gives other ids\n ours: {ours:?}\n vllm: {asked:?}"
        );
        if !shape.responses {
            let tokenized = tokenize(http, engine, shape)
                .await
                .with_context(|| format!("{key}: /tokenize"))?;
            ensure!(
                ours == tokenized,
                "{key}: kvmesh's ids differ from vLLM's /tokenize\n ours: {ours:?}\n vllm: {tokenized:?}"
            );
        }
        let blocks = blocks_reported(engine, hasher, &ours)
            .await
            .with_context(|| key.clone())?;
        note(&format!(
            "shapes: {key}: {} tokens equal vLLM's, {blocks} block hashes reported",
            ours.len()
        ));
    }
    Ok(shapes.len())
}

async fn scrape_sidecar(http: &Http, sidecar: &SidecarUnderTest) -> Result<String> {
    Ok(http
        .get(&format!("{}/metrics", sidecar.admin_url))
        .await?
        .text())
}

fn count(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    super::metrics::sum(text, name, labels).unwrap_or(0.0)
}

/// The sidecar half (see the module docs).
pub async fn through_sidecar(http: &Http, sidecar: &SidecarUnderTest) -> Result<()> {
    const INEXACT: &str = "kvmesh_prefix_inexact_keys_total";
    const TOKENIZED: &str = "kvmesh_prefix_tokenize_total";
    let shape = shapes()?
        .into_iter()
        .find(|s| s.name == "responses_input_items")
        .context("shapes.json has no responses_input_items")?;
    let ours = ours(&tokenizer(SERVED)?, &shape)?;
    let before = scrape_sidecar(http, sidecar).await?;
    let body = with(
        &shape.body,
        vec![("model", Json::from(MODEL)), ("max_output_tokens", num(1))],
    )?;
    let reply = http
        .post_bytes(&format!("{}/v1/responses", sidecar.url), body)
        .await?;
    ensure!(
        reply.status.is_success(),
        "/v1/responses through the sidecar: HTTP {}: {}",
        reply.status,
        reply.text()
    );
    let after = scrape_sidecar(http, sidecar).await?;
    ensure!(
        count(&after, TOKENIZED, &[("outcome", "ok")])
            > count(&before, TOKENIZED, &[("outcome", "ok")]),
        "the prefix stage did not tokenize the /v1/responses request"
    );
    ensure!(
        count(&after, INEXACT, &[]) == count(&before, INEXACT, &[]),
        "the /v1/responses request was keyed approximately"
    );
    ensure!(
        count(&after, "kvmesh_routing_decisions_total", &[])
            > count(&before, "kvmesh_routing_decisions_total", &[]),
        "the /v1/responses request was not scheduled"
    );
    // The engine's events for that request land under the keys kvmesh computes for its body.
    let prefix = sidecar.handle().prefix();
    let keys = prefix.index().request_keys(MODEL, None, &ours, BLOCK_SIZE);
    let (local, _) = prefix.local_pod();
    let end = Instant::now() + SYNC_DEADLINE;
    loop {
        let held = prefix
            .index()
            .match_prefix(&keys)
            .iter()
            .find(|m| m.pod == local)
            .map_or(0, |m| m.blocks);
        if held == keys.len() {
            break;
        }
        if Instant::now() >= end {
            bail!(
                "the sidecar's index holds {held} of the {} blocks of the /v1/responses request",
                keys.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The decision the same body gets now sees them: `/debug/route` (which reads a body with
    // `input` as `/v1/responses`) has its keys exact and the local pod holding every block.
    let body = with(&shape.body, vec![("model", Json::from(MODEL))])?;
    let route = http
        .post_bytes(&format!("{}/debug/route", sidecar.admin_url), body)
        .await?
        .json()?;
    let request = &route["request"];
    ensure!(
        request["prompt_tokens_exact"] == true
            && request["prompt_tokens"].as_u64() == Some(ours.len() as u64)
            && request["block_keys"].as_array().map(Vec::len) == Some(keys.len()),
        "/debug/route keyed the /v1/responses body otherwise: {request}"
    );
    let matched: Vec<u64> = route["endpoints"]
        .as_array()
        .context("no endpoints in /debug/route")?
        .iter()
        .filter_map(|e| e["prefix"]["matched_blocks"].as_u64())
        .collect();
    ensure!(
        matched.contains(&(keys.len() as u64)),
        "/debug/route: no endpoint holds all {} blocks: {matched:?}",
        keys.len()
    );
    // Shapes that cannot be keyed exactly are routed all the same and counted by reason.
    let image = br#"{"model":"tiny-llama","max_tokens":1,"messages":[{"role":"user","content":[{"type":"text","text":"What is in it?"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}"#;
    let previous = br#"{"model":"tiny-llama","max_output_tokens":1,"input":"and then?","previous_response_id":"resp_kvmesh_unknown"}"#;
    for (path, body, reason) in [
        ("/v1/chat/completions", &image[..], "multimodal"),
        ("/v1/responses", &previous[..], "previous_response"),
    ] {
        let before = count(
            &scrape_sidecar(http, sidecar).await?,
            INEXACT,
            &[("reason", reason)],
        );
        // vLLM refuses both (a text-only model; an unknown response id): the answer is its own.
        let reply = http
            .post_bytes(&format!("{}{path}", sidecar.url), body.to_vec())
            .await?;
        ensure!(
            reply.status.is_client_error(),
            "{path} ({reason}): HTTP {}, want vLLM's 4xx",
            reply.status
        );
        let after = count(
            &scrape_sidecar(http, sidecar).await?,
            INEXACT,
            &[("reason", reason)],
        );
        ensure!(
            after == before + 1.0,
            "{reason}: counted {before} -> {after}"
        );
    }
    note(&format!(
        "shapes: /v1/responses through the sidecar: tokenized, scheduled, its {} blocks indexed under kvmesh's keys; image and previous_response_id counted as inexact",
        keys.len()
    ));
    Ok(())
}
