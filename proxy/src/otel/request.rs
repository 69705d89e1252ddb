//! One request's spans: the server span (`kvmesh.request`, the child of the
//! client's `traceparent`), one span per stage under it, and one client span
//! per upstream call (`kvmesh.forward` for each attempt, fallbacks included;
//! `kvmesh.pd.prefill` and `kvmesh.pd.decode` for the legs of a split) under
//! `kvmesh.execute`, whose ids go upstream in `traceparent`.
//!
//! Every type here is a no-op wrapper when the request has no trace (tracing
//! off): `None` inside, one branch per call. Attributes that cost something
//! to build are built only when the span is recording (sampled), see
//! [`Stage::recording`].

use http::{HeaderMap, HeaderValue};
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;

use super::Tracer;
use crate::error::UpstreamName;

const TRACEPARENT: &str = "traceparent";
const TRACESTATE: &str = "tracestate";

/// The request's trace: its server span and, once execution began, the
/// execute stage's span (the parent of every upstream call).
pub struct RequestTrace {
    tracer: Tracer,
    request: Context,
    execute: Option<Context>,
}

/// A stage's span; ends when dropped, unless it is a view on the request or
/// execute span (which end with the request).
pub struct Stage {
    cx: Option<Context>,
    owned: bool,
}

/// An upstream call's span; ends when dropped (for a relayed response: when
/// the response body ends).
pub struct Hop(Option<Context>);

/// Starts the trace of a request: the incoming W3C trace context (when valid)
/// is the parent; without one, the sampler decides on a new trace.
pub fn start(
    tracer: Option<&Tracer>,
    headers: &HeaderMap,
    method: &str,
    route: &'static str,
) -> Option<Box<RequestTrace>> {
    let tracer = tracer?;
    let parent = TraceContextPropagator::new().extract(&Headers(headers));
    let span = tracer
        .sdk()
        .span_builder("kvmesh.request")
        .with_kind(SpanKind::Server)
        .with_attributes([
            KeyValue::new("http.request.method", method.to_owned()),
            KeyValue::new("url.path", route),
        ])
        .start_with_context(tracer.sdk(), &parent);
    Some(Box::new(RequestTrace {
        tracer: tracer.clone(),
        request: parent.with_span(span),
        execute: None,
    }))
}

impl RequestTrace {
    /// The trace id, when this trace is recorded (sampled).
    pub fn sampled_trace_id(&self) -> Option<String> {
        let span = self.request.span();
        let sc = span.span_context();
        sc.is_sampled().then(|| sc.trace_id().to_string())
    }

    /// A stage span under the request span.
    pub fn stage(&self, name: &'static str) -> Stage {
        Stage {
            cx: Some(self.child(&self.request, name, SpanKind::Internal)),
            owned: true,
        }
    }

    /// Opens the execute stage's span, the parent of the calls that follow.
    pub fn begin_execute(&mut self) {
        if self.execute.is_none() {
            self.execute = Some(self.child(&self.request, "kvmesh.execute", SpanKind::Internal));
        }
    }

    /// A client span for one upstream call (`name`: `kvmesh.forward`,
    /// `kvmesh.pd.prefill`, `kvmesh.pd.decode`) to `upstream`, the
    /// `attempt`-th of the request.
    pub fn hop(&self, name: &'static str, upstream: &UpstreamName, attempt: u8) -> Hop {
        let parent = self.execute.as_ref().unwrap_or(&self.request);
        let cx = self.child(parent, name, SpanKind::Client);
        let span = cx.span();
        if span.is_recording() {
            let (kind, addr) = match upstream {
                UpstreamName::Engine(a) => ("engine", a),
                UpstreamName::Peer(a) => ("peer", a),
            };
            span.set_attribute(KeyValue::new("kvmesh.upstream", kind));
            span.set_attribute(KeyValue::new("server.address", addr.clone()));
            span.set_attribute(KeyValue::new("kvmesh.attempt", i64::from(attempt)));
            span.set_attribute(KeyValue::new("kvmesh.fallback", attempt > 1));
        }
        Hop(Some(cx))
    }

    /// The request span, for the observe stage's attributes.
    pub fn request(&self) -> Stage {
        Stage {
            cx: Some(self.request.clone()),
            owned: false,
        }
    }

    /// The stream went on on another pod (docs/migration.md): an event on
    /// the request span, with the count so far, the tokens carried in all
    /// and what failed.
    pub fn migrated(&self, count: u8, carried_tokens: u64, cause: String) {
        self.request.span().add_event(
            "kvmesh.migration",
            vec![
                KeyValue::new("kvmesh.migration.count", i64::from(count)),
                KeyValue::new(
                    "kvmesh.migration.carried_tokens",
                    i64::try_from(carried_tokens).unwrap_or(i64::MAX),
                ),
                KeyValue::new("kvmesh.migration.cause", cause),
            ],
        );
    }

    /// The execute span, when execution began.
    pub fn execute(&self) -> Stage {
        Stage {
            cx: self.execute.clone(),
            owned: false,
        }
    }

    fn child(&self, parent: &Context, name: &'static str, kind: SpanKind) -> Context {
        let span = self
            .tracer
            .sdk()
            .span_builder(name)
            .with_kind(kind)
            .start_with_context(self.tracer.sdk(), parent);
        parent.with_span(span)
    }
}

/// The server span's outcome, once the response head is known: the status
/// (5xx marks it failed), the scheduler's reason and the targets tried.
pub fn finish(
    trace: &RequestTrace,
    status: u16,
    reason: &'static str,
    attempts: u8,
    upstream: bool,
) {
    let span = trace.request();
    if !span.recording() {
        return;
    }
    span.set(KeyValue::new(
        "http.response.status_code",
        i64::from(status),
    ));
    if !reason.is_empty() {
        span.set(KeyValue::new("kvmesh.reason", reason));
    }
    span.set(KeyValue::new("kvmesh.attempts", i64::from(attempts)));
    if status >= 500 {
        let who = if upstream { "upstream" } else { "sidecar" };
        span.fail(&format!("HTTP {status} ({who})"));
    }
    trace
        .execute()
        .set(KeyValue::new("kvmesh.attempts", i64::from(attempts)));
}

impl Drop for RequestTrace {
    fn drop(&mut self) {
        if let Some(cx) = &self.execute {
            cx.span().end();
        }
        self.request.span().end();
    }
}

impl Stage {
    /// A stage span under `trace`'s request span, or none.
    pub fn of(trace: Option<&RequestTrace>, name: &'static str) -> Self {
        match trace {
            Some(t) => t.stage(name),
            None => Self::off(),
        }
    }

    /// No span (tracing off).
    pub const fn off() -> Self {
        Self {
            cx: None,
            owned: false,
        }
    }

    /// Whether attributes are kept: build costly ones only then.
    pub fn recording(&self) -> bool {
        recording(&self.cx)
    }

    pub fn set(&self, kv: KeyValue) {
        set(&self.cx, kv);
    }

    /// Marks the span failed with `e`.
    pub fn fail(&self, e: &dyn std::fmt::Display) {
        fail(&self.cx, e);
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        if let (true, Some(cx)) = (self.owned, &self.cx) {
            cx.span().end();
        }
    }
}

impl Hop {
    /// No span (tracing off).
    pub const fn off() -> Self {
        Self(None)
    }

    /// A span for an upstream call, or none.
    pub fn of(
        trace: Option<&RequestTrace>,
        name: &'static str,
        upstream: &UpstreamName,
        attempt: u8,
    ) -> Self {
        match trace {
            Some(t) => t.hop(name, upstream, attempt),
            None => Self::off(),
        }
    }

    /// Whether there is a span.
    pub fn is_some(&self) -> bool {
        self.0.is_some()
    }

    /// Puts this span's context in the outgoing headers: `traceparent` with
    /// this span as the parent, `tracestate` as the trace carries it. With no
    /// span, the client's headers go on unchanged.
    pub fn inject(&self, headers: &mut HeaderMap) {
        let Some(cx) = &self.0 else {
            return;
        };
        let span = cx.span();
        let sc = span.span_context();
        let tp = format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        );
        if let Ok(v) = HeaderValue::from_str(&tp) {
            headers.insert(TRACEPARENT, v);
        }
        let state = sc.trace_state().header();
        match HeaderValue::from_str(&state) {
            Ok(v) if !state.is_empty() => {
                headers.insert(TRACESTATE, v);
            }
            _ => {
                headers.remove(TRACESTATE);
            }
        }
    }

    /// The local engine's data-parallel rank this call was sent to
    /// (`X-data-parallel-rank`).
    pub fn rank(&self, rank: u32) {
        set(&self.0, KeyValue::new("kvmesh.dp_rank", i64::from(rank)));
    }

    /// The upstream's response status (5xx marks the span failed).
    pub fn status(&self, code: u16) {
        set(
            &self.0,
            KeyValue::new("http.response.status_code", i64::from(code)),
        );
        if code >= 500 {
            fail(&self.0, &format!("HTTP {code}"));
        }
    }

    /// Marks the call failed with `e`.
    pub fn fail(&self, e: &dyn std::fmt::Display) {
        fail(&self.0, e);
    }

    /// What a migration's count found: the tokens the output so far holds
    /// by the next pod's tokenizer.
    pub fn counted(&self, tokens: u64) {
        set(
            &self.0,
            KeyValue::new(
                "kvmesh.migration.counted_tokens",
                i64::try_from(tokens).unwrap_or(i64::MAX),
            ),
        );
    }
}

impl Drop for Hop {
    fn drop(&mut self) {
        if let Some(cx) = &self.0 {
            cx.span().end();
        }
    }
}

fn recording(cx: &Option<Context>) -> bool {
    cx.as_ref().is_some_and(|cx| cx.span().is_recording())
}

fn set(cx: &Option<Context>, kv: KeyValue) {
    if let Some(cx) = cx {
        cx.span().set_attribute(kv);
    }
}

fn fail(cx: &Option<Context>, e: &dyn std::fmt::Display) {
    if let Some(cx) = cx {
        let span = cx.span();
        if span.is_recording() {
            span.set_status(Status::error(e.to_string()));
        }
    }
}

/// Reads the W3C headers from a request's header map.
struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}
