//! What a chat template is given, built from a request the way vLLM 0.32 builds it.
//!
//! vLLM renders a chat request with Hugging Face's `apply_chat_template`
//! (`vllm/renderers/hf.py::safe_apply_chat_template`), and the template sees
//! more than the messages. This module mirrors, field by field:
//!
//! - **messages** (`vllm/renderers/chat_utils.py::_parse_chat_message_content`
//!   and `_postprocess_messages`): text parts joined by newlines; an
//!   assistant's `tool_calls` kept, with each call's `arguments` (a JSON
//!   string: pydantic refuses an object) parsed into an object (an empty,
//!   unparsable or non-object one becomes `{}`), an empty list dropped;
//!   `reasoning` copied to `reasoning` and `reasoning_content`; a tool
//!   message's `tool_call_id`; `name`.
//! - **tools**: each as `ChatCompletionToolsParam.model_dump()` gives it
//!   (`{"type", "function": {"name", "description", "parameters"[, "strict"]}}`,
//!   `null` for a missing description or parameters). `tool_choice` does not
//!   change them: vLLM drops the tools for `tool_choice: "none"` only under
//!   `--exclude-tools-when-tool-choice-none` (`vllm/renderers/online_renderer.py`).
//! - **chat_template_kwargs** (`ChatCompletionRequest.build_chat_params`,
//!   `vllm/renderers/params.py::merge_kwargs`): the client's kwargs, then the
//!   request's own `add_generation_prompt`, `continue_final_message`,
//!   `documents` and `reasoning_effort` over them (a `null` is not set),
//!   `enable_thinking = reasoning_effort != "none"` unless the client set it;
//!   a kwarg whose value is `null` or `"auto"` is dropped; a `tools` kwarg
//!   replaces the request's tools. Hugging Face takes `documents`,
//!   `add_generation_prompt` and `continue_final_message` as its own
//!   arguments; every other kwarg is a template variable, over the special
//!   tokens (`transformers/tokenization_utils_base.py::apply_chat_template`).
//! - **response_format** changes nothing in the prompt: vLLM's HF renderer
//!   never reads it (it is metadata for other renderers).
//! - **`/v1/responses`**: `super::responses` builds the same input from
//!   `input` and `instructions`.
//!
//! What cannot be mirrored is refused with an [`Inexact`] reason; the caller
//! then keys the request approximately, on its text.

use super::json::Json;
use super::ChatMessage;

/// Why a request cannot be keyed exactly as the engine keys it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Inexact {
    /// A content part that is not text (image, audio, video, file, ...): the
    /// engine's processor expands it into tokens kvmesh does not compute.
    Multimodal,
    /// A Responses input item or tool kvmesh does not render.
    ResponsesItem,
    /// `previous_response_id`: the history lives on the engine that answered.
    PreviousResponse,
    /// A field the engine would refuse, or one that picks another template.
    Unsupported,
    /// The chat template failed to render what the request holds.
    Template,
}

impl Inexact {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Multimodal => "multimodal",
            Self::ResponsesItem => "responses_item",
            Self::PreviousResponse => "previous_response",
            Self::Unsupported => "unsupported_field",
            Self::Template => "template_error",
        }
    }

    pub const ALL: [Inexact; 5] = [
        Self::Multimodal,
        Self::ResponsesItem,
        Self::PreviousResponse,
        Self::Unsupported,
        Self::Template,
    ];
}

/// One message as the template sees it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChatTurn {
    pub role: String,
    /// Text content, parts joined by newlines.
    pub content: String,
    /// An assistant's calls (normalized by [`ChatInput::chat`]).
    pub tool_calls: Option<Json>,
    /// A tool message's `tool_call_id`, when the key is present.
    pub tool_call_id: Option<Json>,
    pub name: Option<String>,
    pub reasoning: Option<String>,
}

/// The request fields beside `messages` that reach the template.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChatFields {
    pub tools: Option<Json>,
    pub documents: Option<Json>,
    pub chat_template_kwargs: Option<Json>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub reasoning_effort: Option<String>,
}

/// Everything a chat template is given for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatInput {
    pub messages: Vec<ChatTurn>,
    /// The tool list, as vLLM hands it over (`None`: the template sees `none`).
    pub tools: Option<Json>,
    pub documents: Option<Json>,
    /// Template variables beyond these (the client's `chat_template_kwargs`,
    /// `reasoning_effort`, `enable_thinking`).
    pub kwargs: Vec<(String, Json)>,
    pub add_generation_prompt: bool,
    /// Leave the final message open: the rendered text stops at its content.
    pub continue_final_message: bool,
    /// Whether the rendered text is encoded with the tokenizer's special
    /// tokens (BOS): a chat request's `add_special_tokens` (default false);
    /// always for `/v1/responses`, whose `build_tok_params` leaves
    /// `TokenizeParams.add_special_tokens` at its default, true.
    pub add_special_tokens: bool,
}

/// `apply_chat_template`'s own arguments: never template variables.
const HF_ARGS: [&str; 11] = [
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
];

impl ChatInput {
    /// A chat completion (or `/tokenize` chat) request.
    pub fn chat(messages: Vec<ChatTurn>, f: ChatFields) -> Result<Self, Inexact> {
        let messages = messages
            .into_iter()
            .map(normalize_turn)
            .collect::<Result<Vec<_>, _>>()?;
        let tools = match f.tools.filter(|t| !t.is_null()) {
            Some(t) => Some(chat_tools(&t)?),
            None => None,
        };
        if let Some(d) = &f.documents {
            check_documents(d)?;
        }
        let add_generation_prompt = f.add_generation_prompt.unwrap_or(true);
        let continue_final_message = f.continue_final_message.unwrap_or(false);
        let mut overrides = vec![
            (
                "add_generation_prompt".to_owned(),
                add_generation_prompt.into(),
            ),
            (
                "continue_final_message".to_owned(),
                continue_final_message.into(),
            ),
        ];
        if let Some(d) = f.documents.filter(|d| !d.is_null()) {
            overrides.push(("documents".to_owned(), d));
        }
        Self::assemble(
            messages,
            tools,
            f.chat_template_kwargs.as_ref(),
            overrides,
            f.reasoning_effort.as_deref(),
        )
    }

    /// The kwargs merge of `build_chat_params` + `with_defaults`, then
    /// Hugging Face's split of its own arguments from template variables.
    pub(super) fn assemble(
        messages: Vec<ChatTurn>,
        mut tools: Option<Json>,
        user_kwargs: Option<&Json>,
        mut overrides: Vec<(String, Json)>,
        reasoning_effort: Option<&str>,
    ) -> Result<Self, Inexact> {
        let user: &[(String, Json)] = match user_kwargs {
            None | Some(Json::Null) => &[],
            Some(Json::Object(o)) => o,
            Some(_) => return Err(Inexact::Unsupported),
        };
        if let Some(e) = reasoning_effort {
            overrides.push(("reasoning_effort".to_owned(), e.into()));
            if !user.iter().any(|(k, _)| k == "enable_thinking") {
                overrides.push(("enable_thinking".to_owned(), (e != "none").into()));
            }
        }
        let mut merged: Vec<(String, Json)> = user.to_vec();
        for (k, v) in overrides {
            match merged.iter_mut().find(|(mk, _)| *mk == k) {
                Some(slot) => slot.1 = v,
                None => merged.push((k, v)),
            }
        }
        // `with_defaults` drops unset values (`None`, "auto") of the request's kwargs.
        merged.retain(|(_, v)| !v.is_null() && v.as_str() != Some("auto"));
        let mut kwargs = Vec::with_capacity(merged.len());
        let (mut add_generation_prompt, mut continue_final_message) = (true, false);
        let mut documents = None;
        for (k, v) in merged {
            match k.as_str() {
                // A template of the client's own, or arguments that collide
                // with the renderer's: vLLM refuses them.
                "chat_template" | "messages" | "conversation" => return Err(Inexact::Unsupported),
                "tools" => tools = Some(v),
                "add_generation_prompt" => add_generation_prompt = v.truthy(),
                "continue_final_message" => continue_final_message = v.truthy(),
                "documents" => documents = Some(v),
                k if HF_ARGS.contains(&k) => {}
                _ => kwargs.push((k, v)),
            }
        }
        if add_generation_prompt && continue_final_message {
            // vLLM answers 400: nothing to key.
            return Err(Inexact::Unsupported);
        }
        Ok(Self {
            messages,
            tools,
            documents,
            kwargs,
            add_generation_prompt,
            continue_final_message,
            add_special_tokens: false,
        })
    }

    /// The messages as role and text only (approximate keys; tokenizers
    /// that render nothing else, such as the simulator's).
    pub fn flat(&self) -> Vec<ChatMessage> {
        self.messages
            .iter()
            .map(|m| ChatMessage {
                role: m.role.clone(),
                content: m.content.clone(),
            })
            .collect()
    }

    /// The conversation as the template's `messages`, keys in vLLM's order.
    pub fn messages_json(&self) -> Json {
        Json::Array(self.messages.iter().map(turn_json).collect())
    }
}

pub(super) fn turn_json(m: &ChatTurn) -> Json {
    let mut o = vec![
        ("role".to_owned(), Json::String(m.role.clone())),
        ("content".to_owned(), Json::String(m.content.clone())),
    ];
    if let Some(c) = &m.tool_calls {
        o.push(("tool_calls".to_owned(), c.clone()));
    }
    if let Some(r) = &m.reasoning {
        o.push(("reasoning".to_owned(), Json::String(r.clone())));
        o.push(("reasoning_content".to_owned(), Json::String(r.clone())));
    }
    if let Some(id) = &m.tool_call_id {
        o.push(("tool_call_id".to_owned(), id.clone()));
    }
    if let Some(n) = &m.name {
        o.push(("name".to_owned(), Json::String(n.clone())));
    }
    Json::Object(o)
}

/// A `developer` message for a template that names no developer role, as
/// `safe_apply_chat_template` (`vllm/renderers/hf.py`) turns it: into a
/// system message (`_convert_developer_to_system`), then every system
/// message merged into one at the front, their non-empty contents joined by
/// blank lines, when one is not first or there are several
/// (`_consolidate_system_messages`). `None`: no developer message.
pub(super) fn developer_as_system(messages: &[ChatTurn]) -> Option<Vec<ChatTurn>> {
    if !messages.iter().any(|m| m.role == "developer") {
        return None;
    }
    let converted: Vec<ChatTurn> = messages
        .iter()
        .map(|m| {
            let mut m = m.clone();
            if m.role == "developer" {
                m.role = "system".into();
            }
            m
        })
        .collect();
    let mut systems: Vec<&str> = Vec::new();
    let mut needs = false;
    for (i, m) in converted.iter().enumerate() {
        if m.role == "system" {
            needs |= i > 0 || !systems.is_empty();
            if !m.content.is_empty() {
                systems.push(&m.content);
            }
        }
    }
    if !needs {
        return Some(converted);
    }
    let merged = ChatTurn {
        role: "system".into(),
        content: systems.join("\n\n"),
        ..ChatTurn::default()
    };
    let rest = converted.iter().filter(|m| m.role != "system").cloned();
    Some(std::iter::once(merged).chain(rest).collect())
}

/// `_postprocess_messages` on one message: tool calls kept on assistants
/// only, their arguments parsed into objects.
pub(super) fn normalize_turn(mut m: ChatTurn) -> Result<ChatTurn, Inexact> {
    if m.role != "assistant" {
        m.tool_calls = None;
        m.reasoning = None;
    }
    if m.role != "tool" {
        m.tool_call_id = None;
    }
    let Some(calls) = m.tool_calls.take() else {
        return Ok(m);
    };
    let list = match calls {
        Json::Null => return Ok(m),
        Json::Array(list) => list,
        _ => return Err(Inexact::Unsupported),
    };
    if list.is_empty() {
        return Ok(m);
    }
    let mut out = Vec::with_capacity(list.len());
    for call in list {
        let Json::Object(mut fields) = call else {
            return Err(Inexact::Unsupported);
        };
        let kind_ok = fields
            .iter()
            .find(|(k, _)| k == "type")
            .is_none_or(|(_, t)| t.as_str() == Some("function"));
        let Some((_, Json::Object(function))) = fields.iter_mut().find(|(k, _)| k == "function")
        else {
            return Err(Inexact::Unsupported);
        };
        if !kind_ok {
            return Err(Inexact::Unsupported);
        }
        // The request's `arguments` must be a string (pydantic refuses an
        // object); parsed, anything but an object becomes `{}`.
        let parsed = match function.iter().find(|(k, _)| k == "arguments") {
            Some((_, Json::String(s))) => Json::parse(s)
                .ok()
                .filter(|j| j.as_object().is_some())
                .unwrap_or(Json::Object(Vec::new())),
            None | Some((_, Json::Null)) => Json::Object(Vec::new()),
            Some(_) => return Err(Inexact::Unsupported),
        };
        match function.iter_mut().find(|(k, _)| k == "arguments") {
            Some(slot) => slot.1 = parsed,
            None => function.push(("arguments".to_owned(), parsed)),
        }
        out.push(Json::Object(fields));
    }
    m.tool_calls = Some(Json::Array(out));
    Ok(m)
}

/// `[tool.model_dump() for tool in request.tools]`.
fn chat_tools(tools: &Json) -> Result<Json, Inexact> {
    let list = tools.as_array().ok_or(Inexact::Unsupported)?;
    let mut out = Vec::with_capacity(list.len());
    for t in list {
        if t.field("type")
            .is_some_and(|k| k.as_str() != Some("function"))
        {
            return Err(Inexact::Unsupported);
        }
        let function = t.field("function").ok_or(Inexact::Unsupported)?;
        let top_defer = t.field("defer_loading").cloned();
        let mut o = vec![
            ("type".to_owned(), Json::from("function")),
            (
                "function".to_owned(),
                function_def(function, top_defer.clone())?,
            ),
        ];
        if let Some(d) = top_defer {
            o.push(("defer_loading".to_owned(), d));
        }
        out.push(Json::Object(o));
    }
    Ok(Json::Array(out))
}

/// `FunctionDefinition.model_dump()`: name, description, parameters, then
/// strict and defer_loading when set.
pub(super) fn function_def(f: &Json, inherited_defer: Option<Json>) -> Result<Json, Inexact> {
    let name = f
        .field("name")
        .and_then(Json::as_str)
        .ok_or(Inexact::Unsupported)?;
    let parameters = f.field("parameters").cloned().unwrap_or_default();
    if !matches!(parameters, Json::Null | Json::Object(_)) {
        return Err(Inexact::Unsupported);
    }
    let description = f.field("description").cloned().unwrap_or_default();
    if !matches!(description, Json::Null | Json::String(_)) {
        return Err(Inexact::Unsupported);
    }
    let mut o = vec![
        ("name".to_owned(), Json::from(name)),
        ("description".to_owned(), description),
        ("parameters".to_owned(), parameters),
    ];
    if let Some(s) = f.field("strict") {
        o.push(("strict".to_owned(), s.clone()));
    }
    if let Some(d) = f.field("defer_loading").cloned().or(inherited_defer) {
        o.push(("defer_loading".to_owned(), d));
    }
    Ok(Json::Object(o))
}

/// `documents: list[dict[str, str]]`; anything else is a 400.
fn check_documents(d: &Json) -> Result<(), Inexact> {
    match d {
        Json::Null => Ok(()),
        Json::Array(list) => {
            let ok = list.iter().all(|doc| {
                doc.as_object()
                    .is_some_and(|o| o.iter().all(|(_, v)| v.as_str().is_some()))
            });
            ok.then_some(()).ok_or(Inexact::Unsupported)
        }
        _ => Err(Inexact::Unsupported),
    }
}

/// One chat message of a request body, as `_parse_chat_message_content` reads it.
fn wire_turn(m: &Json) -> Result<ChatTurn, Inexact> {
    let role = m
        .field("role")
        .and_then(Json::as_str)
        .ok_or(Inexact::Unsupported)?;
    let content = content_text(m.field("content"), &["thinking", "refusal"])?;
    Ok(ChatTurn {
        role: role.to_owned(),
        content,
        tool_calls: m.get("tool_calls").cloned(),
        tool_call_id: m.get("tool_call_id").cloned(),
        name: m.field("name").and_then(Json::as_str).map(str::to_owned),
        reasoning: m
            .field("reasoning")
            .and_then(Json::as_str)
            .map(str::to_owned),
    })
}

/// The text of a message's content: a string, or its parts' text joined by
/// newlines (as vLLM joins them). `text`, `input_text` and `output_text`
/// parts give their `text`; a part of a kind in `own_field` gives the field
/// named like its kind (chat's `thinking` and `refusal`); any other part
/// (an image, audio) cannot be keyed on its text alone.
pub(super) fn content_text(content: Option<&Json>, own_field: &[&str]) -> Result<String, Inexact> {
    match content {
        None => Ok(String::new()),
        Some(Json::String(s)) => Ok(s.clone()),
        Some(Json::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for p in parts {
                let kind = match p {
                    Json::String(s) => {
                        texts.push(s.as_str());
                        continue;
                    }
                    _ => p.field("type").and_then(Json::as_str).unwrap_or("text"),
                };
                let key = match kind {
                    "text" | "input_text" | "output_text" => "text",
                    k if own_field.contains(&k) => k,
                    _ => return Err(Inexact::Multimodal),
                };
                if let Some(t) = p.field(key).and_then(Json::as_str) {
                    texts.push(t);
                }
            }
            Ok(texts.join("\n"))
        }
        Some(_) => Err(Inexact::Unsupported),
    }
}

fn opt_bool(body: &Json, key: &str) -> Result<Option<bool>, Inexact> {
    match body.field(key) {
        None => Ok(None),
        Some(Json::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(Inexact::Unsupported),
    }
}

pub(super) fn opt_str(body: &Json, key: &str) -> Result<Option<String>, Inexact> {
    match body.field(key) {
        None => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(Inexact::Unsupported),
    }
}

impl ChatInput {
    /// A whole chat completion (or `/tokenize` chat) body.
    pub fn from_chat_body(body: &Json) -> Result<Self, Inexact> {
        if body.field("chat_template").is_some() {
            return Err(Inexact::Unsupported);
        }
        let messages = body
            .field("messages")
            .and_then(Json::as_array)
            .ok_or(Inexact::Unsupported)?
            .iter()
            .map(wire_turn)
            .collect::<Result<Vec<_>, _>>()?;
        let mut input = Self::chat(
            messages,
            ChatFields {
                tools: body.field("tools").cloned(),
                documents: body.field("documents").cloned(),
                chat_template_kwargs: body.field("chat_template_kwargs").cloned(),
                add_generation_prompt: opt_bool(body, "add_generation_prompt")?,
                continue_final_message: opt_bool(body, "continue_final_message")?,
                reasoning_effort: opt_str(body, "reasoning_effort")?,
            },
        )?;
        input.add_special_tokens = opt_bool(body, "add_special_tokens")?.unwrap_or(false);
        Ok(input)
    }
}
