//! A migrating stream's continuation: the client's body with the output so
//! far added to the prompt (token ids when known, else text; chat's and
//! Responses' partial answer as an open assistant message) and the token
//! limits lowered by it; and, when the output went by text, the `/tokenize`
//! calls that count the tokens it carries.

use bytes::Bytes;
use serde_json::{json, Map, Value};

use super::{Start, Transcript};
use crate::metrics::Route;

/// Reasons known from the request alone.
pub(super) fn unsupported_request(s: &Start) -> Option<&'static str> {
    if !matches!(
        s.route,
        Route::Completions | Route::ChatCompletions | Route::Responses
    ) {
        return Some("route");
    }
    let Ok(v) = serde_json::from_slice::<Map<String, Value>>(&s.body) else {
        return Some("unparsed_request");
    };
    if s.route == Route::Responses {
        // The response it continues is stored on one engine only.
        if v.get("previous_response_id").is_some_and(|p| !p.is_null()) {
            return Some("previous_response");
        }
        // Run and stored by the engine, not streamed to this client.
        if v.get("background").and_then(Value::as_bool) == Some(true) {
            return Some("background");
        }
    }
    let many = |k: &str| v.get(k).and_then(Value::as_u64).is_some_and(|n| n > 1);
    if many("n") || many("best_of") {
        return Some("several_choices");
    }
    // Completions' `echo` puts the prompt in the stream's first text, so
    // the text is not the output alone.
    if v.get("echo").and_then(Value::as_bool) == Some(true) {
        return Some("echo");
    }
    None
}

/// The continuation's body: the client's, with the output so far added to
/// the prompt, its token limits as the client sent them ([`limited`] lowers
/// them); `Err` is why not.
pub(super) fn continuation(s: &Start, t: &Transcript) -> Result<Map<String, Value>, &'static str> {
    let mut body: Map<String, Value> =
        serde_json::from_slice(&s.body).map_err(|_| "unparsed_request")?;
    match s.route {
        Route::Completions => {
            let prompt = body.get("prompt").ok_or("unparsed_request")?;
            let ids = prompt_ids(prompt).or_else(|| t.prompt_token_ids.clone());
            let next = match (ids, &t.token_ids) {
                (Some(mut ids), Some(out)) => {
                    ids.extend_from_slice(out);
                    Value::from(ids)
                }
                _ => match prompt_text(prompt) {
                    Some(p) => Value::from(format!("{p}{}", t.text)),
                    None => return Err("token_ids_unknown"),
                },
            };
            body.insert("prompt".to_owned(), next);
        }
        Route::ChatCompletions => {
            let open = body
                .get("continue_final_message")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let Some(Value::Array(messages)) = body.get_mut("messages") else {
                return Err("unparsed_request");
            };
            if open {
                // The client continues its own last message: extend it.
                let last = messages
                    .last_mut()
                    .and_then(|m| m.get_mut("content"))
                    .ok_or("unparsed_request")?;
                let Some(so_far) = last.as_str() else {
                    return Err("content_parts");
                };
                *last = Value::from(format!("{so_far}{}", t.text));
            } else {
                messages.push(serde_json::json!({"role": "assistant", "content": t.text}));
            }
            body.insert("continue_final_message".to_owned(), Value::Bool(true));
            body.insert("add_generation_prompt".to_owned(), Value::Bool(false));
        }
        Route::Responses => responses_input(&mut body, t)?,
        _ => return Err("route"),
    }
    Ok(body)
}

/// `body` with its token limits lowered by the `n` tokens its prompt
/// carries, serialized; `Err("finished")` when no token is left to generate.
pub(super) fn limited(mut body: Map<String, Value>, n: u64) -> Result<Bytes, &'static str> {
    if exhausted(&body, n) {
        return Err("finished");
    }
    for k in LIMITS {
        if let Some(slot) = body.get_mut(k) {
            if let Some(max) = slot.as_u64() {
                *slot = Value::from(max - n);
            }
        }
    }
    if let Some(slot) = body.get_mut("min_tokens") {
        if let Some(min) = slot.as_u64() {
            *slot = Value::from(min.saturating_sub(n));
        }
    }
    serde_json::to_vec(&body)
        .map(Bytes::from)
        .map_err(|_| "unparsed_request")
}

/// The token limits of the three routes' bodies.
const LIMITS: [&str; 3] = ["max_tokens", "max_completion_tokens", "max_output_tokens"];

/// Whether `n` generated tokens reach one of `body`'s token limits.
fn exhausted(body: &Map<String, Value>, n: u64) -> bool {
    LIMITS.iter().any(|k| {
        body.get(*k)
            .and_then(Value::as_u64)
            .is_some_and(|max| max <= n)
    })
}

/// The smallest token limit of a client's body, if it has one.
pub(super) fn token_limit(body: &[u8]) -> Option<u64> {
    let body: Map<String, Value> = serde_json::from_slice(body).ok()?;
    LIMITS
        .iter()
        .filter_map(|k| body.get(*k).and_then(Value::as_u64))
        .min()
}

/// Two `/tokenize` bodies (vLLM's `TokenizeCompletionRequest` or
/// `TokenizeChatRequest`) whose counts differ by the tokens the
/// continuation's prompt carries, when the output went by text; `None` when
/// the count is exact already (the stream's `token_ids`) or nothing was
/// generated.
///
/// The stream's own count is one token per event with text, which is vLLM's
/// chunking only while its API server keeps up: under load it merges the
/// engine's outputs into one event, and `--stream-interval N` sends N tokens
/// an event. The next engine's tokenizer counts what its prompt will hold:
/// completions, the prompt text with and without the output; chat and
/// Responses, a one-message conversation with the partial answer as the open
/// assistant message (after the client's own open text, if it left one)
/// against the same without it, rendered with the client's `chat_template`,
/// `chat_template_kwargs` and `tools`. The template around the answer is the
/// same in both, so the difference is the answer's tokens (and whatever a
/// template draws around a finished assistant turn that its generation prompt
/// lacks, such as an empty thinking block).
pub(super) fn count_probes(s: &Start, t: &Transcript) -> Option<[Bytes; 2]> {
    if t.token_ids.is_some() || t.text.is_empty() {
        return None;
    }
    let body: Map<String, Value> = serde_json::from_slice(&s.body).ok()?;
    let model = body.get("model").cloned().unwrap_or(Value::Null);
    let [with, without] = match s.route {
        Route::Completions => {
            let prompt = prompt_text(body.get("prompt")?)?;
            [format!("{prompt}{}", t.text), prompt.to_owned()]
                .map(|p| json!({"model": model, "prompt": p}))
        }
        Route::ChatCompletions | Route::Responses => {
            let before = open_text(s.route, &body).unwrap_or_default();
            // The client's template and what it renders with (vLLM's
            // `TokenizeChatRequest` takes them as its chat request does).
            let template: Map<String, Value> = ["chat_template", "chat_template_kwargs", "tools"]
                .into_iter()
                .filter(|_| s.route == Route::ChatCompletions)
                .filter_map(|k| Some((k.to_owned(), body.get(k)?.clone())))
                .filter(|(_, v)| !v.is_null())
                .collect();
            let chat = |answer: Option<String>| {
                let mut messages = vec![json!({"role": "user", "content": "."})];
                let open = answer.is_some();
                if let Some(a) = answer {
                    messages.push(json!({"role": "assistant", "content": a}));
                }
                let mut probe = json!({"model": model, "messages": messages,
                    "add_generation_prompt": !open, "continue_final_message": open});
                if let Value::Object(p) = &mut probe {
                    p.extend(template.clone());
                }
                probe
            };
            let without = (!before.is_empty()).then(|| before.clone());
            [chat(Some(format!("{before}{}", t.text))), chat(without)]
        }
        _ => return None,
    };
    let bytes = |v: Value| serde_json::to_vec(&v).ok().map(Bytes::from);
    Some([bytes(with)?, bytes(without)?])
}

/// The text of a final assistant message the client left open itself (chat's
/// `continue_final_message`, a Responses item `in_progress` or `incomplete`).
fn open_text(route: Route, body: &Map<String, Value>) -> Option<String> {
    let text = |content: &Value| match content {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => parts.last()?.get("text")?.as_str().map(str::to_owned),
        _ => None,
    };
    match route {
        Route::ChatCompletions => {
            if body.get("continue_final_message").and_then(Value::as_bool) != Some(true) {
                return None;
            }
            text(body.get("messages")?.as_array()?.last()?.get("content")?)
        }
        Route::Responses => {
            let last = body.get("input")?.as_array()?.last()?;
            open_item(last).then(|| text(last.get("content")?))?
        }
        _ => None,
    }
}

/// A Responses `input` with the output so far: the client's last item
/// extended when it is an assistant message it left open (`status`
/// `in_progress` or `incomplete`, which vLLM continues), else the partial
/// answer appended as such a message. A string `input` is the user message
/// vLLM renders it as.
fn responses_input(body: &mut Map<String, Value>, t: &Transcript) -> Result<(), &'static str> {
    let input = body.get_mut("input").ok_or("unparsed_request")?;
    if let Value::String(s) = input {
        *input = serde_json::json!([{"role": "user", "content": s}]);
    }
    let Value::Array(items) = input else {
        return Err("unparsed_request");
    };
    if !items.last().is_some_and(open_item) {
        let id = t
            .responses
            .item_id
            .clone()
            .unwrap_or_else(|| Value::from("msg_kvmesh"));
        items.push(serde_json::json!({
            "type": "message", "id": id, "role": "assistant", "status": "in_progress",
            "content": [{"type": "output_text", "text": t.text, "annotations": []}],
        }));
        return Ok(());
    }
    let content = items
        .last_mut()
        .and_then(|m| m.get_mut("content"))
        .ok_or("unparsed_request")?;
    let text = match content {
        Value::String(so_far) => so_far,
        Value::Array(parts) => match parts.last_mut().and_then(|p| p.get_mut("text")) {
            Some(Value::String(so_far)) => so_far,
            _ => return Err("content_parts"),
        },
        _ => return Err("content_parts"),
    };
    text.push_str(&t.text);
    Ok(())
}

/// A Responses input item that is an assistant message left open (`status`
/// `in_progress` or `incomplete`), which vLLM continues.
fn open_item(item: &Value) -> bool {
    item.get("role").and_then(Value::as_str) == Some("assistant")
        && matches!(
            item.get("status").and_then(Value::as_str),
            Some("in_progress" | "incomplete")
        )
}

/// A completions prompt given as token ids (one prompt).
fn prompt_ids(p: &Value) -> Option<Vec<u64>> {
    let ids = |a: &[Value]| a.iter().map(Value::as_u64).collect::<Option<Vec<_>>>();
    match p.as_array()?.as_slice() {
        [Value::Array(one)] => ids(one),
        all if !all.is_empty() && all.iter().all(Value::is_number) => ids(all),
        _ => None,
    }
}

/// A completions prompt given as text (one prompt).
fn prompt_text(p: &Value) -> Option<&str> {
    match p {
        Value::String(s) => Some(s),
        Value::Array(a) if a.len() == 1 => a[0].as_str(),
        _ => None,
    }
}
