//! Writing heads and framing bodies into a byte buffer. The framing fields
//! (`Content-Length`, `Transfer-Encoding`) and `Connection` are always this
//! file's to write: any the caller's header map carries are skipped, so a
//! message never states two framings.

use http::header::{CONNECTION, CONTENT_LENGTH, DATE, TRANSFER_ENCODING};
use http::{HeaderMap, Method, StatusCode};

use super::Framing;

/// The end of a chunked body (no trailers).
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";
/// What a server answers `Expect: 100-continue` with, before the body comes.
pub const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// What a response head says about the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionField {
    /// Nothing: HTTP/1.1's default, kept open.
    None,
    /// `connection: close`: the server closes after this response.
    Close,
    /// `connection: keep-alive`: an HTTP/1.0 client asked to keep it.
    KeepAlive,
}

/// `METHOD target HTTP/1.1`, the caller's fields, and the framing's.
pub fn request_head(
    out: &mut Vec<u8>,
    method: &Method,
    target: &str,
    headers: &HeaderMap,
    framing: Framing,
) {
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    fields(out, headers);
    framing_field(out, framing);
    out.extend_from_slice(b"\r\n");
}

/// `HTTP/1.1 status reason`, the caller's fields, a `Date` unless they have
/// one, the connection's and the framing's. (A response to HEAD states the
/// framing its GET would have, and sends no body: the caller's business.)
pub fn response_head(
    out: &mut Vec<u8>,
    status: StatusCode,
    headers: &HeaderMap,
    framing: Framing,
    connection: ConnectionField,
) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    fields(out, headers);
    if !headers.contains_key(DATE) {
        out.extend_from_slice(b"date: ");
        super::date::write(out);
        out.extend_from_slice(b"\r\n");
    }
    match connection {
        ConnectionField::None => {}
        ConnectionField::Close => out.extend_from_slice(b"connection: close\r\n"),
        ConnectionField::KeepAlive => out.extend_from_slice(b"connection: keep-alive\r\n"),
    }
    framing_field(out, framing);
    out.extend_from_slice(b"\r\n");
}

/// The size line of a chunk of `len` bytes (its data and CRLF follow).
pub fn chunk_size(out: &mut Vec<u8>, len: usize) {
    let mut digits = [0u8; 16];
    let mut i = digits.len();
    let mut n = len;
    loop {
        i -= 1;
        digits[i] = b"0123456789abcdef"[n & 0xf];
        n >>= 4;
        if n == 0 || i == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
    out.extend_from_slice(b"\r\n");
}

fn fields(out: &mut Vec<u8>, headers: &HeaderMap) {
    for (name, value) in headers {
        if name == CONTENT_LENGTH || name == TRANSFER_ENCODING || name == CONNECTION {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
}

fn framing_field(out: &mut Vec<u8>, framing: Framing) {
    match framing {
        Framing::Empty | Framing::UntilClose => {}
        Framing::Length(n) => {
            out.extend_from_slice(b"content-length: ");
            decimal(out, n);
            out.extend_from_slice(b"\r\n");
        }
        Framing::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
}

/// `n` in decimal.
pub fn decimal(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 || i == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn a_request_head_states_one_framing() {
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("engine:8000"));
        h.insert(CONTENT_LENGTH, HeaderValue::from_static("999"));
        h.insert(TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        h.append("x-multi", HeaderValue::from_static("a"));
        h.append("x-multi", HeaderValue::from_static("b"));
        let mut out = Vec::new();
        request_head(
            &mut out,
            &Method::POST,
            "/v1/completions?x=1",
            &h,
            Framing::Length(12),
        );
        assert_eq!(
            String::from_utf8(out).unwrap_or_default(),
            "POST /v1/completions?x=1 HTTP/1.1\r\nhost: engine:8000\r\nx-multi: a\r\nx-multi: b\r\ncontent-length: 12\r\n\r\n"
        );
        let mut out = Vec::new();
        request_head(
            &mut out,
            &Method::GET,
            "/v1/models",
            &HeaderMap::new(),
            Framing::Empty,
        );
        assert_eq!(&out[..], b"GET /v1/models HTTP/1.1\r\n\r\n");
    }

    #[test]
    fn a_response_head_has_a_date_and_the_connection_field() {
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("upgrade"));
        let mut out = Vec::new();
        response_head(
            &mut out,
            StatusCode::OK,
            &h,
            Framing::Chunked,
            ConnectionField::Close,
        );
        let text = String::from_utf8(out).unwrap_or_default();
        assert!(text.starts_with("HTTP/1.1 200 OK\r\ndate: "), "{text}");
        assert!(
            text.ends_with(" GMT\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n"),
            "{text}"
        );
        // The caller's own Date is kept, and an unknown status has no reason.
        let mut h = HeaderMap::new();
        h.insert(
            DATE,
            HeaderValue::from_static("Thu, 01 Jan 1970 00:00:00 GMT"),
        );
        let mut out = Vec::new();
        let status = StatusCode::from_u16(599).unwrap_or(StatusCode::OK);
        response_head(
            &mut out,
            status,
            &h,
            Framing::Length(0),
            ConnectionField::KeepAlive,
        );
        assert_eq!(
            String::from_utf8(out).unwrap_or_default(),
            "HTTP/1.1 599 \r\ndate: Thu, 01 Jan 1970 00:00:00 GMT\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n"
        );
    }

    #[test]
    fn numbers_are_written_exactly() {
        for n in [0u64, 7, 10, 255, 4096, u64::MAX] {
            let mut out = Vec::new();
            decimal(&mut out, n);
            assert_eq!(out, n.to_string().into_bytes());
        }
        for n in [0usize, 1, 15, 16, 255, 65_536, usize::MAX] {
            let mut out = Vec::new();
            chunk_size(&mut out, n);
            assert_eq!(out, format!("{n:x}\r\n").into_bytes());
        }
    }
}
