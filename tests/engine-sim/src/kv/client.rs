//! A small KV-event consumer for tests, benchmarks and tools: a SUB socket
//! for the live stream, a DEALER for replay, and a lenient decoder that reads
//! both event encodings into one shape for assertions. (kvmesh's production
//! decoder lives in `kvmesh_filters::prefix::kvevents`.)

use std::time::Duration;

use bytes::Bytes;
use rmpv::Value;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::publisher::END_SEQ;
use crate::SimError;

/// One message as it came off the wire.
#[derive(Debug, Clone, PartialEq)]
pub struct KvMessage {
    pub topic: Bytes,
    pub seq: u64,
    pub payload: Bytes,
}

/// A decoded event, whichever encoding it came in.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedEvent {
    /// `BlockStored`, `BlockRemoved`, `AllBlocksCleared` (or an unknown tag).
    pub kind: String,
    /// Hashes as their 64 bits (signed SGLang values reinterpreted).
    pub block_hashes: Vec<u64>,
    pub parent_block_hash: Option<u64>,
    pub token_ids: Vec<u32>,
    pub block_size: usize,
    /// The raw event, for shape checks.
    pub raw: Value,
}

/// A decoded batch `[ts, events, dp_rank]`.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedBatch {
    pub ts: f64,
    pub events: Vec<DecodedEvent>,
    pub dp_rank: Option<u64>,
}

impl KvMessage {
    /// Decodes the payload leniently; `None` if it is not a batch.
    pub fn decode(&self) -> Option<DecodedBatch> {
        decode_batch(&self.payload)
    }
}

fn as_u64(v: &Value) -> Option<u64> {
    v.as_u64()
        .or_else(|| v.as_i64().map(|i| u64::from_ne_bytes(i.to_ne_bytes())))
}

/// Decodes one payload (frame 2).
pub fn decode_batch(payload: &[u8]) -> Option<DecodedBatch> {
    let mut rd = payload;
    let v = rmpv::decode::read_value(&mut rd).ok()?;
    let arr = v.as_array()?;
    let ts = arr.first()?.as_f64()?;
    let events = arr
        .get(1)?
        .as_array()?
        .iter()
        .filter_map(decode_event)
        .collect();
    let dp_rank = arr.get(2).and_then(Value::as_u64);
    Some(DecodedBatch {
        ts,
        events,
        dp_rank,
    })
}

/// Field `key` of a map event, or position `idx` of an array event.
fn field<'a>(v: &'a Value, key: &str, idx: usize) -> Option<&'a Value> {
    match v {
        Value::Map(m) => m
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v),
        Value::Array(a) => a.get(idx),
        _ => None,
    }
}

fn decode_event(v: &Value) -> Option<DecodedEvent> {
    let kind = field(v, "type", 0)?.as_str()?.to_string();
    let get = |k: &str, i: usize| field(v, k, i);
    let hashes = get("block_hashes", 1)
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(as_u64).collect())
        .unwrap_or_default();
    let stored = kind == "BlockStored";
    let parent = if stored {
        get("parent_block_hash", 2).and_then(as_u64)
    } else {
        None
    };
    let token_ids = if stored {
        get("token_ids", 3)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|t| t.as_u64().map(|x| x as u32))
                    .collect()
            })
            .unwrap_or_default()
    } else {
        Vec::new()
    };
    let block_size = if stored {
        get("block_size", 4).and_then(Value::as_u64).unwrap_or(0) as usize
    } else {
        0
    };
    Some(DecodedEvent {
        kind,
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids,
        block_size,
        raw: v.clone(),
    })
}

fn to_message(m: ZmqMessage) -> Option<KvMessage> {
    let parts = m.into_vec();
    let [topic, seq, payload] = parts.as_slice() else {
        return None;
    };
    let seq = u64::from_be_bytes(<[u8; 8]>::try_from(seq.as_ref()).ok()?);
    Some(KvMessage {
        topic: topic.clone(),
        seq,
        payload: payload.clone(),
    })
}

/// A SUB socket subscribed to everything.
pub struct KvSubscriber {
    sub: SubSocket,
}

impl std::fmt::Debug for KvSubscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvSubscriber")
    }
}

impl KvSubscriber {
    /// Connects to an engine that binds its PUB socket.
    pub async fn connect(endpoint: &str) -> Result<Self, SimError> {
        let mut sub = SubSocket::new();
        tokio::time::timeout(Duration::from_secs(5), sub.connect(endpoint))
            .await
            .map_err(|_| SimError::KvEvents(format!("connect {endpoint}: timed out")))?
            .map_err(|e| SimError::KvEvents(format!("connect {endpoint}: {e}")))?;
        sub.subscribe("")
            .await
            .map_err(|e| SimError::KvEvents(format!("subscribe: {e}")))?;
        Ok(Self { sub })
    }

    /// Binds (for an engine that connects, vLLM's non-wildcard rule);
    /// returns the resolved endpoint to give the engine.
    pub async fn bind(endpoint: &str) -> Result<(Self, String), SimError> {
        let mut sub = SubSocket::new();
        let ep = sub
            .bind(endpoint)
            .await
            .map_err(|e| SimError::KvEvents(format!("bind {endpoint}: {e}")))?;
        sub.subscribe("")
            .await
            .map_err(|e| SimError::KvEvents(format!("subscribe: {e}")))?;
        Ok((Self { sub }, ep.to_string()))
    }

    /// The next message, or `None` after `timeout`.
    pub async fn recv(&mut self, timeout: Duration) -> Option<KvMessage> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let m = tokio::time::timeout_at(deadline, self.sub.recv())
                .await
                .ok()?
                .ok()?;
            if let Some(m) = to_message(m) {
                return Some(m);
            }
        }
    }
}

/// Asks a replay socket for every kept batch from `start_seq`; stops at the
/// end marker or when `timeout` passes without one.
pub async fn replay(
    endpoint: &str,
    start_seq: u64,
    timeout: Duration,
) -> Result<Vec<KvMessage>, SimError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let err = |what: &str| SimError::KvEvents(format!("replay {endpoint}: {what}"));
    let mut d = DealerSocket::new();
    tokio::time::timeout_at(deadline, d.connect(endpoint))
        .await
        .map_err(|_| err("connect timed out"))?
        .map_err(|e| err(&e.to_string()))?;
    let req = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start_seq.to_be_bytes()),
    ])
    .map_err(|e| err(&e.to_string()))?;
    d.send(req).await.map_err(|e| err(&e.to_string()))?;
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout_at(deadline, d.recv())
            .await
            .map_err(|_| err("no end marker before the deadline"))?
            .map_err(|e| err(&e.to_string()))?;
        let parts = m.into_vec();
        // ["", topic, seq, payload]; the end marker is ["", "", END_SEQ, ""].
        match parts.as_slice() {
            [_, _, seq, _] if seq.as_ref() == END_SEQ => return Ok(out),
            [_, topic, seq, payload] => {
                let seq = <[u8; 8]>::try_from(seq.as_ref()).map_err(|_| err("bad seq frame"))?;
                out.push(KvMessage {
                    topic: topic.clone(),
                    seq: u64::from_be_bytes(seq),
                    payload: payload.clone(),
                });
            }
            _ => return Err(err("unexpected frame count")),
        }
        if out.len() > 1_000_000 {
            return Err(err("too many batches"));
        }
    }
}
