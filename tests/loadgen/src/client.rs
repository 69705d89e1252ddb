//! The HTTP client: one pooled hyper client (HTTP/1.1, TCP_NODELAY) that
//! sends a prepared body to a target and measures what a user would see:
//! time to first content token, every inter-token gap, end-to-end latency,
//! token usage and `cached_tokens`, status and errors.
//!
//! Every wait has a deadline: the whole request, and each gap between body
//! frames.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;

use crate::error::LoadgenError;
use crate::record::{RequestRecord, MAX_ITL_SAMPLES};
use crate::sse::{Chunk, SseParser};

/// Client settings.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Deadline for a whole request, first byte to last.
    pub request_timeout: Duration,
    /// Deadline between two body frames (a stalled stream).
    pub idle_timeout: Duration,
    pub connect_timeout: Duration,
    /// Idle pooled connections kept per target.
    pub max_idle_per_host: usize,
    /// Largest non-streaming response body or SSE event read.
    pub max_body: usize,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            request_timeout: Duration::from_secs(600),
            idle_timeout: Duration::from_secs(120),
            connect_timeout: Duration::from_secs(5),
            max_idle_per_host: 1024,
            max_body: 16 << 20,
        }
    }
}

/// A base URL requests are sent to (`http://host:port`, optionally with a
/// path prefix such as `/proxy`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    base: String,
}

impl Target {
    /// Parses and checks a base URL (http only; a trailing `/` is dropped).
    pub fn parse(url: &str) -> Result<Target, LoadgenError> {
        let bad = |reason: &str| LoadgenError::BadTarget {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let uri: Uri = url.parse().map_err(|_| bad("not a URL"))?;
        if uri.scheme_str() != Some("http") {
            return Err(bad("only http:// is supported"));
        }
        if uri.authority().is_none() {
            return Err(bad("no host"));
        }
        if uri.query().is_some() {
            return Err(bad("a base URL has no query"));
        }
        Ok(Target {
            base: url.trim_end_matches('/').to_string(),
        })
    }

    /// The URL of `path` (which starts with `/`) on this target.
    pub fn uri(&self, path: &str) -> Result<Uri, LoadgenError> {
        format!("{}{}", self.base, path)
            .parse()
            .map_err(|_| LoadgenError::BadTarget {
                url: self.base.clone(),
                reason: format!("cannot append {path}"),
            })
    }

    /// The base URL as given (without a trailing `/`).
    pub fn base(&self) -> &str {
        &self.base
    }
}

/// A pooled client; cheap to clone (clones share the pool).
#[derive(Debug, Clone)]
pub struct Client {
    inner: HyperClient<HttpConnector, Full<Bytes>>,
    cfg: ClientConfig,
}

impl Client {
    /// A client with `cfg`. Needs a tokio runtime when used, not when built.
    pub fn new(cfg: ClientConfig) -> Client {
        let mut conn = HttpConnector::new();
        // Without it, Nagle + delayed ACK add up to 40 ms to small writes.
        conn.set_nodelay(true);
        conn.set_connect_timeout(Some(cfg.connect_timeout));
        let inner = HyperClient::builder(TokioExecutor::new())
            .pool_max_idle_per_host(cfg.max_idle_per_host)
            .pool_idle_timeout(Duration::from_secs(90))
            .build(conn);
        Client { inner, cfg }
    }

    /// POSTs `body` (JSON) to `uri` and measures it. `stream` says whether to
    /// read the response as SSE. Never fails: a failure is in the record's
    /// `error`. Only the measurement fields of the record are set.
    pub async fn send(&self, uri: Uri, body: Bytes, stream: bool) -> RequestRecord {
        let start = Instant::now();
        let mut rec = RequestRecord::default();
        let fut = self.exchange(uri, body, stream, start, &mut rec);
        match tokio::time::timeout(self.cfg.request_timeout, fut).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => rec.error = Some(e),
            Err(_) => rec.error = Some(format!("timeout after {:?}", self.cfg.request_timeout)),
        }
        rec.e2e = start.elapsed();
        rec
    }

    /// GETs `uri` and returns its status, or `None` when no response came
    /// within `deadline` (readiness probes).
    pub async fn get_status(&self, uri: Uri, deadline: Duration) -> Option<u16> {
        let req = Request::get(uri).body(Full::new(Bytes::new())).ok()?;
        let resp = tokio::time::timeout(deadline, self.inner.request(req))
            .await
            .ok()?
            .ok()?;
        let status = resp.status().as_u16();
        let mut body = resp.into_body();
        // Drain so the connection returns to the pool.
        let _ = read_all(&mut body, deadline, 1 << 20).await;
        Some(status)
    }

    async fn exchange(
        &self,
        uri: Uri,
        body: Bytes,
        stream: bool,
        start: Instant,
        rec: &mut RequestRecord,
    ) -> Result<(), String> {
        let req = Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| format!("request: {e}"))?;
        let resp = self
            .inner
            .request(req)
            .await
            .map_err(|e| format!("send: {}", error_chain(&e)))?;
        let status = resp.status();
        rec.status = Some(status.as_u16());
        let mut body = resp.into_body();
        let idle = self.cfg.idle_timeout;
        if !status.is_success() {
            let text = read_all(&mut body, idle, 4096).await.unwrap_or_default();
            let text = String::from_utf8_lossy(&text);
            return Err(format!("status {}: {}", status.as_u16(), text.trim()));
        }
        if !stream {
            let bytes = read_all(&mut body, idle, self.cfg.max_body).await?;
            let chunk: Chunk =
                serde_json::from_slice(&bytes).map_err(|e| format!("bad JSON body: {e}"))?;
            if let Some(err) = chunk.error {
                return Err(format!("error body: {err}"));
            }
            apply_usage(rec, &chunk);
            return Ok(());
        }
        let mut parser = SseParser::new(self.cfg.max_body);
        let mut last_content: Option<Instant> = None;
        let mut content_chunks = 0u64;
        let mut done = false;
        loop {
            let frame = match tokio::time::timeout(idle, body.frame()).await {
                Err(_) => return Err(format!("stream idle for {idle:?}")),
                Ok(None) => break,
                Ok(Some(Err(e))) => return Err(format!("stream: {}", error_chain(&e))),
                Ok(Some(Ok(f))) => f,
            };
            let now = Instant::now();
            let Ok(data) = frame.into_data() else {
                continue;
            };
            for payload in parser.push(&data).map_err(|e| e.to_string())? {
                if payload.trim() == "[DONE]" {
                    done = true;
                    continue;
                }
                let chunk: Chunk =
                    serde_json::from_str(&payload).map_err(|e| format!("bad SSE chunk: {e}"))?;
                if let Some(err) = chunk.error {
                    return Err(format!("error event: {err}"));
                }
                if chunk.has_content() {
                    content_chunks += 1;
                    match last_content {
                        None => rec.ttft = Some(now - start),
                        Some(prev) if rec.itl.len() < MAX_ITL_SAMPLES => rec.itl.push(now - prev),
                        Some(_) => {}
                    }
                    last_content = Some(now);
                }
                apply_usage(rec, &chunk);
            }
        }
        if rec.completion_tokens.is_none() {
            rec.completion_tokens = Some(content_chunks);
        }
        if !done {
            return Err("stream ended before [DONE]".into());
        }
        Ok(())
    }
}

fn apply_usage(rec: &mut RequestRecord, chunk: &Chunk) {
    if let Some(u) = chunk.usage {
        rec.prompt_tokens = u.prompt_tokens.or(rec.prompt_tokens);
        rec.completion_tokens = u.completion_tokens.or(rec.completion_tokens);
        if let Some(c) = u.prompt_tokens_details.and_then(|d| d.cached_tokens) {
            rec.cached_tokens = Some(c);
        }
    }
}

async fn read_all(
    body: &mut hyper::body::Incoming,
    idle: Duration,
    limit: usize,
) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        match tokio::time::timeout(idle, body.frame()).await {
            Err(_) => return Err(format!("body idle for {idle:?}")),
            Ok(None) => return Ok(out),
            Ok(Some(Err(e))) => return Err(format!("body: {}", error_chain(&e))),
            Ok(Some(Ok(f))) => {
                if let Ok(d) = f.into_data() {
                    if out.len() + d.len() > limit {
                        return Err(format!("body over {limit} bytes"));
                    }
                    out.extend_from_slice(&d);
                }
            }
        }
    }
}

/// An error and its causes on one line (hyper's top-level messages alone,
/// such as "client error (Connect)", hide the reason).
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
