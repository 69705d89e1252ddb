//! Request and response heads: `httparse` finds the fields, this file makes
//! them `http` types without copying the values (each is a slice of the
//! head's bytes) and decides how the body that follows is framed.

use std::mem::MaybeUninit;

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, Version};

/// Most header fields a head may carry (hyper's default too).
pub const MAX_HEADERS: usize = 100;
/// Most bytes a head may take before it is refused: hyper's default read
/// buffer limit, so that no client that hyper served is refused now.
pub const MAX_HEAD_BYTES: usize = 8192 + 4096 * 100;

/// How a message's body is delimited (RFC 9112 §6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body.
    Empty,
    /// Exactly this many bytes.
    Length(u64),
    /// Chunked transfer coding.
    Chunked,
    /// Until the sender closes the connection (responses only).
    UntilClose,
}

/// A head that cannot be read; the connection closes after the answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    #[error("the head is larger than {MAX_HEAD_BYTES} bytes")]
    TooLarge,
    #[error("the head has more than {MAX_HEADERS} header fields")]
    TooManyHeaders,
    #[error("malformed head: {0}")]
    Malformed(&'static str),
    #[error("a transfer coding other than chunked")]
    UnsupportedCoding,
}

impl HeadError {
    /// The status a server answers it with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::TooLarge | Self::TooManyHeaders => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Self::Malformed(_) => StatusCode::BAD_REQUEST,
            Self::UnsupportedCoding => StatusCode::NOT_IMPLEMENTED,
        }
    }
}

/// A request head, read.
#[derive(Debug)]
pub struct RequestHead {
    pub parts: http::request::Parts,
    pub framing: Framing,
    /// The client keeps the connection open after this exchange.
    pub keep_alive: bool,
    /// `Expect: 100-continue`: the client waits for a `100` before its body.
    pub expect_continue: bool,
}

/// A response head, read.
#[derive(Debug)]
pub struct ResponseHead {
    pub parts: http::response::Parts,
    pub framing: Framing,
    /// The connection may carry another request after this body.
    pub keep_alive: bool,
}

/// Header slots for one parse, left uninitialized: zeroing 100 of them
/// (3.2 KB) per head cost more than parsing a small head.
type Slots<'b> = [MaybeUninit<httparse::Header<'b>>; MAX_HEADERS];

fn slots<'b>() -> Slots<'b> {
    [const { MaybeUninit::uninit() }; MAX_HEADERS]
}

/// Parses a request head at the front of `buf`. `Ok(None)`: not complete
/// yet (read more). On success the head's bytes are taken off `buf`, which
/// keeps what follows (body, or the next request).
pub fn parse_request(buf: &mut BytesMut) -> Result<Option<RequestHead>, HeadError> {
    let mut raw = slots();
    let mut req = httparse::Request::new(&mut []);
    let parsed = req.parse_with_uninit_headers(buf, &mut raw);
    let Some(len) = head_len(parsed, buf, "request head")? else {
        return Ok(None);
    };
    let method = Method::from_bytes(req.method.unwrap_or("").as_bytes())
        .map_err(|_| HeadError::Malformed("method"))?;
    let version = version(req.version)?;
    // One copy of the head, which the values are slices of; `buf` stays
    // one buffer that the next read reuses.
    let head = Bytes::copy_from_slice(&buf[..len]);
    let target = span(buf, req.path.unwrap_or("").as_bytes());
    let uri = Uri::from_maybe_shared(head.slice(target.0..target.1))
        .map_err(|_| HeadError::Malformed("request target"))?;
    let (headers, fields) = header_map(buf, &head, req.headers)?;
    buf.advance(len);

    let framing = fields.request_framing(version)?;
    let keep_alive = fields.keep_alive(version);
    let expect_continue = version == Version::HTTP_11 && fields.expect_continue;
    let (mut parts, ()) = http::Request::new(()).into_parts();
    parts.method = method;
    parts.uri = uri;
    parts.version = version;
    parts.headers = headers;
    Ok(Some(RequestHead {
        parts,
        framing,
        keep_alive,
        expect_continue,
    }))
}

/// Parses a response head at the front of `buf`, to a request of `method`.
/// An interim (1xx) head is returned too, with [`Framing::Empty`]: the
/// caller skips it and reads on.
pub fn parse_response(
    buf: &mut BytesMut,
    method: &Method,
) -> Result<Option<ResponseHead>, HeadError> {
    let mut raw = slots();
    let mut resp = httparse::Response::new(&mut []);
    let parsed = httparse::ParserConfig::default()
        .parse_response_with_uninit_headers(&mut resp, buf, &mut raw);
    let Some(len) = head_len(parsed, buf, "response head")? else {
        return Ok(None);
    };
    let status =
        StatusCode::from_u16(resp.code.unwrap_or(0)).map_err(|_| HeadError::Malformed("status"))?;
    let version = version(resp.version)?;
    let head = Bytes::copy_from_slice(&buf[..len]);
    let (headers, fields) = header_map(buf, &head, resp.headers)?;
    buf.advance(len);
    let (framing, keep_alive) = fields.response_framing(method, status, version)?;
    let (mut parts, ()) = http::Response::new(()).into_parts();
    parts.status = status;
    parts.version = version;
    parts.headers = headers;
    Ok(Some(ResponseHead {
        parts,
        framing,
        keep_alive,
    }))
}

/// The head's length from httparse's verdict; `None` while it is not
/// complete (and still fits), `what` naming the head in the error.
fn head_len(
    parsed: httparse::Result<usize>,
    buf: &BytesMut,
    what: &'static str,
) -> Result<Option<usize>, HeadError> {
    match parsed {
        Ok(httparse::Status::Complete(n)) => Ok(Some(n)),
        Ok(httparse::Status::Partial) => partial(buf),
        Err(httparse::Error::TooManyHeaders) => Err(HeadError::TooManyHeaders),
        Err(_) => Err(HeadError::Malformed(what)),
    }
}

fn partial<T>(buf: &BytesMut) -> Result<Option<T>, HeadError> {
    if buf.len() >= MAX_HEAD_BYTES {
        Err(HeadError::TooLarge)
    } else {
        Ok(None)
    }
}

fn version(minor: Option<u8>) -> Result<Version, HeadError> {
    match minor {
        Some(0) => Ok(Version::HTTP_10),
        Some(1) => Ok(Version::HTTP_11),
        _ => Err(HeadError::Malformed("version")),
    }
}

/// Offsets of `part` (a slice of `base`) within `base`.
fn span(base: &[u8], part: &[u8]) -> (usize, usize) {
    let start = (part.as_ptr() as usize).saturating_sub(base.as_ptr() as usize);
    (start, start + part.len())
}

/// The header map (names looked up or lowercased, values slices of
/// `head`, a copy of `base`'s first bytes, so the same offsets hold), and
/// the fields that frame the message, read on the way.
fn header_map(
    base: &[u8],
    head: &Bytes,
    parsed: &[httparse::Header<'_>],
) -> Result<(HeaderMap, Fields), HeadError> {
    let mut map = HeaderMap::with_capacity(parsed.len());
    let mut fields = Fields::default();
    for h in parsed {
        fields.note(h.name.as_bytes(), h.value)?;
        let name = HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| HeadError::Malformed("header name"))?;
        let (start, end) = span(base, h.value);
        let value = HeaderValue::from_maybe_shared(head.slice(start..end))
            .map_err(|_| HeadError::Malformed("header value"))?;
        map.append(name, value);
    }
    Ok((map, fields))
}

/// What a head's framing and connection fields say, gathered in one pass
/// over its fields (no lookups in the map afterwards).
#[derive(Debug, Default)]
struct Fields {
    /// The one length every `Content-Length` value states.
    length: Option<u64>,
    /// `Transfer-Encoding` was present (even empty).
    te_present: bool,
    /// Codings listed, how many of them chunked, whether the last was.
    te_count: usize,
    te_chunked: usize,
    te_last_chunked: bool,
    close: bool,
    keep_alive: bool,
    expect_continue: bool,
}

impl Fields {
    fn note(&mut self, name: &[u8], value: &[u8]) -> Result<(), HeadError> {
        let is = |n: &[u8]| name.len() == n.len() && name.eq_ignore_ascii_case(n);
        if is(b"content-length") {
            let mut any = false;
            for token in tokens(value) {
                any = true;
                let n = digits(token).ok_or(HeadError::Malformed("content-length"))?;
                if self.length.is_some_and(|f| f != n) {
                    return Err(HeadError::Malformed("content-length values differ"));
                }
                self.length = Some(n);
            }
            if !any {
                return Err(HeadError::Malformed("content-length"));
            }
        } else if is(b"transfer-encoding") {
            self.te_present = true;
            for token in tokens(value) {
                self.te_count += 1;
                self.te_last_chunked = token.eq_ignore_ascii_case(b"chunked");
                self.te_chunked += usize::from(self.te_last_chunked);
            }
        } else if is(b"connection") {
            for token in tokens(value) {
                self.close |= token.eq_ignore_ascii_case(b"close");
                self.keep_alive |= token.eq_ignore_ascii_case(b"keep-alive");
            }
        } else if is(b"expect") {
            self.expect_continue |= value.trim_ascii().eq_ignore_ascii_case(b"100-continue");
        }
        Ok(())
    }

    /// What `Transfer-Encoding` lists. Malformed: chunked more than once,
    /// or not last (RFC 9112 §6.1). Chunked after other codings is a coding
    /// this proxy cannot pass on (it strips the field as hop-by-hop).
    fn codings(&self) -> Result<Option<Codings>, HeadError> {
        match (self.te_count, self.te_chunked) {
            (0, _) if self.te_present => Err(HeadError::Malformed("empty transfer-encoding")),
            (0, _) => Ok(None),
            (_, 2..) => Err(HeadError::Malformed("chunked more than once")),
            (_, 1) if !self.te_last_chunked => {
                Err(HeadError::Malformed("chunked not the final coding"))
            }
            (1, 1) => Ok(Some(Codings::Chunked)),
            (_, 1) => Err(HeadError::UnsupportedCoding),
            _ => Ok(Some(Codings::Other)),
        }
    }

    /// RFC 9112 §6.3 for requests: chunked when `Transfer-Encoding` ends
    /// in chunked, a length from `Content-Length`, else no body. Refused:
    /// both fields at once, a coding other than chunked, transfer codings
    /// in HTTP/1.0, lengths that disagree or are not digits.
    fn request_framing(&self, version: Version) -> Result<Framing, HeadError> {
        match self.codings()? {
            Some(_) if version == Version::HTTP_10 => {
                Err(HeadError::Malformed("transfer-encoding in HTTP/1.0"))
            }
            Some(_) if self.length.is_some() => Err(HeadError::Malformed(
                "both content-length and transfer-encoding",
            )),
            Some(Codings::Chunked) => Ok(Framing::Chunked),
            Some(Codings::Other) => Err(HeadError::UnsupportedCoding),
            None => Ok(self.length.map_or(Framing::Empty, length)),
        }
    }

    /// RFC 9112 §6.3 for responses, and whether the connection may carry
    /// another request after this one.
    fn response_framing(
        &self,
        method: &Method,
        status: StatusCode,
        version: Version,
    ) -> Result<(Framing, bool), HeadError> {
        let keep_alive = self.keep_alive(version);
        if method == Method::HEAD
            || status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED
        {
            return Ok((Framing::Empty, keep_alive));
        }
        Ok(match (self.codings()?, self.length) {
            // A Content-Length beside the codings may be an attempt at
            // smuggling: read by the codings, and not used again.
            (Some(Codings::Chunked), length) => (Framing::Chunked, keep_alive && length.is_none()),
            // A final coding other than chunked runs until the close.
            (Some(Codings::Other), _) => (Framing::UntilClose, false),
            (None, Some(n)) => (length(n), keep_alive),
            (None, None) => (Framing::UntilClose, false),
        })
    }

    /// Whether the connection stays open: HTTP/1.1 unless `Connection:
    /// close`, HTTP/1.0 only with `Connection: keep-alive`.
    fn keep_alive(&self, version: Version) -> bool {
        match version {
            Version::HTTP_11 => !self.close,
            _ => self.keep_alive && !self.close,
        }
    }
}

fn length(n: u64) -> Framing {
    if n == 0 {
        Framing::Empty
    } else {
        Framing::Length(n)
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Codings {
    /// Exactly one coding, chunked.
    Chunked,
    /// Codings other than chunked (a request is refused; a response runs
    /// until the close).
    Other,
}

/// 1 to 19 ASCII digits (no sign, no spaces): always fits a `u64`.
fn digits(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 19 {
        return None;
    }
    s.iter().try_fold(0u64, |n, &b| {
        b.is_ascii_digit().then(|| n * 10 + u64::from(b - b'0'))
    })
}

/// The comma-separated list elements of a field value, trimmed, empty ones skipped.
fn tokens(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|&b| b == b',')
        .map(|t| t.trim_ascii())
        .filter(|t| !t.is_empty())
}

#[cfg(test)]
#[path = "head_tests.rs"]
mod tests;
