//! The one place an error becomes what the client sees: an OpenAI-style JSON
//! body `{"error": {"message", "type", "code"}}` with its HTTP status, framed
//! either as a whole response or, once a stream has started, as a final SSE
//! event followed by `data: [DONE]` (what vLLM itself sends on a stream error).

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use serde::Serialize;

use crate::error::{Culprit, ProxyError};
use crate::headers::REQUEST_ID;

/// An error rendered for the client.
#[derive(Debug, Clone)]
pub struct ErrorReply {
    pub status: StatusCode,
    /// The JSON document, without framing.
    pub json: Bytes,
    /// For 405: the methods the route accepts.
    pub allow: Option<&'static str>,
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: String,
    #[serde(rename = "type")]
    kind: &'a str,
    code: &'a str,
}

/// THE mapping from an error to status and OpenAI error body.
pub fn openai_error(err: &ProxyError) -> ErrorReply {
    use ProxyError as E;
    let (status, code) = match err {
        E::MalformedJson { .. } => (StatusCode::BAD_REQUEST, "malformed_json"),
        E::BodyTooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
        E::MethodNotAllowed { .. } => (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
        E::ClientBody(_) => (StatusCode::BAD_REQUEST, "bad_request_body"),
        E::ClientTimeout { .. } => (StatusCode::REQUEST_TIMEOUT, "request_timeout"),
        E::Connect { .. } => (StatusCode::BAD_GATEWAY, "upstream_unavailable"),
        E::UpstreamFailed { .. } => (StatusCode::BAD_GATEWAY, "upstream_failed"),
        E::UpstreamDied { .. } => (StatusCode::BAD_GATEWAY, "upstream_died"),
        E::FirstByteTimeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "upstream_timeout"),
        E::IdleTimeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "stream_idle_timeout"),
        E::OverallTimeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "deadline_exceeded"),
        E::ModelNotFound { .. } => (StatusCode::NOT_FOUND, "model_not_found"),
        E::NoEndpoint { .. } => (StatusCode::SERVICE_UNAVAILABLE, "no_endpoint"),
        E::HopLimit { .. } => (StatusCode::LOOP_DETECTED, "loop_detected"),
        // A client error on prefill is the client's to see; an engine failure is a gateway's.
        E::PrefillFailed { status, .. } => match StatusCode::from_u16(*status) {
            Ok(s) if s.is_client_error() => (s, "prefill_rejected"),
            _ => (StatusCode::BAD_GATEWAY, "prefill_failed"),
        },
        E::BadPrefiller { .. } => (StatusCode::FORBIDDEN, "prefiller_not_allowed"),
        E::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal_error"),
    };
    let kind = match err.culprit() {
        Culprit::Client => "invalid_request_error",
        Culprit::Engine | Culprit::Peer => "upstream_error",
        Culprit::Proxy => "server_error",
    };
    let allow = match err {
        E::MethodNotAllowed { allow, .. } => Some(*allow),
        _ => None,
    };
    let envelope = Envelope {
        error: Inner {
            message: err.to_string(),
            kind,
            code,
        },
    };
    // Serializing strings into JSON cannot fail; keep a fixed body rather than panic.
    let json = serde_json::to_vec(&envelope)
        .map(Bytes::from)
        .unwrap_or_else(|_| {
            Bytes::from_static(
                br#"{"error":{"message":"error","type":"server_error","code":"internal_error"}}"#,
            )
        });
    ErrorReply {
        status,
        json,
        allow,
    }
}

/// A complete error response for a request whose response has not started,
/// its body whole (the caller wraps it in whichever body type it sends).
pub fn error_response(err: &ProxyError, request_id: &HeaderValue) -> Response<Bytes> {
    let reply = openai_error(err);
    let mut resp = Response::new(reply.json);
    *resp.status_mut() = reply.status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(REQUEST_ID, request_id.clone());
    if let Some(allow) = reply.allow {
        h.insert(header::ALLOW, HeaderValue::from_static(allow));
    }
    resp
}

/// The closing bytes of an SSE stream that failed after it started. When the
/// last forwarded bytes ended mid-event, a blank line first ends that event so
/// the error is parsed as its own.
pub fn sse_error_tail(err: &ProxyError, mid_event: bool) -> Bytes {
    let reply = openai_error(err);
    let mut out = Vec::with_capacity(reply.json.len() + 32);
    if mid_event {
        out.extend_from_slice(b"\n\n");
    }
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(&reply.json);
    out.extend_from_slice(b"\n\ndata: [DONE]\n\n");
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn body_is_openai_shaped() {
        let r = openai_error(&ProxyError::BodyTooLarge { limit: 10 });
        assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
        let v: serde_json::Value = serde_json::from_slice(&r.json).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "body_too_large");
        assert!(v["error"]["message"].as_str().unwrap().contains("10 bytes"));
    }

    #[test]
    fn sse_tail_closes_a_partial_event() {
        let e = ProxyError::Internal("x".into());
        let t = sse_error_tail(&e, true);
        assert!(t.starts_with(b"\n\ndata: {\"error\""));
        assert!(t.ends_with(b"data: [DONE]\n\n"));
    }
}
