//! `/v1/responses` streams: vLLM's typed events (`event: TYPE`, then the
//! event's JSON as `data:`), read into the transcript, and a continuation's
//! events rewritten as the first stream's.
//!
//! vLLM 0.32 (without harmony) sends `response.created` and
//! `response.in_progress`, then for the message `response.output_item.added`
//! and `response.content_part.added`, one `response.output_text.delta` per
//! engine step, `response.output_text.done`, `response.content_part.done`,
//! `response.output_item.done` and `response.completed` (the whole response,
//! its `usage`), every event numbered by `sequence_number` from 0
//! (`entrypoints/openai/responses/serving.py`, `streaming_events.py`).
//!
//! The continuation's `response.created`, `response.in_progress`, and its
//! item and part openings are dropped when the client had the first
//! stream's; every event it keeps gets the next `sequence_number`, the first
//! stream's item id, and its done events and `response.completed` the whole
//! text, the first response's `id` and `created_at`, the client's
//! `max_output_tokens`, and `usage` counting the whole.

use bytes::Bytes;
use serde_json::{Map, Value};

use super::{Migration, MAX_TRANSCRIPT_BYTES};
use crate::error::ProxyError;

/// What a Responses stream said beyond the text (the transcript's).
#[derive(Debug, Default)]
pub(super) struct ResponsesState {
    /// The response's `id` and `created_at`, from the first `response.created`.
    pub id: Option<Value>,
    pub created_at: Option<Value>,
    /// The message item's id, once its `output_item.added` reached the client.
    pub item_id: Option<Value>,
    /// Its `content_part.added` reached the client.
    pub part_added: bool,
    /// The `sequence_number` the client expects next.
    pub next_seq: u64,
}

/// One typed event.
fn typed_event(kind: &str, v: &Map<String, Value>) -> Result<Bytes, ProxyError> {
    let json = serde_json::to_string(v)
        .map_err(|e| ProxyError::Internal(format!("continuation event: {e}")))?;
    Ok(Bytes::from(format!("event: {kind}\ndata: {json}\n\n")))
}

impl Migration {
    /// One whole event of a Responses stream: what to forward.
    pub(super) fn responses_event(
        &mut self,
        ev: Bytes,
        payload: &[u8],
    ) -> Result<Option<Bytes>, ProxyError> {
        let mut v: Map<String, Value> = match serde_json::from_slice(payload) {
            Ok(v) => v,
            Err(e) if e.is_eof() => {
                return Err(self.died(format!("an event cut short ({e})")));
            }
            Err(_) => {
                self.unsupported.get_or_insert("unparsed_event");
                return Ok(Some(ev));
            }
        };
        let kind = v
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        if v.contains_key("error") || matches!(kind.as_str(), "error" | "response.failed") {
            let event = String::from_utf8_lossy(payload).into_owned();
            return Err(self.died(format!("error event mid-stream: {event}")));
        }
        let first = !self.rewrite;
        let drop = self.read_response_event(&kind, &v, first);
        if first {
            let r = &mut self.out.responses;
            if let Some(n) = v.get("sequence_number").and_then(Value::as_u64) {
                r.next_seq = n + 1;
            }
            self.out.events += 1;
            return Ok(Some(ev));
        }
        if drop {
            return Ok(None);
        }
        self.rewrite_response_event(&kind, &mut v);
        let r = &mut self.out.responses;
        v.insert("sequence_number".to_owned(), Value::from(r.next_seq));
        r.next_seq += 1;
        typed_event(&kind, &v).map(Some)
    }

    /// Reads one event into the transcript; `true` for a continuation's
    /// event the client already had the first stream's of.
    fn read_response_event(&mut self, kind: &str, v: &Map<String, Value>, first: bool) -> bool {
        let t = &mut self.out;
        let r = &mut t.responses;
        match kind {
            "response.created" | "response.in_progress" => {
                let known = r.id.is_some();
                if !known && kind == "response.created" {
                    r.id = v.get("response").and_then(|x| x.get("id")).cloned();
                    r.created_at = v.get("response").and_then(|x| x.get("created_at")).cloned();
                }
                !first && known
            }
            "response.output_item.added" => {
                match v
                    .get("item")
                    .and_then(|i| i.get("type"))
                    .and_then(Value::as_str)
                {
                    Some("message") => {}
                    Some("reasoning") => {
                        self.unsupported.get_or_insert("reasoning");
                    }
                    _ => {
                        self.unsupported.get_or_insert("tool_calls");
                    }
                }
                if r.item_id.is_some() {
                    return !first;
                }
                r.item_id = v.get("item").and_then(|i| i.get("id")).cloned();
                false
            }
            "response.content_part.added" => {
                let had = r.part_added;
                r.part_added = true;
                !first && had
            }
            "response.output_text.delta" => {
                let delta = v.get("delta").and_then(Value::as_str).unwrap_or_default();
                t.generated += u64::from(!delta.is_empty());
                if t.text.len() + delta.len() > MAX_TRANSCRIPT_BYTES {
                    self.unsupported.get_or_insert("transcript_limit");
                    t.text = String::new();
                } else {
                    t.text.push_str(delta);
                }
                false
            }
            "response.output_text.done" => {
                t.finished = true;
                false
            }
            "response.completed" | "response.incomplete" => {
                t.finished = true;
                t.done = true;
                false
            }
            k if k.starts_with("response.reasoning") => {
                self.unsupported.get_or_insert("reasoning");
                false
            }
            k if k.contains("function_call") || k.contains("_call.") => {
                self.unsupported.get_or_insert("tool_calls");
                false
            }
            _ => false,
        }
    }

    /// A continuation's event as the first stream's (see the module docs).
    fn rewrite_response_event(&self, kind: &str, v: &mut Map<String, Value>) {
        let r = &self.out.responses;
        let whole = &self.out.text;
        if let (Some(id), Some(slot)) = (&r.item_id, v.get_mut("item_id")) {
            slot.clone_from(id);
        }
        match kind {
            "response.output_item.added" | "response.output_item.done" => {
                if let Some(item) = v.get_mut("item").and_then(Value::as_object_mut) {
                    self.as_first_item(item);
                }
            }
            "response.output_text.done" => {
                v.insert("text".to_owned(), Value::from(whole.as_str()));
            }
            "response.content_part.done" => {
                if let Some(Value::Object(part)) = v.get_mut("part") {
                    part.insert("text".to_owned(), Value::from(whole.as_str()));
                }
            }
            "response.completed" | "response.incomplete" => {
                if let Some(resp) = v.get_mut("response").and_then(Value::as_object_mut) {
                    self.as_first_response(resp);
                }
            }
            _ => {}
        }
    }

    /// A continuation's message item as the first stream's: its id, and the
    /// whole text once it has any.
    fn as_first_item(&self, item: &mut Map<String, Value>) {
        if item.get("type").and_then(Value::as_str) != Some("message") {
            return;
        }
        if let Some(id) = &self.out.responses.item_id {
            item.insert("id".to_owned(), id.clone());
        }
        let whole = &self.out.text;
        if let Some(Value::Array(content)) = item.get_mut("content") {
            match content.first_mut().and_then(Value::as_object_mut) {
                Some(part) => {
                    part.insert("text".to_owned(), Value::from(whole.as_str()));
                }
                None if !whole.is_empty() => content.push(serde_json::json!(
                    {"type": "output_text", "text": whole, "annotations": [], "logprobs": null}
                )),
                None => {}
            }
        }
    }

    /// The continuation's final response as the first's: its `id` and
    /// `created_at`, the client's `max_output_tokens`, the message's id and
    /// whole text, and `usage` counting the whole (the carried tokens moved
    /// from input to output).
    fn as_first_response(&self, resp: &mut Map<String, Value>) {
        let r = &self.out.responses;
        for (k, keep) in [("id", &r.id), ("created_at", &r.created_at)] {
            if let Some(keep) = keep {
                resp.insert(k.to_owned(), keep.clone());
            }
        }
        let asked = serde_json::from_slice::<Map<String, Value>>(&self.start.body)
            .ok()
            .and_then(|b| b.get("max_output_tokens").cloned());
        if let (Some(asked), true) = (asked, resp.contains_key("max_output_tokens")) {
            resp.insert("max_output_tokens".to_owned(), asked);
        }
        if let Some(Value::Array(output)) = resp.get_mut("output") {
            for item in output.iter_mut().filter_map(Value::as_object_mut) {
                self.as_first_item(item);
            }
        }
        if let Some(Value::Object(u)) = resp.get_mut("usage") {
            let n = i128::from(self.in_prompt.load(std::sync::atomic::Ordering::Acquire));
            for (k, by) in [("input_tokens", -n), ("output_tokens", n)] {
                if let Some(x) = u.get(k).and_then(Value::as_u64) {
                    let y = (i128::from(x) + by).clamp(0, i128::from(u64::MAX));
                    u.insert(k.to_owned(), Value::from(u64::try_from(y).unwrap_or(0)));
                }
            }
        }
    }
}
