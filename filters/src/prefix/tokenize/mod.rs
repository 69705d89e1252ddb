//! Tokenization as the engine does it.
//!
//! A router can only match cached prefixes if it turns a request into the same
//! token ids the engine will. [`Tokenizer`] is that contract; [`Builtin`] is the
//! deterministic tokenizer shared by the engine simulator and the sidecar, so a
//! simulated fleet and its routers agree exactly without any model files.

mod builtin;
mod cache;
mod chat;
mod hf;
mod jinja;
mod json;
mod responses;

pub use builtin::{Builtin, BOS_ID, EOS_ID, FIRST_ORDINARY_ID, MAX_PIECE_CHARS, VOCAB_SIZE};
pub use cache::{CacheStats, CachedTokenizer, CappedIds, TokenCacheConfig};
pub use chat::{ChatFields, ChatInput, ChatTurn, Inexact};
pub use hf::HfTokenizer;
pub use json::Json;
pub use responses::ResponsesFields;

/// One chat message, with multi-part content already flattened to text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// Why a prompt could not be tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("chat template failed to render: {0}")]
    Template(String),
    #[error("tokenizer failed: {0}")]
    Tokenizer(String),
}

/// Turns prompts into token ids the way one engine does.
pub trait Tokenizer: Send + Sync {
    /// Token ids of `text`; with `add_special_tokens` the ids start with BOS, as
    /// vLLM does for a completion prompt.
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError>;

    /// Renders chat messages with the model's chat template, as the engine does
    /// before tokenizing a chat request.
    fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError>;

    /// Renders everything a chat request gives the template (tools,
    /// documents, tool-call history, kwargs, an open final message). A
    /// tokenizer without a template language renders the messages alone, as
    /// the engine it stands for does (the simulator's builtin).
    fn render_chat_input(&self, input: &ChatInput) -> Result<String, TokenizeError> {
        self.render_chat(&input.flat(), input.add_generation_prompt)
    }

    /// Whether the rendered chat text already carries BOS (then chat prompts are
    /// encoded without adding special tokens, as vLLM does).
    fn chat_template_adds_bos(&self) -> bool;

    /// Whether a rendered chat is encoded with special tokens: `input` is the
    /// request's template input (`None`: plain messages). By default when the
    /// template does not emit BOS itself (the simulator's rule).
    fn chat_add_special_tokens(&self, input: Option<&ChatInput>) -> bool {
        let _ = input;
        !self.chat_template_adds_bos()
    }

    /// The text of one token, for engines that synthesise output.
    fn decode_token(&self, id: u32) -> String;

    /// Strings before which a text may be cut, each piece encoded alone (the
    /// first with special tokens as asked, the rest without) and the ids
    /// concatenated, with the same result as encoding it whole. The token
    /// prefix cache uses them; an empty list (the default) disables it.
    fn split_points(&self) -> &[String] {
        &[]
    }

    /// Token ids of a chat request: render, then encode the way the engine does.
    fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat(messages, add_generation_prompt)?;
        self.encode(&text, self.chat_add_special_tokens(None))
    }

    /// Token ids of everything a chat request gives the template.
    fn encode_chat_input(&self, input: &ChatInput) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat_input(input)?;
        self.encode(&text, self.chat_add_special_tokens(Some(input)))
    }
}

/// A shared tokenizer is a tokenizer (so wrappers such as [`CachedTokenizer`]
/// can hold a `&T`, an `Arc<T>` or a `Box<dyn Tokenizer>`).
macro_rules! forward_tokenizer {
    ($($ty:ty),*) => {$(
        impl<T: Tokenizer + ?Sized> Tokenizer for $ty {
            fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
                (**self).encode(text, add_special_tokens)
            }
            fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TokenizeError> {
                (**self).render_chat(messages, add_generation_prompt)
            }
            fn render_chat_input(&self, input: &ChatInput) -> Result<String, TokenizeError> {
                (**self).render_chat_input(input)
            }
            fn chat_template_adds_bos(&self) -> bool {
                (**self).chat_template_adds_bos()
            }
            fn chat_add_special_tokens(&self, input: Option<&ChatInput>) -> bool {
                (**self).chat_add_special_tokens(input)
            }
            fn decode_token(&self, id: u32) -> String {
                (**self).decode_token(id)
            }
            fn split_points(&self) -> &[String] {
                (**self).split_points()
            }
        }
    )*};
}

forward_tokenizer!(&T, std::sync::Arc<T>, Box<T>);
