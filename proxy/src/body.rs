//! Bodies on both sides of the proxy.
//!
//! [`ResponseBody`] is what the client receives: either a whole buffer (errors,
//! admin answers) or a [`Relay`] of the upstream's body, forwarded frame by
//! frame as it arrives (never buffered whole) under the idle and overall
//! deadlines, observing TTFT and inter-chunk gaps on streams. When the upstream
//! fails after the stream started, an SSE response ends with an error event and
//! a clean end; other responses are cut, so the client sees a truncated body
//! rather than a silently short one. Dropping a `ResponseBody` (client gone)
//! drops the upstream body, which cancels the upstream request.
//!
//! A relay given a [`Migrate`] (a streamed completion, `request/migrate.rs`)
//! forwards whole SSE events only and, when its upstream fails, asks it for a
//! continuation on another pod, which it then relays in the same body: the
//! client sees one stream.
//!
//! [`IncomingBody`] is the client's request body as the request path gets
//! it, whichever codec read it. The codecs' own bodies (the HTTP/1.1
//! server's reader, the engine pool's reply) live with their codecs and come
//! here as a [`Streamed`] body, so this module names neither. [`UpstreamBody`] is what the upstream
//! receives: the client's bytes, whole (inference calls, already read for
//! classification) or streamed (passthrough).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

use crate::access::{AccessLog, End};
use crate::error::{ProxyError, UpstreamName};
use crate::metrics::{InFlight, Route, UpstreamMetrics};
use crate::respond::sse_error_tail;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The response body the client receives.
pub struct ResponseBody {
    kind: Kind,
    /// Keeps the request counted as in flight until the body ends or is dropped.
    _in_flight: Option<InFlight>,
    /// The request's access record (`logging.access_log`), written on drop.
    access: Option<AccessGuard>,
    /// The spans that end with the body (`tracing` configured).
    spans: Option<Box<Spans>>,
}

/// Spans ended when the body is dropped, in field order: the upstream call,
/// then the request's execute and server spans.
#[derive(Default)]
struct Spans {
    hop: Option<crate::otel::Hop>,
    trace: Option<Box<crate::otel::RequestTrace>>,
}

/// Writes the access line when the body is dropped, with how it ended.
struct AccessGuard {
    log: Option<Box<AccessLog>>,
    end: End,
}

enum Kind {
    Full(Whole),
    Relay(Box<Relay>),
}

/// What a relay needs to know about its request.
pub struct RelayParams {
    pub upstream: UpstreamName,
    pub route: Route,
    pub metrics: Arc<UpstreamMetrics>,
    /// When the request arrived (TTFT is measured from here).
    pub started: Instant,
    pub stream_idle: Duration,
    pub overall: Duration,
    /// Whether the response is `text/event-stream`.
    pub sse: bool,
    pub request_id: String,
}

/// A stream that may go on elsewhere when its upstream fails after bytes
/// reached the client (request migration, `crate::request::migrate`). The
/// relay hands it every data frame and every failure; it owns no socket.
pub trait Migrate: Send + Sync {
    /// Bytes from the upstream: what to forward to the client now (whole
    /// events, the current upstream's rewritten as the first one's), and the
    /// failure the upstream reported in-band after them (an SSE error
    /// event), if it did.
    fn forward(&mut self, data: Bytes) -> (Bytes, Option<ProxyError>);
    /// The upstream's body ended: `Ok` when the stream is complete, else the
    /// failure (it stopped before its end).
    fn ended(&mut self) -> Result<(), ProxyError>;
    /// The upstream failed with `err`: the call that continues the stream on
    /// another pod, or `None` (why not is counted) and the stream ends with
    /// the error.
    fn resume(&mut self, err: &ProxyError) -> Option<Resuming>;
    /// The tokens carried to other pods so far, in all.
    fn carried(&self) -> u64;
}

/// A continuation being started: its body and who serves it.
pub type Resuming =
    Pin<Box<dyn Future<Output = Result<(Streamed, UpstreamName), ProxyError>> + Send>>;

/// A body still arriving, from whichever codec reads it.
pub type Streamed = BoxBody<Bytes, BoxError>;

/// `body` as a [`Streamed`] one.
pub fn streamed<B>(body: B) -> Streamed
where
    B: Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed()
}

/// A body that holds a count (the fleet's in-flight count towards the pod
/// sending it) until it ends or is dropped.
pub struct Counted {
    inner: Streamed,
    _count: Option<crate::metrics::CountGuard>,
}

impl Counted {
    pub fn new(inner: Streamed, count: Option<crate::metrics::CountGuard>) -> Self {
        Self {
            inner,
            _count: count,
        }
    }
}

impl Body for Counted {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// An upstream body being forwarded to the client.
pub struct Relay {
    inner: Streamed,
    p: RelayParams,
    /// When the relay gives up if no frame arrives: the idle deadline after
    /// the last frame, capped by the overall one.
    deadline_at: Instant,
    /// The timer for `deadline_at`, made the first time the upstream keeps
    /// the relay waiting: a response whose frames are ready when polled (a
    /// small answer read with its head) never touches the timer wheel.
    deadline: Option<Pin<Box<Sleep>>>,
    overall_at: Instant,
    last_chunk: Option<Instant>,
    /// The last forwarded bytes did not end an SSE event.
    mid_event: bool,
    done: bool,
    /// Ended by an upstream failure (an SSE error tail or a cut body).
    failed: bool,
    /// Set for a stream that may migrate.
    migrate: Option<Box<dyn Migrate>>,
    /// The continuation being started; its `Mutex` only makes the future
    /// `Sync` (the relay polls it through `&mut`, never locking).
    resuming: Option<std::sync::Mutex<Resuming>>,
    /// A failure reported after the bytes just forwarded: handled next poll.
    failure: Option<ProxyError>,
    /// Migrations started, and those the access line and spans have heard of.
    migrations: u8,
    reported: u8,
    /// The last migration's cause, for its span event.
    migrated_from: Option<String>,
}

/// The client's request body.
pub enum IncomingBody {
    /// Whole already: it came in with its head (or there is none).
    Full(Whole),
    /// Still arriving on a connection of kvmesh's own HTTP/1.1 server.
    H1(Streamed),
    /// From hyper: HTTP/2 and TLS connections, the mesh port.
    Hyper(Incoming),
}

/// The request body sent upstream.
pub enum UpstreamBody {
    /// Whole: the engine pool takes the bytes as they are, to write them
    /// with the head, and again on a retry.
    Full(Whole),
    Stream(Limited<IncomingBody>),
}

impl UpstreamBody {
    pub fn full(b: impl Into<Bytes>) -> Self {
        Self::Full(Whole::new(b))
    }

    pub fn empty() -> Self {
        Self::Full(Whole::empty())
    }
}

impl ResponseBody {
    pub fn full(b: impl Into<Bytes>) -> Self {
        Self {
            kind: Kind::Full(Whole::new(b)),
            _in_flight: None,
            access: None,
            spans: None,
        }
    }

    pub fn empty() -> Self {
        Self {
            kind: Kind::Full(Whole::empty()),
            _in_flight: None,
            access: None,
            spans: None,
        }
    }

    /// Forwards `inner`, an upstream's body, under `p`'s deadlines.
    pub fn relay<B>(inner: B, p: RelayParams) -> Self
    where
        B: Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        let inner = streamed(inner);
        let now = Instant::now();
        let overall_at = p.started + p.overall;
        let deadline_at = (now + p.stream_idle).min(overall_at);
        Self {
            kind: Kind::Relay(Box::new(Relay {
                inner,
                p,
                deadline_at,
                deadline: None,
                overall_at,
                last_chunk: None,
                mid_event: false,
                done: false,
                failed: false,
                migrate: None,
                resuming: None,
                failure: None,
                migrations: 0,
                reported: 0,
                migrated_from: None,
            })),
            _in_flight: None,
            access: None,
            spans: None,
        }
    }

    /// Lets a relayed stream continue on another pod when its upstream
    /// fails (see [`Migrate`]); a whole body ignores it.
    pub fn with_migration(mut self, m: Box<dyn Migrate>) -> Self {
        if let Kind::Relay(r) = &mut self.kind {
            r.migrate = Some(m);
        }
        self
    }

    pub fn with_in_flight(mut self, guard: InFlight) -> Self {
        self._in_flight = Some(guard);
        self
    }

    /// Ends `hop`, an upstream call's span, when this body is dropped.
    pub fn with_span(mut self, hop: crate::otel::Hop) -> Self {
        if hop.is_some() {
            self.spans.get_or_insert_with(Default::default).hop = Some(hop);
        }
        self
    }

    /// Ends the request's spans when this body is dropped.
    pub fn with_trace(mut self, trace: Box<crate::otel::RequestTrace>) -> Self {
        self.spans.get_or_insert_with(Default::default).trace = Some(trace);
        self
    }

    /// Writes `log` as the request's access line when this body is dropped.
    pub fn with_access(mut self, log: Box<AccessLog>) -> Self {
        let end = if self.is_end_stream() {
            End::Complete
        } else {
            End::Cancelled
        };
        self.access = Some(AccessGuard {
            log: Some(log),
            end,
        });
        self
    }

    /// After a poll: the first byte and whether the body has ended, for the access line.
    fn note(&mut self, sent_bytes: bool) {
        // hyper stops polling a body whose length it knows once that many
        // bytes went out, so a relay has ended when its upstream body has.
        let ended = match &self.kind {
            Kind::Full(b) => b.is_end_stream(),
            // A continuation being started has an empty body in the meantime.
            Kind::Relay(r) => r.done || (r.resuming.is_none() && r.inner.is_end_stream()),
        };
        let failed = matches!(&self.kind, Kind::Relay(r) if r.failed);
        let Some(a) = &mut self.access else {
            return;
        };
        if let (true, Some(log)) = (sent_bytes, a.log.as_mut()) {
            log.byte_sent();
        }
        if failed {
            a.end = End::UpstreamError;
        } else if ended {
            a.end = End::Complete;
        }
    }
}

impl ResponseBody {
    /// A migration started since the last poll: the access line's count,
    /// and an event on the request's span.
    fn report_migration(&mut self) {
        let Kind::Relay(r) = &mut self.kind else {
            return;
        };
        r.reported = r.migrations;
        let carried = r.migrate.as_ref().map_or(0, |m| m.carried());
        if let Some(log) = self.access.as_mut().and_then(|a| a.log.as_mut()) {
            log.migrated(r.migrations, carried);
        }
        if let Some(trace) = self.spans.as_ref().and_then(|s| s.trace.as_deref()) {
            trace.migrated(
                r.migrations,
                carried,
                r.migrated_from.take().unwrap_or_default(),
            );
        }
    }
}

impl Drop for AccessGuard {
    fn drop(&mut self) {
        if let Some(log) = self.log.take() {
            log.finish(self.end);
        }
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = match &mut self.kind {
            Kind::Full(b) => Pin::new(b).poll_frame(cx),
            Kind::Relay(r) => r.poll_frame(cx),
        };
        if self.access.is_some() {
            let sent = matches!(&polled, Poll::Ready(Some(Ok(f))) if f.data_ref().is_some_and(|d| !d.is_empty()));
            self.note(sent);
        }
        if matches!(&self.kind, Kind::Relay(r) if r.migrations != r.reported) {
            self.report_migration();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full(b) => b.is_end_stream(),
            Kind::Relay(r) => r.done,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full(b) => b.size_hint(),
            // An SSE relay may append an error event, so it promises no length.
            Kind::Relay(r) if r.p.sse => SizeHint::default(),
            Kind::Relay(r) => r.inner.size_hint(),
        }
    }
}

impl Relay {
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            if let Some(e) = self.failure.take() {
                if let Some(r) = self.migrate_or_fail(e) {
                    return Poll::Ready(Some(r));
                }
            }
            if let Some(r) = self.resuming.as_mut() {
                let fut = match r.get_mut() {
                    Ok(f) => f,
                    Err(poisoned) => poisoned.into_inner(),
                };
                match fut.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok((inner, upstream))) => {
                        self.resuming = None;
                        self.inner = inner;
                        self.p.upstream = upstream;
                        self.deadline_at =
                            (Instant::now() + self.p.stream_idle).min(self.overall_at);
                    }
                    Poll::Ready(Err(e)) => {
                        self.resuming = None;
                        match self.migrate_or_fail(e) {
                            Some(r) => return Poll::Ready(Some(r)),
                            None => continue,
                        }
                    }
                }
            }
            match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let frame = match (self.migrate.as_mut(), frame.into_data()) {
                        (Some(m), Ok(data)) => {
                            let (data, failure) = m.forward(data);
                            self.failure = failure;
                            if data.is_empty() {
                                // Part of an event (wait for the rest), or
                                // a failure (handled at the loop's top).
                                continue;
                            }
                            Frame::data(data)
                        }
                        (_, Ok(data)) => Frame::data(data),
                        (_, Err(frame)) => frame,
                    };
                    if let Some(data) = frame.data_ref() {
                        self.observe(data);
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(Some(Err(e))) => {
                    let err = ProxyError::UpstreamDied {
                        upstream: self.p.upstream.clone(),
                        reason: e.to_string(),
                    };
                    match self.migrate_or_fail(err) {
                        Some(r) => return Poll::Ready(Some(r)),
                        None => continue,
                    }
                }
                Poll::Ready(None) => {
                    if let Some(Err(e)) = self.migrate.as_mut().map(|m| m.ended()) {
                        match self.migrate_or_fail(e) {
                            Some(r) => return Poll::Ready(Some(r)),
                            None => continue,
                        }
                    }
                    self.done = true;
                    return Poll::Ready(None);
                }
                Poll::Pending => match self.deadline_timer().poll(cx) {
                    Poll::Ready(()) => {
                        let overall = Instant::now() >= self.overall_at;
                        let err = if overall {
                            ProxyError::OverallTimeout {
                                upstream: self.p.upstream.clone(),
                                after: self.p.overall,
                            }
                        } else {
                            ProxyError::IdleTimeout {
                                upstream: self.p.upstream.clone(),
                                after: self.p.stream_idle,
                            }
                        };
                        // Past the overall deadline the request is over,
                        // wherever it might go on.
                        if overall {
                            return Poll::Ready(Some(self.fail(err)));
                        }
                        match self.migrate_or_fail(err) {
                            Some(r) => return Poll::Ready(Some(r)),
                            None => continue,
                        }
                    }
                    Poll::Pending => return Poll::Pending,
                },
            }
        }
    }

    /// After an upstream failure: starts the continuation when the stream
    /// may migrate (and returns `None`: poll on), else ends the body.
    fn migrate_or_fail(&mut self, err: ProxyError) -> Option<Result<Frame<Bytes>, BoxError>> {
        if let Some(next) = self.migrate.as_mut().and_then(|m| m.resume(&err)) {
            tracing::info!(request_id = %self.p.request_id, error = %err, "stream failed after it started; migrating");
            // The failed upstream's body goes now: dropping it cancels the
            // call (a hung engine stops working on it).
            self.inner = streamed(Whole::empty());
            self.resuming = Some(std::sync::Mutex::new(next));
            self.migrations = self.migrations.saturating_add(1);
            self.migrated_from = Some(err.to_string());
            return None;
        }
        Some(self.fail(err))
    }

    fn observe(&mut self, data: &Bytes) {
        if data.is_empty() {
            return;
        }
        let now = Instant::now();
        let m = &self.p.metrics;
        m.bytes_out(self.p.route, data.len() as u64);
        if self.p.sse {
            match self.last_chunk {
                None => m.ttft(self.p.route, (now - self.p.started).as_secs_f64()),
                Some(prev) => m.itl(self.p.route, (now - prev).as_secs_f64()),
            }
            self.mid_event = !(data.ends_with(b"\n\n") || data.ends_with(b"\r\n\r\n"));
        }
        self.last_chunk = Some(now);
        self.deadline_at = (now + self.p.stream_idle).min(self.overall_at);
    }

    /// The timer for `deadline_at`, made or moved there.
    fn deadline_timer(&mut self) -> Pin<&mut Sleep> {
        let at = self.deadline_at;
        let timer = self
            .deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
        if timer.deadline() != at {
            timer.as_mut().reset(at);
        }
        timer.as_mut()
    }

    /// Ends the body after an upstream failure: an SSE error event and a clean
    /// end for streams, a cut connection otherwise.
    fn fail(&mut self, err: ProxyError) -> Result<Frame<Bytes>, BoxError> {
        self.done = true;
        self.failed = true;
        tracing::warn!(request_id = %self.p.request_id, culprit = ?err.culprit(), error = %err, "response failed after it started");
        if self.p.sse {
            let tail = sse_error_tail(&err, self.mid_event);
            self.p.metrics.bytes_out(self.p.route, tail.len() as u64);
            Ok(Frame::data(tail))
        } else {
            Err(Box::new(err))
        }
    }
}

/// A body that is whole already (an answer of the sidecar's own, a request
/// body read for classification, an engine reply that came with its head):
/// its bytes in one frame, then its end. Every body type here has one as
/// its `Full` variant.
#[derive(Debug, Default)]
pub struct Whole(Option<Bytes>);

impl Whole {
    pub fn new(b: impl Into<Bytes>) -> Self {
        Self(Some(b.into()))
    }

    pub fn empty() -> Self {
        Self(None)
    }

    /// The bytes not yet sent (none once sent, or for an empty body).
    pub fn bytes(&self) -> Option<&Bytes> {
        self.0.as_ref()
    }

    /// Its length, exactly.
    pub fn len(&self) -> u64 {
        self.0.as_ref().map_or(0, |b| b.len() as u64)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Body for Whole {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Poll::Ready(
            self.get_mut()
                .0
                .take()
                .filter(|b| !b.is_empty())
                .map(|b| Ok(Frame::data(b))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.len())
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            Self::Full(b) => Pin::new(b).poll_frame(cx),
            Self::Stream(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Full(b) => b.is_end_stream(),
            Self::Stream(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full(b) => b.size_hint(),
            Self::Stream(b) => b.size_hint(),
        }
    }
}

impl IncomingBody {
    pub fn empty() -> Self {
        Self::Full(Whole::empty())
    }
}

impl Body for IncomingBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            Self::Full(b) => Pin::new(b).poll_frame(cx),
            Self::H1(b) => Pin::new(b).poll_frame(cx),
            Self::Hyper(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Full(b) => b.is_end_stream(),
            Self::H1(b) => b.is_end_stream(),
            Self::Hyper(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full(b) => b.size_hint(),
            Self::H1(b) => b.size_hint(),
            Self::Hyper(b) => b.size_hint(),
        }
    }
}
