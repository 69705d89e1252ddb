//! Stage 1, classify: check the method, decide whether the request's route
//! came with it (a peer's `x-kvmesh-routed`, read when the context is made;
//! llm-d's `x-prefiller-host-port`, checked here), read an inference body
//! (bounded in size and time) and parse it once into the request view. Other
//! paths pass through with their body streamed untouched.

use bytes::Bytes;
use http::{header, Method, Request};
use http_body_util::{BodyExt, Limited};

use crate::body::IncomingBody;
use crate::error::ProxyError;
use crate::fleet::Fleet;
use crate::metrics::{ClientMetrics, Route};
use crate::otel::Stage;
use crate::request::view::{RequestView, Shape};
use crate::request::{ClientBody, ClientRequest, RequestCtx};
use opentelemetry::KeyValue;

/// What classify reads: the limits and deadlines, the clients' counters, and
/// the fleet (an llm-d prefiller must be a pod it knows).
#[derive(Clone, Copy)]
pub struct Classify<'a> {
    /// The body limit.
    pub limits: &'a crate::config::Limits,
    /// Which prefillers an llm-d EPP may name.
    pub pd: &'a crate::config::Pd,
    /// The body-read deadlines.
    pub timeouts: &'a crate::config::Timeouts,
    /// Request body bytes; a body too slow to arrive.
    pub clients: &'a ClientMetrics,
    pub fleet: &'a Fleet,
}

pub async fn classify(
    h: Classify<'_>,
    ctx: &mut RequestCtx,
    req: Request<IncomingBody>,
) -> Result<ClientRequest, ProxyError> {
    let span = Stage::of(ctx.trace.as_deref(), "kvmesh.classify");
    let r = read(h, ctx, req).await;
    if span.recording() {
        span.set(KeyValue::new("kvmesh.route", ctx.route.as_str()));
        span.set(KeyValue::new("kvmesh.request_id", ctx.id().to_owned()));
        if let Some(v) = &ctx.view {
            if let Some(m) = &v.model {
                span.set(KeyValue::new("gen_ai.request.model", m.clone()));
            }
            span.set(KeyValue::new("kvmesh.stream", v.stream));
        }
        if let Err(e) = &r {
            span.fail(e);
        }
    }
    r
}

async fn read(
    h: Classify<'_>,
    ctx: &mut RequestCtx,
    req: Request<IncomingBody>,
) -> Result<ClientRequest, ProxyError> {
    check_method(ctx)?;
    let limit = h.limits.max_body_bytes.0;
    let (head, body) = req.into_parts();
    let declared = head
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ProxyError::BodyTooLarge { limit });
    }
    let shape = match ctx.route {
        Route::Completions => Shape::Completion,
        Route::ChatCompletions => Shape::Chat,
        Route::Responses => Shape::Responses,
        Route::Embeddings => Shape::Embedding,
        Route::Models | Route::Other => {
            return Ok(ClientRequest {
                head,
                body: ClientBody::Streaming(Some(body)),
            })
        }
    };
    // Refused (403) before the body is read or any connection made.
    ctx.epp_prefiller = crate::pd::llmd::prefiller(h.pd, h.fleet, &head.headers)?;
    let bytes = read_body(h, ctx, body, limit).await?;
    h.clients.bytes_in(ctx.route, bytes.len() as u64);
    let view =
        RequestView::parse_shared(&bytes, shape).map_err(|source| ProxyError::MalformedJson {
            route: ctx.route.as_str(),
            source,
        })?;
    ctx.view = Some(view);
    Ok(ClientRequest {
        head,
        body: ClientBody::Buffered(bytes),
    })
}

fn check_method(ctx: &RequestCtx) -> Result<(), ProxyError> {
    let (ok, allow) = match ctx.route {
        Route::Completions | Route::ChatCompletions | Route::Responses | Route::Embeddings => {
            (ctx.method == Method::POST, "POST")
        }
        Route::Models => (
            ctx.method == Method::GET || ctx.method == Method::HEAD,
            "GET, HEAD",
        ),
        Route::Other => (true, ""),
    };
    if ok {
        Ok(())
    } else {
        Err(ProxyError::MethodNotAllowed {
            method: ctx.method.clone(),
            route: ctx.route.as_str(),
            allow,
        })
    }
}

/// Reads the whole body, refusing more than `limit` bytes and giving up after
/// `timeouts.request_body` (or the overall deadline, if sooner): a client
/// that stalls or trickles its upload is cut and counted.
async fn read_body(
    h: Classify<'_>,
    ctx: &RequestCtx,
    body: IncomingBody,
    limit: u64,
) -> Result<Bytes, ProxyError> {
    let limit_usize = usize::try_from(limit).unwrap_or(usize::MAX);
    let t = h.timeouts;
    let after = t.request_body.get().min(t.overall.get());
    let collected = tokio::time::timeout_at(
        ctx.started + after,
        Limited::new(body, limit_usize).collect(),
    )
    .await;
    match collected {
        Err(_) => {
            let reason = crate::metrics::RejectReason::BodyTimeout;
            h.clients.rejected(crate::metrics::Listener::Client, reason);
            Err(ProxyError::ClientTimeout { after })
        }
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(ProxyError::BodyTooLarge { limit })
        }
        Ok(Err(e)) => Err(ProxyError::ClientBody(e.to_string())),
    }
}
