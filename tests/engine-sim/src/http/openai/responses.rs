//! `/v1/responses`, as vLLM 0.32 serves it without harmony
//! (`entrypoints/openai/responses/serving.py`, `streaming_events.py`): the
//! input rendered as chat messages and run by the same core; the answer one
//! `response` object, or typed SSE events (`event: TYPE`, then `data:` the
//! event's JSON): `response.created`, `response.in_progress`,
//! `response.output_item.added`, `response.content_part.added`, one
//! `response.output_text.delta` per token, `response.output_text.done`,
//! `response.content_part.done`, `response.output_item.done`,
//! `response.completed`, numbered by `sequence_number` from 0. No `[DONE]`.

use std::sync::Arc;

use bytes::Bytes;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::{bad, decode, flatten_content, prepare, record, unix_now, ApiError, Interval};
use crate::core::{Cmd, CoreEvent, FinishReason, Outcome};
use crate::faults::Verdict;
use crate::http::shapes;
use crate::http::{json_response, sse_response, Reply, Shared};

/// The chat body a responses body renders as: `instructions` as a system
/// message, `input` as one user message (a string) or its messages (a
/// list), the last one continued open when it is an assistant message
/// whose `status` is `in_progress` or `incomplete` (vLLM's
/// `should_continue_final_message`), `max_output_tokens` as `max_tokens`.
fn as_chat(body: &Value) -> Result<Value, ApiError> {
    let mut messages = Vec::new();
    if let Some(i) = body.get("instructions").and_then(Value::as_str) {
        messages.push(json!({"role": "system", "content": i}));
    }
    let mut open = false;
    match body.get("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for item in items {
                let kind = item
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("message");
                if kind != "message" {
                    return Err(bad(
                        format!("input items of type {kind} are not simulated"),
                        Some("input"),
                    ));
                }
                let role = item.get("role").and_then(Value::as_str).unwrap_or("user");
                let content = item.get("content").map(flatten_content).unwrap_or_default();
                messages.push(json!({"role": role, "content": content}));
            }
            open = items.last().is_some_and(|last| {
                last.get("role").and_then(Value::as_str) == Some("assistant")
                    && matches!(
                        last.get("status").and_then(Value::as_str),
                        Some("in_progress" | "incomplete")
                    )
            });
        }
        _ => {
            return Err(bad(
                "input must be a string or a list of items",
                Some("input"),
            ))
        }
    }
    let mut chat = json!({
        "messages": messages,
        "add_generation_prompt": !open,
        "continue_final_message": open,
    });
    for (from, to) in [
        ("model", "model"),
        ("stream", "stream"),
        ("max_output_tokens", "max_tokens"),
        ("kv_transfer_params", "kv_transfer_params"),
        ("cache_salt", "cache_salt"),
    ] {
        if let Some(v) = body.get(from) {
            chat[to] = v.clone();
        }
    }
    Ok(chat)
}

/// What every event of one response repeats.
struct Resp {
    id: String,
    item_id: String,
    created_at: u64,
    model: String,
    /// The client's body (the response object echoes its settings).
    request: Value,
    max_output_tokens: usize,
}

impl Resp {
    /// The `response` object.
    fn object(&self, status: &str, output: Value, usage: Value, kv: Value) -> Value {
        let r = &self.request;
        let or = |k: &str, d: Value| r.get(k).cloned().unwrap_or(d);
        json!({
            "id": self.id, "created_at": self.created_at,
            "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "instructions": or("instructions", Value::Null), "metadata": or("metadata", Value::Null),
            "model": self.model, "object": "response", "output": output,
            "parallel_tool_calls": or("parallel_tool_calls", json!(true)),
            "temperature": or("temperature", json!(1.0)), "tool_choice": or("tool_choice", json!("auto")),
            "tools": or("tools", json!([])), "top_p": or("top_p", json!(1.0)),
            "background": or("background", json!(false)), "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": null, "previous_response_id": or("previous_response_id", Value::Null),
            "prompt": null, "reasoning": null, "service_tier": "auto", "status": status, "text": null,
            "top_logprobs": null, "truncation": "disabled", "usage": usage, "user": null,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "kv_transfer_params": kv,
            "ec_transfer_params": null, "input_messages": null, "output_messages": null,
        })
    }

    fn part(text: &str) -> Value {
        json!({"type": "output_text", "text": text, "annotations": [], "logprobs": null})
    }

    /// The message output item (`content` empty while it runs, as vLLM's).
    fn item(&self, text: &str, status: &str) -> Value {
        let content = if text.is_empty() {
            json!([])
        } else {
            json!([Self::part(text)])
        };
        json!({"id": self.item_id, "type": "message", "role": "assistant", "content": content, "status": status})
    }
}

fn usage(o: &Outcome) -> Value {
    let (p, n) = (o.prompt_tokens, o.output.len());
    json!({
        "input_tokens": p,
        "input_tokens_details": {"cached_tokens": o.cached_tokens, "cache_write_tokens": 0,
                                 "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": n,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                  "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
        "total_tokens": p + n,
    })
}

fn status(o: &Outcome) -> &'static str {
    if o.finish_reason == FinishReason::Length {
        "incomplete"
    } else {
        "completed"
    }
}

/// Serves one `/v1/responses` request.
pub(crate) async fn serve(shared: Arc<Shared>, body: Bytes, verdict: Verdict) -> Reply {
    let err = |e: ApiError, verdict: &Verdict| {
        json_response(
            e.status,
            &shapes::error(e.status, &e.message, e.param),
            verdict,
        )
    };
    let request: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return err(bad(format!("invalid JSON body: {e}"), None), &verdict),
    };
    let chat = match as_chat(&request) {
        Ok(c) => c,
        Err(e) => return err(e, &verdict),
    };
    let mut p = match prepare(&shared, chat.to_string().as_bytes(), true).await {
        Ok(p) => p,
        Err(e) => return err(e, &verdict),
    };
    let resp = Resp {
        id: format!("resp_{}", uuid::Uuid::new_v4().simple()),
        item_id: format!("msg_{}", uuid::Uuid::new_v4().simple()),
        created_at: unix_now(),
        model: p.meta.model.clone(),
        request,
        max_output_tokens: p.req.max_tokens,
    };
    let stream = p.req.stream;
    let internal_id = p.internal_id.clone();
    if shared
        .core_tx
        .try_send(Cmd::Submit(Box::new(p.req)))
        .is_err()
    {
        let e = shapes::error(503, "the engine's waiting queue is full", None);
        return json_response(503, &e, &verdict);
    }
    if stream {
        return sse_response(stream_body(shared, resp, p.rx), &verdict);
    }
    let o = match super::whole(&mut p.rx, &verdict).await {
        Ok(o) => o,
        Err(reply) => return reply,
    };
    record(&shared, &resp.id, &o);
    let text: String = o
        .output
        .iter()
        .map(|t| shared.tokenizer.decode_token(*t))
        .collect();
    let kv = match &o.held_blocks {
        Some(ids) => shapes::nixl_params(
            ids,
            &shared.engine_id,
            &internal_id,
            &shared.cfg.side_channel_host,
            shared.cfg.side_channel_port,
            o.prompt_tokens,
            o.cached_tokens,
        ),
        None => Value::Null,
    };
    let body = resp.object(
        status(&o),
        json!([resp.item(&text, "completed")]),
        usage(&o),
        kv,
    );
    json_response(200, &body, &verdict)
}

/// One typed SSE event.
fn event(seq: &mut u64, mut v: Value) -> String {
    v["sequence_number"] = json!(*seq);
    *seq += 1;
    let kind = v["type"].as_str().unwrap_or("unknown").to_owned();
    format!("event: {kind}\ndata: {v}\n\n")
}

struct StreamState {
    shared: Arc<Shared>,
    resp: Resp,
    rx: mpsc::UnboundedReceiver<CoreEvent>,
    seq: u64,
    text: String,
    started: bool,
    opened: bool,
    pending: Option<u32>,
    interval: Interval,
    done: bool,
}

impl StreamState {
    /// One event's delta (its tokens' text), after the item and its part are
    /// opened.
    fn delta(&mut self, ids: &[u32], out: &mut String) {
        let delta = decode(&self.shared, ids);
        if !self.opened {
            self.opened = true;
            let added = json!({"type": "response.output_item.added", "output_index": 0,
                               "item": self.resp.item("", "in_progress")});
            out.push_str(&event(&mut self.seq, added));
            let part = json!({"type": "response.content_part.added", "output_index": 0,
                              "item_id": self.resp.item_id, "content_index": 0,
                              "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}});
            out.push_str(&event(&mut self.seq, part));
        }
        self.text.push_str(&delta);
        let d = json!({"type": "response.output_text.delta", "content_index": 0, "output_index": 0,
                       "item_id": self.resp.item_id, "delta": delta, "logprobs": []});
        out.push_str(&event(&mut self.seq, d));
    }

    /// The closing events and `response.completed`.
    fn finish(&mut self, o: &Outcome, out: &mut String) {
        let text = self.text.clone();
        let item_id = self.resp.item_id.clone();
        let mut output = json!([]);
        if self.opened {
            let done = [
                json!({"type": "response.output_text.done", "output_index": 0, "content_index": 0,
                       "text": text, "logprobs": [], "item_id": item_id}),
                json!({"type": "response.content_part.done", "item_id": item_id, "output_index": 0,
                       "content_index": 0, "part": Resp::part(&text)}),
                json!({"type": "response.output_item.done", "output_index": 0,
                       "item": self.resp.item(&text, "completed")}),
            ];
            for e in done {
                out.push_str(&event(&mut self.seq, e));
            }
            output = json!([self.resp.item(&text, "completed")]);
        }
        let response = self.resp.object(status(o), output, usage(o), Value::Null);
        out.push_str(&event(
            &mut self.seq,
            json!({"type": "response.completed", "response": response}),
        ));
    }
}

fn stream_body(
    shared: Arc<Shared>,
    resp: Resp,
    rx: mpsc::UnboundedReceiver<CoreEvent>,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    let interval = Interval::new(shared.cfg.stream_interval);
    let st = StreamState {
        shared,
        resp,
        rx,
        interval,
        seq: 0,
        text: String::new(),
        started: false,
        opened: false,
        pending: None,
        done: false,
    };
    futures_util::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let mut out = String::new();
        if !st.started {
            // vLLM sends these before any token.
            st.started = true;
            let initial = st
                .resp
                .object("in_progress", json!([]), Value::Null, Value::Null);
            for kind in ["response.created", "response.in_progress"] {
                out.push_str(&event(
                    &mut st.seq,
                    json!({"type": kind, "response": initial}),
                ));
            }
            return Some((Ok(Bytes::from(out)), st));
        }
        loop {
            match st.rx.recv().await {
                Some(CoreEvent::Token { id, last: true }) => st.pending = Some(id),
                Some(CoreEvent::Token { id, last: false }) => {
                    if let Some(ids) = st.interval.token(id) {
                        st.delta(&ids, &mut out);
                        return Some((Ok(Bytes::from(out)), st));
                    }
                }
                Some(CoreEvent::Finished(o)) => {
                    record(&st.shared, &st.resp.id, &o);
                    let last = st.interval.last(st.pending.take());
                    if !last.is_empty() {
                        st.delta(&last, &mut out);
                    }
                    st.finish(&o, &mut out);
                    st.done = true;
                    return Some((Ok(Bytes::from(out)), st));
                }
                Some(CoreEvent::Failed(e)) => {
                    let err = json!({"type": "error", "code": "InternalServerError",
                                     "message": e.to_string(), "param": null});
                    out.push_str(&event(&mut st.seq, err));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_renders_as_chat_messages_and_an_open_assistant_message_continues() {
        let c = as_chat(
            &json!({"model": "m", "instructions": "be brief", "input": "hi",
                                "max_output_tokens": 5, "stream": true}),
        )
        .unwrap_or_else(|_| unreachable!());
        assert_eq!(
            c["messages"][0],
            json!({"role": "system", "content": "be brief"})
        );
        assert_eq!(c["messages"][1], json!({"role": "user", "content": "hi"}));
        assert_eq!(c["add_generation_prompt"], true);
        assert_eq!(c["max_tokens"], 5);
        let open = as_chat(&json!({"input": [
            {"role": "user", "content": "hi"},
            {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress",
             "content": [{"type": "output_text", "text": "Hel", "annotations": []}]}]}))
        .unwrap_or_else(|_| unreachable!());
        assert_eq!(
            open["messages"][1],
            json!({"role": "assistant", "content": "Hel"})
        );
        assert_eq!(open["continue_final_message"], true);
        assert_eq!(open["add_generation_prompt"], false);
        assert!(as_chat(&json!({"input": [{"type": "function_call_output"}]})).is_err());
    }
}
