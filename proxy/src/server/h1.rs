//! One plain-TCP client connection served with kvmesh's own HTTP/1.1 codec
//! (`crate::h1`): read a head, hand the request to the handler, write its
//! response, and again while the client keeps the connection open. A
//! connection that opens with the HTTP/2 preface goes to hyper
//! ([`super::serve_conn`]) with the bytes already read in front.
//!
//! Everything happens on the connection's one task: the request body is
//! read from the socket by whoever polls it, the response body is polled
//! and written here, and nothing is handed between tasks. Only a body that
//! is not whole in the first read needs the socket from the handler's side:
//! it shares the socket (`Arc<TcpStream>`, read by reference) and the read
//! buffer (behind a lock nobody contends: one task) with this loop, which
//! takes the buffer back once the body has been read to its end.
//!
//! What hyper did here and this loop keeps doing: a deadline on every
//! request head (`timeouts.request_head`; counted when the first one
//! misses it), 431 for an oversize head and 400 for a malformed one (then
//! close), `100 Continue` when a body that waits for it is first read, a
//! `Date` on every response, a body length from the response's size when
//! it is known and chunked framing when not, keep-alive by the rules of
//! HTTP/1.0 and 1.1, the client's close noticed while its response is
//! awaited or streamed (the response is dropped, which cancels the
//! upstream request), and on shutdown: idle connections close, a request in
//! flight is finished with `connection: close`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH};
use http::{Method, Request, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use hyper_util::rt::TokioExecutor;
use hyper_util::server::conn::auto;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

use super::{ConnLimits, Handler};
use crate::body::{IncomingBody, ResponseBody};
use crate::h1::encode::{self, ConnectionField};
use crate::h1::io::ReadSize;
use crate::h1::{self, BodyError, Decoded, Decoder, Framing, HeadError, RequestHead};
use crate::metrics::RejectReason;
use crate::shutdown::Shutdown;

/// HTTP/2's connection preface (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// A response's frames are gathered into one write up to this size; a
/// larger frame is written beside what was gathered (`writev`).
const COALESCE: usize = 16 * 1024;
/// A request body of known length up to this size is handed on in one
/// frame, read with as few system calls as the socket allows (the request
/// path reads an inference body whole anyway); a longer one goes in frames
/// of this size.
const GATHER: u64 = 1 << 20;

/// Serves one accepted TCP connection until the client closes it, a head
/// misses its deadline, or shutdown.
pub(super) async fn serve<H: Handler>(
    tcp: TcpStream,
    handler: H,
    shutdown: &Shutdown,
    limits: &ConnLimits,
    h2: &auto::Builder<TokioExecutor>,
) {
    let mut conn = Conn {
        io: Arc::new(tcp),
        buf: BytesMut::new(),
        reads: ReadSize::default(),
        out: Vec::with_capacity(4096),
    };
    let mut timer = Box::pin(tokio::time::sleep(limits.request_head));
    let mut first = true;
    loop {
        let head = match conn
            .next_head(timer.as_mut(), limits.request_head, shutdown, first)
            .await
        {
            Next::Head(h) => h,
            Next::Http2 => {
                let Conn { io, buf, .. } = conn;
                if let Ok(tcp) = Arc::try_unwrap(io) {
                    let io = Rewind {
                        prefix: buf.freeze(),
                        inner: tcp,
                    };
                    super::serve_conn(h2, io, handler, shutdown, limits).await;
                }
                return;
            }
            Next::Bad(e) => {
                if e.status() == StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE {
                    limits.reject(RejectReason::HeaderTooLarge);
                }
                tracing::debug!(error = %e, "refusing a request head");
                conn.refuse(e.status()).await;
                return;
            }
            Next::Timeout => {
                if first {
                    limits.reject(RejectReason::HeaderTimeout);
                    tracing::debug!("no request head within timeouts.request_head; closing");
                }
                return;
            }
            Next::Closed => return,
        };
        first = false;
        if !conn.exchange(&handler, head, shutdown).await {
            conn.close().await;
            return;
        }
    }
}

/// The connection's socket and buffers.
struct Conn {
    io: Arc<TcpStream>,
    /// Read and not yet used: the next head, pipelined requests.
    buf: BytesMut,
    reads: ReadSize,
    /// The response being written: its head and the body frames gathered.
    out: Vec<u8>,
}

/// How waiting for a request head ended. (Returned once per request and
/// moved no further: the head's size is no reason to box it.)
#[allow(clippy::large_enum_variant)]
enum Next {
    Head(RequestHead),
    Http2,
    Bad(HeadError),
    Timeout,
    /// The client closed, the socket failed, or shutdown found it idle.
    Closed,
}

/// What the loop watching the client found.
enum Watch {
    /// Nothing new: still there.
    Quiet,
    /// It closed (or the socket failed): its request is abandoned.
    Gone,
    /// It sent more than a head's worth ahead: stop reading until this
    /// exchange is over.
    Full,
}

impl Conn {
    async fn next_head(
        &mut self,
        mut timer: Pin<&mut Sleep>,
        wait: Duration,
        shutdown: &Shutdown,
        first: bool,
    ) -> Next {
        let mut armed = false;
        loop {
            if !self.buf.is_empty() {
                let n = self.buf.len().min(H2_PREFACE.len());
                if first && self.buf[..n] == H2_PREFACE[..n] {
                    if n == H2_PREFACE.len() {
                        return Next::Http2;
                    }
                } else {
                    match h1::head::parse_request(&mut self.buf) {
                        Ok(Some(h)) => return Next::Head(h),
                        Ok(None) => {}
                        Err(e) => return Next::Bad(e),
                    }
                }
            }
            if !armed {
                timer.as_mut().reset(Instant::now() + wait);
                armed = true;
            }
            let idle = self.buf.is_empty();
            let Self { io, buf, reads, .. } = self;
            let read = tokio::select! {
                biased;
                r = h1::io::read(io, buf, reads) => r,
                _ = timer.as_mut() => return Next::Timeout,
                _ = shutdown.triggered(), if idle => return Next::Closed,
            };
            match read {
                Ok(0) | Err(_) => return Next::Closed,
                Ok(_) => {}
            }
        }
    }

    /// One request and its response. True when the connection stays open.
    async fn exchange<H: Handler>(
        &mut self,
        handler: &H,
        head: RequestHead,
        shutdown: &Shutdown,
    ) -> bool {
        let bodiless = head.parts.method == Method::HEAD;
        let version = head.parts.version;
        let keep_alive = head.keep_alive;
        let (body, inbound) = self.request_body(&head);
        let req = Request::from_parts(head.parts, body);
        // Boxed: the request path's future is several KB, and a box is
        // moved as a pointer (docs/bench-tool.md, "Paced: user time, not
        // syscalls").
        let mut fut = Box::pin(handler.clone().handle(req));
        // The client is watched while it has nothing more to send.
        let mut watch = inbound.is_none();
        let resp = {
            let Self { io, buf, reads, .. } = self;
            watching(io, buf, reads, &mut watch, |cx| fut.as_mut().poll(cx)).await
        };
        drop(fut);
        let Some(resp) = resp else {
            tracing::debug!("the client closed before its response; dropping it");
            return false;
        };
        if let Some(i) = &inbound {
            i.lock().response_started = true;
        }
        let keep = keep_alive && !shutdown.is_triggered();
        let keep = self
            .respond(resp, bodiless, version, keep, watch && inbound.is_none())
            .await;
        match inbound {
            None => keep,
            // The body's bytes and what follows them come back to the
            // connection once it was read to its end; a body left unread
            // (the response did not need it) ends the connection.
            Some(i) => {
                let mut i = i.lock();
                if keep && i.decoder.is_done() && !i.failed {
                    self.buf = std::mem::take(&mut i.buf);
                    self.reads = i.reads;
                    true
                } else {
                    false
                }
            }
        }
    }

    /// The request body: whole when it came in with the head, else a reader
    /// sharing the socket and the buffer, and the connection's handle on them.
    fn request_body(&mut self, head: &RequestHead) -> (IncomingBody, Option<Arc<Mutex<Inbound>>>) {
        match head.framing {
            Framing::Empty => (IncomingBody::empty(), None),
            Framing::Length(n) if !head.expect_continue && self.buf.len() as u64 >= n => {
                // `n` is at most `buf.len()`, a usize.
                let body = self.buf.split_to(n as usize).freeze();
                (IncomingBody::Full(crate::body::Whole::new(body)), None)
            }
            framing => {
                let inbound = Arc::new(Mutex::new(Inbound {
                    io: self.io.clone(),
                    reads: self.reads,
                    continue_due: head.expect_continue && self.buf.is_empty(),
                    buf: std::mem::take(&mut self.buf),
                    decoder: Decoder::new(framing),
                    response_started: false,
                    failed: false,
                }));
                let reader = BodyReader {
                    inbound: inbound.clone(),
                };
                (
                    IncomingBody::H1(crate::body::streamed(reader)),
                    Some(inbound),
                )
            }
        }
    }

    /// Writes `resp`. True when the connection may carry another request.
    async fn respond(
        &mut self,
        resp: Response<ResponseBody>,
        to_head: bool,
        version: Version,
        keep: bool,
        mut watch: bool,
    ) -> bool {
        let (parts, body) = resp.into_parts();
        let status = parts.status;
        let declared = declared_length(&parts.headers);
        let bodiless = to_head
            || status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED;
        let framing = if bodiless {
            // A response to HEAD states its GET's length; the others none.
            match declared {
                Some(n) if to_head => Framing::Length(n),
                _ => Framing::Empty,
            }
        } else if let Some(n) = declared.or(body.size_hint().exact()) {
            Framing::Length(n)
        } else if version == Version::HTTP_11 {
            Framing::Chunked
        } else {
            Framing::UntilClose
        };
        let mut keep = keep && framing != Framing::UntilClose && !says_close(&parts.headers);
        let connection = match (keep, version) {
            (false, _) => ConnectionField::Close,
            (true, Version::HTTP_10) => ConnectionField::KeepAlive,
            (true, _) => ConnectionField::None,
        };
        self.out.clear();
        encode::response_head(&mut self.out, status, &parts.headers, framing, connection);
        if bodiless {
            drop(body);
            return self.flush().await.is_ok() && keep;
        }
        // Unpin: polled in place, and dropped (its in-flight count, access
        // line and spans end) as soon as its last frame is queued.
        let mut body = body;
        let mut sent: u64 = 0;
        loop {
            // The next frame; what is gathered goes out first when the body
            // has to wait for it.
            let frame = match poll_now(Pin::new(&mut body)) {
                Poll::Ready(f) => f,
                Poll::Pending => {
                    if self.flush().await.is_err() {
                        return false;
                    }
                    let Self { io, buf, reads, .. } = self;
                    let next = watching(io, buf, reads, &mut watch, |cx| {
                        Pin::new(&mut body).poll_frame(cx)
                    })
                    .await;
                    match next {
                        Some(f) => f,
                        None => {
                            tracing::debug!("the client closed during its response");
                            return false;
                        }
                    }
                }
            };
            let data = match frame {
                None => break,
                // The body failed: what came before it goes out, then the
                // close tells the client the response is cut.
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "the response body failed; closing");
                    let _ = self.flush().await;
                    return false;
                }
                Some(Ok(f)) => match f.into_data() {
                    Ok(d) if !d.is_empty() => d,
                    _ => continue, // trailers and empty frames: nothing to send
                },
            };
            let written = match framing {
                Framing::Length(n) => {
                    // Never more than was declared: the rest would be read
                    // as the next response.
                    let left = n - sent;
                    let data = if data.len() as u64 > left {
                        keep = false;
                        data.slice(..left as usize)
                    } else {
                        data
                    };
                    sent += data.len() as u64;
                    self.push(None, &data, b"").await
                }
                Framing::Chunked => self.push(Some(data.len()), &data, b"\r\n").await,
                _ => self.push(None, &data, b"").await,
            };
            if written.is_err() {
                return false;
            }
            if matches!(framing, Framing::Length(n) if sent == n) {
                break;
            }
        }
        match framing {
            Framing::Chunked => self.out.extend_from_slice(encode::LAST_CHUNK),
            // Shorter than declared: only the close tells the client.
            Framing::Length(n) if sent < n => keep = false,
            _ => {}
        }
        drop(body);
        self.flush().await.is_ok() && keep
    }

    /// Queues `data` (with a chunk size line before it and `tail` after),
    /// writing what is queued once it would pass [`COALESCE`].
    async fn push(
        &mut self,
        chunk: Option<usize>,
        data: &Bytes,
        tail: &'static [u8],
    ) -> std::io::Result<()> {
        if let Some(len) = chunk {
            encode::chunk_size(&mut self.out, len);
        }
        if self.out.len() + data.len() <= COALESCE {
            self.out.extend_from_slice(data);
            self.out.extend_from_slice(tail);
            return Ok(());
        }
        h1::io::write_all(&self.io, &mut [&self.out, data, tail]).await?;
        self.out.clear();
        Ok(())
    }

    async fn flush(&mut self) -> std::io::Result<()> {
        if self.out.is_empty() {
            return Ok(());
        }
        h1::io::write_all(&self.io, &mut [&self.out]).await?;
        self.out.clear();
        Ok(())
    }

    /// Answers a head that cannot be served (431, 400, 501), then closes.
    async fn refuse(mut self, status: StatusCode) {
        self.out.clear();
        let headers = http::HeaderMap::new();
        encode::response_head(
            &mut self.out,
            status,
            &headers,
            Framing::Length(0),
            ConnectionField::Close,
        );
        let _ = self.flush().await;
        self.close().await;
    }

    /// Closes gracefully: the client reads the end of the response, then EOF.
    async fn close(self) {
        if let Ok(mut tcp) = Arc::try_unwrap(self.io) {
            let _ = tokio::io::AsyncWriteExt::shutdown(&mut tcp).await;
        }
    }
}

/// Polls `body` once, with a context that wakes nothing: `Pending` means
/// "not yet", and the caller polls again with its own before it waits.
fn poll_now(
    body: Pin<&mut ResponseBody>,
) -> Poll<Option<Result<Frame<Bytes>, crate::body::BoxError>>> {
    body.poll_frame(&mut Context::from_waker(std::task::Waker::noop()))
}

/// Polls `work` to its end, watching the client meanwhile while `*watch`
/// (see [`watch_client`]); `None` when the client went away first. A client
/// that filled the head buffer is not watched again.
async fn watching<T>(
    io: &TcpStream,
    buf: &mut BytesMut,
    reads: &mut ReadSize,
    watch: &mut bool,
    mut work: impl FnMut(&mut Context<'_>) -> Poll<T>,
) -> Option<T> {
    std::future::poll_fn(|cx| {
        if let Poll::Ready(r) = work(cx) {
            return Poll::Ready(Some(r));
        }
        if *watch {
            match watch_client(io, buf, reads, cx) {
                Watch::Gone => return Poll::Ready(None),
                Watch::Full => *watch = false,
                Watch::Quiet => {}
            }
        }
        Poll::Pending
    })
    .await
}

/// Reads what the client sent while it should have nothing to send: a
/// close (or error) means it is gone; bytes are kept as its next request.
fn watch_client(
    io: &TcpStream,
    buf: &mut BytesMut,
    reads: &mut ReadSize,
    cx: &mut Context<'_>,
) -> Watch {
    loop {
        if buf.len() >= h1::head::MAX_HEAD_BYTES {
            return Watch::Full;
        }
        match h1::io::poll_read(io, buf, reads, cx) {
            Poll::Pending => return Watch::Quiet,
            Poll::Ready(Ok(0) | Err(_)) => return Watch::Gone,
            Poll::Ready(Ok(_)) => {}
        }
    }
}

/// A response's own `Content-Length`, when it states one clearly.
fn declared_length(headers: &http::HeaderMap) -> Option<u64> {
    let v = headers.get(CONTENT_LENGTH)?.to_str().ok()?;
    v.trim().parse().ok()
}

fn says_close(headers: &http::HeaderMap) -> bool {
    headers.get_all(CONNECTION).iter().any(|v| {
        v.as_bytes()
            .split(|&b| b == b',')
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"))
    })
}

/// The read side of a connection while a request body is read from it.
struct Inbound {
    io: Arc<TcpStream>,
    buf: BytesMut,
    reads: ReadSize,
    decoder: Decoder,
    /// `Expect: 100-continue` and nothing of the body read yet: the first
    /// read answers `100 Continue`.
    continue_due: bool,
    /// The response head is out: a `100 Continue` now would corrupt it.
    response_started: bool,
    /// Reading the body failed: the connection is not used again.
    failed: bool,
}

/// A request body being read from a connection of the own HTTP/1.1
/// server, by whoever polls it (the request path, or the upstream call
/// that streams it on).
pub struct BodyReader {
    inbound: Arc<Mutex<Inbound>>,
}

/// Why a request body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Body(#[from] BodyError),
    #[error("reading the request body: {0}")]
    Io(#[from] std::io::Error),
}

impl Body for BodyReader {
    type Data = Bytes;
    type Error = ReadError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ReadError>>> {
        let mut guard = self.inbound.lock();
        let i = &mut *guard;
        if i.failed {
            return Poll::Ready(None);
        }
        if std::mem::take(&mut i.continue_due) && !i.response_started {
            // The socket has just taken a head and sent nothing: its send
            // buffer has room, so a failed write here is a broken socket.
            if let Err(e) = i.io.try_write(encode::CONTINUE) {
                i.failed = true;
                return Poll::Ready(Some(Err(e.into())));
            }
        }
        loop {
            // A known length is gathered (up to GATHER) before it is handed on.
            let gather = i
                .decoder
                .length_left()
                .map_or(0, |n| n.min(GATHER) as usize);
            if i.buf.len() < gather {
                i.buf.reserve(gather - i.buf.len());
            } else {
                match i.decoder.decode(&mut i.buf) {
                    Ok(Decoded::Data(d)) => return Poll::Ready(Some(Ok(Frame::data(d)))),
                    Ok(Decoded::End) => return Poll::Ready(None),
                    Ok(Decoded::More) => {}
                    Err(e) => {
                        i.failed = true;
                        return Poll::Ready(Some(Err(e.into())));
                    }
                }
            }
            match h1::io::poll_read(&i.io, &mut i.buf, &mut i.reads, cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0)) => {
                    i.failed = true;
                    let e = i.decoder.at_eof().err().unwrap_or(BodyError::Incomplete);
                    return Poll::Ready(Some(Err(e.into())));
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => {
                    i.failed = true;
                    return Poll::Ready(Some(Err(e.into())));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inbound.lock().decoder.is_done()
    }

    fn size_hint(&self) -> SizeHint {
        self.inbound.lock().decoder.size_hint()
    }
}

/// A socket with bytes already read from it in front (the HTTP/2 preface
/// read while telling the protocols apart), for hyper to read again.
struct Rewind {
    prefix: Bytes,
    inner: TcpStream,
}

impl AsyncRead for Rewind {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            let head = self.prefix.split_to(n);
            buf.put_slice(&head);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Rewind {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
#[path = "h1_tests.rs"]
mod tests;
