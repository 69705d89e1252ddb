//! The mesh state stream's framing and messages (docs/mesh.md).
//!
//! A frame is a fixed 14-byte header, `u8 version, u8 kind, u64 seq, u32 len`
//! (big-endian), then `len` bytes of payload in a small hand-written encoding:
//! integers big-endian, strings and lists as a `u32` count then the items,
//! options as a `u8` flag. Decoding never trusts a length: every count is
//! checked against the bytes left, payloads over [`MAX_PAYLOAD`] are refused,
//! and any malformed frame is an error (the subscriber drops the stream and
//! resyncs), never a panic.

use bytes::{BufMut, Bytes, BytesMut};
use kvmesh_filters::prefix::kvevents::{BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};
use kvmesh_filters::sched::view::Role;

use crate::fleet::{EngineLoad, EngineWork, PromptSpread};

/// The protocol version this sidecar speaks; a frame of another is refused.
pub const VERSION: u8 = 1;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 14;
/// Largest payload accepted (a snapshot chunk is far below it).
pub const MAX_PAYLOAD: u32 = 16 << 20;

/// What a sidecar announces about itself: the first frame of every stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announce {
    /// The pod identity: its sidecar's advertised client address.
    pub id: String,
    /// Where its mesh port listens, as it knows it.
    pub mesh_addr: String,
    pub role: Role,
    pub models: Vec<String>,
    pub lora_adapters: Vec<String>,
    pub labels: Vec<(String, String)>,
    /// Random per process: a restarted sidecar is a new stream.
    pub instance: u64,
    /// The KV agent of the pod's node, `host:port` (`pod.node_ip` and
    /// `pd.kvagent_port`), where prefill pods send this pod's KV blocks when
    /// it decodes; empty when the pod did not configure its node IP.
    pub kv_agent: String,
}

/// The local engine's load as published.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadMsg {
    pub load: EngineLoad,
    /// How old the load was when sent (ms; `u64::MAX`: never scraped).
    pub age_ms: u64,
    pub healthy: bool,
}

/// One message of the stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Msg {
    Hello(Announce),
    /// Everything before it was the snapshot; deltas follow.
    SnapshotEnd,
    Load(LoadMsg),
    /// The sender's requests in flight per target pod (replaces the last one).
    InFlight(Vec<(String, u32)>),
    /// KV events of the sender's own pod, keyed by `model`.
    Kv {
        model: String,
        batch: EventBatch,
    },
    /// An approximate routing decision: `pod` was sent these block keys.
    Decision {
        pod: String,
        keys: Vec<u64>,
    },
    /// The sender pod's cumulative counters (requests served, P/D, prefix
    /// cache), for `kvmesh stat`; sent with each load tick.
    Stats(crate::stat::PodStats),
    /// The LoRA adapters the sender's engine has loaded now, replacing the
    /// list of its `Hello` and of any earlier `Adapters` (docs/mesh.md):
    /// sent when the set changes, out of sequence, to subscribers that take it.
    Adapters(Vec<String>),
    /// The prompt tokens the sender has sent per target pod that wait to be
    /// prefilled (replaces the last one): sent with each load tick, out of
    /// sequence, to subscribers that take it.
    Prefill(Vec<(String, u64)>),
}

/// A frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: u8,
    pub seq: u64,
    pub len: u32,
}

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("protocol version {0}, this sidecar speaks {VERSION}")]
    Version(u8),
    #[error("unknown frame kind {0}")]
    Kind(u8),
    #[error("payload of {0} bytes exceeds the limit")]
    TooLarge(u32),
    #[error("truncated payload")]
    Truncated,
    #[error("invalid value in a {0} field")]
    Invalid(&'static str),
}

mod kind {
    pub const HELLO: u8 = 1;
    pub const SNAPSHOT_END: u8 = 2;
    pub const LOAD: u8 = 3;
    pub const IN_FLIGHT: u8 = 4;
    pub const KV: u8 = 5;
    pub const DECISION: u8 = 6;
    pub const STATS: u8 = 7;
    pub const ADAPTERS: u8 = 8;
    pub const PREFILL: u8 = 9;
}

const EV_STORED: u8 = 1;
const EV_REMOVED: u8 = 2;
const EV_CLEARED: u8 = 3;

/// Encodes one frame.
pub fn encode(seq: u64, msg: &Msg) -> Bytes {
    let mut b = BytesMut::with_capacity(64);
    b.put_u8(VERSION);
    b.put_u8(kind_of(msg));
    b.put_u64(seq);
    b.put_u32(0);
    match msg {
        Msg::Hello(a) => {
            put_str(&mut b, &a.id);
            put_str(&mut b, &a.mesh_addr);
            b.put_u8(role_code(a.role));
            put_strs(&mut b, &a.models);
            put_strs(&mut b, &a.lora_adapters);
            put_len(&mut b, a.labels.len());
            for (k, v) in &a.labels {
                put_str(&mut b, k);
                put_str(&mut b, v);
            }
            b.put_u64(a.instance);
            // Written only when set: a sidecar older than the field refuses
            // trailing bytes, and still reads a Hello without it.
            if !a.kv_agent.is_empty() {
                put_str(&mut b, &a.kv_agent);
            }
        }
        Msg::SnapshotEnd => {}
        Msg::Load(l) => {
            b.put_u32(l.load.waiting);
            b.put_u32(l.load.running);
            b.put_f64(l.load.kv_usage);
            b.put_u32(l.load.block_size);
            b.put_u32(l.load.num_blocks);
            b.put_u64(l.age_ms);
            b.put_u8(u8::from(l.healthy));
            // Written only when reported: a sidecar older than the counters
            // refuses trailing bytes, and still reads a Load without them.
            if let Some(w) = &l.load.work {
                for v in [
                    w.finished,
                    w.prompt_tokens,
                    w.cached_tokens,
                    w.generation_tokens,
                ] {
                    b.put_u64(v);
                }
                // After them, the same way: only when the engine exports it.
                if let Some(p) = &w.prompt_spread {
                    b.put_u64(p.tokens);
                    b.put_u64(p.tokens_sq);
                }
            }
        }
        Msg::InFlight(counts) => {
            put_len(&mut b, counts.len());
            for (t, n) in counts {
                put_str(&mut b, t);
                b.put_u32(*n);
            }
        }
        Msg::Kv { model, batch } => {
            put_str(&mut b, model);
            put_len(&mut b, batch.events.len());
            for ev in &batch.events {
                put_event(&mut b, ev);
            }
        }
        Msg::Stats(s) => {
            for v in [
                s.requests,
                s.pd_splits,
                s.pd_failures,
                s.prefix_queries,
                s.prefix_hits,
            ] {
                b.put_u64(v);
            }
        }
        Msg::Decision { pod, keys } => {
            put_str(&mut b, pod);
            put_len(&mut b, keys.len());
            for k in keys {
                b.put_u64(*k);
            }
        }
        Msg::Adapters(names) => put_strs(&mut b, names),
        Msg::Prefill(tokens) => {
            put_len(&mut b, tokens.len());
            for (t, n) in tokens {
                put_str(&mut b, t);
                b.put_u64(*n);
            }
        }
    }
    let len = u32::try_from(b.len() - HEADER_LEN).unwrap_or(u32::MAX);
    b[10..14].copy_from_slice(&len.to_be_bytes());
    b.freeze()
}

/// Reads a header from the first [`HEADER_LEN`] bytes of `buf`.
pub fn header(buf: &[u8]) -> Result<Option<Header>, WireError> {
    let Some(h) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    if h[0] != VERSION {
        return Err(WireError::Version(h[0]));
    }
    let mut r = Reader(&h[1..]);
    let kind = r.u8()?;
    let seq = r.u64()?;
    let len = r.u32()?;
    if len > MAX_PAYLOAD {
        return Err(WireError::TooLarge(len));
    }
    Ok(Some(Header { kind, seq, len }))
}

/// Decodes the payload of a frame of `kind`.
pub fn decode(kind: u8, payload: &[u8]) -> Result<Msg, WireError> {
    let mut r = Reader(payload);
    let msg = match kind {
        kind::HELLO => {
            let id = r.str()?;
            let mesh_addr = r.str()?;
            let role = role_of(r.u8()?)?;
            let models = r.strs()?;
            let lora_adapters = r.strs()?;
            let n = r.len(8)?;
            let mut labels = Vec::with_capacity(n);
            for _ in 0..n {
                labels.push((r.str()?, r.str()?));
            }
            Msg::Hello(Announce {
                id,
                mesh_addr,
                role,
                models,
                lora_adapters,
                labels,
                instance: r.u64()?,
                // Absent from sidecars older than the field: no agent announced.
                kv_agent: if r.0.is_empty() {
                    String::new()
                } else {
                    r.str()?
                },
            })
        }
        kind::SNAPSHOT_END => Msg::SnapshotEnd,
        kind::LOAD => {
            let mut load = EngineLoad {
                waiting: r.u32()?,
                running: r.u32()?,
                kv_usage: r.f64()?,
                block_size: r.u32()?,
                num_blocks: r.u32()?,
                work: None,
            };
            if !load.kv_usage.is_finite() {
                return Err(WireError::Invalid("kv_usage"));
            }
            let age_ms = r.u64()?;
            let healthy = r.u8()? != 0;
            // Absent from sidecars older than the counters, and from pods
            // whose engine exports none.
            if !r.0.is_empty() {
                load.work = Some(EngineWork {
                    finished: r.u64()?,
                    prompt_tokens: r.u64()?,
                    cached_tokens: r.u64()?,
                    generation_tokens: r.u64()?,
                    // Absent from sidecars older than it, and from engines
                    // without the prompt-length histogram.
                    prompt_spread: if r.0.is_empty() {
                        None
                    } else {
                        Some(PromptSpread {
                            tokens: r.u64()?,
                            tokens_sq: r.u64()?,
                        })
                    },
                });
            }
            Msg::Load(LoadMsg {
                load,
                age_ms,
                healthy,
            })
        }
        kind::IN_FLIGHT => {
            let n = r.len(8)?;
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push((r.str()?, r.u32()?));
            }
            Msg::InFlight(v)
        }
        kind::KV => {
            let model = r.str()?;
            let n = r.len(1)?;
            let mut events = Vec::with_capacity(n);
            for _ in 0..n {
                events.push(get_event(&mut r)?);
            }
            Msg::Kv {
                model,
                batch: EventBatch {
                    ts: 0.0,
                    events,
                    dp_rank: None,
                    unknown_events: 0,
                },
            }
        }
        kind::DECISION => {
            let pod = r.str()?;
            let n = r.len(8)?;
            let mut keys = Vec::with_capacity(n);
            for _ in 0..n {
                keys.push(r.u64()?);
            }
            Msg::Decision { pod, keys }
        }
        kind::STATS => Msg::Stats(crate::stat::PodStats {
            requests: r.u64()?,
            pd_splits: r.u64()?,
            pd_failures: r.u64()?,
            prefix_queries: r.u64()?,
            prefix_hits: r.u64()?,
        }),
        kind::ADAPTERS => Msg::Adapters(r.strs()?),
        kind::PREFILL => {
            let n = r.len(12)?;
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push((r.str()?, r.u64()?));
            }
            Msg::Prefill(v)
        }
        k => return Err(WireError::Kind(k)),
    };
    if !r.0.is_empty() {
        return Err(WireError::Invalid("trailing bytes"));
    }
    Ok(msg)
}

fn kind_of(msg: &Msg) -> u8 {
    match msg {
        Msg::Hello(_) => kind::HELLO,
        Msg::SnapshotEnd => kind::SNAPSHOT_END,
        Msg::Load(_) => kind::LOAD,
        Msg::InFlight(_) => kind::IN_FLIGHT,
        Msg::Kv { .. } => kind::KV,
        Msg::Decision { .. } => kind::DECISION,
        Msg::Stats(_) => kind::STATS,
        Msg::Adapters(_) => kind::ADAPTERS,
        Msg::Prefill(_) => kind::PREFILL,
    }
}

/// Only what the prefix index reads is sent: hashes, parent, tokens, block
/// size, medium, LoRA name and the cache salt of root blocks.
fn put_event(b: &mut BytesMut, ev: &KvEvent) {
    match ev {
        KvEvent::BlockStored(s) => {
            b.put_u8(EV_STORED);
            put_u64s(b, &s.block_hashes);
            put_opt_u64(b, s.parent_block_hash);
            b.put_u32(s.block_size);
            b.put_u8(s.medium.code());
            put_opt_str(b, s.lora_name.as_deref());
            put_opt_str(b, s.salt());
            put_len(b, s.token_ids.len());
            for t in &s.token_ids {
                b.put_u32(*t);
            }
        }
        KvEvent::BlockRemoved(r) => {
            b.put_u8(EV_REMOVED);
            put_u64s(b, &r.block_hashes);
            b.put_u8(r.medium.code());
        }
        KvEvent::AllBlocksCleared => b.put_u8(EV_CLEARED),
    }
}

fn get_event(r: &mut Reader<'_>) -> Result<KvEvent, WireError> {
    Ok(match r.u8()? {
        EV_STORED => {
            let block_hashes = r.u64s()?;
            let parent_block_hash = r.opt_u64()?;
            let block_size = r.u32()?;
            let medium = Medium::from_code(r.u8()?);
            let lora_name = r.opt_str()?;
            let cache_salt = r.opt_str()?;
            let n = r.len(4)?;
            let mut token_ids = Vec::with_capacity(n);
            for _ in 0..n {
                token_ids.push(r.u32()?);
            }
            KvEvent::BlockStored(BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora_name,
                cache_salt,
                ..BlockStored::default()
            })
        }
        EV_REMOVED => KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: r.u64s()?,
            medium: Medium::from_code(r.u8()?),
            ..BlockRemoved::default()
        }),
        EV_CLEARED => KvEvent::AllBlocksCleared,
        _ => return Err(WireError::Invalid("event tag")),
    })
}

pub(crate) fn role_code(role: Role) -> u8 {
    match role {
        Role::Prefill => 1,
        Role::Decode => 2,
        Role::Both => 3,
    }
}

fn role_of(c: u8) -> Result<Role, WireError> {
    match c {
        1 => Ok(Role::Prefill),
        2 => Ok(Role::Decode),
        3 => Ok(Role::Both),
        _ => Err(WireError::Invalid("role")),
    }
}

fn put_len(b: &mut BytesMut, n: usize) {
    b.put_u32(u32::try_from(n).unwrap_or(u32::MAX));
}

fn put_str(b: &mut BytesMut, s: &str) {
    put_len(b, s.len());
    b.put_slice(s.as_bytes());
}

fn put_strs(b: &mut BytesMut, v: &[String]) {
    put_len(b, v.len());
    for s in v {
        put_str(b, s);
    }
}

fn put_opt_str(b: &mut BytesMut, s: Option<&str>) {
    match s {
        Some(s) => {
            b.put_u8(1);
            put_str(b, s);
        }
        None => b.put_u8(0),
    }
}

fn put_opt_u64(b: &mut BytesMut, v: Option<u64>) {
    match v {
        Some(v) => {
            b.put_u8(1);
            b.put_u64(v);
        }
        None => b.put_u8(0),
    }
}

fn put_u64s(b: &mut BytesMut, v: &[u64]) {
    put_len(b, v.len());
    for x in v {
        b.put_u64(*x);
    }
}

/// A cursor over a payload; every read is bounds-checked.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Truncated);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_be_bytes(a))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(a))
    }

    fn f64(&mut self) -> Result<f64, WireError> {
        Ok(f64::from_bits(self.u64()?))
    }

    /// A count of items of at least `min_item` bytes each: a count larger
    /// than the bytes left could hold is refused before any allocation.
    fn len(&mut self, min_item: usize) -> Result<usize, WireError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_item) > self.0.len() {
            return Err(WireError::Truncated);
        }
        Ok(n)
    }

    fn str(&mut self) -> Result<String, WireError> {
        let n = self.len(1)?;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| WireError::Invalid("string"))
    }

    fn strs(&mut self) -> Result<Vec<String>, WireError> {
        let n = self.len(4)?;
        (0..n).map(|_| self.str()).collect()
    }

    fn opt_str(&mut self) -> Result<Option<String>, WireError> {
        match self.u8()? {
            0 => Ok(None),
            1 => self.str().map(Some),
            _ => Err(WireError::Invalid("option flag")),
        }
    }

    fn opt_u64(&mut self) -> Result<Option<u64>, WireError> {
        match self.u8()? {
            0 => Ok(None),
            1 => self.u64().map(Some),
            _ => Err(WireError::Invalid("option flag")),
        }
    }

    fn u64s(&mut self) -> Result<Vec<u64>, WireError> {
        let n = self.len(8)?;
        (0..n).map(|_| self.u64()).collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn roundtrip(seq: u64, msg: &Msg) -> Msg {
        let f = encode(seq, msg);
        let h = header(&f).unwrap().unwrap();
        assert_eq!(h.seq, seq);
        assert_eq!(h.len as usize, f.len() - HEADER_LEN);
        decode(h.kind, &f[HEADER_LEN..]).unwrap()
    }

    #[test]
    fn every_message_roundtrips() {
        let msgs = [
            Msg::Hello(Announce {
                id: "10.0.0.1:8000".into(),
                mesh_addr: "10.0.0.1:7000".into(),
                role: Role::Decode,
                models: vec!["m".into()],
                lora_adapters: vec!["a".into(), "b".into()],
                labels: vec![("zone".into(), "x".into())],
                instance: 42,
                kv_agent: "10.1.0.1:7600".into(),
            }),
            Msg::SnapshotEnd,
            Msg::Load(LoadMsg {
                load: EngineLoad {
                    waiting: 1,
                    running: 2,
                    kv_usage: 0.5,
                    block_size: 16,
                    num_blocks: 100,
                    work: None,
                },
                age_ms: 7,
                healthy: true,
            }),
            Msg::Load(LoadMsg {
                load: EngineLoad {
                    waiting: 1,
                    work: Some(EngineWork {
                        finished: 9,
                        prompt_tokens: 9000,
                        cached_tokens: 4000,
                        generation_tokens: 900,
                        prompt_spread: None,
                    }),
                    ..EngineLoad::default()
                },
                age_ms: 7,
                healthy: true,
            }),
            Msg::Load(LoadMsg {
                load: EngineLoad {
                    work: Some(EngineWork {
                        finished: 9,
                        prompt_tokens: 9000,
                        cached_tokens: 0,
                        generation_tokens: 9,
                        prompt_spread: Some(PromptSpread {
                            tokens: 9100,
                            tokens_sq: 11_000_000,
                        }),
                    }),
                    ..EngineLoad::default()
                },
                age_ms: 7,
                healthy: true,
            }),
            Msg::InFlight(vec![("p".into(), 3)]),
            Msg::Stats(crate::stat::PodStats {
                requests: 1,
                pd_splits: 2,
                pd_failures: 3,
                prefix_queries: 4,
                prefix_hits: u64::MAX,
            }),
            Msg::Decision {
                pod: "p".into(),
                keys: vec![1, 2, u64::MAX],
            },
            Msg::Adapters(vec!["sql-lora".into(), "chat-lora".into()]),
            Msg::Adapters(vec![]),
            Msg::Prefill(vec![("p".into(), 4096), ("q".into(), u64::MAX)]),
            Msg::Prefill(vec![]),
            Msg::Kv {
                model: "m".into(),
                batch: EventBatch {
                    ts: 0.0,
                    events: vec![
                        KvEvent::BlockStored(BlockStored {
                            block_hashes: vec![9, 10],
                            parent_block_hash: None,
                            token_ids: (0..32).collect(),
                            block_size: 16,
                            cache_salt: Some("s".into()),
                            ..BlockStored::default()
                        }),
                        KvEvent::BlockRemoved(BlockRemoved {
                            block_hashes: vec![9],
                            medium: Medium::Cpu,
                            ..BlockRemoved::default()
                        }),
                        KvEvent::AllBlocksCleared,
                    ],
                    dp_rank: None,
                    unknown_events: 0,
                },
            },
        ];
        for (i, m) in msgs.iter().enumerate() {
            assert_eq!(&roundtrip(i as u64, m), m);
        }
    }

    #[test]
    fn hello_without_kv_agent_is_from_an_older_sidecar() {
        let hello = Announce {
            id: "10.0.0.1:8000".into(),
            mesh_addr: "10.0.0.1:7000".into(),
            role: Role::Both,
            models: vec![],
            lora_adapters: vec![],
            labels: vec![],
            instance: 7,
            kv_agent: String::new(),
        };
        // Before the field, the payload ended after `instance`; without an
        // agent it still does, so older sidecars read it.
        let f = encode(0, &Msg::Hello(hello.clone()));
        let with = Announce {
            kv_agent: "10.1.0.1:7600".into(),
            ..hello.clone()
        };
        let g = encode(0, &Msg::Hello(with));
        assert_eq!(g.len(), f.len() + 4 + "10.1.0.1:7600".len());
        assert_eq!(decode(f[1], &f[HEADER_LEN..]), Ok(Msg::Hello(hello)));
    }

    #[test]
    fn garbage_is_an_error_never_a_panic() {
        let f = encode(
            1,
            &Msg::Decision {
                pod: "p".into(),
                keys: vec![1, 2, 3],
            },
        );
        for cut in 0..f.len() - HEADER_LEN {
            assert!(decode(f[1], &f[HEADER_LEN..HEADER_LEN + cut]).is_err());
        }
        // A count far larger than the payload is refused before allocating.
        let mut huge = vec![0, 0, 0, 1, b'p'];
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(decode(6, &huge), Err(WireError::Truncated));
        let mut bad = f.to_vec();
        bad[0] = 9;
        assert_eq!(header(&bad), Err(WireError::Version(9)));
        assert_eq!(decode(200, &[]), Err(WireError::Kind(200)));
        let mut big = encode(0, &Msg::SnapshotEnd).to_vec();
        big[10..14].copy_from_slice(&(MAX_PAYLOAD + 1).to_be_bytes());
        assert_eq!(header(&big), Err(WireError::TooLarge(MAX_PAYLOAD + 1)));
        assert_eq!(header(&big[..5]), Ok(None));
    }
}
