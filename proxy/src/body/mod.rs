//! Bodies on both sides of the proxy.
//!
//! [`ResponseBody`] is what the client receives: either a whole buffer (errors,
//! admin answers) or a [`Relay`] of the upstream's body (`relay.rs`: frame by
//! frame under the idle and overall deadlines; an SSE error event and a clean
//! end, or a cut body, when the upstream fails after the stream started; a
//! continuation on another pod, in the same body, for a stream that may
//! migrate). Dropping a `ResponseBody` (client gone) drops the upstream body,
//! which cancels the upstream request.
//!
//! [`IncomingBody`] is the client's request body as the request path gets
//! it, whichever codec read it. The codecs' own bodies (the HTTP/1.1
//! server's reader, the engine pool's reply) live with their codecs and come
//! here as a [`Streamed`] body, so this module names neither. [`UpstreamBody`] is what the upstream
//! receives: the client's bytes, whole (inference calls, already read for
//! classification) or streamed (passthrough).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use crate::access::{AccessLog, End};
use crate::metrics::InFlight;

mod relay;

pub use relay::{Migrate, Relay, RelayParams, Resuming};

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

/// A body that holds what lasts as long as it does: the fleet's in-flight
/// count towards the pod sending it, and the span of the call it answers.
pub struct Counted {
    inner: Streamed,
    _count: Option<crate::metrics::CountGuard>,
    _hop: crate::otel::Hop,
}

impl Counted {
    pub fn new(
        inner: Streamed,
        count: Option<crate::metrics::CountGuard>,
        hop: crate::otel::Hop,
    ) -> Self {
        Self {
            inner,
            _count: count,
            _hop: hop,
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
        Self {
            kind: Kind::Relay(Box::new(Relay::new(streamed(inner), p))),
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
    /// A migration started since the last poll: the failed pod's in-flight
    /// count let go, the access line's count, and an event on the request's
    /// span.
    fn report_migration(&mut self) {
        let Kind::Relay(r) = &mut self.kind else {
            return;
        };
        r.reported = r.migrations;
        // The pod that failed no longer serves it (the continuation's body
        // counts it at the next pod).
        if let Some(g) = self._in_flight.as_mut() {
            g.hold_target(None);
        }
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
        let this = &mut *self;
        let trace = this.spans.as_deref().and_then(|s| s.trace.as_deref());
        let polled = match &mut this.kind {
            Kind::Full(b) => Pin::new(b).poll_frame(cx),
            Kind::Relay(r) => r.poll_frame(cx, trace),
        };
        let sent = matches!(&polled, Poll::Ready(Some(Ok(f))) if f.data_ref().is_some_and(|d| !d.is_empty()));
        if sent {
            if let Some(g) = self._in_flight.as_mut() {
                g.first_byte();
            }
        }
        if self.access.is_some() {
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
