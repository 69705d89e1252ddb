//! Decoding the KV cache events that vLLM and SGLang publish
//! (docs/wire-formats.md §1).
//!
//! A live message is 3 ZMQ frames: topic, an 8-byte big-endian sequence number
//! and a msgpack [`EventBatch`]. Engines disagree on details, so decoding is
//! lenient where the formats differ and strict where they agree:
//!
//! * the batch is an array `[ts, events, dp_rank?]` (or a map);
//! * each event is a tagged array `["BlockStored", f1, f2, …]` (vLLM ≤ 0.23,
//!   old SGLang) or a map with a `type` key (newer vLLM and SGLang);
//! * hashes are uint64, int64 (reinterpreted as u64) or bytes (last 8 bytes
//!   big-endian, left-padded);
//! * unknown keys, unknown tags and extra trailing fields are ignored.
//!
//! Known fields of the wrong type, truncated input and lengths that exceed the
//! input are a [`DecodeError`]: never a panic, never an allocation larger than
//! a small multiple of the payload. Replay replies (ROUTER→DEALER, with or
//! without the topic frame, and the `END_SEQ` marker) decode with
//! [`decode_replay_reply`].

mod events;
mod msgpack;

pub use events::{BlockRemoved, BlockStored, ExtraKey, Medium};

use msgpack::{Item, Reader};

/// Sequence number of the replay end marker (−1 as a signed 8-byte integer).
pub const END_SEQ: u64 = u64::MAX;

/// Deepest nesting accepted inside `extra_keys`.
pub(crate) const MAX_EXTRA_DEPTH: usize = 8;

/// Why a frame or payload was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("payload truncated")]
    Truncated,
    #[error("length exceeds the payload")]
    TooLong,
    #[error("field {field}: unexpected {found}")]
    Type {
        field: &'static str,
        found: &'static str,
    },
    #[error("value out of range in {0}")]
    Range(&'static str),
    #[error("extra_keys nested deeper than {MAX_EXTRA_DEPTH}")]
    TooDeep,
    #[error("expected {expected} frames, got {got}")]
    Frames { expected: &'static str, got: usize },
    #[error("sequence frame must be 8 bytes, got {0}")]
    SeqLen(usize),
    #[error("{0} trailing bytes after the batch")]
    Trailing(usize),
}

/// One engine event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared,
}

/// The events of one engine step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EventBatch {
    /// Wall-clock seconds at the engine.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    /// The data-parallel rank, when the engine sends one.
    pub dp_rank: Option<i64>,
    /// Events with a tag this decoder does not know (skipped).
    pub unknown_events: usize,
}

/// A decoded live message (or a replayed batch).
#[derive(Debug, Clone, PartialEq)]
pub struct KvMessage {
    /// Frame 0 as text (lossy UTF-8); empty for replay replies without a topic.
    pub topic: String,
    pub seq: u64,
    pub batch: EventBatch,
}

/// One reply on the replay socket.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplayReply {
    Batch(KvMessage),
    /// The engine has sent every buffered batch.
    End,
}

/// The pod and model named by a topic of the form `kv@<pod>@<model>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topic<'a> {
    pub pod: &'a str,
    pub model: &'a str,
}

/// Splits a `kv@<pod>@<model>` topic; `None` for any other shape.
pub fn parse_topic(topic: &str) -> Option<Topic<'_>> {
    let mut parts = topic.splitn(3, '@');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(_), Some(pod), Some(model)) => Some(Topic { pod, model }),
        _ => None,
    }
}

/// The two frames a DEALER sends to ask for every batch from `start_seq` on.
pub fn replay_request(start_seq: u64) -> [Vec<u8>; 2] {
    [Vec::new(), start_seq.to_be_bytes().to_vec()]
}

/// Reads an 8-byte big-endian sequence frame.
pub fn decode_seq(frame: &[u8]) -> Result<u64, DecodeError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError::SeqLen(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// Decodes a live 3-frame message `[topic, seq, payload]`.
pub fn decode_message<F: AsRef<[u8]>>(frames: &[F]) -> Result<KvMessage, DecodeError> {
    match frames {
        [topic, seq, payload] => Ok(KvMessage {
            topic: String::from_utf8_lossy(topic.as_ref()).into_owned(),
            seq: decode_seq(seq.as_ref())?,
            batch: decode_batch(payload.as_ref())?,
        }),
        _ => Err(DecodeError::Frames {
            expected: "3",
            got: frames.len(),
        }),
    }
}

/// Decodes one replay reply as a DEALER receives it, with or without the
/// leading empty delimiter: `[seq, payload]` (vLLM < 0.26, SGLang) or
/// `[topic, seq, payload]` (vLLM ≥ 0.26); an empty payload means the end.
pub fn decode_replay_reply<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayReply, DecodeError> {
    let rest = match frames {
        [first, rest @ ..] if first.as_ref().is_empty() && rest.len() >= 2 => rest,
        _ => frames,
    };
    let (topic, seq, payload) = match rest {
        [seq, payload] => (&[][..], seq.as_ref(), payload.as_ref()),
        [topic, seq, payload] => (topic.as_ref(), seq.as_ref(), payload.as_ref()),
        _ => {
            return Err(DecodeError::Frames {
                expected: "2 or 3 after the delimiter",
                got: frames.len(),
            })
        }
    };
    let seq = decode_seq(seq)?;
    if payload.is_empty() {
        return Ok(ReplayReply::End);
    }
    Ok(ReplayReply::Batch(KvMessage {
        topic: String::from_utf8_lossy(topic).into_owned(),
        seq,
        batch: decode_batch(payload)?,
    }))
}

/// Decodes one msgpack batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut r = Reader::new(payload);
    let mut batch = EventBatch::default();
    match r.next()? {
        Item::Array(n) => {
            if n < 2 {
                return Err(DecodeError::Type {
                    field: "batch",
                    found: "short array",
                });
            }
            batch.ts = read_ts(&mut r)?;
            read_events(&mut r, &mut batch)?;
            if n >= 3 {
                batch.dp_rank = read_opt_int(&mut r, "data_parallel_rank")?;
            }
            for _ in 3..n {
                r.skip()?;
            }
        }
        Item::Map(n) => {
            for _ in 0..n {
                match r.next()? {
                    Item::Str(b"ts") => batch.ts = read_ts(&mut r)?,
                    Item::Str(b"events") => read_events(&mut r, &mut batch)?,
                    Item::Str(b"data_parallel_rank" | b"dp_rank" | b"attn_dp_rank") => {
                        batch.dp_rank = read_opt_int(&mut r, "data_parallel_rank")?;
                    }
                    key => {
                        r.skip_rest(key)?;
                        r.skip()?;
                    }
                }
            }
        }
        other => {
            return Err(DecodeError::Type {
                field: "batch",
                found: other.kind(),
            })
        }
    }
    match r.remaining() {
        0 => Ok(batch),
        n => Err(DecodeError::Trailing(n)),
    }
}

fn read_ts(r: &mut Reader<'_>) -> Result<f64, DecodeError> {
    match r.next()? {
        Item::Float(f) => Ok(f),
        Item::Uint(u) => Ok(u as f64),
        Item::Neg(i) => Ok(i as f64),
        Item::Nil => Ok(0.0),
        other => Err(DecodeError::Type {
            field: "ts",
            found: other.kind(),
        }),
    }
}

fn read_events(r: &mut Reader<'_>, batch: &mut EventBatch) -> Result<(), DecodeError> {
    let n = match r.next()? {
        Item::Array(n) => n,
        other => {
            return Err(DecodeError::Type {
                field: "events",
                found: other.kind(),
            })
        }
    };
    // Capacity is capped: an event struct is far larger than its shortest encoding.
    batch.events.reserve(n.min(256));
    for _ in 0..n {
        match events::read_event(r)? {
            Some(ev) => batch.events.push(ev),
            None => batch.unknown_events += 1,
        }
    }
    Ok(())
}

pub(crate) fn read_opt_int(
    r: &mut Reader<'_>,
    field: &'static str,
) -> Result<Option<i64>, DecodeError> {
    match r.next()? {
        Item::Nil => Ok(None),
        Item::Uint(u) => i64::try_from(u)
            .map(Some)
            .map_err(|_| DecodeError::Range(field)),
        Item::Neg(i) => Ok(Some(i)),
        other => Err(DecodeError::Type {
            field,
            found: other.kind(),
        }),
    }
}

#[cfg(test)]
mod tests;
