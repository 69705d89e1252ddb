//! A Hugging Face tokenizer plus the model's chat template, tokenizing the way
//! vLLM does: a completion prompt is encoded with special tokens (BOS first);
//! chat messages are rendered with the template (Jinja, run by minijinja with
//! the Hugging Face settings: `trim_blocks`, `lstrip_blocks`, `bos_token`,
//! `add_generation_prompt`, `raise_exception`, `strftime_now`, a
//! Python-compatible `tojson` and the common Python string/dict methods), then
//! encoded without adding special tokens when the template already emits BOS.
//!
//! A request's tools, documents, tool-call history, `chat_template_kwargs` and
//! `continue_final_message` reach the template as they do in vLLM 0.32 (see
//! [`super::chat`] for the sources); objects keep their keys in the client's
//! order, so `tojson` prints what Python's `json.dumps` prints.
//!
//! Constructed from bytes (the crate does no I/O): the caller reads
//! `tokenizer.json`, `tokenizer_config.json` and, if present,
//! `chat_template.jinja` from the model directory.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use minijinja::{Environment, Value};

use super::chat::{developer_as_system, turn_json, ChatInput, ChatTurn};
use super::jinja::{build_env, json_value, TEMPLATE};
use super::json::Json;
use super::{ChatMessage, TokenizeError, Tokenizer};

/// What Hugging Face appends to the final message's content to find where
/// it ends in the rendered text (`render_jinja_template`, transformers 5).
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// A Hugging Face `tokenizer.json` with the model's chat template.
pub struct HfTokenizer {
    tok: tokenizers::Tokenizer,
    env: Option<Environment<'static>>,
    /// The template's source (`continue_final_message` checks it names `content`).
    source: String,
    bos_token: String,
    eos_token: String,
    template_adds_bos: bool,
    /// Special added tokens that strip no whitespace: the tokenizer splits the
    /// text at each of them before anything else, so text can be tokenized in
    /// pieces cut right before one of them with identical ids.
    boundaries: Vec<String>,
    /// Unix seconds `strftime_now` formats (templates that print the date);
    /// set by the caller, since this crate reads no clock.
    now_unix: Arc<AtomicI64>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab", &self.tok.get_vocab_size(true))
            .field("chat_template", &self.env.is_some())
            .field("template_adds_bos", &self.template_adds_bos)
            .finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> TokenizeError {
    TokenizeError::Tokenizer(e.to_string())
}

fn tpl_err(e: impl std::fmt::Display) -> TokenizeError {
    TokenizeError::Template(e.to_string())
}

/// A token in `tokenizer_config.json`: a string or an `AddedToken` object.
fn config_token(cfg: &serde_json::Value, key: &str) -> Option<String> {
    match cfg.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `chat_template` is a string or a list of `{name, template}` (use `default`).
fn config_template(cfg: &serde_json::Value) -> Option<String> {
    match cfg.get("chat_template")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
        _ => None,
    }
}

impl HfTokenizer {
    /// Builds from the bytes of `tokenizer.json`, the text of
    /// `tokenizer_config.json` (tokens and maybe the template) and of a
    /// separate `chat_template.jinja` (which wins when both exist).
    pub fn from_parts(
        tokenizer_json: &[u8],
        tokenizer_config_json: Option<&str>,
        chat_template: Option<&str>,
    ) -> Result<Self, TokenizeError> {
        let tok = tokenizers::Tokenizer::from_bytes(tokenizer_json).map_err(tok_err)?;
        let cfg: serde_json::Value = match tokenizer_config_json {
            Some(text) => serde_json::from_str(text).map_err(tok_err)?,
            None => serde_json::Value::Null,
        };
        let bos_token = config_token(&cfg, "bos_token").unwrap_or_default();
        let eos_token = config_token(&cfg, "eos_token").unwrap_or_default();
        let source = chat_template
            .map(str::to_owned)
            .or_else(|| config_template(&cfg));
        let now_unix = Arc::new(AtomicI64::new(0));
        let (env, source) = match source {
            Some(src) => (Some(build_env(src.clone(), now_unix.clone())?), src),
            None => (None, String::new()),
        };
        let mut added: Vec<(u32, tokenizers::AddedToken)> =
            tok.get_added_tokens_decoder().into_iter().collect();
        added.sort_by_key(|(id, _)| *id);
        let boundaries = added
            .into_iter()
            .filter(|(_, t)| {
                t.special && !t.lstrip && !t.rstrip && !t.single_word && !t.content.is_empty()
            })
            .map(|(_, t)| t.content)
            .collect();
        let mut me = Self {
            tok,
            env,
            source,
            bos_token,
            eos_token,
            template_adds_bos: false,
            boundaries,
            now_unix,
        };
        me.template_adds_bos = me.probe_template_bos();
        Ok(me)
    }

    /// Whether the rendered template starts with BOS (vLLM then encodes chat
    /// prompts without adding special tokens).
    fn probe_template_bos(&self) -> bool {
        if self.bos_token.is_empty() || self.env.is_none() {
            return false;
        }
        let probe = [
            ChatMessage {
                role: "system".into(),
                content: "s".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "u".into(),
            },
        ];
        match self.render_chat(&probe, true) {
            Ok(text) => text.starts_with(&self.bos_token),
            Err(_) => false,
        }
    }

    /// Whether a chat template was configured.
    pub fn has_chat_template(&self) -> bool {
        self.env.is_some()
    }

    /// Special tokens before which text may be cut without changing its ids.
    pub fn boundary_tokens(&self) -> &[String] {
        &self.boundaries
    }

    /// Sets the time `strftime_now` formats, in Unix seconds (UTC).
    pub fn set_now_unix(&self, secs: i64) {
        self.now_unix.store(secs, Ordering::Relaxed);
    }
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        let enc = self
            .tok
            .encode_fast(text, add_special_tokens)
            .map_err(tok_err)?;
        Ok(enc.get_ids().to_vec())
    }

    fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let input = ChatInput {
            messages: messages
                .iter()
                .map(|m| ChatTurn {
                    role: m.role.clone(),
                    content: m.content.clone(),
                    ..ChatTurn::default()
                })
                .collect(),
            tools: None,
            documents: None,
            kwargs: Vec::new(),
            add_generation_prompt,
            continue_final_message: false,
            add_special_tokens: false,
        };
        self.render_chat_input(&input)
    }

    /// `apply_chat_template(conversation, tools=, documents=,
    /// add_generation_prompt=, continue_final_message=, **kwargs)` as
    /// transformers 5 runs it: the special tokens, then the kwargs over them,
    /// then `messages`, `tools`, `documents` (`none` when absent) and
    /// `add_generation_prompt`.
    fn render_chat_input(&self, input: &ChatInput) -> Result<String, TokenizeError> {
        let env = self
            .env
            .as_ref()
            .ok_or_else(|| TokenizeError::Template("the model has no chat template".into()))?;
        // `_detect_developer_role_support`: the template names the role, quoted.
        let developer =
            self.source.contains("\"developer\"") || self.source.contains("'developer'");
        let converted = if developer {
            None
        } else {
            developer_as_system(&input.messages)
        };
        let messages = converted.as_deref().unwrap_or(&input.messages);
        let mut turns = Json::Array(messages.iter().map(turn_json).collect());
        let mut open_final = None;
        if input.continue_final_message {
            if !self.source.contains("content") {
                return Err(TokenizeError::Template(
                    "continue_final_message: the template reads no content".into(),
                ));
            }
            if let Json::Array(list) = &mut turns {
                if let Some(Json::Object(last)) = list.last_mut() {
                    if let Some((_, Json::String(c))) =
                        last.iter_mut().find(|(k, _)| k == "content")
                    {
                        open_final = Some(c.trim().to_owned());
                        c.push_str(CONTINUE_TAG);
                    }
                }
            }
            if open_final.is_none() {
                return Err(TokenizeError::Template(
                    "continue_final_message: no final message to continue".into(),
                ));
            }
        }
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        ctx.insert("bos_token".into(), Value::from(self.bos_token.as_str()));
        ctx.insert("eos_token".into(), Value::from(self.eos_token.as_str()));
        for (k, v) in &input.kwargs {
            ctx.insert(k.clone(), json_value(v));
        }
        ctx.insert("messages".into(), json_value(&turns));
        let none = || Value::from(());
        ctx.insert(
            "tools".into(),
            input.tools.as_ref().map_or_else(none, json_value),
        );
        ctx.insert(
            "documents".into(),
            input.documents.as_ref().map_or_else(none, json_value),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(input.add_generation_prompt),
        );
        let tpl = env.get_template(TEMPLATE).map_err(tpl_err)?;
        let rendered = tpl.render(Value::from(ctx)).map_err(tpl_err)?;
        match open_final {
            None => Ok(rendered),
            Some(final_text) => cut_open_final(rendered, &final_text),
        }
    }

    fn chat_template_adds_bos(&self) -> bool {
        self.template_adds_bos
    }

    /// vLLM 0.32 encodes a rendered chat with the request's
    /// `add_special_tokens` (`TokenizeParams`), not by what the template emits.
    fn chat_add_special_tokens(&self, input: Option<&ChatInput>) -> bool {
        input.is_some_and(|i| i.add_special_tokens)
    }

    fn decode_token(&self, id: u32) -> String {
        self.tok.decode(&[id], false).unwrap_or_default()
    }

    fn split_points(&self) -> &[String] {
        &self.boundaries
    }
}

/// The rendered text up to the end of the final message's content, as
/// `render_jinja_template` cuts it for `continue_final_message`.
fn cut_open_final(mut rendered: String, final_text: &str) -> Result<String, TokenizeError> {
    let tag = CONTINUE_TAG.trim_end();
    let Some(at) = rendered.rfind(tag) else {
        return Err(TokenizeError::Template(
            "continue_final_message: the final message is not in the rendered chat".into(),
        ));
    };
    if !rendered.contains(final_text) {
        return Err(TokenizeError::Template(
            "continue_final_message: the template changed the final message".into(),
        ));
    }
    let spaced = rendered[at..].starts_with(CONTINUE_TAG);
    rendered.truncate(at);
    if !spaced {
        // The template trimmed the content's trailing space: trim as Python's rstrip.
        let end = rendered.trim_end().len();
        rendered.truncate(end);
    }
    Ok(rendered)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(template: &str) -> HfTokenizer {
        let json = br#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,"model":{"type":"WordLevel","vocab":{"[UNK]":0,"a":1},"unk_token":"[UNK]"}}"#;
        HfTokenizer::from_parts(
            json,
            Some(r#"{"bos_token":{"content":"<s>"}}"#),
            Some(template),
        )
        .unwrap()
    }

    #[test]
    fn templates_get_hf_helpers() {
        let msgs = [
            ChatMessage {
                role: "system".into(),
                content: "  be brief \n".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "hi".into(),
            },
        ];
        let t = tok("{{ bos_token }}{% for m in messages %}{{ m['content'].strip() | upper }}|{{ m | tojson }}\n{% endfor %}{% if add_generation_prompt %}GO{% endif %}");
        assert!(t.chat_template_adds_bos());
        assert_eq!(
            t.render_chat(&msgs, true).unwrap(),
            "<s>BE BRIEF|{\"role\": \"system\", \"content\": \"  be brief \\n\"}\nHI|{\"role\": \"user\", \"content\": \"hi\"}\nGO"
        );
        let t = tok("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok");
        let err = t.render_chat(&msgs, false).unwrap_err().to_string();
        assert!(err.contains("user first"), "{err}");
        assert!(!t.chat_template_adds_bos());
        let t = tok("{{ strftime_now('%Y') }}");
        t.set_now_unix(1_722_000_309);
        assert_eq!(t.render_chat(&msgs, false).unwrap(), "2024");
    }
}
