//! The request view: what later stages need from an inference body, parsed once.
//!
//! Fields the proxy does not use are ignored (clients send many), but the ones
//! it reads must have the types the OpenAI API gives them, so a request the
//! engine would reject is rejected here with the same 400, before any routing.

use kvmesh_filters::prefix::tokenize::{ChatInput, ChatMessage, Inexact};
use std::borrow::Cow;
use std::fmt;

use bytes::Bytes;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

/// What an inference call asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestView {
    /// The `model` field: a base model or, for LoRA, an adapter name the engine
    /// serves (see [`RequestView::adapter`]).
    pub model: Option<String>,
    pub prompt: Prompt,
    pub stream: bool,
    /// `max_completion_tokens`, else `max_tokens`.
    pub max_tokens: Option<u64>,
    /// vLLM's per-tenant prefix-cache isolation salt.
    pub cache_salt: Option<String>,
    /// What a chat or `/v1/responses` request gives the chat template beyond
    /// plain messages (tools, documents, a tool-call history, kwargs, an open
    /// final message), as vLLM renders it (`super::shapes`); `None` when
    /// `prompt`'s messages are all of it. `prompt` holds the messages' text
    /// either way.
    pub chat: Option<Box<ChatInput>>,
    /// Why this request cannot be keyed exactly as the engine keys it (its
    /// keys are then approximate, on `prompt`'s text); `None`: exact.
    pub inexact: Option<Inexact>,
}

/// The prompt in the shape the client sent it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Prompt {
    /// Embeddings, or a body without a prompt.
    #[default]
    None,
    Text(Text),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenBatches(Vec<Vec<u32>>),
    /// Chat messages, multi-part text content flattened.
    Chat(Vec<ChatMessage>),
}

/// A text prompt. A JSON string without escapes is a slice of the request
/// body itself ([`RequestView::parse_shared`]): a 200 KB prompt is then
/// neither copied nor allocated again; the body is held for the request's
/// life anyway, to be sent upstream.
#[derive(Clone)]
pub struct Text(TextRepr);

#[derive(Clone)]
enum TextRepr {
    Owned(String),
    /// Valid UTF-8: only [`Text::from_body`] builds it, from a `&str`.
    Shared(Bytes),
}

impl Text {
    /// `s` as a slice of `body` when it lies inside it, else a copy.
    fn from_body(body: &Bytes, s: &str) -> Self {
        let (start, end) = (body.as_ptr() as usize, body.as_ptr() as usize + body.len());
        let at = s.as_ptr() as usize;
        if at >= start && at + s.len() <= end {
            let from = at - start;
            Self(TextRepr::Shared(body.slice(from..from + s.len())))
        } else {
            Self(TextRepr::Owned(s.to_owned()))
        }
    }

    pub fn as_str(&self) -> &str {
        match &self.0 {
            TextRepr::Owned(s) => s,
            // SAFETY: `Shared` holds the bytes of a `&str` (see `from_body`),
            // and `Bytes` is immutable.
            TextRepr::Shared(b) => unsafe { std::str::from_utf8_unchecked(b) },
        }
    }
}

impl std::ops::Deref for Text {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Debug for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl PartialEq for Text {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for Text {}

impl From<String> for Text {
    fn from(s: String) -> Self {
        Self(TextRepr::Owned(s))
    }
}

impl From<&str> for Text {
    fn from(s: &str) -> Self {
        Self(TextRepr::Owned(s.to_owned()))
    }
}

/// Which body shape to expect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Completion,
    Chat,
    Embedding,
    /// `/v1/responses`: `input` and `instructions` (`super::shapes`).
    Responses,
}

/// The fields kvmesh reads. `QUICK`: the body holds no byte below 0x20, so
/// no string in it can hold a raw control character (which JSON forbids),
/// and the long ones, the prompt and message contents, are read as bytes
/// (see [`Quick`]).
#[derive(Deserialize)]
struct Wire<'a, const QUICK: bool> {
    model: Option<String>,
    #[serde(borrow)]
    prompt: Option<Quick<WirePrompt<'a>, QUICK>>,
    messages: Option<Vec<WireMessage<QUICK>>>,
    stream: Option<bool>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    cache_salt: Option<String>,
    // Chat fields that reach the template: only whether they are there
    // (`super::shapes` reads the body again, keeping key order, when one is).
    tools: Option<de::IgnoredAny>,
    documents: Option<de::IgnoredAny>,
    chat_template_kwargs: Option<de::IgnoredAny>,
    add_generation_prompt: Option<de::IgnoredAny>,
    continue_final_message: Option<de::IgnoredAny>,
    reasoning_effort: Option<de::IgnoredAny>,
    add_special_tokens: Option<de::IgnoredAny>,
    chat_template: Option<de::IgnoredAny>,
}

impl<const QUICK: bool> Wire<'_, QUICK> {
    /// Whether the template gets more than role and text content.
    fn beyond_messages(&self) -> bool {
        let fields = [
            &self.tools,
            &self.documents,
            &self.chat_template_kwargs,
            &self.add_generation_prompt,
            &self.continue_final_message,
            &self.reasoning_effort,
            &self.add_special_tokens,
            &self.chat_template,
        ];
        fields.iter().any(|f| f.is_some())
            || self.messages.iter().flatten().any(WireMessage::beyond_text)
    }
}

/// `prompt`: a string, strings, token ids or batches of token ids. Decoded by
/// hand rather than with `#[serde(untagged)]`, which buffers the value (a
/// 200 KB prompt copied twice) before trying each shape. A string without
/// escapes is borrowed from the body.
enum WirePrompt<'a> {
    Text(Cow<'a, str>),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenBatches(Vec<Vec<u32>>),
}

impl<'de: 'a, 'a, const QUICK: bool> Deserialize<'de> for Quick<WirePrompt<'a>, QUICK> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = PromptVisitor(std::marker::PhantomData);
        if QUICK {
            d.deserialize_bytes(v).map(Quick)
        } else {
            d.deserialize_any(v).map(Quick)
        }
    }
}

/// A long string field read the quick way when `QUICK`: serde_json hands a
/// string asked for as bytes over after a `memchr` for its closing quote or
/// next escape (vector compares), where a string asked for as text is
/// scanned a word at a time for control characters too and then checked as
/// UTF-8; that was a fifth of the proxy's CPU on 200 KB prompts
/// (docs/bench-tool.md, "the prompt read as bytes"). The bytes are checked as
/// UTF-8 here (SIMD), which also refuses an unpaired `\u` surrogate, and a
/// control character cannot be among them since the body holds none. An
/// array still arrives as a sequence.
struct Quick<T, const QUICK: bool>(T);

/// `v` as text, or the client's error.
fn utf8<E: de::Error>(v: &[u8]) -> Result<&str, E> {
    simdutf8::basic::from_utf8(v)
        .map_err(|_| E::custom("a string that is not UTF-8 (or holds an unpaired \\u surrogate)"))
}

struct PromptVisitor<'a>(std::marker::PhantomData<&'a ()>);

impl<'de: 'a, 'a> Visitor<'de> for PromptVisitor<'a> {
    type Value = WirePrompt<'a>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, an array of strings, of token ids or of arrays of token ids")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<WirePrompt<'a>, E> {
        Ok(WirePrompt::Text(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<WirePrompt<'a>, E> {
        Ok(WirePrompt::Text(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<WirePrompt<'a>, E> {
        Ok(WirePrompt::Text(Cow::Owned(v)))
    }

    fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<WirePrompt<'a>, E> {
        utf8(v).map(|s| WirePrompt::Text(Cow::Borrowed(s)))
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<WirePrompt<'a>, E> {
        utf8(v).map(|s| WirePrompt::Text(Cow::Owned(s.to_owned())))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<WirePrompt<'a>, A::Error> {
        // The first element decides the shape; the rest must share it.
        let Some(first) = seq.next_element::<PromptItem>()? else {
            return Ok(WirePrompt::Texts(Vec::new()));
        };
        Ok(match first {
            PromptItem::Text(s) => WirePrompt::Texts(same_shape(s, &mut seq, |i| match i {
                PromptItem::Text(s) => Some(s),
                _ => None,
            })?),
            PromptItem::Token(t) => WirePrompt::Tokens(same_shape(t, &mut seq, |i| match i {
                PromptItem::Token(t) => Some(t),
                _ => None,
            })?),
            PromptItem::Batch(b) => {
                WirePrompt::TokenBatches(same_shape(b, &mut seq, |i| match i {
                    PromptItem::Batch(b) => Some(b),
                    _ => None,
                })?)
            }
        })
    }
}

/// `first` and the rest of `seq`, each of which `pick` must accept.
fn same_shape<'de, T, A: SeqAccess<'de>>(
    first: T,
    seq: &mut A,
    pick: impl Fn(PromptItem) -> Option<T>,
) -> Result<Vec<T>, A::Error> {
    let mut v = vec![first];
    while let Some(item) = seq.next_element::<PromptItem>()? {
        let item = pick(item).ok_or_else(|| {
            de::Error::custom("prompt: an array mixes strings, token ids and arrays")
        })?;
        v.push(item);
    }
    Ok(v)
}

/// One element of an array `prompt`.
enum PromptItem {
    Text(String),
    Token(u32),
    Batch(Vec<u32>),
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ItemVisitor)
    }
}

struct ItemVisitor;

impl<'de> Visitor<'de> for ItemVisitor {
    type Value = PromptItem;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, a token id (0 to 2^32-1) or an array of token ids")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<PromptItem, E> {
        Ok(PromptItem::Text(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<PromptItem, E> {
        Ok(PromptItem::Text(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<PromptItem, E> {
        u32::try_from(v)
            .map(PromptItem::Token)
            .map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &self))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<PromptItem, E> {
        u32::try_from(v)
            .map(PromptItem::Token)
            .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptItem, A::Error> {
        let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        while let Some(t) = seq.next_element::<u32>()? {
            v.push(t);
        }
        Ok(PromptItem::Batch(v))
    }
}

#[derive(Deserialize)]
struct WireMessage<const QUICK: bool> {
    role: String,
    #[serde(default)]
    content: Option<Quick<WireContent, QUICK>>,
    // Fields beyond role and content the template may read: only whether
    // they are there.
    tool_calls: Option<de::IgnoredAny>,
    tool_call_id: Option<de::IgnoredAny>,
    name: Option<de::IgnoredAny>,
    reasoning: Option<de::IgnoredAny>,
}

impl<const QUICK: bool> WireMessage<QUICK> {
    /// Whether the template reads more of this message than its role and
    /// text (or the message holds a part that is not text).
    fn beyond_text(&self) -> bool {
        let fields = [
            &self.tool_calls,
            &self.tool_call_id,
            &self.name,
            &self.reasoning,
        ];
        fields.iter().any(|f| f.is_some())
            || matches!(&self.content, Some(Quick(WireContent::Parts(parts))) if parts.iter().any(|p| !is_text_part(p.kind.as_deref())))
    }
}

/// Content parts vLLM reads as text (`TEXT_PART_TYPES` in
/// `vllm/renderers/chat_utils.py`); a part without a type is text.
fn is_text_part(kind: Option<&str>) -> bool {
    matches!(
        kind,
        None | Some("text" | "input_text" | "output_text" | "refusal" | "thinking")
    )
}

/// A message's `content`: a string or an array of parts (decoded by hand for
/// the reason given at [`WirePrompt`]).
enum WireContent {
    Text(String),
    Parts(Vec<WirePart>),
}

impl<'de, const QUICK: bool> Deserialize<'de> for Quick<WireContent, QUICK> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if QUICK {
            d.deserialize_bytes(ContentVisitor).map(Quick)
        } else {
            d.deserialize_any(ContentVisitor).map(Quick)
        }
    }
}

struct ContentVisitor;

impl<'de> Visitor<'de> for ContentVisitor {
    type Value = WireContent;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string or an array of content parts")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<WireContent, E> {
        Ok(WireContent::Text(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<WireContent, E> {
        Ok(WireContent::Text(v))
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<WireContent, E> {
        utf8(v).map(|s| WireContent::Text(s.to_owned()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<WireContent, A::Error> {
        let mut parts = Vec::new();
        while let Some(p) = seq.next_element::<WirePart>()? {
            parts.push(p);
        }
        Ok(WireContent::Parts(parts))
    }
}

#[derive(Deserialize)]
struct WirePart {
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    text: Option<String>,
}

impl RequestView {
    /// Parses an inference body. Errors are the client's (malformed JSON or a
    /// field of the wrong type).
    pub fn parse(body: &[u8], shape: Shape) -> Result<Self, serde_json::Error> {
        Self::parse_with(body, None, shape)
    }

    /// [`RequestView::parse`] of a body the request keeps: a text prompt
    /// without JSON escapes is a slice of `body`, not a copy.
    pub fn parse_shared(body: &Bytes, shape: Shape) -> Result<Self, serde_json::Error> {
        Self::parse_with(body, Some(body), shape)
    }

    fn parse_with(
        body: &[u8],
        shared: Option<&Bytes>,
        shape: Shape,
    ) -> Result<Self, serde_json::Error> {
        Ok(if holds_control_bytes(body) {
            Self::from_wire(
                serde_json::from_slice::<Wire<false>>(body)?,
                body,
                shared,
                shape,
            )
        } else {
            Self::from_wire(
                serde_json::from_slice::<Wire<true>>(body)?,
                body,
                shared,
                shape,
            )
        })
    }

    fn from_wire<const QUICK: bool>(
        w: Wire<'_, QUICK>,
        body: &[u8],
        shared: Option<&Bytes>,
        shape: Shape,
    ) -> Self {
        let text = |s: Cow<'_, str>| match (s, shared) {
            (Cow::Borrowed(s), Some(b)) => Text::from_body(b, s),
            (s, _) => Text::from(s.into_owned()),
        };
        let mut chat = None;
        let mut inexact = None;
        let mut max_tokens = w.max_completion_tokens.or(w.max_tokens);
        let beyond = w.beyond_messages();
        let prompt = match shape {
            Shape::Embedding => Prompt::None,
            Shape::Completion => match w.prompt.map(|p| p.0) {
                None => Prompt::None,
                Some(WirePrompt::Text(s)) => Prompt::Text(text(s)),
                Some(WirePrompt::Texts(v)) => Prompt::Texts(v),
                Some(WirePrompt::Tokens(v)) => Prompt::Tokens(v),
                Some(WirePrompt::TokenBatches(v)) => Prompt::TokenBatches(v),
            },
            Shape::Chat => match w.messages {
                None => Prompt::None,
                Some(ms) => {
                    if beyond {
                        match super::shapes::chat(body) {
                            Ok(input) => chat = Some(Box::new(input)),
                            Err(reason) => inexact = Some(reason),
                        }
                    }
                    Prompt::Chat(ms.into_iter().map(flatten).collect())
                }
            },
            Shape::Responses => {
                let (messages, input, limit) = super::shapes::responses(body);
                max_tokens = limit;
                match input {
                    Ok(input) => chat = Some(Box::new(input)),
                    Err(reason) => inexact = Some(reason),
                }
                if messages.is_empty() {
                    Prompt::None
                } else {
                    Prompt::Chat(messages)
                }
            }
        };
        Self {
            model: w.model,
            prompt,
            stream: w.stream.unwrap_or(false),
            max_tokens,
            cache_salt: w.cache_salt,
            chat,
            inexact,
        }
    }

    /// The LoRA adapter this request names: its model, when that is not one of
    /// the engine's base models.
    pub fn adapter<'a>(&'a self, base_models: &[&str]) -> Option<&'a str> {
        self.model.as_deref().filter(|m| !base_models.contains(m))
    }
}

/// Multi-part content becomes its text parts joined by newlines, as vLLM does
/// for templates that take string content.
fn flatten<const QUICK: bool>(m: WireMessage<QUICK>) -> ChatMessage {
    let content = match m.content.map(|c| c.0) {
        None => String::new(),
        Some(WireContent::Text(s)) => s,
        Some(WireContent::Parts(parts)) => parts
            .into_iter()
            .filter_map(|p| p.text)
            .collect::<Vec<_>>()
            .join("\n"),
    };
    ChatMessage {
        role: m.role,
        content,
    }
}

/// Whether any byte of `body` is below 0x20: whitespace between the tokens
/// of a pretty-printed body, or a raw control character inside a string
/// (which JSON forbids). In blocks of 1 KiB, whose minimum the compiler
/// turns into vector instructions.
fn holds_control_bytes(body: &[u8]) -> bool {
    body.chunks(1024)
        .any(|block| block.iter().fold(u8::MAX, |low, &b| low.min(b)) < 0x20)
}

#[cfg(test)]
#[path = "view_tests.rs"]
mod tests;
