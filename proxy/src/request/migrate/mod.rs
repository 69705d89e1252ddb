//! Request migration: a streamed completion whose upstream (the engine, or
//! the peer sidecar serving it) fails after bytes reached the client goes on
//! on another pod, in the same response (docs/migration.md).
//!
//! | file | holds |
//! |---|---|
//! | `mod.rs` | [`Migration`] (the transcript, the continuation's events rewritten), [`Reroute`] |
//! | `continuation.rs` | the continuation's body, and what no continuation can carry |
//! | `responses.rs` | `/v1/responses` streams: their typed events read and rewritten |
//! | `sse.rs` | SSE framing |
//!
//! [`Migration`] is the relay's [`Migrate`]: it forwards whole SSE events
//! only (a partial one waits for its end, so a failure never leaves half an
//! event with the client), keeps what was generated so far (the text, the
//! token ids when the engine returns them, the count), and on a failure
//! builds the continuation: the client's body with the output so far added
//! to the prompt and the token limits lowered by it, sent through the
//! [`Reroute`] the execute stage gave it (the path owns the pods; this file
//! names none). The continuation's events are rewritten as the first
//! stream's (its `id` and `created`; chat's second role chunk dropped;
//! `usage` counting the whole), so the client reads one stream.
//!
//! - Completions: a token-id prompt (the client's, or `prompt_token_ids`
//!   from the first event) plus the generated `token_ids` when the stream
//!   carries them (`return_token_ids`), exact; else the prompt text plus the
//!   generated text (re-tokenized by the next engine; with greedy decoding
//!   equal as long as the text re-tokenizes to the same ids).
//! - Chat: the partial answer appended as an assistant message, rendered
//!   open with `continue_final_message: true` and `add_generation_prompt:
//!   false` (vLLM's continuation of a final message).
//! - Responses (`responses.rs`): the partial answer appended to `input` as
//!   an assistant message with `status: in_progress`, which vLLM renders
//!   open; the continuation's typed events renumbered and rewritten as the
//!   first stream's.
//!
//! What went by text is counted by the next pod's `/tokenize` before the
//! continuation is sent ([`Reroute::count`]): an event may carry several
//! tokens (vLLM merges outputs its API server fell behind on, and
//! `--stream-interval` sends several at once), so one token per event is
//! only the fallback when the pod cannot count. The count lowers the token
//! limits and sets what `usage` moves from the prompt to the completion.
//!
//! A stream does not migrate (the reason is counted in
//! `kvmesh_migrations_total{outcome}` and it ends with an error event, as
//! without migration) past `migration.max_migrations` or
//! `migration.deadline`, with several choices (`n`), tool calls or
//! reasoning in its output, a token-id prompt whose output ids are unknown,
//! or when no other pod is left. A client that goes away drops the relay
//! and this with it: a cancelled request never migrates.

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Method, Uri};
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{Map, Value};
use tokio::time::Instant;

use super::context::Served;
use super::plan::Target;
use crate::body::{Migrate, Resuming, Streamed};
use crate::error::{ProxyError, UpstreamName};
use crate::metrics::{Route, UpstreamMetrics};
use crate::otel::{Hop, RequestTrace};
use continuation::{continuation, count_probes, limited, token_limit, unsupported_request};
use responses::ResponsesState;
use sse::{data_of, ends_event, event_end, sse_event};

mod continuation;
mod responses;
mod sse;

/// Longest SSE event held while its end is awaited; a longer one ends the
/// stream's chance to migrate (it is forwarded as it comes).
const MAX_EVENT_BYTES: usize = 1024 * 1024;

/// Most generated text kept for a continuation; past it the stream no longer
/// migrates (and the text is dropped).
const MAX_TRANSCRIPT_BYTES: usize = 16 * 1024 * 1024;

/// How a continuation reaches another pod: implemented by the request path
/// (`path/migrate.rs`), which knows the fleet.
pub trait Reroute: Send + Sync {
    /// The pod to continue on, and its name for errors: none of `avoid`
    /// (the pods that failed this request), the plan's `targets` first.
    fn pick(
        &self,
        model: Option<&str>,
        avoid: &[Served],
        targets: &[Target],
    ) -> Option<(Served, UpstreamName)>;
    /// Sends the continuation to `to`; a response other than a `200` stream
    /// is an error.
    fn send(&self, to: Served, job: Job) -> Continuing;
    /// The tokens `to`'s `/tokenize` counts in `count.probes[0]` less those
    /// in `count.probes[1]`, or why it cannot tell.
    fn count(&self, to: Served, count: Count) -> Counting;
}

/// A token count's call: the difference, or why there is none.
pub type Counting = Pin<Box<dyn Future<Output = Result<u64, &'static str>> + Send>>;

/// Two `/tokenize` bodies whose counts differ by what a continuation's
/// prompt carries (`continuation::count_probes`).
pub struct Count {
    pub request_id: HeaderValue,
    /// When the client's request arrived.
    pub started: Instant,
    /// The client's headers, credentials included, as the continuation
    /// carries them.
    pub headers: HeaderMap,
    pub probes: [Bytes; 2],
    /// The count's span ([`COUNT`]), under the request's: both calls carry
    /// its context upstream.
    pub hop: Hop,
}

/// The span of a migration's token count (its two `/tokenize` calls).
pub const COUNT: &str = "kvmesh.migration.count";

/// What the execute stage holds to give each migrating stream its own,
/// owned [`Reroute`] (the stream outlives the stage).
pub trait RerouteSource: Sync {
    fn reroute(&self) -> Box<dyn Reroute>;
}

/// A continuation's call: its response body and who answered.
pub type Continuing =
    Pin<Box<dyn Future<Output = Result<(Streamed, UpstreamName), ProxyError>> + Send>>;

/// One continuation to send: the client's head and the rewritten body.
pub struct Job {
    pub request_id: HeaderValue,
    pub route: Route,
    /// When the client's request arrived (the overall deadline counts from here).
    pub started: Instant,
    pub method: Method,
    pub uri: Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The 1-based number of this call among the request's attempts.
    pub attempt: u8,
    /// The call's span, under the request's (its context goes upstream).
    pub hop: Hop,
}

/// What a migrating stream starts from (the execute stage fills it in).
pub struct Start {
    pub route: Route,
    pub model: Option<String>,
    /// The client's JSON body.
    pub body: Bytes,
    pub method: Method,
    pub uri: Uri,
    pub headers: HeaderMap,
    pub request_id: HeaderValue,
    pub started: Instant,
    /// The plan's targets, in order (where a continuation goes first).
    pub targets: Vec<Target>,
    /// Who serves the stream now, and its name.
    pub serving: Served,
    pub upstream: UpstreamName,
    pub attempts: u8,
    pub max_migrations: u8,
    pub deadline: Duration,
    /// A P/D request's decode leg, to send again as it was when its decode
    /// pod fails before any token ([`KvResend`]).
    pub kv_resend: Option<KvResend>,
}

/// A P/D decode leg that may go again, as it was (the prefill's
/// `kv_transfer_params` and all), to another decode pod: while nothing was
/// generated the prefill's blocks are all that pod needs, and the prefill
/// pod holds them until its lease passes (`migration.pd_kv_lease`). The
/// continuation otherwise sends the whole prompt, computed again.
#[derive(Debug, Clone)]
pub struct KvResend {
    /// The decode leg's body.
    pub body: Bytes,
    /// When the prefill pod's lease on the blocks ends.
    pub until: Instant,
}

/// See the module docs.
pub struct Migration {
    start: Start,
    reroute: Arc<dyn Reroute>,
    metrics: Arc<UpstreamMetrics>,
    /// Pods that failed this request.
    avoid: Vec<Served>,
    /// The decode leg was sent again once ([`KvResend`]): a second failure
    /// (its KV perhaps gone) continues with the whole prompt.
    kv_resent: bool,
    /// Who serves the stream now (errors name it).
    upstream: UpstreamName,
    migrations: u8,
    /// Why it cannot migrate, once known.
    unsupported: Option<&'static str>,
    /// The start of an event whose end has not come yet.
    pending: BytesMut,
    out: Transcript,
    /// The current upstream is a continuation: its events are rewritten.
    rewrite: bool,
    /// Tokens generated before the current continuation (its prompt holds
    /// them): set when its call counts them, before any of its events.
    in_prompt: Arc<AtomicU64>,
    /// Tokens carried by the continuations before the current one, in all.
    carried_before: u64,
    /// `out.generated` when the current continuation began.
    generated_before: u64,
    /// The request's smallest token limit (`max_tokens` and the like).
    limit: Option<u64>,
}

/// What the stream said so far.
#[derive(Debug, Default)]
struct Transcript {
    /// The first stream's `id` and `created`, which every event keeps.
    id: Option<Value>,
    created: Option<Value>,
    text: String,
    /// The generated ids, while every event carried them.
    token_ids: Option<Vec<u64>>,
    prompt_token_ids: Option<Vec<u64>>,
    /// Tokens generated: exact with `token_ids`, else one per event with
    /// text (a lower bound: see the module docs).
    generated: u64,
    events: u64,
    /// Chat: the opening chunk (`delta.role`) reached the client.
    role_sent: bool,
    /// Responses: the response, its item, and the events' numbering.
    responses: ResponsesState,
    finished: bool,
    done: bool,
}

/// The fields of a streamed chunk the transcript reads.
#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(default)]
    error: Option<IgnoredAny>,
    #[serde(default, borrow)]
    object: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    choices: Vec<ChoiceChunk<'a>>,
    #[serde(default)]
    prompt_token_ids: Option<Vec<u64>>,
}

/// One choice of a chunk; its text borrowed from the event where it can be
/// (no escapes), so that reading an event allocates little.
#[derive(Deserialize)]
struct ChoiceChunk<'a> {
    #[serde(default)]
    index: u64,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    delta: Option<Delta<'a>>,
    #[serde(default)]
    token_ids: Option<Vec<u64>>,
    #[serde(default)]
    prompt_token_ids: Option<Vec<u64>>,
    #[serde(default)]
    finish_reason: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(default)]
    role: Option<IgnoredAny>,
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning: Option<Cow<'a, str>>,
    #[serde(default)]
    tool_calls: Option<Vec<IgnoredAny>>,
}

impl Migration {
    pub fn new(start: Start, reroute: Box<dyn Reroute>, metrics: Arc<UpstreamMetrics>) -> Self {
        let unsupported = unsupported_request(&start);
        let limit = token_limit(&start.body);
        Self {
            avoid: vec![start.serving],
            kv_resent: false,
            upstream: start.upstream.clone(),
            start,
            reroute: Arc::from(reroute),
            metrics,
            migrations: 0,
            unsupported,
            pending: BytesMut::new(),
            out: Transcript::default(),
            rewrite: false,
            in_prompt: Arc::new(AtomicU64::new(0)),
            carried_before: 0,
            generated_before: 0,
            limit,
        }
    }

    /// One whole event (its separator included): what to forward.
    fn event(&mut self, ev: Bytes) -> Result<Option<Bytes>, ProxyError> {
        let Some(payload) = data_of(&ev) else {
            return Ok(Some(ev)); // a comment or an empty event
        };
        if self.start.route == Route::Responses {
            return self.responses_event(ev, &payload);
        }
        if payload.trim_ascii() == b"[DONE]" {
            self.out.done = true;
            return Ok(Some(ev));
        }
        if self.rewrite {
            return match self.rewritten(&payload)? {
                Some(json) => {
                    self.track(&json)?;
                    Ok(Some(sse_event(&json)))
                }
                None => Ok(None),
            };
        }
        self.track(&payload)?;
        Ok(Some(ev))
    }

    /// Reads one event's JSON into the transcript; an error event is the
    /// upstream's failure.
    fn track(&mut self, payload: &[u8]) -> Result<(), ProxyError> {
        let chunk: Chunk<'_> = match serde_json::from_slice(payload) {
            Ok(c) => c,
            // JSON that stops short was cut: a peer sidecar whose engine
            // died mid-event closes it with its error event. The upstream
            // failed, and the cut event never reaches the client.
            Err(e) if e.is_eof() => {
                return Err(self.died(format!("an event cut short ({e})")));
            }
            // Something else (not an OpenAI chunk): relayed as it came, but
            // the stream cannot be continued from it.
            Err(_) => {
                self.unsupported.get_or_insert("unparsed_event");
                return Ok(());
            }
        };
        if chunk.error.is_some() || chunk.object.as_deref() == Some("error") {
            let event = String::from_utf8_lossy(payload).into_owned();
            return Err(self.died(format!("error event mid-stream: {event}")));
        }
        let t = &mut self.out;
        if t.events == 0 && !self.rewrite {
            if let Ok(v) = serde_json::from_slice::<Map<String, Value>>(payload) {
                t.id = v.get("id").cloned();
                t.created = v.get("created").cloned();
            }
            t.prompt_token_ids = chunk.prompt_token_ids.clone();
        }
        for c in chunk.choices {
            if c.index != 0 {
                self.unsupported.get_or_insert("several_choices");
                continue;
            }
            if t.events == 0 && !self.rewrite && c.prompt_token_ids.is_some() {
                t.prompt_token_ids = c.prompt_token_ids;
            }
            let text = match c.delta {
                Some(d) => {
                    t.role_sent |= d.role.is_some();
                    let thinking = d.reasoning_content.or(d.reasoning);
                    if thinking.is_some_and(|r| !r.is_empty()) {
                        self.unsupported.get_or_insert("reasoning");
                    }
                    if d.tool_calls.is_some_and(|c| !c.is_empty()) {
                        self.unsupported.get_or_insert("tool_calls");
                    }
                    d.content
                }
                None => c.text,
            };
            let text = text.unwrap_or_default();
            match (c.token_ids, t.events == 0) {
                (Some(ids), true) => t.token_ids = Some(ids),
                (Some(ids), false) => {
                    if let Some(all) = t.token_ids.as_mut() {
                        all.extend_from_slice(&ids);
                    }
                }
                (None, _) => t.token_ids = None,
            }
            t.generated += match &t.token_ids {
                Some(_) => 0,
                None => u64::from(!text.is_empty()),
            };
            if t.text.len() + text.len() > MAX_TRANSCRIPT_BYTES {
                self.unsupported.get_or_insert("transcript_limit");
                t.text = String::new();
            } else {
                t.text.push_str(&text);
            }
            if c.finish_reason.is_some() {
                t.finished = true;
            }
        }
        if let Some(ids) = &t.token_ids {
            t.generated = ids.len() as u64;
        }
        t.events += 1;
        Ok(())
    }

    /// A continuation's event as the first stream's: `None` to drop it.
    fn rewritten(&mut self, payload: &[u8]) -> Result<Option<Vec<u8>>, ProxyError> {
        let Ok(mut v) = serde_json::from_slice::<Map<String, Value>>(payload) else {
            // `track` fails it.
            return Ok(Some(payload.to_vec()));
        };
        if v.contains_key("error") || v.get("object").and_then(Value::as_str) == Some("error") {
            // Tracked as a failure (never forwarded).
            return Ok(Some(payload.to_vec()));
        }
        for (k, keep) in [("id", &self.out.id), ("created", &self.out.created)] {
            if let (Some(keep), Some(slot)) = (keep, v.get_mut(k)) {
                slot.clone_from(keep);
            }
        }
        // The client has the prompt's ids from the first stream already.
        if v.get("prompt_token_ids").is_some_and(|p| !p.is_null()) {
            v.insert("prompt_token_ids".to_owned(), Value::Null);
        }
        let mut role_only = false;
        if let Some(Value::Array(choices)) = v.get_mut("choices") {
            for c in choices.iter_mut().filter_map(Value::as_object_mut) {
                if c.get("prompt_token_ids").is_some_and(|p| !p.is_null()) {
                    c.insert("prompt_token_ids".to_owned(), Value::Null);
                }
                let no_finish = c.get("finish_reason").is_none_or(Value::is_null);
                if let Some(Value::Object(d)) = c.get_mut("delta") {
                    // Chat's opening chunk: the client had its own (unless
                    // the first stream died before it was sent).
                    if self.out.role_sent && d.remove("role").is_some() {
                        let empty = d.get("content").is_none_or(|t| t.as_str() == Some(""));
                        role_only = empty && d.len() <= 1 && no_finish;
                    }
                }
            }
        }
        if let Some(Value::Object(u)) = v.get_mut("usage") {
            let n = self.in_prompt.load(Ordering::Acquire);
            let add = |u: &mut Map<String, Value>, k: &str, by: i128| {
                if let Some(x) = u.get(k).and_then(Value::as_u64) {
                    let y = (i128::from(x) + by).clamp(0, i128::from(u64::MAX));
                    u.insert(k.to_owned(), Value::from(u64::try_from(y).unwrap_or(0)));
                }
            };
            add(u, "prompt_tokens", -i128::from(n));
            add(u, "completion_tokens", i128::from(n));
        }
        if role_only && v.get("usage").is_none_or(Value::is_null) {
            return Ok(None);
        }
        serde_json::to_vec(&v)
            .map(Some)
            .map_err(|e| ProxyError::Internal(format!("continuation event: {e}")))
    }

    /// The current upstream failed as `reason` says.
    fn died(&self, reason: String) -> ProxyError {
        ProxyError::UpstreamDied {
            upstream: self.upstream.clone(),
            reason,
        }
    }

    /// Why this stream cannot migrate now, if it cannot.
    fn refusal(&self) -> Option<&'static str> {
        if let Some(r) = self.unsupported {
            return Some(r);
        }
        // Every token asked for was generated: only the end was lost.
        if self.limit.is_some_and(|l| self.generated() >= l) {
            return Some("finished");
        }
        if self.migrations >= self.start.max_migrations {
            return Some("limit");
        }
        if self.start.started.elapsed() >= self.start.deadline {
            return Some("deadline");
        }
        if self.start.route == Route::Responses && self.out.finished {
            // The text is whole; only the closing events were lost.
            return Some("finished");
        }
        None
    }
}

impl Migrate for Migration {
    fn carried(&self) -> u64 {
        self.carried_before + self.in_prompt.load(Ordering::Acquire)
    }

    fn forward(&mut self, data: Bytes) -> (Bytes, Option<ProxyError>) {
        // The common case: whole events in one frame, forwarded as they came.
        if self.pending.is_empty() && !self.rewrite && ends_event(&data) {
            let mut rest = data.clone();
            let mut sent = 0;
            while let Some(end) = event_end(&rest) {
                let ev = rest.split_to(end);
                if let Err(e) = self.event(ev) {
                    return (data.slice(..sent), Some(e));
                }
                sent += end;
            }
            return (data, None);
        }
        let mut out = BytesMut::new();
        self.pending.extend_from_slice(&data);
        while let Some(end) = event_end(&self.pending) {
            let ev = self.pending.split_to(end).freeze();
            match self.event(ev) {
                Ok(Some(b)) => out.extend_from_slice(&b),
                Ok(None) => {}
                Err(e) => return (out.freeze(), Some(e)),
            }
        }
        if self.pending.len() > MAX_EVENT_BYTES {
            self.unsupported.get_or_insert("event_too_large");
            out.extend_from_slice(&self.pending.split());
        }
        (out.freeze(), None)
    }

    fn complete(&mut self) -> Option<Bytes> {
        if self.start.route == Route::Responses {
            // `response.completed` is the end; nothing stands in for it.
            return self.out.done.then(Bytes::new);
        }
        match (self.out.done, self.out.finished) {
            (true, _) => Some(Bytes::new()),
            (false, true) => {
                self.out.done = true;
                Some(Bytes::from_static(b"data: [DONE]\n\n"))
            }
            (false, false) => None,
        }
    }

    fn resume(&mut self, err: &ProxyError, trace: Option<&RequestTrace>) -> Option<Resuming> {
        if let Some(reason) = self.refusal() {
            self.metrics.migration(reason);
            tracing::warn!(request_id = self.start.request_id.to_str().unwrap_or("-"), reason, error = %err, "stream not migrated");
            return None;
        }
        // At least this many tokens were generated; the next pod's count of
        // what went by text replaces it where larger.
        let estimate = self.generated();
        let body = match self.kv_resend_now() {
            Some(leg) => Body::Resent(leg),
            None => match continuation(&self.start, &self.out) {
                Ok(b) => Body::Continued(b),
                Err(reason) => {
                    self.metrics.migration(reason);
                    return None;
                }
            },
        };
        let Some((to, name)) = self.reroute.pick(
            self.start.model.as_deref(),
            &self.avoid,
            &self.start.targets,
        ) else {
            self.metrics.migration("no_target");
            return None;
        };
        let probes = match body {
            Body::Continued(_) => count_probes(&self.start, &self.out),
            Body::Resent(_) => None,
        };
        self.migrations += 1;
        self.start.attempts = self.start.attempts.saturating_add(1);
        self.avoid.push(to);
        self.pending.clear();
        self.rewrite = true;
        self.carried_before = self.carried();
        self.generated_before = self.out.generated;
        let in_prompt = Arc::new(AtomicU64::new(estimate));
        self.in_prompt = Arc::clone(&in_prompt);
        let hop = Hop::of(trace, super::call::FORWARD, &name, self.start.attempts);
        let s = &self.start;
        let mut job = Job {
            request_id: s.request_id.clone(),
            route: s.route,
            started: s.started,
            method: s.method.clone(),
            uri: s.uri.clone(),
            headers: s.headers.clone(),
            body: Bytes::new(),
            attempt: s.attempts,
            hop,
        };
        let counting = probes.map(|probes| {
            let count = Count {
                request_id: s.request_id.clone(),
                started: s.started,
                headers: s.headers.clone(),
                probes,
                hop: Hop::of(trace, COUNT, &name, s.attempts),
            };
            self.reroute.count(to, count)
        });
        let failed = std::mem::replace(&mut self.upstream, name);
        let request_id = s.request_id.clone();
        let reroute = Arc::clone(&self.reroute);
        let metrics = Arc::clone(&self.metrics);
        let outcome = match body {
            Body::Resent(_) => KV_RESENT,
            Body::Continued(_) => "migrated",
        };
        Some(Box::pin(async move {
            job.body = match body {
                Body::Resent(leg) => leg,
                Body::Continued(b) => {
                    let counted = match counting {
                        Some(c) => c
                            .await
                            .inspect_err(|why| tracing::warn!(request_id = request_id.to_str().unwrap_or("-"), why, "the next pod could not count the output so far; its events' count stands"))
                            .ok(),
                        None => None,
                    };
                    // A re-tokenized text can hold fewer tokens than were
                    // generated (two merged into one): the limits keep the larger.
                    let n = counted.map_or(estimate, |c| c.max(estimate));
                    in_prompt.store(n, Ordering::Release);
                    match limited(b, n) {
                        Ok(b) => b,
                        // The relay asks again: `refusal` finds the count
                        // at the limit then, and counts it as `finished`.
                        Err(reason) => {
                            return Err(ProxyError::UpstreamDied {
                                upstream: failed,
                                reason: format!(
                                    "it failed after the last token the client asked for ({reason}), before the stream's end"
                                ),
                            });
                        }
                    }
                }
            };
            let carried = in_prompt.load(Ordering::Acquire);
            match reroute.send(to, job).await {
                Ok((body, name)) => {
                    metrics.migration(outcome);
                    metrics.migrated_tokens(carried);
                    Ok((body, name))
                }
                Err(e) => {
                    metrics.migration("continuation_failed");
                    Err(e)
                }
            }
        }))
    }
}

/// What a continuation sends: a P/D decode leg again, as it was, or the
/// client's body continued (its limits lowered once the output is counted).
enum Body {
    Resent(Bytes),
    Continued(Map<String, Value>),
}

/// The outcome in `kvmesh_migrations_total` of a P/D stream whose decode
/// pod failed before any token and whose decode leg went again, as it was,
/// to another decode pod ([`KvResend`]).
pub const KV_RESENT: &str = "kv_resent";

impl Migration {
    /// Tokens generated so far, at least: one per event with text (or the
    /// exact ids), or what the pod of the current continuation counted
    /// before it plus what came since.
    fn generated(&self) -> u64 {
        let since = self.out.generated.saturating_sub(self.generated_before);
        let counted = self.in_prompt.load(Ordering::Acquire) + since;
        self.out.generated.max(counted)
    }

    /// The decode leg to send again as it was ([`KvResend`]): nothing
    /// generated yet, the lease not passed, and not sent again once already.
    fn kv_resend_now(&mut self) -> Option<Bytes> {
        if self.kv_resent || self.out.generated > 0 || !self.out.text.is_empty() {
            return None;
        }
        let leg = self
            .start
            .kv_resend
            .as_ref()
            .filter(|k| Instant::now() < k.until)?;
        self.kv_resent = true;
        Some(leg.body.clone())
    }
}

#[cfg(test)]
mod tests;
