//! A fast fake engine: a minimal hyper server that answers OpenAI
//! completions and chat completions at once (or after scripted delays), for
//! measuring a proxy's own overhead and for testing the client.
//!
//! It does as little as possible per request: the body is read whole but
//! only scanned for `"stream":true` and `max_tokens`; prompt tokens are
//! estimated as spaces + 1. Streams send `min(max_tokens, chunks)` content
//! chunks, a usage chunk and `[DONE]`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Either, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::error::LoadgenError;

/// Largest request body accepted (a 200 KB prompt fits many times over).
pub const MAX_REQUEST_BODY: usize = 64 << 20;

/// Scripted behaviour of the fake engine.
#[derive(Debug, Clone)]
pub struct FastEngineConfig {
    /// Most content chunks per streamed answer (fewer when `max_tokens` is).
    pub chunks: u32,
    /// Delay before the first content chunk of a stream, or before a
    /// non-streaming answer.
    pub first_token_delay: Duration,
    /// Delay between content chunks of a stream.
    pub chunk_delay: Duration,
    /// `cached_tokens` reported in usage (capped at the prompt tokens).
    pub cached_tokens: u64,
}

impl Default for FastEngineConfig {
    fn default() -> Self {
        FastEngineConfig {
            chunks: 8,
            first_token_delay: Duration::ZERO,
            chunk_delay: Duration::ZERO,
            cached_tokens: 0,
        }
    }
}

/// A running fake engine; stops on [`FastEngine::shutdown`] or drop.
#[derive(Debug)]
pub struct FastEngine {
    addr: SocketAddr,
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl FastEngine {
    /// Serves on `listener` (bind port 0 and pass it in).
    pub fn start(listener: TcpListener, cfg: FastEngineConfig) -> Result<FastEngine, LoadgenError> {
        let addr = listener.local_addr().map_err(|source| LoadgenError::Net {
            what: "fake engine address".into(),
            source,
        })?;
        let stop = CancellationToken::new();
        let task = tokio::spawn(serve(listener, Arc::new(cfg), stop.clone()));
        Ok(FastEngine {
            addr,
            stop,
            task: Some(task),
        })
    }

    /// Binds `addr` (e.g. `127.0.0.1:0`) and serves.
    pub async fn bind(addr: &str, cfg: FastEngineConfig) -> Result<FastEngine, LoadgenError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| LoadgenError::Net {
                what: format!("bind {addr}"),
                source,
            })?;
        FastEngine::start(listener, cfg)
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, drops open connections and waits for the server task.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for FastEngine {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn serve(listener: TcpListener, cfg: Arc<FastEngineConfig>, stop: CancellationToken) {
    // Connection tasks live in this set: dropping it on stop aborts them.
    let mut conns = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            a = listener.accept() => a,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        let Ok((sock, _)) = accepted else { continue };
        let _ = sock.set_nodelay(true);
        let cfg = cfg.clone();
        conns.spawn(async move {
            let svc = service_fn(move |req| handle(req, cfg.clone()));
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(sock), svc)
                .await;
        });
    }
}

type Body =
    Either<Full<Bytes>, StreamBody<stream::BoxStream<'static, Result<Frame<Bytes>, Infallible>>>>;

fn full(status: StatusCode, body: String) -> Response<Body> {
    let mut r = Response::new(Either::Left(Full::new(Bytes::from(body))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

async fn handle(
    req: Request<Incoming>,
    cfg: Arc<FastEngineConfig>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_string();
    let chat = match (req.method(), path.as_str()) {
        (&Method::GET, "/health") => return Ok(full(StatusCode::OK, String::new())),
        (&Method::GET, "/v1/models") => {
            let models =
                r#"{"object":"list","data":[{"id":"fake","object":"model","owned_by":"kvmesh"}]}"#;
            return Ok(full(StatusCode::OK, models.into()));
        }
        (&Method::GET, "/metrics") => {
            // vLLM's load gauges, all idle: sidecars that scrape the engine
            // see a valid, empty engine rather than a failing scrape.
            let m = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n";
            let mut r = full(StatusCode::OK, m.into());
            r.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            return Ok(r);
        }
        (&Method::POST, "/v1/completions") => false,
        (&Method::POST, "/v1/chat/completions") => true,
        _ => {
            return Ok(full(
                StatusCode::NOT_FOUND,
                r#"{"error":{"message":"not found","type":"not_found","code":404}}"#.into(),
            ))
        }
    };
    let body = match Limited::new(req.into_body(), MAX_REQUEST_BODY)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(_) => return Ok(full(
            StatusCode::PAYLOAD_TOO_LARGE,
            r#"{"error":{"message":"body too large","type":"invalid_request_error","code":413}}"#
                .into(),
        )),
    };
    let view = scan(&body);
    let n = view.max_tokens.min(cfg.chunks).max(1);
    let prompt_tokens = body.iter().filter(|&&b| b == b' ').count() as u64 + 1;
    let usage = format!(
        r#"{{"prompt_tokens":{prompt_tokens},"completion_tokens":{n},"total_tokens":{},"prompt_tokens_details":{{"cached_tokens":{}}}}}"#,
        prompt_tokens + u64::from(n),
        cfg.cached_tokens.min(prompt_tokens)
    );
    if !view.stream {
        pause(cfg.first_token_delay).await;
        let text = " tok".repeat(n as usize);
        let choice = if chat {
            format!(
                r#"{{"index":0,"message":{{"role":"assistant","content":"{text}"}},"finish_reason":"length"}}"#
            )
        } else {
            format!(r#"{{"index":0,"text":"{text}","finish_reason":"length"}}"#)
        };
        let object = if chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        let body = format!(
            r#"{{"id":"fake-1","object":"{object}","model":"fake","choices":[{choice}],"usage":{usage}}}"#
        );
        return Ok(full(StatusCode::OK, body));
    }
    let chunk = if chat {
        r#"data: {"id":"fake-1","object":"chat.completion.chunk","model":"fake","choices":[{"index":0,"delta":{"content":" tok"}}]}"#
    } else {
        r#"data: {"id":"fake-1","object":"text_completion","model":"fake","choices":[{"index":0,"text":" tok"}]}"#
    };
    let chunk = Bytes::from(format!("{chunk}\n\n"));
    let tail = Bytes::from(format!(
        "data: {{\"id\":\"fake-1\",\"model\":\"fake\",\"choices\":[],\"usage\":{usage}}}\n\ndata: [DONE]\n\n"
    ));
    let (first, gap) = (cfg.first_token_delay, cfg.chunk_delay);
    // State: how many content chunks were sent; n + 1 means the tail went out.
    let frames = stream::unfold(0u32, move |i| {
        let (chunk, tail) = (chunk.clone(), tail.clone());
        async move {
            match i {
                _ if i > n => None,
                _ if i == n => Some((Ok(Frame::data(tail)), i + 1)),
                _ => {
                    pause(if i == 0 { first } else { gap }).await;
                    Some((Ok(Frame::data(chunk)), i + 1))
                }
            }
        }
    });
    let mut r = Response::new(Either::Right(StreamBody::new(
        Box::pin(frames) as stream::BoxStream<'static, _>
    )));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/event-stream"),
    );
    Ok(r)
}

/// The two request fields the fake engine honours.
struct View {
    stream: bool,
    max_tokens: u32,
}

/// Finds `"stream": true` and `"max_tokens": N` without parsing the body
/// (a 200 KB prompt would dominate a proxy-overhead measurement otherwise).
fn scan(body: &[u8]) -> View {
    let text = String::from_utf8_lossy(body);
    let value_after = |key: &str| -> Option<String> {
        let at = text.find(key)? + key.len();
        let rest = text[at..].trim_start().strip_prefix(':')?.trim_start();
        Some(
            rest.chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect(),
        )
    };
    View {
        stream: value_after("\"stream\"").as_deref() == Some("true"),
        max_tokens: value_after("\"max_tokens\"")
            .and_then(|v| v.parse().ok())
            .unwrap_or(16),
    }
}

/// Waits `d`; no wait at all when it is zero. (`tokio::time::sleep(ZERO)` still
/// waits for the timer's next 1 ms tick: that made the "answers at once" engine
/// take ~1 ms per request, and quantized every leg's latency to timer ticks.)
async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}
