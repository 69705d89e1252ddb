//! The engine's HTTP/1.1 server (uvicorn speaks HTTP/1.1 only): routes,
//! fault application, request recording, the admin routes `/sim/*`, and the
//! P/D side channels `/kvmesh-sim/*` other engines call (`crate::pd`).

pub(crate) mod dp;
pub(crate) mod lora;
mod openai;
pub(crate) mod shapes;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::SimConfig;
use crate::core::{Clock, Cmd};
use crate::faults::{FaultScript, Faults, Verdict};
use crate::metrics::EngineMetrics;
use crate::pd::{bootstrap, nixl};
use crate::stats::{ReceivedRequest, Recorder};

/// Largest request body accepted.
const MAX_BODY: usize = 32 * 1024 * 1024;

pub(crate) type Body = BoxBody<Bytes, std::io::Error>;
pub(crate) type Reply = Response<Body>;

/// What every handler of one engine shares.
pub(crate) struct Shared {
    pub cfg: SimConfig,
    pub engine_id: String,
    pub tokenizer: Arc<dyn kvmesh_filters::prefix::tokenize::Tokenizer>,
    pub core_tx: mpsc::Sender<Cmd>,
    pub metrics: Arc<Mutex<EngineMetrics>>,
    pub faults: Arc<Faults>,
    pub recorder: Arc<Recorder>,
    pub clock: Clock,
    pub created: u64,
    pub fingerprint: String,
    /// The node agent, when the engine speaks the kvmesh KV connector.
    pub kvagent: Option<Arc<crate::pd::kvagent::Link>>,
    /// LoRA adapters loaded at run time (one set for every rank).
    pub adapters: Arc<lora::Adapters>,
}

/// Accepts connections until `cancel`; each connection is a task in a set
/// owned here, so shutting down ends them all.
pub(crate) async fn serve(listener: TcpListener, ranks: Arc<dp::Ranks>, cancel: CancellationToken) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            acc = listener.accept() => match acc {
                Ok((stream, _)) => {
                    if ranks.first().faults.refusing() {
                        drop(stream);
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    let ranks = ranks.clone();
                    let cancel = cancel.clone();
                    conns.spawn(async move {
                        let svc = hyper::service::service_fn(move |req| {
                            let ranks = ranks.clone();
                            async move { Ok::<_, Infallible>(dispatch(&ranks, req).await) }
                        });
                        let conn = hyper::server::conn::http1::Builder::new()
                            .keep_alive(true)
                            .serve_connection(TokioIo::new(stream), svc);
                        tokio::select! {
                            _ = conn => {}
                            _ = cancel.cancelled() => {}
                        }
                    });
                }
                // Out of file descriptors and the like: back off briefly.
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(5)).await,
            },
        }
    }
    conns.shutdown().await;
}

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// Wraps chunks so the connection dies after `die_after` of them, once
/// those are on the wire: the failure waits for one turn of the runtime, in
/// which hyper flushes what it buffered. Otherwise a loaded machine, where
/// the chunks are all ready at once, would lose them with the connection,
/// and the stream would die before its first token rather than after k.
fn chunked<S>(s: S, die_after: Option<usize>) -> Body
where
    S: Stream<Item = Result<Bytes, std::io::Error>> + Send + Sync + 'static,
{
    let s = s.enumerate().then(move |(i, item)| async move {
        match die_after {
            Some(k) if i >= k => {
                tokio::task::yield_now().await;
                Err(std::io::Error::other(
                    "fault injection: connection dropped mid-stream",
                ))
            }
            _ => item.map(Frame::data),
        }
    });
    let s = s.scan(false, |dead, item| {
        // Stop after the first error so the body ends there.
        if *dead {
            return futures_util::future::ready(None);
        }
        *dead = item.is_err();
        futures_util::future::ready(Some(item))
    });
    BodyExt::boxed(StreamBody::new(s))
}

pub(crate) fn json_response(status: u16, v: &Value, verdict: &Verdict) -> Reply {
    let bytes = Bytes::from(v.to_string());
    let body = match verdict.die_after_chunks {
        Some(k) => chunked(futures_util::stream::iter([Ok(bytes)]), Some(k)),
        None => full(bytes),
    };
    let mut r = Response::new(body);
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

pub(crate) fn sse_response<S>(s: S, verdict: &Verdict) -> Reply
where
    S: Stream<Item = Result<Bytes, std::io::Error>> + Send + Sync + 'static,
{
    let mut r = Response::new(chunked(s, verdict.die_after_chunks));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    r
}

fn plain(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Reply {
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    r
}

fn detail(status: StatusCode, msg: &str) -> Reply {
    plain(
        status,
        "application/json",
        json!({ "detail": msg }).to_string(),
    )
}

/// Runs a request on its data-parallel rank ([`dp`]); `/metrics` without a
/// rank header is every rank's.
async fn dispatch(ranks: &dp::Ranks, req: Request<Incoming>) -> Reply {
    let path = req.uri().path();
    let named = req.headers().contains_key(dp::RANK_HEADER);
    if req.method() == Method::GET && path == "/metrics" && !named && ranks.len() > 1 {
        return plain(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            ranks.metrics(),
        );
    }
    let inference = req.method() == Method::POST && path.starts_with("/v1/");
    match ranks.pick(req.headers(), inference) {
        Ok(shared) => route(shared.clone(), req).await,
        Err(msg) => dp::bad_rank(&msg),
    }
}

async fn route(shared: Arc<Shared>, req: Request<Incoming>) -> Reply {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return detail(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request body too large or unreadable",
            )
        }
    };
    shared.recorder.received(ReceivedRequest {
        method: method.to_string(),
        path: path.clone(),
        headers,
        body: body.clone(),
        at: Instant::now(),
    });
    let inference = matches!(
        path.as_str(),
        "/v1/completions" | "/v1/chat/completions" | "/v1/responses"
    );
    if inference {
        if method != Method::POST {
            return detail(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed");
        }
        let verdict = shared.faults.next_verdict();
        if let Some(d) = verdict.first_byte_delay {
            tokio::time::sleep(d).await;
        }
        if let Some(status) = verdict.status {
            let e = shapes::error(status, &format!("injected fault: status {status}"), None);
            return json_response(status, &e, &verdict);
        }
        if path == "/v1/responses" {
            return openai::responses::serve(shared, body, verdict).await;
        }
        return openai::serve(shared, body, path == "/v1/chat/completions", verdict).await;
    }
    let none = Verdict::default();
    match (method, path.as_str()) {
        (Method::GET, "/health") => plain(StatusCode::OK, "application/json", Bytes::new()),
        (Method::GET, "/v1/models") => {
            let perm = format!(
                "modelperm-{}",
                &uuid::Uuid::new_v4().simple().to_string()[..16]
            );
            // Routers tell the engine family by `owned_by` (SMG picks its
            // P/D protocol from it): SGLang's model cards say "sglang".
            let owner = match shared.cfg.flavor {
                crate::config::Flavor::Vllm => "vllm",
                crate::config::Flavor::Sglang => "sglang",
            };
            let mut v = shapes::models(
                &shared.cfg.model,
                owner,
                shared.created,
                shared.cfg.max_model_len,
                &perm,
            );
            let cards = shared
                .adapters
                .cards(&shared.cfg.model, shared.created, &perm);
            if let Some(data) = v.get_mut("data").and_then(Value::as_array_mut) {
                data.extend(cards);
            }
            json_response(200, &v, &none)
        }
        (Method::POST, "/tokenize") => tokenize(&shared, &body),
        (Method::POST, "/v1/load_lora_adapter") if shared.cfg.max_loras > 0 => {
            lora_answer(shared.adapters.load(&shared.cfg.model, &body))
        }
        (Method::POST, "/v1/unload_lora_adapter") if shared.cfg.max_loras > 0 => {
            lora_answer(shared.adapters.unload(&body))
        }
        (Method::GET, "/metrics") => {
            let text = shared.metrics.lock().render(&shared.cfg);
            plain(
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                text,
            )
        }
        (Method::POST, "/reset_prefix_cache") => {
            let (tx, rx) = oneshot::channel();
            let ok = shared.core_tx.send(Cmd::ResetPrefixCache(tx)).await.is_ok()
                && rx.await.unwrap_or(false);
            json_response(200, &json!({ "success": ok }), &none)
        }
        (Method::GET, "/sim/faults") => {
            json_response(200, &json!({ "refusing": shared.faults.refusing() }), &none)
        }
        (Method::POST, "/sim/faults") => admin_faults(&shared, &body).await,
        (Method::POST, nixl::FETCH_PATH) => nixl::serve_fetch(&shared, &body),
        (Method::POST, bootstrap::BOOTSTRAP_PATH) => bootstrap::serve(&shared, &body).await,
        (Method::GET, "/sim/stats") => {
            let m = shared.metrics.lock().clone();
            let v = json!({
                "running": m.running, "waiting": m.waiting, "kv_cache_usage": m.kv_usage,
                "prefix_cache_queries": m.prefix_queries, "prefix_cache_hits": m.prefix_hits,
                "preempted_queries": m.preempted_queries, "preempted_hits": m.preempted_hits,
                "kv_batches_published": m.kv_batches_published, "engine_id": shared.engine_id,
                "held_transfers": m.held_transfers, "external_kv_tokens": m.by_source_external,
                "failed_kv_transfers": m.nixl_failed_transfers,
            });
            json_response(200, &v, &none)
        }
        (
            _,
            "/health"
            | "/v1/models"
            | "/tokenize"
            | "/metrics"
            | "/reset_prefix_cache"
            | "/sim/faults"
            | "/sim/stats"
            | nixl::FETCH_PATH
            | bootstrap::BOOTSTRAP_PATH,
        ) => detail(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed"),
        _ => detail(StatusCode::NOT_FOUND, "Not Found"),
    }
}

/// vLLM answers a done adapter call with bare text (no content type).
fn lora_answer(a: lora::Answer) -> Reply {
    match a {
        lora::Answer::Done(text) => Response::new(full(text)),
        lora::Answer::Error(code, body) => json_response(code, &body, &Verdict::default()),
    }
}

fn tokenize(shared: &Shared, body: &[u8]) -> Reply {
    let none = Verdict::default();
    let v: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            return json_response(
                400,
                &shapes::error(400, &format!("invalid JSON body: {e}"), None),
                &none,
            )
        }
    };
    let chat = v.get("messages").is_some();
    match openai::prompt_tokens(shared, &v, chat) {
        Ok(t) => json_response(200, &shapes::tokenize(&t, shared.cfg.max_model_len), &none),
        Err(e) => json_response(
            e.status,
            &shapes::error(e.status, &e.message, e.param),
            &none,
        ),
    }
}

async fn admin_faults(shared: &Shared, body: &[u8]) -> Reply {
    let none = Verdict::default();
    let script: FaultScript = match serde_json::from_slice(body) {
        Ok(s) => s,
        Err(e) => {
            return json_response(
                400,
                &shapes::error(400, &format!("bad fault script: {e}"), None),
                &none,
            )
        }
    };
    shared.faults.apply(&script);
    if script.restart {
        let (tx, rx) = oneshot::channel();
        if shared.core_tx.send(Cmd::Restart(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }
    json_response(200, &json!({ "ok": true }), &none)
}
