//! The relay of an upstream's body to the client: frame by frame as it
//! arrives (never buffered whole) under the idle and overall deadlines,
//! observing TTFT and inter-chunk gaps on streams. When the upstream fails
//! after the stream started, an SSE response ends with an error event and a
//! clean end; other responses are cut.
//!
//! A relay given a [`Migrate`] (a streamed completion,
//! `crate::request::migrate`) forwards whole SSE events only and, when its
//! upstream fails (a broken body, an in-band error, an early end, the idle
//! deadline), asks it for a continuation on another pod, which it then
//! relays in the same body: the client sees one stream.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use tokio::time::{Instant, Sleep};

use super::{streamed, BoxError, Streamed, Whole};
use crate::error::{ProxyError, UpstreamName};
use crate::metrics::{Route, UpstreamMetrics};
use crate::otel::RequestTrace;
use crate::respond::sse_error_tail;

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
    /// Whether the stream is complete already, so that a failure (or the
    /// body's end) now cuts nothing the client needs: the bytes that end it
    /// (`data: [DONE]` when only the finish came; none after `[DONE]`).
    fn complete(&mut self) -> Option<Bytes>;
    /// The upstream failed with `err`: the call that continues the stream on
    /// another pod, or `None` (why not is counted) and the stream ends with
    /// the error.
    /// `trace`, the request's spans, parents the continuation's call.
    fn resume(&mut self, err: &ProxyError, trace: Option<&RequestTrace>) -> Option<Resuming>;
    /// The tokens carried to other pods so far, in all.
    fn carried(&self) -> u64;
}

/// A continuation being started: its body and who serves it.
pub type Resuming =
    Pin<Box<dyn Future<Output = Result<(Streamed, UpstreamName), ProxyError>> + Send>>;

/// An upstream body being forwarded to the client.
pub struct Relay {
    pub(super) inner: Streamed,
    pub(super) p: RelayParams,
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
    pub(super) done: bool,
    /// Ended by an upstream failure (an SSE error tail or a cut body).
    pub(super) failed: bool,
    /// Set for a stream that may migrate.
    pub(super) migrate: Option<Box<dyn Migrate>>,
    /// The continuation being started; its `Mutex` only makes the future
    /// `Sync` (the relay polls it through `&mut`, never locking).
    pub(super) resuming: Option<std::sync::Mutex<Resuming>>,
    /// A failure reported after the bytes just forwarded: handled next poll.
    failure: Option<ProxyError>,
    /// Migrations whose continuation's call has ended (answered or failed),
    /// and those the access line and spans have heard of.
    pub(super) migrations: u8,
    pub(super) reported: u8,
    /// The last migration's cause, for its span event.
    pub(super) migrated_from: Option<String>,
}

impl Relay {
    /// Forwards `inner` under `p`'s deadlines.
    pub(super) fn new(inner: Streamed, p: RelayParams) -> Self {
        let now = Instant::now();
        let overall_at = p.started + p.overall;
        let deadline_at = (now + p.stream_idle).min(overall_at);
        Self {
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
        }
    }

    pub(super) fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
        trace: Option<&RequestTrace>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            if let Some(e) = self.failure.take() {
                if let Some(r) = self.migrate_or_fail(e, trace) {
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
                        self.migrations = self.migrations.saturating_add(1);
                        self.inner = inner;
                        self.p.upstream = upstream;
                        self.deadline_at =
                            (Instant::now() + self.p.stream_idle).min(self.overall_at);
                    }
                    Poll::Ready(Err(e)) => {
                        self.resuming = None;
                        self.migrations = self.migrations.saturating_add(1);
                        match self.migrate_or_fail(e, trace) {
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
                    match self.migrate_or_fail(err, trace) {
                        Some(r) => return Poll::Ready(Some(r)),
                        None => continue,
                    }
                }
                Poll::Ready(None) if self.migrate.is_some() => {
                    // Complete, or stopped before its end: a failure.
                    let err = ProxyError::UpstreamDied {
                        upstream: self.p.upstream.clone(),
                        reason: "the stream ended before `data: [DONE]`".to_owned(),
                    };
                    match self.migrate_or_fail(err, trace) {
                        Some(r) => return Poll::Ready(Some(r)),
                        None => continue,
                    }
                }
                Poll::Ready(None) => {
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
                        match self.migrate_or_fail(err, trace) {
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
    fn migrate_or_fail(
        &mut self,
        err: ProxyError,
        trace: Option<&RequestTrace>,
    ) -> Option<Result<Frame<Bytes>, BoxError>> {
        if let Some(tail) = self.migrate.as_mut().and_then(|m| m.complete()) {
            // The stream had its end (or all of it but `[DONE]`): the
            // failure cut nothing the client needs, and it ends cleanly.
            self.done = true;
            self.inner = streamed(Whole::empty());
            if tail.is_empty() {
                return None;
            }
            self.observe(&tail);
            return Some(Ok(Frame::data(tail)));
        }
        if let Some(next) = self.migrate.as_mut().and_then(|m| m.resume(&err, trace)) {
            tracing::info!(request_id = %self.p.request_id, error = %err, "stream failed after it started; migrating");
            // The failed upstream's body goes now: dropping it cancels the
            // call (a hung engine stops working on it).
            self.inner = streamed(Whole::empty());
            // Counted (and reported) once the continuation's call ends:
            // by then the output it carries has been counted.
            self.resuming = Some(std::sync::Mutex::new(next));
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
