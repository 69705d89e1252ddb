//! A migrating stream's continuation: the client's body with the output so
//! far added to the prompt (token ids when known, else text; chat's and
//! Responses' partial answer as an open assistant message) and the token
//! limits lowered by it.

use bytes::Bytes;
use serde_json::{Map, Value};

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
/// the prompt and the token limits lowered by it; `Err` is why not.
pub(super) fn continuation(s: &Start, t: &Transcript) -> Result<Bytes, &'static str> {
    let mut body: Map<String, Value> =
        serde_json::from_slice(&s.body).map_err(|_| "unparsed_request")?;
    let n = t.generated;
    for k in ["max_tokens", "max_completion_tokens", "max_output_tokens"] {
        if let Some(slot) = body.get_mut(k) {
            if let Some(max) = slot.as_u64() {
                let left = max.saturating_sub(n);
                if left == 0 {
                    return Err("finished");
                }
                *slot = Value::from(left);
            }
        }
    }
    if let Some(slot) = body.get_mut("min_tokens") {
        if let Some(min) = slot.as_u64() {
            *slot = Value::from(min.saturating_sub(n));
        }
    }
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
    serde_json::to_vec(&body)
        .map(Bytes::from)
        .map_err(|_| "unparsed_request")
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
    let open = items.last().is_some_and(|last| {
        last.get("role").and_then(Value::as_str) == Some("assistant")
            && matches!(
                last.get("status").and_then(Value::as_str),
                Some("in_progress" | "incomplete")
            )
    });
    if !open {
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
