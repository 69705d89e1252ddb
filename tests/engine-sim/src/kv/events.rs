//! KV-cache events and their msgpack encoding, byte-compatible with vLLM's
//! `ZmqEventPublisher` (docs/wire-formats.md §1.3) and SGLang's variant
//! (§1.7).
//!
//! A batch is the positional array `[ts, [event, ...], dp_rank]`. Events are
//! tagged maps (vLLM >= 0.26, what vLLM 0.32 sends: keys in declaration order,
//! `None` defaults omitted, the no-default fields `lora_id`, `medium`,
//! `lora_name` always present) or legacy tagged arrays. vLLM hashes are msgpack
//! unsigned ints; SGLang's are signed (the same 64 bits reinterpreted).

use std::io::Write;

use rmp::encode;

use crate::config::{Flavor, KvEventsFormat};

/// One KV-cache event, engine side.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: usize,
        lora_name: Option<String>,
        /// Per block: `Some([salt])` on a salted block 0, else `None`.
        extra_keys: Vec<Option<Vec<String>>>,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
    },
    AllBlocksCleared,
}

/// How to encode: engine family and event layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Encoding {
    pub flavor: Flavor,
    pub format: KvEventsFormat,
}

/// The msgpack payload (frame 2) of one batch.
pub fn encode_batch(ts: f64, events: &[KvEvent], dp_rank: u32, enc: Encoding) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 128);
    // Writing into a Vec cannot fail; the `let _` keeps the encoder panic-free.
    let _ = write_batch(&mut out, ts, events, dp_rank, enc);
    out
}

fn write_batch(
    w: &mut Vec<u8>,
    ts: f64,
    events: &[KvEvent],
    dp_rank: u32,
    enc: Encoding,
) -> Result<(), encode::ValueWriteError> {
    encode::write_array_len(w, 3)?;
    encode::write_f64(w, ts)?;
    encode::write_array_len(w, len32(events.len()))?;
    for ev in events {
        match enc.format {
            KvEventsFormat::Map => write_map_event(w, ev, enc.flavor)?,
            KvEventsFormat::Array => write_array_event(w, ev, enc.flavor)?,
        }
    }
    encode::write_uint(w, u64::from(dp_rank))?;
    Ok(())
}

fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn write_hash(w: &mut Vec<u8>, h: u64, flavor: Flavor) -> Result<(), encode::ValueWriteError> {
    match flavor {
        Flavor::Vllm => encode::write_uint(w, h).map(|_| ()),
        Flavor::Sglang => encode::write_sint(w, i64::from_ne_bytes(h.to_ne_bytes())).map(|_| ()),
    }
}

fn write_hashes(
    w: &mut Vec<u8>,
    hs: &[u64],
    flavor: Flavor,
) -> Result<(), encode::ValueWriteError> {
    encode::write_array_len(w, len32(hs.len()))?;
    for h in hs {
        write_hash(w, *h, flavor)?;
    }
    Ok(())
}

fn write_opt_hash(
    w: &mut Vec<u8>,
    h: Option<u64>,
    flavor: Flavor,
) -> Result<(), encode::ValueWriteError> {
    match h {
        Some(h) => write_hash(w, h, flavor),
        None => encode::write_nil(w).map_err(encode::ValueWriteError::InvalidMarkerWrite),
    }
}

fn write_tokens(w: &mut Vec<u8>, toks: &[u32]) -> Result<(), encode::ValueWriteError> {
    encode::write_array_len(w, len32(toks.len()))?;
    for t in toks {
        encode::write_uint(w, u64::from(*t))?;
    }
    Ok(())
}

fn write_opt_str(w: &mut Vec<u8>, s: Option<&str>) -> Result<(), encode::ValueWriteError> {
    match s {
        Some(s) => encode::write_str(w, s),
        None => encode::write_nil(w).map_err(encode::ValueWriteError::InvalidMarkerWrite),
    }
}

fn nil(w: &mut Vec<u8>) -> Result<(), encode::ValueWriteError> {
    encode::write_nil(w).map_err(encode::ValueWriteError::InvalidMarkerWrite)
}

fn write_extra_keys(
    w: &mut Vec<u8>,
    extra: &[Option<Vec<String>>],
) -> Result<(), encode::ValueWriteError> {
    encode::write_array_len(w, len32(extra.len()))?;
    for e in extra {
        match e {
            Some(keys) => {
                encode::write_array_len(w, len32(keys.len()))?;
                for k in keys {
                    encode::write_str(w, k)?;
                }
            }
            None => nil(w)?,
        }
    }
    Ok(())
}

fn write_map_event(
    w: &mut Vec<u8>,
    ev: &KvEvent,
    flavor: Flavor,
) -> Result<(), encode::ValueWriteError> {
    match ev {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_name,
            extra_keys,
        } => {
            let salt = extra_keys
                .first()
                .and_then(|e| e.as_ref())
                .and_then(|k| k.first());
            let n = match flavor {
                // type..lora_name (8), extra_keys, group_idx, kv_cache_spec_kind
                Flavor::Vllm => 11,
                // type, hashes, parent, tokens, block_size, lora_id, medium (+ cache_salt, lora_name when set)
                Flavor::Sglang => 7 + u32::from(salt.is_some()) + u32::from(lora_name.is_some()),
            };
            encode::write_map_len(w, n)?;
            encode::write_str(w, "type")?;
            encode::write_str(w, "BlockStored")?;
            encode::write_str(w, "block_hashes")?;
            write_hashes(w, block_hashes, flavor)?;
            encode::write_str(w, "parent_block_hash")?;
            write_opt_hash(w, *parent_block_hash, flavor)?;
            encode::write_str(w, "token_ids")?;
            write_tokens(w, token_ids)?;
            encode::write_str(w, "block_size")?;
            encode::write_uint(w, *block_size as u64)?;
            encode::write_str(w, "lora_id")?;
            nil(w)?;
            encode::write_str(w, "medium")?;
            encode::write_str(w, "GPU")?;
            match flavor {
                Flavor::Vllm => {
                    encode::write_str(w, "lora_name")?;
                    write_opt_str(w, lora_name.as_deref())?;
                    encode::write_str(w, "extra_keys")?;
                    write_extra_keys(w, extra_keys)?;
                    encode::write_str(w, "group_idx")?;
                    encode::write_uint(w, 0)?;
                    encode::write_str(w, "kv_cache_spec_kind")?;
                    encode::write_str(w, "full_attention")?;
                }
                Flavor::Sglang => {
                    if let Some(salt) = salt {
                        encode::write_str(w, "cache_salt")?;
                        encode::write_str(w, salt)?;
                    }
                    if let Some(l) = lora_name {
                        encode::write_str(w, "lora_name")?;
                        encode::write_str(w, l)?;
                    }
                }
            }
        }
        KvEvent::BlockRemoved { block_hashes } => {
            let n = if flavor == Flavor::Vllm { 4 } else { 3 };
            encode::write_map_len(w, n)?;
            encode::write_str(w, "type")?;
            encode::write_str(w, "BlockRemoved")?;
            encode::write_str(w, "block_hashes")?;
            write_hashes(w, block_hashes, flavor)?;
            encode::write_str(w, "medium")?;
            encode::write_str(w, "GPU")?;
            if flavor == Flavor::Vllm {
                encode::write_str(w, "group_idx")?;
                encode::write_uint(w, 0)?;
            }
        }
        KvEvent::AllBlocksCleared => {
            encode::write_map_len(w, 1)?;
            encode::write_str(w, "type")?;
            encode::write_str(w, "AllBlocksCleared")?;
        }
    }
    Ok(())
}

fn write_array_event(
    w: &mut Vec<u8>,
    ev: &KvEvent,
    flavor: Flavor,
) -> Result<(), encode::ValueWriteError> {
    match ev {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_name,
            extra_keys,
        } => {
            // vLLM <= 0.23 order: tag, hashes, parent, tokens, block_size,
            // lora_id, medium, lora_name; trailing defaults omitted, so
            // extra_keys only appears when a block has some.
            // SGLang's salted variant (BlockStoredWithMetadata) appends a
            // `{"cache_salt": S}` metadata map.
            let has_extra = extra_keys.iter().any(Option::is_some);
            let salt = extra_keys
                .first()
                .and_then(|e| e.as_ref())
                .and_then(|k| k.first());
            let n = match flavor {
                Flavor::Vllm => 8 + u32::from(has_extra),
                Flavor::Sglang => 7 + u32::from(salt.is_some()),
            };
            encode::write_array_len(w, n)?;
            encode::write_str(w, "BlockStored")?;
            write_hashes(w, block_hashes, flavor)?;
            write_opt_hash(w, *parent_block_hash, flavor)?;
            write_tokens(w, token_ids)?;
            encode::write_uint(w, *block_size as u64)?;
            nil(w)?;
            encode::write_str(w, "GPU")?;
            if flavor == Flavor::Vllm {
                write_opt_str(w, lora_name.as_deref())?;
                if has_extra {
                    write_extra_keys(w, extra_keys)?;
                }
            } else if let Some(salt) = salt {
                encode::write_map_len(w, 1)?;
                encode::write_str(w, "cache_salt")?;
                encode::write_str(w, salt)?;
            }
        }
        KvEvent::BlockRemoved { block_hashes } => {
            encode::write_array_len(w, 3)?;
            encode::write_str(w, "BlockRemoved")?;
            write_hashes(w, block_hashes, flavor)?;
            encode::write_str(w, "GPU")?;
        }
        KvEvent::AllBlocksCleared => {
            encode::write_array_len(w, 1)?;
            encode::write_str(w, "AllBlocksCleared")?;
        }
    }
    let _ = w.flush();
    Ok(())
}
