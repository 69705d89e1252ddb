//! The request view: what later stages need from an inference body, parsed once.
//!
//! Fields the proxy does not use are ignored (clients send many), but the ones
//! it reads must have the types the OpenAI API gives them, so a request the
//! engine would reject is rejected here with the same 400, before any routing.

use kvmesh_filters::prefix::tokenize::ChatMessage;
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
}

#[derive(Deserialize)]
struct Wire<'a> {
    model: Option<String>,
    #[serde(borrow)]
    prompt: Option<WirePrompt<'a>>,
    messages: Option<Vec<WireMessage>>,
    stream: Option<bool>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    cache_salt: Option<String>,
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

impl<'de: 'a, 'a> Deserialize<'de> for WirePrompt<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor(std::marker::PhantomData))
    }
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
struct WireMessage {
    role: String,
    #[serde(default)]
    content: Option<WireContent>,
}

/// A message's `content`: a string or an array of parts (decoded by hand for
/// the reason given at [`WirePrompt`]).
enum WireContent {
    Text(String),
    Parts(Vec<WirePart>),
}

impl<'de> Deserialize<'de> for WireContent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ContentVisitor)
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
        let w: Wire = serde_json::from_slice(body)?;
        let text = |s: Cow<'_, str>| match (s, shared) {
            (Cow::Borrowed(s), Some(b)) => Text::from_body(b, s),
            (s, _) => Text::from(s.into_owned()),
        };
        let prompt = match shape {
            Shape::Embedding => Prompt::None,
            Shape::Completion => match w.prompt {
                None => Prompt::None,
                Some(WirePrompt::Text(s)) => Prompt::Text(text(s)),
                Some(WirePrompt::Texts(v)) => Prompt::Texts(v),
                Some(WirePrompt::Tokens(v)) => Prompt::Tokens(v),
                Some(WirePrompt::TokenBatches(v)) => Prompt::TokenBatches(v),
            },
            Shape::Chat => match w.messages {
                None => Prompt::None,
                Some(ms) => Prompt::Chat(ms.into_iter().map(flatten).collect()),
            },
        };
        Ok(Self {
            model: w.model,
            prompt,
            stream: w.stream.unwrap_or(false),
            max_tokens: w.max_completion_tokens.or(w.max_tokens),
            cache_salt: w.cache_salt,
        })
    }

    /// The LoRA adapter this request names: its model, when that is not one of
    /// the engine's base models.
    pub fn adapter<'a>(&'a self, base_models: &[&str]) -> Option<&'a str> {
        self.model.as_deref().filter(|m| !base_models.contains(m))
    }
}

/// Multi-part content becomes its text parts joined by newlines, as vLLM does
/// for templates that take string content.
fn flatten(m: WireMessage) -> ChatMessage {
    let content = match m.content {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn completion_view() {
        let v = RequestView::parse(
            br#"{"model":"m","prompt":"hi","stream":true,"max_tokens":5,"cache_salt":"t","temperature":0}"#,
            Shape::Completion,
        )
        .unwrap();
        assert_eq!(v.model.as_deref(), Some("m"));
        assert_eq!(v.prompt, Prompt::Text("hi".into()));
        assert!(v.stream);
        assert_eq!(v.max_tokens, Some(5));
        assert_eq!(v.cache_salt.as_deref(), Some("t"));
        assert_eq!(v.adapter(&["m"]), None);
        assert_eq!(v.adapter(&["base"]), Some("m"));
    }

    #[test]
    fn token_prompts_and_chat_parts() {
        let v = RequestView::parse(br#"{"prompt":[1,2,3]}"#, Shape::Completion).unwrap();
        assert_eq!(v.prompt, Prompt::Tokens(vec![1, 2, 3]));
        let v = RequestView::parse(
            br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{}},{"type":"text","text":"b"}]},{"role":"assistant","content":null}],"max_completion_tokens":3,"max_tokens":9}"#,
            Shape::Chat,
        )
        .unwrap();
        let Prompt::Chat(ms) = v.prompt else {
            panic!("not chat")
        };
        assert_eq!(ms[0].content, "a\nb");
        assert_eq!(ms[1].content, "");
        assert_eq!(v.max_tokens, Some(3));
    }

    #[test]
    fn every_prompt_shape() {
        let parse = |b: &str| RequestView::parse(b.as_bytes(), Shape::Completion).map(|v| v.prompt);
        assert_eq!(
            parse(r#"{"prompt":["a","b\n"]}"#).unwrap(),
            Prompt::Texts(vec!["a".into(), "b\n".into()])
        );
        assert_eq!(
            parse(r#"{"prompt":[[1,2],[],[4294967295]]}"#).unwrap(),
            Prompt::TokenBatches(vec![vec![1, 2], vec![], vec![u32::MAX]])
        );
        assert_eq!(
            parse(r#"{"prompt":[]}"#).unwrap(),
            Prompt::Texts(Vec::new())
        );
        assert_eq!(parse(r#"{"prompt":null}"#).unwrap(), Prompt::None);
        for bad in [
            r#"{"prompt":["a",1]}"#,
            r#"{"prompt":[1,"a"]}"#,
            r#"{"prompt":[[1],2]}"#,
            r#"{"prompt":[4294967296]}"#,
            r#"{"prompt":[-1]}"#,
            r#"{"prompt":[1.5]}"#,
            r#"{"prompt":{"text":"a"}}"#,
            r#"{"prompt":[[1,"a"]]}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad} parsed");
        }
        let chat = |b: &str| RequestView::parse(b.as_bytes(), Shape::Chat);
        assert!(chat(r#"{"messages":[{"role":"user","content":7}]}"#).is_err());
        assert!(chat(r#"{"messages":[{"role":"user","content":"x"}]}"#).is_ok());
    }

    #[test]
    fn shared_text_is_a_slice_of_the_body_and_escapes_are_decoded() {
        let body = Bytes::from_static(br#"{"model":"m","prompt":"plain text \u00e9 no"}"#);
        let v = RequestView::parse_shared(&body, Shape::Completion).unwrap();
        // An escape: decoded into an owned copy.
        assert_eq!(v.prompt, Prompt::Text("plain text \u{e9} no".into()));
        let body = Bytes::from(r#"{"prompt":"héllo wörld","stream":false}"#.to_owned());
        let v = RequestView::parse_shared(&body, Shape::Completion).unwrap();
        let Prompt::Text(t) = &v.prompt else {
            panic!("not text")
        };
        assert_eq!(t.as_str(), "héllo wörld");
        assert!(matches!(t.0, TextRepr::Shared(_)), "borrowed from the body");
        let inside = body.as_ptr_range();
        assert!(inside.contains(&t.as_str().as_ptr()));
        assert_eq!(v, RequestView::parse(&body, Shape::Completion).unwrap());
        assert_eq!(format!("{t:?}"), "\"héllo wörld\"");
    }

    #[test]
    fn wrong_types_are_errors() {
        assert!(RequestView::parse(br#"{"stream":"yes"}"#, Shape::Completion).is_err());
        assert!(RequestView::parse(br#"[1]"#, Shape::Chat).is_err());
        assert!(RequestView::parse(br#"{"model":"m""#, Shape::Chat).is_err());
    }
}
