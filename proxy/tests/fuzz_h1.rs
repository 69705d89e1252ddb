#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Hostile input at volume for kvmesh's own HTTP/1.1 codec (`kvmesh_proxy::h1`):
//! request and response heads and the bodies they frame, read as the
//! server and the engine pool read them, from a buffer fed in pieces.
//!
//! - Generated messages (methods, targets, header fields, bodies of a
//!   length or chunked in random pieces, with extensions and trailers)
//!   written out and read back give the same message, whatever the read
//!   boundaries.
//! - Byte-level mutations of valid messages never panic, allocate at most a
//!   small multiple of their size, and read the same fed at once or byte
//!   by byte: the parsers keep no state that a read boundary could change.
//!
//! The count of cases per target is `KVMESH_FUZZ_CASES` (`scripts/fuzz`
//! runs 100k).

use bytes::BytesMut;
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use kvmesh_fuzz::{allocated_during, edits, fuzz, mutate, CountingAlloc};
use kvmesh_proxy::h1::head::{parse_request, parse_response};
use kvmesh_proxy::h1::{encode, Decoded, Decoder, Framing};
use proptest::prelude::*;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Bytes reading a message may allocate per input byte, plus a constant.
const ALLOC_PER_BYTE: usize = 64;
const ALLOC_BASE: usize = 64 << 10;

/// What a message read back came to: its head's fields in order, its body,
/// and the bytes left after it; or where it failed.
#[derive(Debug, PartialEq, Eq)]
enum Read {
    Message {
        start: String,
        fields: Vec<(String, Vec<u8>)>,
        framing: Framing,
        body: Vec<u8>,
        rest: Vec<u8>,
    },
    /// More bytes were needed than the input has.
    Incomplete,
    Failed(String),
}

/// Which side of the codec reads the input.
#[derive(Debug, Clone, Copy)]
enum Side {
    Request,
    /// A response to a request of this method.
    Response(&'static str),
}

/// Reads one message from `wire`, fed `step` bytes at a time.
fn read(side: Side, wire: &[u8], step: usize) -> Read {
    let mut buf = BytesMut::new();
    let mut fed = 0;
    let mut feed = |buf: &mut BytesMut| {
        if fed >= wire.len() {
            return false;
        }
        let end = (fed + step).min(wire.len());
        buf.extend_from_slice(&wire[fed..end]);
        fed = end;
        true
    };
    let (start, fields, framing) = loop {
        let parsed = match side {
            Side::Request => parse_request(&mut buf).map(|h| {
                h.map(|h| {
                    let start = format!("{} {} {:?}", h.parts.method, h.parts.uri, h.parts.version);
                    (start, fields_of(&h.parts.headers), h.framing)
                })
            }),
            Side::Response(m) => {
                let method = Method::from_bytes(m.as_bytes()).unwrap();
                parse_response(&mut buf, &method).map(|h| {
                    h.map(|h| {
                        let start = format!("{} {:?}", h.parts.status, h.parts.version);
                        (start, fields_of(&h.parts.headers), h.framing)
                    })
                })
            }
        };
        match parsed {
            Ok(Some(head)) => break head,
            Ok(None) if feed(&mut buf) => {}
            Ok(None) => return Read::Incomplete,
            Err(e) => return Read::Failed(e.to_string()),
        }
    };
    let mut decoder = Decoder::new(framing);
    let mut body = Vec::new();
    loop {
        match decoder.decode(&mut buf) {
            Ok(Decoded::Data(d)) => body.extend_from_slice(&d),
            Ok(Decoded::End) => break,
            Ok(Decoded::More) if feed(&mut buf) => {}
            Ok(Decoded::More) => match decoder.at_eof() {
                Ok(()) => break,
                Err(_) => return Read::Incomplete,
            },
            Err(e) => return Read::Failed(e.to_string()),
        }
    }
    while feed(&mut buf) {}
    Read::Message {
        start,
        fields,
        framing,
        body,
        rest: buf.to_vec(),
    }
}

fn fields_of(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect()
}

/// Reads `wire` whole, byte by byte and in a middling step: the same each
/// time, within the allocation bound.
fn reads_alike(side: Side, wire: &[u8]) -> Result<Read, TestCaseError> {
    let (whole, bytes) = allocated_during(|| read(side, wire, wire.len().max(1)));
    prop_assert!(
        bytes <= ALLOC_PER_BYTE * wire.len() + ALLOC_BASE,
        "{bytes} bytes allocated for {} input bytes",
        wire.len()
    );
    // Fed in pieces, a message that fails may fail on an earlier field
    // than the whole one did, or wait for bytes that never come instead of
    // failing; a message read whole must read the same in pieces.
    for step in [1, 7] {
        let pieces = read(side, wire, step);
        if let Read::Message { .. } = whole {
            prop_assert_eq!(&pieces, &whole, "step {}", step);
        }
    }
    Ok(whole)
}

// ---------- generated messages ----------

fn token() -> impl Strategy<Value = String> {
    "[a-z][a-z0-9-]{0,12}"
}

/// Field values of visible ASCII and spaces (no leading or trailing space:
/// a parser trims those), or obs-text bytes.
fn field_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        "[!-~]([ -~]{0,30}[!-~])?".prop_map(String::into_bytes),
        proptest::collection::vec(0x80u8..=0xff, 1..8),
    ]
}

/// Header fields other than the framing and connection ones.
fn plain_fields() -> impl Strategy<Value = Vec<(String, Vec<u8>)>> {
    proptest::collection::vec((token(), field_value()), 0..8).prop_map(|fields| {
        fields
            .into_iter()
            .filter(|(n, _)| {
                !matches!(
                    n.as_str(),
                    "content-length" | "transfer-encoding" | "connection" | "expect"
                )
            })
            .collect()
    })
}

/// Chunk sizes, and trailer fields after the last chunk.
type Chunks = (Vec<usize>, Vec<(String, String)>);

/// A body and how it goes on the wire: chunked in these pieces (with an
/// extension on some sizes, and trailers), or with its length.
#[derive(Debug, Clone)]
struct BodySpec {
    body: Vec<u8>,
    chunks: Option<Chunks>,
}

fn body_spec() -> impl Strategy<Value = BodySpec> {
    let chunked = (
        proptest::collection::vec(1usize..40, 0..6),
        proptest::collection::vec((token(), "[a-z0-9]{0,8}"), 0..3),
    );
    (
        proptest::collection::vec(any::<u8>(), 0..200),
        proptest::option::of(chunked),
    )
        .prop_map(|(body, chunks)| BodySpec {
            chunks: chunks.map(|(sizes, trailers)| {
                // Sizes that add up to the body.
                let mut left = body.len();
                let mut out = Vec::new();
                for s in sizes {
                    if left == 0 {
                        break;
                    }
                    let s = s.min(left);
                    out.push(s);
                    left -= s;
                }
                if left > 0 {
                    out.push(left);
                }
                (out, trailers)
            }),
            body,
        })
}

/// The body on the wire; the framing to write the head with, and the one
/// it should be read with (a length of 0 is no body).
fn write_body(spec: &BodySpec, wire: &mut Vec<u8>) -> (Framing, Framing) {
    match &spec.chunks {
        None => {
            let n = spec.body.len() as u64;
            wire.extend_from_slice(&spec.body);
            let read = if n == 0 {
                Framing::Empty
            } else {
                Framing::Length(n)
            };
            (Framing::Length(n), read)
        }
        Some((sizes, trailers)) => {
            let mut at = 0;
            for (i, s) in sizes.iter().enumerate() {
                wire.extend_from_slice(format!("{s:X}").as_bytes());
                if i % 2 == 1 {
                    wire.extend_from_slice(b";ext=\"v\"");
                }
                wire.extend_from_slice(b"\r\n");
                wire.extend_from_slice(&spec.body[at..at + s]);
                wire.extend_from_slice(b"\r\n");
                at += s;
            }
            wire.extend_from_slice(b"0\r\n");
            for (n, v) in trailers {
                wire.extend_from_slice(format!("{n}: {v}\r\n").as_bytes());
            }
            wire.extend_from_slice(b"\r\n");
            (Framing::Chunked, Framing::Chunked)
        }
    }
}

fn header_map(fields: &[(String, Vec<u8>)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (n, v) in fields {
        map.append(
            HeaderName::from_bytes(n.as_bytes()).unwrap(),
            HeaderValue::from_bytes(v).unwrap(),
        );
    }
    map
}

#[derive(Debug, Clone)]
struct Generated {
    method: String,
    target: String,
    fields: Vec<(String, Vec<u8>)>,
    body: BodySpec,
}

fn generated() -> impl Strategy<Value = Generated> {
    let method = prop_oneof![
        Just("GET".to_owned()),
        Just("POST".to_owned()),
        Just("PUT".to_owned()),
        Just("DELETE".to_owned()),
        "[A-Z]{1,10}",
    ];
    let target = prop_oneof![
        "/[a-zA-Z0-9/_.-]{0,40}",
        "/v1/[a-z]{1,12}\\?[a-z]{1,6}=[a-z0-9%]{0,10}",
        Just("*".to_owned()),
    ];
    (method, target, plain_fields(), body_spec()).prop_map(|(method, target, fields, body)| {
        Generated {
            method,
            target,
            fields,
            body,
        }
    })
}

#[test]
fn generated_requests_read_back_whatever_the_read_boundaries() {
    fuzz("h1-request/generated", generated(), |g| {
        let head = header_map(&g.fields);
        let mut body = Vec::new();
        let (written, framing) = write_body(&g.body, &mut body);
        let mut wire = Vec::new();
        let method = Method::from_bytes(g.method.as_bytes()).unwrap();
        // The codec's own writer: the fields, then the framing's.
        encode::request_head(&mut wire, &method, &g.target, &head, written);
        wire.extend_from_slice(&body);
        wire.extend_from_slice(b"GET /next HTTP/1.1\r\n\r\n");
        match reads_alike(Side::Request, &wire)? {
            Read::Message {
                start,
                fields,
                framing: read_framing,
                body,
                rest,
            } => {
                prop_assert_eq!(start, format!("{} {} HTTP/1.1", g.method, g.target));
                prop_assert_eq!(read_framing, framing);
                prop_assert_eq!(&body, &g.body.body);
                prop_assert_eq!(&rest[..], &b"GET /next HTTP/1.1\r\n\r\n"[..]);
                let mut want = g.fields.clone();
                match framing {
                    Framing::Chunked => {
                        want.push(("transfer-encoding".into(), b"chunked".to_vec()))
                    }
                    _ => want.push((
                        "content-length".into(),
                        g.body.body.len().to_string().into_bytes(),
                    )),
                }
                let mut got = fields;
                got.sort();
                want.sort();
                prop_assert_eq!(got, want);
            }
            other => prop_assert!(false, "{other:?}"),
        }
        Ok(())
    });
}

/// Valid requests and responses to mutate.
fn seeds() -> Vec<(Side, Vec<u8>)> {
    let req = |s: &str| (Side::Request, s.as_bytes().to_vec());
    let resp = |m: &'static str, s: &str| (Side::Response(m), s.as_bytes().to_vec());
    vec![
        req("POST /v1/completions HTTP/1.1\r\nhost: engine:8000\r\ncontent-type: application/json\r\ncontent-length: 27\r\n\r\n{\"model\":\"m\",\"prompt\":\"p\"}\n"),
        req("POST /v1/chat/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\nexpect: 100-continue\r\n\r\n5;a=b\r\nhello\r\n1\r\n!\r\n0\r\nx-t: 1\r\n\r\n"),
        req("GET /v1/models?x=1 HTTP/1.0\r\nconnection: keep-alive\r\n\r\nGET / HTTP/1.1\r\n\r\n"),
        resp("POST", "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n6\r\ndata: \r\nA\r\n{\"x\":1}\n\n\n\r\n0\r\n\r\n"),
        resp("GET", "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"),
        resp("HEAD", "HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n"),
        resp("GET", "HTTP/1.0 503 Service Unavailable\r\nconnection: close\r\n\r\nbusy until the close"),
    ]
}

/// Byte strings worth splicing into a message.
const TOKENS: &[&[u8]] = &[
    b"\r\n",
    b"\n",
    b"\r",
    b"\r\n\r\n",
    b"content-length: 18446744073709551616\r\n",
    b"content-length: 99999999999999999999\r\n",
    b"content-length: 5, 6\r\n",
    b"transfer-encoding: chunked\r\n",
    b"transfer-encoding: gzip, chunked\r\n",
    b"ffffffffffffffffff\r\n",
    b"0\r\n\r\n",
    b";",
    b" ",
    b"\t",
    b":",
    b"\x00",
    b"\xff",
    b"HTTP/1.1 ",
];

#[test]
fn mutated_messages_never_panic_and_read_alike_in_pieces() {
    let seeds = seeds();
    let n = seeds.len();
    fuzz("h1-messages/mutated", (0..n, edits()), |(i, edits)| {
        let (side, seed) = &seeds[i];
        let wire = mutate(seed, &edits, TOKENS);
        reads_alike(*side, &wire)?;
        Ok(())
    });
}

#[test]
fn random_bytes_never_panic() {
    fuzz(
        "h1-messages/random",
        (
            proptest::collection::vec(any::<u8>(), 0..512),
            any::<bool>(),
        ),
        |(wire, request)| {
            let side = if request {
                Side::Request
            } else {
                Side::Response("GET")
            };
            reads_alike(side, &wire)?;
            Ok(())
        },
    );
}
