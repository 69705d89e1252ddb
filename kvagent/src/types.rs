//! Small shared types: transfer ids, region ids and the block layout of a registered region.
//!
//! A region holds `layers * blocks` segments of `block_bytes` each, layer-major: segment
//! `(layer, block)` starts at `(layer * blocks + block) * block_bytes`. This matches an engine that
//! keeps one KV tensor per layer; "block b" of a request means its segment in every layer.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Longest transfer id accepted (bytes).
pub const MAX_TRANSFER_ID: usize = 256;
/// Largest block (bytes) a region may declare.
pub const MAX_BLOCK_BYTES: u64 = 64 << 20;
/// Most layers a region may declare.
pub const MAX_LAYERS: u32 = 4096;
/// Most blocks a region may declare.
pub const MAX_BLOCKS: u32 = 1 << 22;

/// The id both ends of a transfer use for one request's KV (the proxy hands it to both engines).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct TransferId(String);

impl TransferId {
    /// Validate an id: 1 to 256 bytes of printable ASCII.
    pub fn new(id: impl Into<String>) -> Result<Self> {
        let id = id.into();
        if id.is_empty() || id.len() > MAX_TRANSFER_ID {
            return Err(Error::BadRequest(format!(
                "transfer id must be 1..={MAX_TRANSFER_ID} bytes, got {}",
                id.len()
            )));
        }
        if !id.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Error::BadRequest(
                "transfer id must be printable ASCII without spaces".into(),
            ));
        }
        Ok(Self(id))
    }

    /// A fresh random id (128 bits, hex), for a proxy that starts a P/D handoff.
    pub fn random() -> Self {
        Self(format!("kvx-{:032x}", rand::random::<u128>()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for TransferId {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        Self::new(s)
    }
}

impl From<TransferId> for String {
    fn from(t: TransferId) -> String {
        t.0
    }
}

impl std::fmt::Display for TransferId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Block layout of a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockLayout {
    /// Bytes of one block in one layer.
    pub block_bytes: u64,
    /// Number of layers.
    pub layers: u32,
    /// Number of blocks per layer.
    pub blocks: u32,
}

impl BlockLayout {
    /// Check the bounds and return the region size in bytes.
    pub fn validate(&self, max_region_bytes: u64) -> Result<usize> {
        if self.block_bytes == 0 || self.block_bytes > MAX_BLOCK_BYTES {
            return Err(Error::BadRequest(format!(
                "block_bytes must be 1..={MAX_BLOCK_BYTES}, got {}",
                self.block_bytes
            )));
        }
        if self.layers == 0 || self.layers > MAX_LAYERS {
            return Err(Error::BadRequest(format!(
                "layers must be 1..={MAX_LAYERS}"
            )));
        }
        if self.blocks == 0 || self.blocks > MAX_BLOCKS {
            return Err(Error::BadRequest(format!(
                "blocks must be 1..={MAX_BLOCKS}"
            )));
        }
        let total = self
            .block_bytes
            .checked_mul(u64::from(self.layers))
            .and_then(|v| v.checked_mul(u64::from(self.blocks)))
            .filter(|v| *v <= max_region_bytes)
            .ok_or_else(|| Error::Limit(format!("region larger than {max_region_bytes} bytes")))?;
        usize::try_from(total).map_err(|_| Error::Limit("region too large for this host".into()))
    }

    /// Byte offset of segment (`layer`, `block`).
    pub fn offset(&self, layer: u32, block: u32) -> usize {
        let idx = u64::from(layer) * u64::from(self.blocks) + u64::from(block);
        usize::try_from(idx * self.block_bytes).unwrap_or(usize::MAX)
    }

    /// Bytes a transfer of `n` blocks moves (all layers).
    pub fn transfer_bytes(&self, n: usize) -> u64 {
        self.block_bytes * u64::from(self.layers) * n as u64
    }

    /// Whether a block of `other` fits this layout's block exactly (same size and layer count).
    pub fn compatible(&self, other: &BlockLayout) -> bool {
        self.block_bytes == other.block_bytes && self.layers == other.layers
    }

    /// Bytes of one block in one layer, as usize.
    pub fn block_len(&self) -> usize {
        usize::try_from(self.block_bytes).unwrap_or(usize::MAX)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn layout_offsets_are_layer_major_and_bounded() {
        let l = BlockLayout {
            block_bytes: 16,
            layers: 2,
            blocks: 4,
        };
        assert_eq!(l.validate(1 << 20).unwrap(), 128);
        assert_eq!(l.offset(0, 3), 48);
        assert_eq!(l.offset(1, 0), 64);
        assert!(l.validate(100).is_err(), "over the region limit");
        let zero = BlockLayout {
            block_bytes: 0,
            layers: 1,
            blocks: 1,
        };
        assert!(zero.validate(1 << 20).is_err());
    }

    #[test]
    fn transfer_ids_are_validated() {
        assert!(TransferId::new("req-1").is_ok());
        assert!(TransferId::new("").is_err());
        assert!(TransferId::new("a b").is_err());
        assert!(TransferId::new("x".repeat(300)).is_err());
        assert_ne!(TransferId::random(), TransferId::random());
        let parsed: std::result::Result<TransferId, _> = serde_json::from_str("\"bad\\nid\"");
        assert!(parsed.is_err());
    }
}
