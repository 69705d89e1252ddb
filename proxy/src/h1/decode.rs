//! Decoding a message body from a read buffer, incrementally: the caller
//! reads from its socket into the buffer and calls [`Decoder::decode`]
//! until it says [`Decoded::End`]. Data comes out as slices of the buffer
//! (`split_to`, no copy).

use bytes::{Buf, Bytes, BytesMut};
use http_body::SizeHint;

use super::Framing;

/// Most bytes of chunk extensions a body may carry in all (they are read
/// and dropped).
const MAX_EXTENSION_BYTES: usize = 4096;
/// Most bytes of trailer fields a body may carry (read and dropped).
const MAX_TRAILER_BYTES: usize = 16 * 1024;
/// Most hex digits of one chunk size: 15 keep it under 2^60.
const MAX_SIZE_DIGITS: u8 = 15;

/// A body that cannot be read to its end.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("malformed chunked body: {0}")]
    Chunked(&'static str),
    #[error("the connection closed before the body ended")]
    Incomplete,
}

/// What one call to [`Decoder::decode`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    Data(Bytes),
    /// The buffer holds no more of the body: read more.
    More,
    /// The body ended; the buffer keeps what follows it.
    End,
}

/// The state of one body being decoded.
#[derive(Debug, Clone)]
pub struct Decoder {
    state: State,
}

#[derive(Debug, Clone)]
enum State {
    Length(u64),
    Chunked(Chunked),
    UntilClose,
    Done,
}

#[derive(Debug, Clone, Default)]
struct Chunked {
    step: Step,
    size: u64,
    digits: u8,
    extension_bytes: usize,
    trailer_bytes: usize,
}

/// Where in RFC 9112 §7.1's grammar the next byte falls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Step {
    /// chunk-size: hex digits.
    #[default]
    Size,
    /// Spaces or tabs after the size (BWS before an extension).
    SizeSpace,
    /// chunk-ext, up to the CR.
    Extension,
    /// The LF after a size line.
    SizeLf,
    /// chunk-data, this many bytes left.
    Data(u64),
    /// The CRLF after chunk-data.
    DataCr,
    DataLf,
    /// After the last chunk: a trailer field or the final CRLF.
    TrailerStart,
    TrailerLine,
    TrailerLf,
    /// The LF of the final CRLF.
    EndLf,
}

impl Decoder {
    pub fn new(framing: Framing) -> Self {
        let state = match framing {
            Framing::Empty | Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Chunked(Chunked::default()),
            Framing::UntilClose => State::UntilClose,
        };
        Self { state }
    }

    /// The next piece of the body from `buf`.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, BodyError> {
        match &mut self.state {
            State::Done => Ok(Decoded::End),
            State::Length(left) => {
                if buf.is_empty() {
                    return Ok(Decoded::More);
                }
                let n = (*left).min(buf.len() as u64);
                *left -= n;
                // `n` is at most `buf.len()`, a usize.
                let data = buf.split_to(n as usize).freeze();
                if *left == 0 {
                    self.state = State::Done;
                }
                Ok(Decoded::Data(data))
            }
            State::UntilClose => {
                if buf.is_empty() {
                    Ok(Decoded::More)
                } else {
                    Ok(Decoded::Data(buf.split().freeze()))
                }
            }
            State::Chunked(c) => {
                let r = c.decode(buf);
                if matches!(r, Ok(Decoded::End)) {
                    self.state = State::Done;
                }
                r
            }
        }
    }

    /// The peer closed the connection: the end of a body that runs until
    /// the close, an error for any other that has not ended.
    pub fn at_eof(&mut self) -> Result<(), BodyError> {
        match self.state {
            State::Done => Ok(()),
            State::UntilClose => {
                self.state = State::Done;
                Ok(())
            }
            _ => Err(BodyError::Incomplete),
        }
    }

    /// The bytes left of a body of known length (`None`: chunked, until
    /// the close, or ended).
    pub fn length_left(&self) -> Option<u64> {
        match self.state {
            State::Length(n) => Some(n),
            _ => None,
        }
    }

    pub fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// What is known of the length left.
    pub fn size_hint(&self) -> SizeHint {
        match self.state {
            State::Done => SizeHint::with_exact(0),
            State::Length(n) => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        }
    }
}

impl Chunked {
    fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, BodyError> {
        loop {
            if let Step::Data(left) = self.step {
                if left == 0 {
                    self.step = Step::DataCr;
                    continue;
                }
                if buf.is_empty() {
                    return Ok(Decoded::More);
                }
                let n = left.min(buf.len() as u64);
                self.step = Step::Data(left - n);
                return Ok(Decoded::Data(buf.split_to(n as usize).freeze()));
            }
            let Some(&b) = buf.first() else {
                return Ok(Decoded::More);
            };
            buf.advance(1);
            if self.byte(b)? {
                return Ok(Decoded::End);
            }
        }
    }

    /// One byte of framing. True when the body has ended.
    fn byte(&mut self, b: u8) -> Result<bool, BodyError> {
        let bad = |what| Err(BodyError::Chunked(what));
        self.step = match (self.step, b) {
            (Step::Size, _) if hex(b).is_some() => {
                if self.digits == MAX_SIZE_DIGITS {
                    return bad("chunk size too large");
                }
                self.digits += 1;
                self.size = self.size * 16 + u64::from(hex(b).unwrap_or(0));
                Step::Size
            }
            (Step::Size, _) if self.digits == 0 => return bad("chunk size"),
            (Step::Size | Step::SizeSpace, b' ' | b'\t') => Step::SizeSpace,
            (Step::Size | Step::SizeSpace, b';') => Step::Extension,
            (Step::Size | Step::SizeSpace | Step::Extension, b'\r') => Step::SizeLf,
            (Step::Size | Step::SizeSpace, _) => return bad("chunk size line"),
            (Step::Extension, b'\n') => return bad("bare LF in a chunk extension"),
            (Step::Extension, _) => {
                self.extension_bytes += 1;
                if self.extension_bytes > MAX_EXTENSION_BYTES {
                    return bad("chunk extensions too long");
                }
                Step::Extension
            }
            (Step::SizeLf, b'\n') => {
                let size = std::mem::take(&mut self.size);
                self.digits = 0;
                if size == 0 {
                    Step::TrailerStart
                } else {
                    Step::Data(size)
                }
            }
            (Step::SizeLf, _) => return bad("CR without LF after a chunk size"),
            (Step::DataCr, b'\r') => Step::DataLf,
            (Step::DataCr, _) => return bad("chunk data longer than its size"),
            (Step::DataLf, b'\n') => Step::Size,
            (Step::DataLf, _) => return bad("CR without LF after chunk data"),
            (Step::TrailerStart, b'\r') => Step::EndLf,
            (Step::TrailerStart | Step::TrailerLine, b'\n') => {
                return bad("bare LF in the trailer section")
            }
            (Step::TrailerLine, b'\r') => Step::TrailerLf,
            (Step::TrailerStart | Step::TrailerLine, _) => {
                self.trailer_bytes += 1;
                if self.trailer_bytes > MAX_TRAILER_BYTES {
                    return bad("trailer section too long");
                }
                Step::TrailerLine
            }
            (Step::TrailerLf, b'\n') => Step::TrailerStart,
            (Step::TrailerLf, _) => return bad("CR without LF in the trailer section"),
            (Step::EndLf, b'\n') => return Ok(true),
            (Step::EndLf, _) => return bad("CR without LF at the end"),
            (Step::Data(_), _) => return bad("chunk data"),
        };
        Ok(false)
    }
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `wire` to a decoder `step` bytes at a time; the body, or the error.
    fn decode_in_steps(framing: Framing, wire: &[u8], step: usize) -> Result<Vec<u8>, BodyError> {
        let mut d = Decoder::new(framing);
        let mut buf = BytesMut::new();
        let mut body = Vec::new();
        let mut fed = 0;
        loop {
            match d.decode(&mut buf)? {
                Decoded::Data(b) => body.extend_from_slice(&b),
                Decoded::End => return Ok(body),
                Decoded::More if fed < wire.len() => {
                    let end = (fed + step).min(wire.len());
                    buf.extend_from_slice(&wire[fed..end]);
                    fed = end;
                }
                Decoded::More => {
                    d.at_eof()?;
                    return Ok(body);
                }
            }
        }
    }

    fn every_step(framing: Framing, wire: &[u8]) -> Result<Vec<u8>, BodyError> {
        let whole = decode_in_steps(framing, wire, wire.len().max(1));
        for step in 1..wire.len() {
            assert_eq!(decode_in_steps(framing, wire, step), whole, "step {step}");
        }
        whole
    }

    #[test]
    fn a_length_body_ends_at_its_length_and_leaves_the_rest() {
        let mut d = Decoder::new(Framing::Length(5));
        let mut buf = BytesMut::from(&b"helloGET /next"[..]);
        assert_eq!(d.decode(&mut buf), Ok(Decoded::Data(Bytes::from("hello"))));
        assert_eq!(d.decode(&mut buf), Ok(Decoded::End));
        assert_eq!(&buf[..], b"GET /next");
        assert_eq!(
            every_step(Framing::Length(5), b"hello"),
            Ok(b"hello".to_vec())
        );
    }

    #[test]
    fn chunked_bodies_decode_whatever_the_read_boundaries() {
        let wire = b"5\r\nhello\r\n6;name=value\r\n world\r\n0\r\n\r\n";
        assert_eq!(
            every_step(Framing::Chunked, wire),
            Ok(b"hello world".to_vec())
        );
        // Upper-case hex, spaces before an extension, leading zeros, trailers.
        let wire = b"00A \t;x\r\n0123456789\r\n000\r\nx-trailer: 1\r\nx-other: 2\r\n\r\n";
        assert_eq!(
            every_step(Framing::Chunked, wire),
            Ok(b"0123456789".to_vec())
        );
    }

    #[test]
    fn chunked_bodies_leave_what_follows() {
        let mut d = Decoder::new(Framing::Chunked);
        let mut buf = BytesMut::from(&b"2\r\nok\r\n0\r\n\r\nGET / HTTP/1.1\r\n"[..]);
        assert_eq!(d.decode(&mut buf), Ok(Decoded::Data(Bytes::from("ok"))));
        assert_eq!(d.decode(&mut buf), Ok(Decoded::End));
        assert!(d.is_done());
        assert_eq!(&buf[..], b"GET / HTTP/1.1\r\n");
    }

    #[test]
    fn malformed_chunked_framing_is_refused() {
        for wire in [
            &b"x\r\n"[..],               // no size
            b"5\nhello\r\n0\r\n\r\n",    // bare LF after the size
            b"5\r\nhelloX\r\n0\r\n\r\n", // data longer than its size
            b"5\r\nhello\r0\r\n\r\n",    // CR without LF after data
            b"1000000000000000\r\n",     // 16 hex digits
            b"-1\r\n",                   // a sign
            b"5 x\r\nhello\r\n",         // junk after the size
            b"5;a\nb\r\n",               // bare LF in an extension
            b"0\r\nx-t: 1\n\r\n",        // bare LF in a trailer
            b"0\r\n\rX",                 // CR without LF at the end
        ] {
            assert!(
                matches!(
                    every_step(Framing::Chunked, wire),
                    Err(BodyError::Chunked(_))
                ),
                "{:?}",
                String::from_utf8_lossy(wire)
            );
        }
    }

    #[test]
    fn extensions_and_trailers_are_bounded() {
        let mut long_ext = b"1;".to_vec();
        long_ext.extend(std::iter::repeat_n(b'e', MAX_EXTENSION_BYTES + 1));
        long_ext.extend_from_slice(b"\r\nx\r\n0\r\n\r\n");
        assert!(decode_in_steps(Framing::Chunked, &long_ext, 1024).is_err());
        let mut long_trailer = b"0\r\nx: ".to_vec();
        long_trailer.extend(std::iter::repeat_n(b't', MAX_TRAILER_BYTES + 1));
        long_trailer.extend_from_slice(b"\r\n\r\n");
        assert!(decode_in_steps(Framing::Chunked, &long_trailer, 1024).is_err());
    }

    #[test]
    fn a_close_ends_only_a_body_that_runs_until_it() {
        assert_eq!(
            every_step(Framing::UntilClose, b"all of it"),
            Ok(b"all of it".to_vec())
        );
        assert_eq!(
            decode_in_steps(Framing::Length(10), b"short", 2),
            Err(BodyError::Incomplete)
        );
        assert_eq!(
            decode_in_steps(Framing::Chunked, b"5\r\nhel", 2),
            Err(BodyError::Incomplete)
        );
    }

    #[test]
    fn size_hints_follow_the_length_left() {
        let mut d = Decoder::new(Framing::Length(4));
        assert_eq!(d.size_hint().exact(), Some(4));
        let mut buf = BytesMut::from(&b"ab"[..]);
        let _ = d.decode(&mut buf);
        assert_eq!(d.size_hint().exact(), Some(2));
        assert_eq!(Decoder::new(Framing::Empty).size_hint().exact(), Some(0));
        assert_eq!(Decoder::new(Framing::Chunked).size_hint().exact(), None);
    }
}
