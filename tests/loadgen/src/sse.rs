//! Incremental server-sent-events parsing and the OpenAI chunk fields the
//! client measures (content, usage, errors).
//!
//! Bytes arrive in arbitrary pieces; [`SseParser::push`] returns the `data`
//! payloads of the events completed so far. An event larger than the
//! parser's limit is an error rather than unbounded buffering.

use bytes::{Buf, BytesMut};
use serde::Deserialize;

/// Why a stream could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    #[error("SSE event over {0} bytes")]
    TooLarge(usize),
}

/// Splits a byte stream into SSE events and collects their `data` fields.
#[derive(Debug)]
pub struct SseParser {
    buf: BytesMut,
    max_event: usize,
}

impl SseParser {
    /// A parser that refuses events over `max_event` bytes.
    pub fn new(max_event: usize) -> Self {
        SseParser {
            buf: BytesMut::new(),
            max_event,
        }
    }

    /// Feeds `bytes`; returns the data payloads of the events it completed
    /// (multi-line `data:` fields joined by `\n`; events without data and
    /// comments are skipped).
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<String>, SseError> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some((end, sep)) = find_event_end(&self.buf) {
            let event = self.buf.split_to(end);
            self.buf.advance(sep);
            if let Some(data) = event_data(&event) {
                out.push(data);
            }
        }
        if self.buf.len() > self.max_event {
            return Err(SseError::TooLarge(self.max_event));
        }
        Ok(out)
    }
}

/// Position and length of the first blank-line separator.
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i + 1 < buf.len() {
        if buf[i] == b'\n' {
            if buf[i + 1] == b'\n' {
                return Some((i, 2));
            }
            if buf[i + 1] == b'\r' && buf.get(i + 2) == Some(&b'\n') {
                return Some((i, 3));
            }
        }
        i += 1;
    }
    None
}

fn event_data(event: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(event);
    let mut data: Option<String> = None;
    for line in text.lines() {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if let Some(v) = line.strip_prefix("data:") {
            let v = v.strip_prefix(' ').unwrap_or(v);
            match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(v);
                }
                None => data = Some(v.to_string()),
            }
        }
    }
    data
}

/// The fields of an OpenAI completion, chat completion, or one of their
/// stream chunks, that the client reads. Unknown fields are ignored.
#[derive(Debug, Default, Deserialize)]
pub struct Chunk {
    #[serde(default)]
    pub choices: Vec<Choice>,
    #[serde(default)]
    pub usage: Option<Usage>,
    #[serde(default)]
    pub error: Option<serde_json::Value>,
}

/// One choice: `text` (completions), `delta` (chat stream) or `message`
/// (chat, non-streaming).
#[derive(Debug, Default, Deserialize)]
pub struct Choice {
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub delta: Option<Content>,
    #[serde(default)]
    pub message: Option<Content>,
}

/// A chat delta or message.
#[derive(Debug, Default, Deserialize)]
pub struct Content {
    #[serde(default)]
    pub content: Option<String>,
}

/// `usage`, with vLLM's `prompt_tokens_details.cached_tokens`.
#[derive(Debug, Default, Clone, Copy, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: Option<u64>,
    #[serde(default)]
    pub completion_tokens: Option<u64>,
    #[serde(default)]
    pub prompt_tokens_details: Option<Details>,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Default, Clone, Copy, Deserialize)]
pub struct Details {
    #[serde(default)]
    pub cached_tokens: Option<u64>,
}

impl Chunk {
    /// Whether any choice carries non-empty content (a token the user sees).
    pub fn has_content(&self) -> bool {
        self.choices.iter().any(|c| {
            let non_empty = |s: &Option<String>| s.as_deref().is_some_and(|t| !t.is_empty());
            non_empty(&c.text)
                || c.delta.as_ref().is_some_and(|d| non_empty(&d.content))
                || c.message.as_ref().is_some_and(|m| non_empty(&m.content))
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn events_split_across_pieces_come_out_whole() {
        let mut p = SseParser::new(1024);
        assert!(p.push(b"data: {\"a\"").unwrap().is_empty());
        assert_eq!(p.push(b":1}\n\ndata: [DO").unwrap(), vec!["{\"a\":1}"]);
        assert_eq!(p.push(b"NE]\r\n\r\n: comment\n\n").unwrap(), vec!["[DONE]"]);
    }

    #[test]
    fn multi_line_data_is_joined_and_oversize_is_refused() {
        let mut p = SseParser::new(16);
        assert_eq!(
            p.push(b"event: x\ndata: a\ndata:b\n\n").unwrap(),
            vec!["a\nb"]
        );
        assert_eq!(p.push(&[b'x'; 17]), Err(SseError::TooLarge(16)));
    }

    #[test]
    fn chunk_reads_content_usage_and_cached_tokens() {
        let c: Chunk = serde_json::from_str(
            r#"{"choices":[{"index":0,"delta":{"content":" hi"}}],"usage":null}"#,
        )
        .unwrap();
        assert!(c.has_content());
        let u: Chunk = serde_json::from_str(
            r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":4,
                "prompt_tokens_details":{"cached_tokens":8}}}"#,
        )
        .unwrap();
        assert!(!u.has_content());
        let usage = u.usage.unwrap();
        assert_eq!(usage.prompt_tokens_details.unwrap().cached_tokens, Some(8));
        let empty: Chunk =
            serde_json::from_str(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#)
                .unwrap();
        assert!(!empty.has_content());
    }
}
