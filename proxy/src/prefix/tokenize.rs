//! Prompts to token ids, the way the engine will see them.
//!
//! Three sources: a tokenizer in this process (the simulator's `builtin`, or a
//! Hugging Face model directory read once at start: `tokenizer.json`,
//! `tokenizer_config.json`, `chat_template.jinja`), behind the filters
//! crate's token prefix cache so shared system prompts and conversation
//! prefixes are tokenized once; or the local engine's `/tokenize` (vLLM's
//! request and response shapes, chat through `messages`), one call per
//! request under a deadline. Long prompts are tokenized only up to
//! `prefix.max_tokenize_bytes` (their leading blocks are what matches anyway).
//!
//! A chat or `/v1/responses` request whose template input is more than plain
//! messages (a [`ChatInput`]: tools, documents, tool-call history, kwargs, an
//! open final message) is rendered whole, as vLLM renders it, or sent whole to
//! the engine's `/tokenize` (keys in the client's order, tool-call arguments
//! as the JSON strings `/tokenize` accepts).

use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::{header, Method, Request, Uri};
use http_body_util::{BodyExt, Limited};
use kvmesh_filters::prefix::tokenize::{
    Builtin, CachedTokenizer, ChatInput, ChatMessage, HfTokenizer, Json, TokenCacheConfig,
    TokenizeError, Tokenizer,
};
use serde::Deserialize;

use crate::body::UpstreamBody;
use crate::request::Prompt;
use crate::upstream::UpstreamClient;

/// Largest `/tokenize` response read (a 128k-token prompt is under 1 MiB of JSON).
pub(crate) const MAX_TOKENIZE_RESPONSE: usize = 8 * 1024 * 1024;

/// Why the tokenizer could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum PrefixError {
    #[error("tokenizer {dir}: cannot read {file}: {source}")]
    Read {
        dir: String,
        file: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("tokenizer {dir}: {source}")]
    Load {
        dir: String,
        #[source]
        source: TokenizeError,
    },
    #[error(transparent)]
    Tokenize(#[from] TokenizeError),
    #[error("engine /tokenize: {0}")]
    Engine(String),
    #[error("engine /tokenize did not answer within {0:?}")]
    EngineTimeout(Duration),
    /// The engine answered, and not with ids (its template refused the
    /// request, say).
    #[error("engine /tokenize: status {status}: {body}")]
    EngineRefused { status: u16, body: String },
}

/// A tokenizer in this process, with the token prefix cache in front.
pub struct LocalTokenizer {
    cached: CachedTokenizer<Arc<dyn Tokenizer>>,
    /// Kept to give templates that print the date the current time.
    hf: Option<Arc<HfTokenizer>>,
}

impl std::fmt::Debug for LocalTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTokenizer")
            .field("hf", &self.hf)
            .finish()
    }
}

/// Token ids of one prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokenized {
    /// Exact ids of the prompt, or of its first `max_tokenize_bytes` when capped.
    pub ids: Vec<u32>,
    pub capped: bool,
    /// Tokens of the whole prompt (estimated when capped).
    pub prompt_tokens: usize,
}

impl LocalTokenizer {
    /// The simulator's deterministic tokenizer.
    pub fn builtin(cache_bytes: usize) -> Self {
        Self::wrap(Arc::new(Builtin), None, cache_bytes)
    }

    /// A Hugging Face model directory, read once.
    pub fn from_dir(dir: &Path, cache_bytes: usize) -> Result<Self, PrefixError> {
        let name = dir.display().to_string();
        let json =
            std::fs::read(dir.join("tokenizer.json")).map_err(|source| PrefixError::Read {
                dir: name.clone(),
                file: "tokenizer.json",
                source,
            })?;
        let optional = |file: &'static str| -> Result<Option<String>, PrefixError> {
            match std::fs::read_to_string(dir.join(file)) {
                Ok(s) => Ok(Some(s)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(source) => Err(PrefixError::Read {
                    dir: name.clone(),
                    file,
                    source,
                }),
            }
        };
        let config = optional("tokenizer_config.json")?;
        let template = optional("chat_template.jinja")?;
        let hf = HfTokenizer::from_parts(&json, config.as_deref(), template.as_deref()).map_err(
            |source| PrefixError::Load {
                dir: name.clone(),
                source,
            },
        )?;
        let hf = Arc::new(hf);
        Ok(Self::wrap(hf.clone(), Some(hf), cache_bytes))
    }

    fn wrap(inner: Arc<dyn Tokenizer>, hf: Option<Arc<HfTokenizer>>, cache_bytes: usize) -> Self {
        let config = TokenCacheConfig {
            max_bytes: cache_bytes,
            ..TokenCacheConfig::default()
        };
        Self {
            cached: CachedTokenizer::new(inner, config),
            hf,
        }
    }

    pub fn cache(&self) -> &CachedTokenizer<Arc<dyn Tokenizer>> {
        &self.cached
    }

    /// Token ids of `prompt` as the engine computes them (`None` when the
    /// prompt has no text or ids, e.g. embeddings). A batch of prompts is
    /// keyed by its first (the request runs on one pod).
    pub fn tokenize(
        &self,
        prompt: &Prompt,
        add_generation_prompt: bool,
        max_bytes: usize,
    ) -> Result<Option<Tokenized>, PrefixError> {
        let (text, special) = match prompt {
            Prompt::None => return Ok(None),
            Prompt::Tokens(ids) => return Ok(Some(exact(ids.clone()))),
            Prompt::TokenBatches(b) => return Ok(b.first().map(|ids| exact(ids.clone()))),
            Prompt::Text(s) => (Cow::Borrowed(s.as_str()), true),
            Prompt::Texts(v) => match v.first() {
                Some(s) => (Cow::Borrowed(s.as_str()), true),
                None => return Ok(None),
            },
            Prompt::Chat(ms) => {
                if let Some(hf) = &self.hf {
                    hf.set_now_unix(unix_now());
                }
                let text = self.cached.render_chat(ms, add_generation_prompt)?;
                (Cow::Owned(text), self.cached.chat_add_special_tokens(None))
            }
        };
        let c = self.cached.encode_capped(&text, special, max_bytes)?;
        Ok(Some(Tokenized {
            ids: c.ids,
            capped: c.capped,
            prompt_tokens: c.estimated_tokens,
        }))
    }
}

impl LocalTokenizer {
    /// Token ids of everything a chat or Responses request gives the
    /// template, rendered and encoded as vLLM does.
    pub fn tokenize_chat_input(
        &self,
        input: &ChatInput,
        max_bytes: usize,
    ) -> Result<Tokenized, PrefixError> {
        if let Some(hf) = &self.hf {
            hf.set_now_unix(unix_now());
        }
        let text = self.cached.render_chat_input(input)?;
        let special = self.cached.chat_add_special_tokens(Some(input));
        let c = self.cached.encode_capped(&text, special, max_bytes)?;
        Ok(Tokenized {
            ids: c.ids,
            capped: c.capped,
            prompt_tokens: c.estimated_tokens,
        })
    }
}

fn exact(ids: Vec<u32>) -> Tokenized {
    let n = ids.len();
    Tokenized {
        ids,
        capped: false,
        prompt_tokens: n,
    }
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

#[derive(Deserialize)]
struct TokenizeReply {
    tokens: Vec<u32>,
}

/// What `/tokenize` is asked: the client's prompt, or its messages.
fn engine_body(
    model: Option<&str>,
    prompt: &Prompt,
    add_generation_prompt: bool,
    max_bytes: usize,
) -> Option<(serde_json::Value, bool)> {
    let mut capped = false;
    let mut cut = |s: &str| -> String {
        if s.len() <= max_bytes {
            return s.to_owned();
        }
        capped = true;
        let mut end = max_bytes;
        while end > 0 && !s.is_char_boundary(end) {
            end -= 1;
        }
        // Cut before a space so the last whole word tokenizes as in the full text.
        let end = s[..end].rfind(' ').unwrap_or(end);
        s[..end].to_owned()
    };
    let mut body = match prompt {
        Prompt::Text(s) => serde_json::json!({ "prompt": cut(s) }),
        Prompt::Texts(v) => serde_json::json!({ "prompt": cut(v.first()?) }),
        Prompt::Chat(ms) => {
            let total: usize = ms.iter().map(|m| m.content.len()).sum();
            if total > max_bytes {
                // A cut chat cannot be rendered faithfully; skip it (counted as capped).
                return None;
            }
            let msgs: Vec<serde_json::Value> = ms
                .iter()
                .map(|m: &ChatMessage| serde_json::json!({"role": m.role, "content": m.content}))
                .collect();
            serde_json::json!({ "messages": msgs, "add_generation_prompt": add_generation_prompt })
        }
        Prompt::None | Prompt::Tokens(_) | Prompt::TokenBatches(_) => return None,
    };
    if let (Some(m), Some(obj)) = (model, body.as_object_mut()) {
        obj.insert("model".to_owned(), serde_json::Value::String(m.to_owned()));
    }
    Some((body, capped))
}

/// Whether the engine would be asked at all (token prompts need no call;
/// an over-long chat is skipped).
pub fn engine_skips_chat(prompt: &Prompt, max_bytes: usize) -> bool {
    matches!(prompt, Prompt::Chat(ms) if ms.iter().map(|m| m.content.len()).sum::<usize>() > max_bytes)
}

/// Asks the local engine's `/tokenize` for the prompt's ids.
pub async fn engine_tokenize(
    client: &UpstreamClient,
    engine_url: &str,
    model: Option<&str>,
    prompt: &Prompt,
    add_generation_prompt: bool,
    max_bytes: usize,
    deadline: Duration,
) -> Result<Option<Tokenized>, PrefixError> {
    match prompt {
        Prompt::Tokens(ids) => return Ok(Some(exact(ids.clone()))),
        Prompt::TokenBatches(b) => return Ok(b.first().map(|ids| exact(ids.clone()))),
        _ => {}
    }
    let Some((body, capped)) = engine_body(model, prompt, add_generation_prompt, max_bytes) else {
        return Ok(None);
    };
    let bytes = serde_json::to_vec(&body).map_err(|e| PrefixError::Engine(e.to_string()))?;
    let mut ids = post_tokenize(client, engine_url, bytes, deadline).await?;
    if capped {
        // The last token before the cut may differ from the full prompt's.
        ids.pop();
    }
    let n = ids.len();
    Ok(Some(Tokenized {
        ids,
        capped,
        prompt_tokens: n,
    }))
}

/// Asks the local engine's `/tokenize` for the ids of a chat or Responses
/// request's whole template input (`None`: its text is over `max_bytes`, so
/// it is not asked, as an over-long plain chat is not).
pub async fn engine_tokenize_chat_input(
    client: &UpstreamClient,
    engine_url: &str,
    model: Option<&str>,
    input: &ChatInput,
    max_bytes: usize,
    deadline: Duration,
) -> Result<Option<Tokenized>, PrefixError> {
    if input
        .messages
        .iter()
        .map(|m| m.content.len())
        .sum::<usize>()
        > max_bytes
    {
        return Ok(None);
    }
    let body = engine_chat_body(model, input);
    let bytes = serde_json::to_vec(&body).map_err(|e| PrefixError::Engine(e.to_string()))?;
    let ids = post_tokenize(client, engine_url, bytes, deadline).await?;
    Ok(Some(exact(ids)))
}

/// The `/tokenize` body of a template input: vLLM's `TokenizeChatRequest`
/// has no `documents` or `reasoning_effort`, so they travel as
/// `chat_template_kwargs`, as its chat path passes them; a tool call's
/// arguments go back to the JSON string the request field must be.
pub fn engine_chat_body(model: Option<&str>, input: &ChatInput) -> Json {
    let mut messages = input.messages_json();
    if let Json::Array(list) = &mut messages {
        for m in list {
            let Json::Object(fields) = m else { continue };
            let Some((_, Json::Array(calls))) = fields.iter_mut().find(|(k, _)| k == "tool_calls")
            else {
                continue;
            };
            for call in calls {
                let Some(Json::Object(f)) = object_field(call, "function") else {
                    continue;
                };
                if let Some((_, args)) = f.iter_mut().find(|(k, _)| k == "arguments") {
                    *args = Json::String(serde_json::to_string(&*args).unwrap_or_default());
                }
            }
        }
    }
    let mut kwargs = input.kwargs.clone();
    if let Some(d) = &input.documents {
        kwargs.push(("documents".to_owned(), d.clone()));
    }
    let mut body = Vec::new();
    if let Some(m) = model {
        body.push(("model".to_owned(), Json::from(m)));
    }
    body.push(("messages".to_owned(), messages));
    if let Some(t) = &input.tools {
        body.push(("tools".to_owned(), t.clone()));
    }
    if !kwargs.is_empty() {
        body.push(("chat_template_kwargs".to_owned(), Json::Object(kwargs)));
    }
    body.extend([
        (
            "add_generation_prompt".to_owned(),
            Json::from(input.add_generation_prompt),
        ),
        (
            "continue_final_message".to_owned(),
            Json::from(input.continue_final_message),
        ),
        (
            "add_special_tokens".to_owned(),
            Json::from(input.add_special_tokens),
        ),
    ]);
    Json::Object(body)
}

fn object_field<'a>(j: &'a mut Json, key: &str) -> Option<&'a mut Json> {
    match j {
        Json::Object(o) => o.iter_mut().find(|(k, _)| k == key).map(|(_, v)| v),
        _ => None,
    }
}

/// One `POST /tokenize` to the local engine under `deadline`: its ids.
async fn post_tokenize(
    client: &UpstreamClient,
    engine_url: &str,
    bytes: Vec<u8>,
    deadline: Duration,
) -> Result<Vec<u32>, PrefixError> {
    let uri: Uri = format!("{engine_url}/tokenize")
        .parse()
        .map_err(|e| PrefixError::Engine(format!("bad URL: {e}")))?;
    let req = Request::builder()
        .method(Method::POST)
        .uri(uri)
        .header(header::CONTENT_TYPE, "application/json")
        .body(UpstreamBody::full(bytes))
        .map_err(|e| PrefixError::Engine(e.to_string()))?;
    let call = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| PrefixError::Engine(e.to_string()))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), MAX_TOKENIZE_RESPONSE)
            .collect()
            .await
            .map_err(|e| PrefixError::Engine(e.to_string()))?
            .to_bytes();
        if !status.is_success() {
            return Err(PrefixError::EngineRefused {
                status: status.as_u16(),
                body: String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
            });
        }
        let reply: TokenizeReply =
            serde_json::from_slice(&body).map_err(|e| PrefixError::Engine(e.to_string()))?;
        Ok(reply.tokens)
    };
    tokio::time::timeout(deadline, call)
        .await
        .map_err(|_| PrefixError::EngineTimeout(deadline))?
}

/// The text the approximate index hashes: the prompt, or the chat messages
/// with their roles (no template is known in this mode).
pub fn approx_text(prompt: &Prompt) -> Option<Cow<'_, str>> {
    match prompt {
        Prompt::Text(s) => Some(Cow::Borrowed(s)),
        Prompt::Texts(v) => v.first().map(|s| Cow::Borrowed(s.as_str())),
        Prompt::Chat(ms) => {
            let mut s = String::with_capacity(ms.iter().map(|m| m.content.len() + 16).sum());
            for m in ms {
                s.push_str(&m.role);
                s.push('\n');
                s.push_str(&m.content);
                s.push_str("\n\n");
            }
            Some(Cow::Owned(s))
        }
        Prompt::None | Prompt::Tokens(_) | Prompt::TokenBatches(_) => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn builtin_tokenizes_completion_and_chat_like_the_simulator() {
        let t = LocalTokenizer::builtin(1 << 20);
        let p = Prompt::Text("hello world again".into());
        let got = t.tokenize(&p, true, 1 << 20).unwrap().unwrap();
        assert_eq!(got.ids, Builtin.encode("hello world again", true).unwrap());
        assert!(!got.capped);
        let ms = vec![ChatMessage {
            role: "user".into(),
            content: "hi there".into(),
        }];
        let got = t
            .tokenize(&Prompt::Chat(ms.clone()), true, 1 << 20)
            .unwrap()
            .unwrap();
        assert_eq!(got.ids, Builtin.encode_chat(&ms, true).unwrap());
        assert_eq!(t.tokenize(&Prompt::None, true, 10).unwrap(), None);
    }

    #[test]
    fn long_prompts_are_capped_and_estimated() {
        let t = LocalTokenizer::builtin(1 << 20);
        let text = "word ".repeat(10_000);
        let got = t
            .tokenize(&Prompt::Text(text.clone().into()), true, 1000)
            .unwrap()
            .unwrap();
        assert!(got.capped);
        assert!(got.ids.len() < 400, "{}", got.ids.len());
        assert!(got.prompt_tokens > 5_000, "{}", got.prompt_tokens);
        // The capped ids are a prefix of the full ids.
        let full = Builtin.encode(&text, true).unwrap();
        assert_eq!(&full[..got.ids.len()], &got.ids[..]);
    }

    #[test]
    fn engine_body_has_vllms_shape() {
        let (b, capped) = engine_body(Some("m"), &Prompt::Text("a b c".into()), true, 100).unwrap();
        assert_eq!(b, serde_json::json!({"model": "m", "prompt": "a b c"}));
        assert!(!capped);
        let (b, capped) = engine_body(None, &Prompt::Text("aaa bbb ccc".into()), true, 9).unwrap();
        assert_eq!(b, serde_json::json!({"prompt": "aaa bbb"}));
        assert!(capped);
        let ms = vec![ChatMessage {
            role: "user".into(),
            content: "x".into(),
        }];
        let (b, _) = engine_body(None, &Prompt::Chat(ms), false, 100).unwrap();
        assert_eq!(
            b,
            serde_json::json!({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false})
        );
    }

    #[test]
    fn engine_chat_body_is_what_tokenize_accepts_in_the_clients_order() {
        let body = Json::parse(
            r#"{"messages":[{"role":"user","content":"q"},{"role":"assistant","tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{\"z\": 1, \"a\": 2}"}}]}],
                "tools":[{"type":"function","function":{"name":"f","parameters":{"z":{},"a":{}}}}],
                "documents":[{"text":"d"}],"reasoning_effort":"none","add_generation_prompt":true}"#,
        )
        .unwrap();
        let input = ChatInput::from_chat_body(&body).unwrap();
        let got = serde_json::to_string(&engine_chat_body(Some("m"), &input)).unwrap();
        assert_eq!(
            got,
            concat!(
                r#"{"model":"m","messages":[{"role":"user","content":"q"},{"role":"assistant","content":"","#,
                r#""tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{\"z\":1,\"a\":2}"}}]}],"#,
                r#""tools":[{"type":"function","function":{"name":"f","description":null,"parameters":{"z":{},"a":{}}}}],"#,
                r#""chat_template_kwargs":{"reasoning_effort":"none","enable_thinking":false,"documents":[{"text":"d"}]},"#,
                r#""add_generation_prompt":true,"continue_final_message":false,"add_special_tokens":false}"#
            )
        );
    }

    #[test]
    fn a_chat_input_renders_whole_and_a_plain_one_as_before() {
        let t = LocalTokenizer::builtin(1 << 20);
        let body = Json::parse(
            r#"{"messages":[{"role":"user","content":"hi there"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#,
        )
        .unwrap();
        let input = ChatInput::from_chat_body(&body).unwrap();
        // The simulator renders messages alone, as its engine does.
        let got = t.tokenize_chat_input(&input, 1 << 20).unwrap();
        assert_eq!(got.ids, Builtin.encode_chat(&input.flat(), true).unwrap());
    }
}
