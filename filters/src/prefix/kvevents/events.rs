//! The event structs and their field-by-field decoding (array and map forms).

use super::msgpack::{Item, Reader};
use super::{DecodeError, KvEvent, MAX_EXTRA_DEPTH};
use crate::prefix::hash::digest_to_u64;

/// Where a stored block lives. `None` on the wire means the GPU pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Medium {
    #[default]
    Gpu,
    /// Host memory (vLLM `CPU`, SGLang `CPU_PINNED` / `CPU_TIER1`).
    Cpu,
    /// Disk or object storage (vLLM `STORAGE`/`FS`/`OBJ`, SGLang `DISK`/`CPU_TIER2`).
    Storage,
    /// SGLang's `EXTERNAL` tier.
    External,
    Other,
}

impl Medium {
    /// Case-insensitive parse of the engines' medium strings.
    pub fn parse(s: &str) -> Self {
        match s.to_ascii_uppercase().as_str() {
            "GPU" | "CUDA" | "HBM" => Medium::Gpu,
            "CPU" | "CPU_PINNED" | "CPU_TIER1" | "HOST" => Medium::Cpu,
            "STORAGE" | "FS" | "OBJ" | "DISK" | "CPU_TIER2" => Medium::Storage,
            "EXTERNAL" => Medium::External,
            _ => Medium::Other,
        }
    }

    /// A small stable number for the medium (0 GPU .. 4 other): how the
    /// prefix index packs it and how the mesh sends it. [`Medium::from_code`]
    /// reads it back; unknown numbers are `Other`.
    pub fn code(self) -> u8 {
        match self {
            Medium::Gpu => 0,
            Medium::Cpu => 1,
            Medium::Storage => 2,
            Medium::External => 3,
            Medium::Other => 4,
        }
    }

    /// The medium of a [`Medium::code`].
    pub fn from_code(c: u8) -> Self {
        match c {
            0 => Medium::Gpu,
            1 => Medium::Cpu,
            2 => Medium::Storage,
            3 => Medium::External,
            _ => Medium::Other,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "gpu",
            Medium::Cpu => "cpu",
            Medium::Storage => "storage",
            Medium::External => "external",
            Medium::Other => "other",
        }
    }
}

/// One element of a block's `extra_keys` (LoRA name, multimodal identifier
/// and offset, cache salt, prompt-embeds digest), as sent.
#[derive(Debug, Clone, PartialEq)]
pub enum ExtraKey {
    Nil,
    Bool(bool),
    Int(i64),
    Uint(u64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<ExtraKey>),
    /// A map or extension value (kept opaque).
    Other,
}

/// `BlockStored`: full blocks entered the prefix cache.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// Engine hashes, one per block.
    pub block_hashes: Vec<u64>,
    /// Engine hash of the block before the first one here (`None`: a root block).
    pub parent_block_hash: Option<u64>,
    /// Tokens of all blocks, concatenated (SGLang bigram pairs keep their first id).
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub medium: Medium,
    pub lora_name: Option<String>,
    /// Per block: the extra keys, or `None`.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    pub group_idx: Option<i64>,
    pub kv_cache_spec_kind: Option<String>,
    pub kv_cache_spec_sliding_window: Option<i64>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
    /// SGLang sends the salt as its own field (or in a trailing `metadata` map).
    pub cache_salt: Option<String>,
}

impl BlockStored {
    /// The request's `cache_salt`, when this event starts at a root block: the
    /// SGLang field, else vLLM's block-0 extra keys (tagged `["cache_salt", S]`,
    /// or untagged: the last string that is not the LoRA name).
    pub fn salt(&self) -> Option<&str> {
        if self.parent_block_hash.is_some() {
            return None;
        }
        if let Some(s) = &self.cache_salt {
            return Some(s);
        }
        let keys = self.extra_keys.as_ref()?.first()?.as_ref()?;
        let mut lora_skipped = false;
        let mut salt = None;
        for k in keys {
            match k {
                ExtraKey::List(pair) => {
                    if let [ExtraKey::Str(tag), ExtraKey::Str(s)] = pair.as_slice() {
                        if tag == "cache_salt" {
                            return Some(s);
                        }
                    }
                }
                ExtraKey::Str(s) => {
                    if !lora_skipped && self.lora_name.as_deref() == Some(s.as_str()) {
                        lora_skipped = true;
                    } else {
                        salt = Some(s.as_str());
                    }
                }
                _ => {}
            }
        }
        salt
    }

    /// Whether this event belongs to the main full-attention KV group (the only
    /// one a prefix index should follow).
    pub fn is_main_group(&self) -> bool {
        self.group_idx.unwrap_or(0) == 0
            && self
                .kv_cache_spec_kind
                .as_deref()
                .is_none_or(|k| k == "full_attention")
    }
}

/// `BlockRemoved`: blocks left the cache (one entry per physical copy).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    pub block_hashes: Vec<u64>,
    pub medium: Medium,
    pub group_idx: Option<i64>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
}

#[derive(Debug, Clone, Copy)]
enum Field {
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    SlidingWindow,
    Locality,
    Ownership,
    CacheSalt,
    Ignore,
}

const STORED_ORDER: [Field; 13] = [
    Field::BlockHashes,
    Field::Parent,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::SpecKind,
    Field::SlidingWindow,
    Field::Locality,
    Field::Ownership,
];

const REMOVED_ORDER: [Field; 5] = [
    Field::BlockHashes,
    Field::Medium,
    Field::GroupIdx,
    Field::Locality,
    Field::Ownership,
];

fn field_by_name(name: &[u8]) -> Field {
    match name {
        b"block_hashes" => Field::BlockHashes,
        b"parent_block_hash" => Field::Parent,
        b"token_ids" => Field::TokenIds,
        b"block_size" => Field::BlockSize,
        b"lora_id" => Field::LoraId,
        b"medium" => Field::Medium,
        b"lora_name" => Field::LoraName,
        b"extra_keys" => Field::ExtraKeys,
        b"group_idx" => Field::GroupIdx,
        b"kv_cache_spec_kind" => Field::SpecKind,
        b"kv_cache_spec_sliding_window" => Field::SlidingWindow,
        b"locality" => Field::Locality,
        b"ownership" => Field::Ownership,
        b"cache_salt" => Field::CacheSalt,
        _ => Field::Ignore,
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

fn tag_of(name: &[u8]) -> Tag {
    match name {
        b"BlockStored" | b"BlockStoredWithMetadata" => Tag::Stored,
        b"BlockRemoved" => Tag::Removed,
        b"AllBlocksCleared" => Tag::Cleared,
        _ => Tag::Unknown,
    }
}

/// Reads one event; `Ok(None)` for an unknown tag (skipped whole).
pub(super) fn read_event(r: &mut Reader<'_>) -> Result<Option<KvEvent>, DecodeError> {
    let mut s = BlockStored::default();
    let tag = match r.next()? {
        Item::Array(0) => {
            return Err(DecodeError::Type {
                field: "event",
                found: "empty array",
            })
        }
        Item::Array(n) => {
            let tag = match r.next()? {
                Item::Str(t) => tag_of(t),
                other => {
                    return Err(DecodeError::Type {
                        field: "event tag",
                        found: other.kind(),
                    })
                }
            };
            let order: &[Field] = match tag {
                Tag::Stored => &STORED_ORDER,
                Tag::Removed => &REMOVED_ORDER,
                Tag::Cleared | Tag::Unknown => &[],
            };
            for i in 0..n - 1 {
                let head = r.next()?;
                read_field(
                    r,
                    order.get(i).copied().unwrap_or(Field::Ignore),
                    head,
                    &mut s,
                )?;
            }
            tag
        }
        Item::Map(n) => {
            let mut tag = None;
            for _ in 0..n {
                match r.next()? {
                    Item::Str(b"type") => match r.next()? {
                        Item::Str(t) => tag = Some(tag_of(t)),
                        other => {
                            return Err(DecodeError::Type {
                                field: "type",
                                found: other.kind(),
                            })
                        }
                    },
                    Item::Str(key) => {
                        let head = r.next()?;
                        read_field(r, field_by_name(key), head, &mut s)?;
                    }
                    key => {
                        r.skip_rest(key)?;
                        r.skip()?;
                    }
                }
            }
            tag.ok_or(DecodeError::Type {
                field: "event",
                found: "map without type",
            })?
        }
        other => {
            return Err(DecodeError::Type {
                field: "event",
                found: other.kind(),
            })
        }
    };
    Ok(match tag {
        Tag::Stored => Some(KvEvent::BlockStored(s)),
        Tag::Removed => Some(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: s.block_hashes,
            medium: s.medium,
            group_idx: s.group_idx,
            locality: s.locality,
            ownership: s.ownership,
        })),
        Tag::Cleared => Some(KvEvent::AllBlocksCleared),
        Tag::Unknown => None,
    })
}

fn read_field<'a>(
    r: &mut Reader<'a>,
    field: Field,
    head: Item<'a>,
    s: &mut BlockStored,
) -> Result<(), DecodeError> {
    match field {
        Field::BlockHashes => s.block_hashes = read_hashes(r, head)?,
        Field::Parent => {
            s.parent_block_hash = match head {
                Item::Nil => None,
                h => Some(hash_value(h, "parent_block_hash")?),
            }
        }
        Field::TokenIds => s.token_ids = read_tokens(r, head)?,
        Field::BlockSize => {
            s.block_size = match head {
                Item::Uint(u) => u32::try_from(u).map_err(|_| DecodeError::Range("block_size"))?,
                Item::Nil => 0,
                other => {
                    return Err(DecodeError::Type {
                        field: "block_size",
                        found: other.kind(),
                    })
                }
            }
        }
        Field::LoraId => s.lora_id = int_head(head, "lora_id")?,
        Field::Medium => {
            s.medium = opt_str(head, "medium")?
                .map(|m| Medium::parse(&m))
                .unwrap_or_default()
        }
        // SGLang's `BlockStoredWithMetadata` puts a metadata map where vLLM has `lora_name`.
        Field::LoraName if matches!(head, Item::Map(_)) => read_metadata(r, head, s)?,
        Field::LoraName => s.lora_name = opt_str(head, "lora_name")?,
        Field::ExtraKeys => s.extra_keys = read_extra_keys(r, head)?,
        Field::GroupIdx => s.group_idx = int_head(head, "group_idx")?,
        Field::SpecKind => s.kv_cache_spec_kind = opt_str(head, "kv_cache_spec_kind")?,
        Field::SlidingWindow => {
            s.kv_cache_spec_sliding_window = int_head(head, "kv_cache_spec_sliding_window")?
        }
        Field::Locality => s.locality = opt_str(head, "locality")?,
        Field::Ownership => s.ownership = opt_str(head, "ownership")?,
        Field::CacheSalt => s.cache_salt = opt_str(head, "cache_salt")?,
        Field::Ignore => r.skip_rest(head)?,
    }
    Ok(())
}

fn read_metadata<'a>(
    r: &mut Reader<'a>,
    head: Item<'a>,
    s: &mut BlockStored,
) -> Result<(), DecodeError> {
    let Item::Map(n) = head else {
        return r.skip_rest(head);
    };
    for _ in 0..n {
        match r.next()? {
            Item::Str(b"cache_salt") => s.cache_salt = opt_str(r.next()?, "cache_salt")?,
            Item::Str(b"lora_name") => s.lora_name = opt_str(r.next()?, "lora_name")?,
            key => {
                r.skip_rest(key)?;
                r.skip()?;
            }
        }
    }
    Ok(())
}

fn hash_value(item: Item<'_>, field: &'static str) -> Result<u64, DecodeError> {
    match item {
        Item::Uint(u) => Ok(u),
        // Signed hashes (old vLLM, SGLang) keep their bits.
        Item::Neg(i) => Ok(i as u64),
        Item::Bin(b) | Item::Str(b) => Ok(digest_to_u64(b)),
        other => Err(DecodeError::Type {
            field,
            found: other.kind(),
        }),
    }
}

fn read_hashes<'a>(r: &mut Reader<'a>, head: Item<'a>) -> Result<Vec<u64>, DecodeError> {
    let n = match head {
        Item::Array(n) => n,
        Item::Nil => return Ok(Vec::new()),
        other => {
            return Err(DecodeError::Type {
                field: "block_hashes",
                found: other.kind(),
            })
        }
    };
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(hash_value(r.next()?, "block_hashes")?);
    }
    Ok(out)
}

fn read_tokens<'a>(r: &mut Reader<'a>, head: Item<'a>) -> Result<Vec<u32>, DecodeError> {
    let n = match head {
        Item::Array(n) => n,
        Item::Nil => return Ok(Vec::new()),
        other => {
            return Err(DecodeError::Type {
                field: "token_ids",
                found: other.kind(),
            })
        }
    };
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = match r.next()? {
            Item::Uint(u) => u,
            // SGLang's Eagle bigram mode sends `[t, t+1]` pairs: keep the token itself.
            Item::Array(k) if k >= 1 => {
                let first = match r.next()? {
                    Item::Uint(u) => u,
                    other => {
                        return Err(DecodeError::Type {
                            field: "token_ids",
                            found: other.kind(),
                        })
                    }
                };
                for _ in 1..k {
                    r.skip()?;
                }
                first
            }
            other => {
                return Err(DecodeError::Type {
                    field: "token_ids",
                    found: other.kind(),
                })
            }
        };
        out.push(u32::try_from(t).map_err(|_| DecodeError::Range("token_ids"))?);
    }
    Ok(out)
}

type ExtraKeys = Option<Vec<Option<Vec<ExtraKey>>>>;

fn read_extra_keys<'a>(r: &mut Reader<'a>, head: Item<'a>) -> Result<ExtraKeys, DecodeError> {
    let n = match head {
        Item::Nil => return Ok(None),
        Item::Array(n) => n,
        other => {
            return Err(DecodeError::Type {
                field: "extra_keys",
                found: other.kind(),
            })
        }
    };
    let mut out = Vec::with_capacity(n.min(1024));
    for _ in 0..n {
        let per_block = match r.next()? {
            Item::Nil => None,
            Item::Array(m) => {
                let mut keys = Vec::with_capacity(m.min(64));
                for _ in 0..m {
                    let h = r.next()?;
                    keys.push(read_extra_key(r, h, 1)?);
                }
                Some(keys)
            }
            scalar => Some(vec![read_extra_key(r, scalar, 1)?]),
        };
        out.push(per_block);
    }
    Ok(Some(out))
}

fn read_extra_key<'a>(
    r: &mut Reader<'a>,
    head: Item<'a>,
    depth: usize,
) -> Result<ExtraKey, DecodeError> {
    Ok(match head {
        Item::Nil => ExtraKey::Nil,
        Item::Bool(b) => ExtraKey::Bool(b),
        Item::Uint(u) => ExtraKey::Uint(u),
        Item::Neg(i) => ExtraKey::Int(i),
        Item::Float(f) => ExtraKey::Float(f),
        Item::Str(s) => ExtraKey::Str(String::from_utf8_lossy(s).into_owned()),
        Item::Bin(b) => ExtraKey::Bytes(b.to_vec()),
        Item::Array(m) => {
            if depth >= MAX_EXTRA_DEPTH {
                return Err(DecodeError::TooDeep);
            }
            let mut items = Vec::with_capacity(m.min(64));
            for _ in 0..m {
                let h = r.next()?;
                items.push(read_extra_key(r, h, depth + 1)?);
            }
            ExtraKey::List(items)
        }
        Item::Map(_) | Item::Ext => {
            r.skip_rest(head)?;
            ExtraKey::Other
        }
    })
}

fn opt_str(item: Item<'_>, field: &'static str) -> Result<Option<String>, DecodeError> {
    match item {
        Item::Nil => Ok(None),
        Item::Str(s) => Ok(Some(String::from_utf8_lossy(s).into_owned())),
        other => Err(DecodeError::Type {
            field,
            found: other.kind(),
        }),
    }
}

fn int_head(item: Item<'_>, field: &'static str) -> Result<Option<i64>, DecodeError> {
    match item {
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
