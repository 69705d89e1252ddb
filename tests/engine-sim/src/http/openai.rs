//! `/v1/completions` and `/v1/chat/completions`: parse the body, tokenize,
//! work out the P/D mode, hand the request to the core, and answer as vLLM
//! does (one JSON body, or SSE chunks ending in `data: [DONE]`).
//! `/v1/responses` is [`responses`], on the same steps.

pub(crate) mod responses;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kvmesh_filters::prefix::tokenize::ChatMessage;
use serde_json::Value;
use tokio::sync::mpsc;

use super::shapes::{self, Meta};
use super::{json_response, sse_response, Reply, Shared};
use crate::config::{Flavor, Role};
use crate::core::{Cmd, CoreEvent, CoreRequest, FinishReason, KvMode, Outcome};
use crate::faults::Verdict;
use crate::kv::hash::{self, BlockExtras};
use crate::pd::bootstrap::{self, Bootstrap};
use crate::pd::{self, kvagent, nixl, Half};
use crate::stats::CompletedRequest;

/// Waits for an unstreamed request's outcome; `Err` is the 500 to answer
/// when the engine failed it or stopped.
pub(super) async fn whole(
    rx: &mut mpsc::UnboundedReceiver<CoreEvent>,
    verdict: &Verdict,
) -> Result<Box<Outcome>, Reply> {
    loop {
        match rx.recv().await {
            Some(CoreEvent::Token { .. }) => continue,
            Some(CoreEvent::Finished(o)) => return Ok(o),
            Some(CoreEvent::Failed(e)) => {
                return Err(json_response(
                    500,
                    &shapes::error(500, &e.to_string(), None),
                    verdict,
                ))
            }
            None => {
                return Err(json_response(
                    500,
                    &shapes::error(500, "engine stopped", None),
                    verdict,
                ))
            }
        }
    }
}

/// A request that failed before reaching the core.
pub(crate) struct ApiError {
    pub status: u16,
    pub message: String,
    pub param: Option<&'static str>,
}

fn bad(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
    ApiError {
        status: 400,
        message: message.into(),
        param,
    }
}

fn hex16() -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    id[..16].to_string()
}

fn flatten_content(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// Chat messages of a body, content flattened to text.
pub(crate) fn messages(body: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    let msgs = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("messages must be a list", Some("messages")))?;
    Ok(msgs
        .iter()
        .map(|m| ChatMessage {
            role: m
                .get("role")
                .and_then(Value::as_str)
                .unwrap_or("user")
                .to_string(),
            content: m.get("content").map(flatten_content).unwrap_or_default(),
        })
        .collect())
}

/// Prompt token ids of a completions or chat body (as vLLM tokenizes).
pub(crate) fn prompt_tokens(
    shared: &Shared,
    body: &Value,
    chat: bool,
) -> Result<Vec<u32>, ApiError> {
    let tok = &shared.tokenizer;
    let terr = |e: kvmesh_filters::prefix::tokenize::TokenizeError| bad(e.to_string(), None);
    if chat {
        let flag = |k: &str| body.get(k).and_then(Value::as_bool);
        let gen = flag("add_generation_prompt").unwrap_or(true);
        let open = flag("continue_final_message").unwrap_or(false);
        if !open {
            return tok.encode_chat(&messages(body)?, gen).map_err(terr);
        }
        if gen {
            return Err(bad(
                "continue_final_message and add_generation_prompt cannot both be true",
                Some("continue_final_message"),
            ));
        }
        // vLLM's continuation of the last message: rendered without what
        // closes it, so the model writes on inside it.
        let text = tok.render_chat(&messages(body)?, false).map_err(terr)?;
        let text = text.strip_suffix('\n').unwrap_or(&text);
        return tok
            .encode(text, tok.chat_add_special_tokens(None))
            .map_err(terr);
    }
    let special = body
        .get("add_special_tokens")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let prompt = body
        .get("prompt")
        .ok_or_else(|| bad("prompt is required", Some("prompt")))?;
    let ids = |a: &[Value]| -> Option<Vec<u32>> {
        a.iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect()
    };
    match prompt {
        Value::String(s) => tok.encode(s, special).map_err(terr),
        Value::Array(a) if a.len() == 1 && a[0].is_string() => tok
            .encode(a[0].as_str().unwrap_or(""), special)
            .map_err(terr),
        Value::Array(a) if a.len() == 1 && a[0].is_array() => {
            ids(a[0].as_array().map_or(&[][..], Vec::as_slice))
                .ok_or_else(|| bad("prompt token ids must be integers", Some("prompt")))
        }
        Value::Array(a) if a.iter().all(Value::is_number) => {
            ids(a).ok_or_else(|| bad("prompt token ids must be integers", Some("prompt")))
        }
        Value::Array(_) => Err(bad(
            "the simulator serves one prompt per request (batched prompts are not simulated)",
            Some("prompt"),
        )),
        _ => Err(bad(
            "prompt must be a string or a list of token ids",
            Some("prompt"),
        )),
    }
}

/// Serves one inference request.
pub(crate) async fn serve(shared: Arc<Shared>, body: Bytes, chat: bool, verdict: Verdict) -> Reply {
    match prepare(&shared, &body, chat).await {
        Ok(p) => run(shared, p, verdict).await,
        Err(e) => json_response(
            e.status,
            &shapes::error(e.status, &e.message, e.param),
            &verdict,
        ),
    }
}

struct Prepared {
    meta: Meta,
    /// `return_token_ids`: the prompt's ids, to return with the output's.
    return_ids: Option<Vec<u32>>,
    req: CoreRequest,
    rx: mpsc::UnboundedReceiver<CoreEvent>,
    include_usage: bool,
    sglang: Option<SglangHalf>,
    internal_id: String,
    /// A kvagent prefill: the blocks go to this agent once computed.
    kvagent_send: Option<KvagentSend>,
}

struct KvagentSend {
    link: Arc<kvagent::Link>,
    transfer: String,
    dest: String,
}

/// This engine's half of an SGLang P/D request.
enum SglangHalf {
    /// Finish the prompt, then wait in the room for the decode half.
    Prefill(u64),
    /// Wait at the prefill engine's bootstrap endpoint, then receive the KV.
    Decode(Bootstrap),
}

async fn prepare(shared: &Shared, body: &[u8], chat: bool) -> Result<Prepared, ApiError> {
    let cfg = &shared.cfg;
    let body: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}"), None))?;
    // A loaded adapter runs as its own model (`crate::http::lora`).
    let lora_name = body
        .get("model")
        .and_then(Value::as_str)
        .filter(|m| *m != cfg.model && cfg.max_loras > 0 && shared.adapters.has(m))
        .map(str::to_owned);
    if let Some(m) = body.get("model").and_then(Value::as_str) {
        if m != cfg.model && lora_name.is_none() {
            return Err(ApiError {
                status: 404,
                message: format!("The model `{m}` does not exist."),
                param: Some("model"),
            });
        }
    }
    if body
        .get("n")
        .and_then(Value::as_u64)
        .is_some_and(|n| n != 1)
    {
        return Err(bad("the simulator serves n=1 only", Some("n")));
    }
    let prompt = prompt_tokens(shared, &body, chat)?;
    if prompt.is_empty() {
        return Err(bad("prompt is empty", Some("prompt")));
    }
    let limit = body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_u64);
    let room_left = cfg.max_model_len.saturating_sub(prompt.len());
    let (mut max_tokens, limit_reason) = match limit {
        Some(n) => (
            usize::try_from(n).unwrap_or(usize::MAX).max(1),
            FinishReason::Length,
        ),
        None => (
            cfg.default_max_tokens.min(room_left).max(1),
            FinishReason::Stop,
        ),
    };
    if prompt.len() + max_tokens > cfg.max_model_len {
        return Err(bad(
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the messages, {} in the completion). Please reduce the length of the messages or completion.",
                cfg.max_model_len, prompt.len() + max_tokens, prompt.len(), max_tokens
            ),
            None,
        ));
    }
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let return_ids = body
        .get("return_token_ids")
        .and_then(Value::as_bool)
        .unwrap_or(false)
        .then(|| prompt.clone());
    let include_usage = body
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let extras = BlockExtras {
        cache_salt: body
            .get("cache_salt")
            .and_then(Value::as_str)
            .map(str::to_string),
        lora_name: lora_name.clone(),
    };
    let hashes = hash::block_hashes(&prompt, cfg.block_size, &extras);
    let prefix = if chat { "chatcmpl-" } else { "cmpl-" };
    let id = format!("{prefix}{}", hex16());
    let internal_id = if chat {
        format!("{id}-{}", &hex16()[..8])
    } else {
        format!("{id}-0-{}", &hex16()[..8])
    };
    let mut kv = KvMode::Local;
    let mut sglang = None;
    let params = body.get("kv_transfer_params");
    let flag = |k: &str| {
        params
            .and_then(|p| p.get(k))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    };
    let mut kvagent_send = None;
    let kvagent_leg = shared
        .kvagent
        .as_ref()
        .filter(|_| cfg.flavor == Flavor::Vllm)
        .and_then(|link| Some((link.clone(), kvagent::Leg::of(params)?)));
    if let Some((link, leg)) = kvagent_leg {
        match leg {
            kvagent::Leg::Send { transfer, dest } => {
                kvagent_send = Some(KvagentSend {
                    link,
                    transfer,
                    dest,
                });
            }
            kvagent::Leg::Receive { transfer } => match link.receive(transfer.clone()).await {
                Ok(()) => kv = KvMode::ReceiveKv,
                Err(reason) => {
                    tracing::warn!(%transfer, %reason, "KV load failed: recomputing the prompt");
                    shared.metrics.lock().nixl_failed_transfers += 1;
                }
            },
        }
    } else if cfg.flavor == Flavor::Vllm && flag("do_remote_decode") && cfg.role != Role::Decode {
        kv = KvMode::HoldForDecode {
            remote_request_id: internal_id.clone(),
        };
    } else if cfg.flavor == Flavor::Vllm && flag("do_remote_prefill") {
        kv = nixl::pull(shared, params).await;
    }
    if cfg.flavor == Flavor::Sglang && cfg.role != Role::Both {
        if cfg.role == Role::Decode {
            let b = Bootstrap::from_body(&body, cfg.bootstrap_port).ok_or_else(|| {
                bad(
                    "decode server needs bootstrap_host, bootstrap_port and bootstrap_room",
                    Some("bootstrap_room"),
                )
            })?;
            sglang = Some(SglangHalf::Decode(b));
            kv = KvMode::ReceiveKv;
        } else if let Some(r) = body.get("bootstrap_room").and_then(Value::as_u64) {
            sglang = Some(SglangHalf::Prefill(r));
            max_tokens = 1;
        }
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let meta = Meta {
        id,
        created: unix_now(),
        model: lora_name.unwrap_or_else(|| cfg.model.clone()),
        fingerprint: shared.fingerprint.clone(),
        chat,
    };
    let req = CoreRequest {
        prompt,
        hashes,
        extras,
        max_tokens,
        limit_reason,
        stream,
        kv,
        arrival: Instant::now(),
        out: tx,
    };
    Ok(Prepared {
        meta,
        return_ids,
        req,
        rx,
        include_usage,
        sglang,
        internal_id,
        kvagent_send,
    })
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn run(shared: Arc<Shared>, mut p: Prepared, verdict: Verdict) -> Reply {
    let failed = |msg: &str| json_response(500, &shapes::error(500, msg, None), &verdict);
    if let Some(SglangHalf::Decode(b)) = &p.sglang {
        if let Err(msg) = bootstrap::join(&shared, b).await {
            return failed(&msg);
        }
    }
    let stream = p.req.stream;
    if shared
        .core_tx
        .try_send(Cmd::Submit(Box::new(p.req)))
        .is_err()
    {
        let e = shapes::error(503, "the engine's waiting queue is full", None);
        return json_response(503, &e, &verdict);
    }
    // SGLang's decode half streams to its client like an ordinary request;
    // the prefill half answers once, after the rendezvous below.
    if stream && !matches!(p.sglang, Some(SglangHalf::Prefill(_))) {
        return sse_response(
            stream_body(shared, p.meta, p.rx, p.include_usage, p.return_ids),
            &verdict,
        );
    }
    let outcome = match whole(&mut p.rx, &verdict).await {
        Ok(o) => o,
        Err(reply) => return reply,
    };
    if let Some(SglangHalf::Prefill(room)) = p.sglang {
        let timeout = shared.clock.real_duration(shared.cfg.bootstrap_timeout_s);
        if !pd::rendezvous(room, Half::Prefill, timeout).await {
            return failed(&bootstrap::timed_out(&shared, room));
        }
    }
    record(&shared, &p.meta.id, &outcome);
    let text: String = outcome
        .output
        .iter()
        .map(|t| shared.tokenizer.decode_token(*t))
        .collect();
    let kv_params = match (&p.kvagent_send, &outcome.held_blocks) {
        (Some(s), _) => {
            let prompt = outcome.prompt_tokens;
            let sent = s.link.send(
                s.transfer.clone(),
                s.dest.clone(),
                prompt,
                shared.cfg.block_size,
            );
            match sent.await {
                Ok(bytes) => {
                    tracing::debug!(transfer = %s.transfer, dest = %s.dest, bytes, "KV sent")
                }
                // As the connector: the decode engine waits, then recomputes.
                Err(reason) => tracing::warn!(transfer = %s.transfer, %reason, "KV send failed"),
            }
            kvagent::prefill_params(&s.transfer, prompt)
        }
        (None, Some(ids)) => shapes::nixl_params(
            ids,
            &shared.engine_id,
            &p.internal_id,
            &shared.cfg.side_channel_host,
            shared.cfg.side_channel_port,
            outcome.prompt_tokens,
            outcome.cached_tokens,
        ),
        (None, None) => Value::Null,
    };
    let usage = shapes::usage(
        outcome.prompt_tokens,
        outcome.output.len(),
        outcome.cached_tokens,
    );
    let mut body = p
        .meta
        .full(&text, outcome.finish_reason.as_str(), usage, kv_params);
    if let Some(prompt) = &p.return_ids {
        shapes::with_token_ids(&mut body, p.meta.chat, &outcome.output, Some(prompt));
    }
    if stream {
        // An SGLang P/D half asked for a stream: send the whole answer as one.
        let chunks = vec![p
            .meta
            .token_chunk(&text, Some(outcome.finish_reason.as_str()), true)
            .to_string()];
        return sse_response(
            futures_util::stream::iter(
                chunks
                    .into_iter()
                    .map(|c| Ok(Bytes::from(format!("data: {c}\n\ndata: [DONE]\n\n")))),
            ),
            &verdict,
        );
    }
    json_response(200, &body, &verdict)
}

fn record(shared: &Shared, id: &str, o: &Outcome) {
    shared.recorder.completed(CompletedRequest {
        request_id: id.to_string(),
        prompt_tokens: o.prompt_tokens,
        completion_tokens: o.output.len(),
        cached_tokens: o.cached_tokens,
        external_tokens: o.external_tokens,
        queue_s: o.queue_s,
        ttft_s: o.ttft_s,
        e2e_s: o.e2e_s,
    });
}

struct StreamState {
    shared: Arc<Shared>,
    meta: Meta,
    rx: mpsc::UnboundedReceiver<CoreEvent>,
    include_usage: bool,
    /// `return_token_ids`: the prompt's ids, sent with the first token.
    return_ids: Option<Vec<u32>>,
    pending: Option<u32>,
    interval: Interval,
    started: bool,
    done: bool,
}

impl StreamState {
    /// One event's chunk: its tokens' text, with their ids (and, first, the
    /// prompt's) when the request asked for them.
    fn token_chunk(&mut self, ids: &[u32], finish: Option<&str>, fingerprint: bool) -> Value {
        let text = decode(&self.shared, ids);
        let mut chunk = self.meta.token_chunk(&text, finish, fingerprint);
        if let Some(prompt) = &mut self.return_ids {
            let first = std::mem::take(prompt);
            let prompt = (!first.is_empty()).then_some(first.as_slice());
            shapes::with_token_ids(&mut chunk, self.meta.chat, ids, prompt);
        }
        chunk
    }
}

/// The text of tokens sent together, each decoded as the stream decodes one.
pub(crate) fn decode(shared: &Shared, ids: &[u32]) -> String {
    ids.iter()
        .map(|id| shared.tokenizer.decode_token(*id))
        .collect()
}

/// Which tokens go out together, as vLLM's output processor sends them with
/// `--stream-interval N` (`RequestState.make_request_output` in
/// `vllm/v1/engine/output_processor.py`): the first token at once, then an
/// event each time N more have come, and at the end whatever is left.
pub(crate) struct Interval {
    every: usize,
    held: Vec<u32>,
    sent: bool,
}

impl Interval {
    pub(crate) fn new(every: usize) -> Self {
        Self {
            every: every.max(1),
            held: Vec::new(),
            sent: false,
        }
    }

    /// A token before the last: the tokens to send now, if it is time.
    pub(crate) fn token(&mut self, id: u32) -> Option<Vec<u32>> {
        self.held.push(id);
        if self.sent && self.held.len() < self.every {
            return None;
        }
        self.sent = true;
        Some(std::mem::take(&mut self.held))
    }

    /// The end: what is held, and the last token.
    pub(crate) fn last(&mut self, id: Option<u32>) -> Vec<u32> {
        self.held.extend(id);
        std::mem::take(&mut self.held)
    }
}

/// SSE chunks as the core produces tokens, each sent when its step ends (the
/// first when the prefill step does, which is what TTFT measures). Only the
/// last token waits, for `Finished` (sent in the same step), so that its chunk
/// carries `finish_reason` as vLLM's final chunk does.
fn stream_body(
    shared: Arc<Shared>,
    meta: Meta,
    rx: mpsc::UnboundedReceiver<CoreEvent>,
    include_usage: bool,
    return_ids: Option<Vec<u32>>,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    let interval = Interval::new(shared.cfg.stream_interval);
    let st = StreamState {
        shared,
        meta,
        rx,
        include_usage,
        return_ids,
        pending: None,
        interval,
        started: false,
        done: false,
    };
    futures_util::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let mut out = String::new();
        if !st.started && st.meta.chat {
            out.push_str(&sse(&st.meta.chat_role_chunk()));
        }
        st.started = true;
        loop {
            match st.rx.recv().await {
                Some(CoreEvent::Token { id, last: true }) => st.pending = Some(id),
                Some(CoreEvent::Token { id, last: false }) => {
                    if let Some(ids) = st.interval.token(id) {
                        out.push_str(&sse(&st.token_chunk(&ids, None, false)));
                        return Some((Ok(Bytes::from(out)), st));
                    }
                }
                Some(CoreEvent::Finished(o)) => {
                    record(&st.shared, &st.meta.id, &o);
                    let last = st.interval.last(st.pending.take());
                    if !last.is_empty() {
                        let fingerprint = !st.include_usage;
                        let chunk =
                            st.token_chunk(&last, Some(o.finish_reason.as_str()), fingerprint);
                        out.push_str(&sse(&chunk));
                    }
                    if st.include_usage {
                        let u =
                            shapes::stream_usage(o.prompt_tokens, o.output.len(), o.cached_tokens);
                        out.push_str(&sse(&st.meta.usage_chunk(u)));
                    }
                    out.push_str("data: [DONE]\n\n");
                    st.done = true;
                    return Some((Ok(Bytes::from(out)), st));
                }
                Some(CoreEvent::Failed(e)) => {
                    // vLLM reports a failure mid-stream as an error event.
                    out.push_str(&sse(&shapes::error(500, &e.to_string(), None)));
                    out.push_str("data: [DONE]\n\n");
                    st.done = true;
                    return Some((Ok(Bytes::from(out)), st));
                }
                None => {
                    st.done = true;
                    return Some((Err(std::io::Error::other("engine stopped")), st));
                }
            }
        }
    })
}

fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

#[cfg(test)]
mod tests {
    use super::Interval;

    #[test]
    fn the_first_token_goes_alone_then_every_n_and_the_rest_at_the_end() {
        let mut i = Interval::new(3);
        let sent: Vec<Option<Vec<u32>>> = (1..=8).map(|id| i.token(id)).collect();
        assert_eq!(
            sent,
            [
                Some(vec![1]),
                None,
                None,
                Some(vec![2, 3, 4]),
                None,
                None,
                Some(vec![5, 6, 7]),
                None
            ]
        );
        assert_eq!(i.last(Some(9)), [8, 9]);
        // One token an event, vLLM's default.
        let mut one = Interval::new(1);
        assert_eq!(one.token(1), Some(vec![1]));
        assert_eq!(one.token(2), Some(vec![2]));
        assert_eq!(one.last(None), Vec::<u32>::new());
    }
}
