//! Stage 5, observe: turn the outcome into the client's response head, count it
//! and log it. Streams are observed further as they flow (TTFT, inter-chunk
//! gaps, bytes) by the relay body, which also holds the in-flight count until
//! the last byte. Later stages feed the approximate prefix index from here.

use http::Response;

use crate::body::ResponseBody;
use crate::error::ProxyError;
use crate::fleet::Fleet;
use crate::metrics::RequestMetrics;
use crate::request::RequestCtx;
use crate::respond::error_response;

/// What the observe stage reads: the requests' counters (by route and
/// status), and the fleet (the served pod's id for the access line).
#[derive(Clone, Copy)]
pub struct Observe<'a> {
    pub requests: &'a RequestMetrics,
    pub fleet: &'a Fleet,
}

pub fn observe(
    h: Observe<'_>,
    mut ctx: RequestCtx,
    result: Result<Response<ResponseBody>, ProxyError>,
) -> Response<ResponseBody> {
    let resp = match result {
        Ok(resp) => resp,
        Err(e) => {
            let culprit = e.culprit();
            if culprit == crate::error::Culprit::Client {
                tracing::debug!(request_id = ctx.id(), route = ctx.route.as_str(), error = %e, "request rejected");
            } else {
                tracing::warn!(request_id = ctx.id(), route = ctx.route.as_str(), ?culprit, retry = ?e.retry(), error = %e, "request failed");
            }
            let mut resp = error_response(&e, &ctx.request_id).map(ResponseBody::full);
            if ctx.already_routed && crate::error::next_target_may_serve(&e) {
                // The forwarding sidecar walks its fallbacks on this mark.
                resp.headers_mut().insert(
                    crate::headers::UNSERVED,
                    http::HeaderValue::from_static("1"),
                );
            }
            resp
        }
    };
    let status = resp.status().as_u16();
    h.requests.done(ctx.route, status);
    tracing::debug!(
        request_id = ctx.id(),
        route = ctx.route.as_str(),
        status,
        decision = ctx.route_reason,
        served_by = ?ctx.served_by,
        attempts = ctx.attempts,
        head_ms = ctx.started.elapsed().as_secs_f64() * 1000.0,
        "response head"
    );
    let resp = match ctx.trace.take() {
        Some(trace) => {
            crate::otel::request::finish(
                &trace,
                status,
                ctx.route_reason,
                ctx.attempts,
                ctx.served_by.is_some(),
            );
            resp.map(|b| b.with_trace(trace))
        }
        None => resp,
    };
    let resp = match ctx.access.take() {
        Some(mut log) => {
            let pod = ctx
                .served_by
                .map(|s| super::account::served_pod(h.fleet, s));
            let model = ctx.view.as_ref().and_then(|v| v.model.as_deref());
            log.head(status, model, ctx.route_reason, pod, ctx.attempts);
            let on_engine = ctx.served_by == Some(crate::request::Served::LocalEngine);
            log.rank(ctx.dp_rank.filter(|_| on_engine));
            resp.map(|b| b.with_access(log))
        }
        None => resp,
    };
    match ctx.in_flight.take() {
        Some(guard) => resp.map(|b| b.with_in_flight(guard)),
        None => resp,
    }
}
