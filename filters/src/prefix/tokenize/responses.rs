//! `/v1/responses` requests as vLLM 0.32 turns them into a chat template's
//! input (`vllm/entrypoints/openai/responses/utils.py::construct_input_messages`,
//! `_construct_message_from_response_item`, `should_continue_final_message`,
//! `construct_tool_dicts`; `ResponsesRequest.build_chat_params` and the
//! `input_item_parsing` validator in `responses/protocol.py`): `instructions`
//! as a first system message, a string `input` as a user message, items as
//! chat messages (a `function_call` joins the assistant message before it, a
//! `function_call_output` is a tool message, a `reasoning` item is an
//! assistant's reasoning), flat function tools in the chat shape, and a final
//! message left `in_progress` or `incomplete` continued. Rendered text is
//! encoded with special tokens: `build_tok_params` leaves
//! `TokenizeParams.add_special_tokens` at its default, true.

use super::chat::{
    content_text, function_def, normalize_turn, opt_str, ChatInput, ChatTurn, Inexact,
};
use super::json::Json;

/// The `/v1/responses` fields that make the prompt.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ResponsesFields {
    pub instructions: Option<String>,
    pub input: Json,
    pub tools: Option<Json>,
    pub chat_template_kwargs: Option<Json>,
    /// `reasoning.effort`.
    pub reasoning_effort: Option<String>,
    pub previous_response_id: bool,
}

impl ChatInput {
    /// A `/v1/responses` request.
    pub fn responses(f: ResponsesFields) -> Result<Self, Inexact> {
        if f.previous_response_id {
            return Err(Inexact::PreviousResponse);
        }
        let mut messages = Vec::new();
        if let Some(i) = f.instructions.filter(|i| !i.is_empty()) {
            messages.push(ChatTurn {
                role: "system".into(),
                content: i,
                ..ChatTurn::default()
            });
        }
        let continue_final = match &f.input {
            Json::String(s) => {
                messages.push(ChatTurn {
                    role: "user".into(),
                    content: s.clone(),
                    ..ChatTurn::default()
                });
                false
            }
            Json::Array(items) => {
                for item in items {
                    responses_item(item, &mut messages)?;
                }
                items.last().is_some_and(continues)
            }
            _ => return Err(Inexact::Unsupported),
        };
        let messages = messages
            .into_iter()
            .map(normalize_turn)
            .collect::<Result<Vec<_>, _>>()?;
        let tools = match f.tools.as_ref().and_then(Json::as_array) {
            Some(list) if !list.is_empty() => Some(responses_tools(list)?),
            _ => None,
        };
        let overrides = vec![
            ("add_generation_prompt".to_owned(), (!continue_final).into()),
            ("continue_final_message".to_owned(), continue_final.into()),
        ];
        let mut input = Self::assemble(
            messages,
            tools,
            f.chat_template_kwargs.as_ref(),
            overrides,
            f.reasoning_effort.as_deref(),
        )?;
        input.add_special_tokens = true;
        Ok(input)
    }

    /// A whole `/v1/responses` body.
    pub fn from_responses_body(body: &Json) -> Result<Self, Inexact> {
        let effort = match body.field("reasoning") {
            None => None,
            Some(r) => opt_str(r, "effort")?,
        };
        Self::responses(ResponsesFields {
            instructions: opt_str(body, "instructions")?,
            input: body.field("input").cloned().unwrap_or_default(),
            tools: body.field("tools").cloned(),
            chat_template_kwargs: body.field("chat_template_kwargs").cloned(),
            reasoning_effort: effort,
            previous_response_id: body.field("previous_response_id").is_some(),
        })
    }
}

/// Flat Responses function tools in the chat shape (`construct_tool_dicts`).
fn responses_tools(list: &[Json]) -> Result<Json, Inexact> {
    let mut out = Vec::with_capacity(list.len());
    for t in list {
        if t.field("type").and_then(Json::as_str) != Some("function") {
            return Err(Inexact::ResponsesItem);
        }
        out.push(Json::Object(vec![
            ("type".to_owned(), Json::from("function")),
            ("function".to_owned(), function_def(t, None)?),
        ]));
    }
    Ok(Json::Array(out))
}

/// Whether the final input item is a message (or reasoning) left open.
fn continues(item: &Json) -> bool {
    let kind = item
        .field("type")
        .and_then(Json::as_str)
        .unwrap_or("message");
    matches!(kind, "message" | "reasoning")
        && matches!(
            item.field("status").and_then(Json::as_str),
            Some("in_progress" | "incomplete")
        )
}

/// `_construct_message_from_response_item`: adds `item` to `messages`, or
/// merges it into the assistant message before it.
fn responses_item(item: &Json, messages: &mut Vec<ChatTurn>) -> Result<(), Inexact> {
    let kind = item.field("type").and_then(Json::as_str);
    let prev = messages.last_mut().filter(|m| m.role == "assistant");
    match kind {
        Some("function_call") => {
            if item.field("namespace").is_some() {
                return Err(Inexact::ResponsesItem);
            }
            let call = Json::Object(vec![
                (
                    "id".to_owned(),
                    item.field("call_id").cloned().unwrap_or_default(),
                ),
                (
                    "function".to_owned(),
                    Json::Object(vec![
                        (
                            "name".to_owned(),
                            item.field("name").cloned().unwrap_or_default(),
                        ),
                        (
                            "arguments".to_owned(),
                            item.field("arguments").cloned().unwrap_or_default(),
                        ),
                    ]),
                ),
                ("type".to_owned(), Json::from("function")),
            ]);
            match prev {
                Some(p) => match &mut p.tool_calls {
                    Some(Json::Array(calls)) => calls.push(call),
                    _ => p.tool_calls = Some(Json::Array(vec![call])),
                },
                None => messages.push(ChatTurn {
                    role: "assistant".into(),
                    tool_calls: Some(Json::Array(vec![call])),
                    ..ChatTurn::default()
                }),
            }
        }
        Some("function_call_output") => {
            let output = match item.field("output") {
                Some(Json::String(s)) => s.clone(),
                _ => return Err(Inexact::ResponsesItem),
            };
            messages.push(ChatTurn {
                role: "tool".into(),
                content: output,
                tool_call_id: Some(item.field("call_id").cloned().unwrap_or_default()),
                ..ChatTurn::default()
            });
        }
        Some("reasoning") => {
            if item.field("encrypted_content").is_some() {
                return Err(Inexact::ResponsesItem);
            }
            let first_text = |key: &str| {
                item.field(key)
                    .and_then(Json::as_array)
                    .and_then(|l| l.first())
                    .and_then(|c| c.field("text"))
                    .and_then(Json::as_str)
                    .map(str::to_owned)
            };
            let text = first_text("content")
                .or_else(|| first_text("summary"))
                .unwrap_or_default();
            match prev {
                Some(p) if p.reasoning.is_none() => p.reasoning = Some(text),
                _ => messages.push(ChatTurn {
                    role: "assistant".into(),
                    reasoning: Some(text),
                    ..ChatTurn::default()
                }),
            }
        }
        None | Some("message") => {
            let role = item
                .field("role")
                .and_then(Json::as_str)
                .ok_or(Inexact::ResponsesItem)?;
            if role == "assistant" {
                // The first part's text (`content[0].text`), as vLLM takes it.
                let text = match item.field("content") {
                    Some(Json::String(s)) => s.clone(),
                    Some(Json::Array(parts)) => parts
                        .first()
                        .and_then(|p| p.field("text"))
                        .and_then(Json::as_str)
                        .ok_or(Inexact::ResponsesItem)?
                        .to_owned(),
                    _ => return Err(Inexact::ResponsesItem),
                };
                match prev {
                    Some(p) if p.content.is_empty() => p.content = text,
                    _ => messages.push(ChatTurn {
                        role: "assistant".into(),
                        content: text,
                        ..ChatTurn::default()
                    }),
                }
            } else {
                messages.push(ChatTurn {
                    role: role.to_owned(),
                    content: content_text(item.field("content"), &[])?,
                    name: item.field("name").and_then(Json::as_str).map(str::to_owned),
                    ..ChatTurn::default()
                });
            }
        }
        Some(_) => return Err(Inexact::ResponsesItem),
    }
    Ok(())
}
