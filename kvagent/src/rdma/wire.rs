//! What two agents exchange over their TCP control connection to connect an RC queue pair and
//! let the sender RDMA-WRITE into the receiver's landing blocks.
//!
//! The sender's `offer` carries its [`QpInfo`]; the receiver's `accept` carries an [`RdmaTarget`]
//! (its own queue pair, the memory region's address and rkey, and where the landing blocks are),
//! or nothing when it cannot do RDMA for this transfer, in which case the data goes over TCP on the
//! same offer. Both are JSON inside the existing control frames and only sent to a peer that
//! announced [`Caps::RDMA`](crate::planner::Caps) in the handshake, so agents without RDMA never
//! see the fields. Values are checked on arrival: a peer is trusted, but a bad value must become
//! an error and a TCP fallback, never a wild write.

use std::net::Ipv6Addr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::types::BlockLayout;

/// Largest queue-pair number and packet sequence number (both 24-bit fields in verbs).
pub const MAX_24: u32 = 0x00ff_ffff;

/// One end of an RC queue pair, as the other end needs it for the RTR transition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QpInfo {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number this end sends with (24 bits).
    pub psn: u32,
    /// Port LID (InfiniBand; 0 on RoCE, where the GID routes).
    pub lid: u16,
    /// Port GID, as an IPv6 address (RoCE v2 GIDs are IPv6 or v4-mapped addresses).
    pub gid: Ipv6Addr,
    /// Active path MTU in bytes (256..=4096); the two ends use the smaller.
    pub mtu: u32,
}

impl QpInfo {
    /// Check the fields a peer sent.
    pub fn validate(&self) -> Result<()> {
        if self.qpn == 0 || self.qpn > MAX_24 {
            return Err(Error::Protocol(format!(
                "queue pair number {:#x} is not 24-bit",
                self.qpn
            )));
        }
        if self.psn > MAX_24 {
            return Err(Error::Protocol(format!(
                "PSN {:#x} is not 24-bit",
                self.psn
            )));
        }
        if !matches!(self.mtu, 256 | 512 | 1024 | 2048 | 4096) {
            return Err(Error::Protocol(format!(
                "path MTU {} is not a verbs MTU",
                self.mtu
            )));
        }
        if self.lid == 0 && self.gid.is_unspecified() {
            return Err(Error::Protocol(
                "neither a LID nor a GID to route to".into(),
            ));
        }
        Ok(())
    }
}

/// Where the sender may write: the receiver's queue pair and its landing blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RdmaTarget {
    /// The receiver's queue pair.
    pub qp: QpInfo,
    /// Virtual address of the start of the receiving region's memory region.
    pub addr: u64,
    /// Remote key of that memory region.
    pub rkey: u32,
    /// Bytes registered from `addr`.
    pub len: u64,
    /// The receiving region's layout (the landing offsets follow from it).
    pub layout: BlockLayout,
    /// Landing block ids, in transfer order.
    pub blocks: Vec<u32>,
}

impl RdmaTarget {
    /// Check the target against the offer it answers (`layout` is the sender's).
    pub fn validate(&self, layout: &BlockLayout, blocks: usize) -> Result<()> {
        self.qp.validate()?;
        if self.layout.block_bytes != layout.block_bytes || self.layout.layers != layout.layers {
            return Err(Error::Protocol(
                "RDMA target layout differs from the offer".into(),
            ));
        }
        if self.blocks.len() != blocks {
            return Err(Error::Protocol(format!(
                "RDMA target has {} landing blocks for {blocks} sent",
                self.blocks.len()
            )));
        }
        if let Some(b) = self.blocks.iter().find(|b| **b >= self.layout.blocks) {
            return Err(Error::Protocol(format!(
                "landing block {b} outside a region of {} blocks",
                self.layout.blocks
            )));
        }
        let region = region_bytes(&self.layout);
        if region.is_none_or(|r| r > self.len) {
            return Err(Error::Protocol(format!(
                "memory region of {} bytes smaller than its region ({region:?} bytes)",
                self.len
            )));
        }
        Ok(())
    }
}

/// Bytes of a region with `layout` (None on overflow).
pub fn region_bytes(layout: &BlockLayout) -> Option<u64> {
    layout
        .block_bytes
        .checked_mul(u64::from(layout.layers))?
        .checked_mul(u64::from(layout.blocks))
}

/// The MTU both ends can use.
pub fn common_mtu(a: u32, b: u32) -> u32 {
    a.min(b)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn qp() -> QpInfo {
        QpInfo {
            qpn: 0x1234,
            psn: 0xabcdef,
            lid: 0,
            gid: "fe80::1".parse().unwrap(),
            mtu: 4096,
        }
    }

    fn target() -> RdmaTarget {
        RdmaTarget {
            qp: qp(),
            addr: 0x7f00_0000_0000,
            rkey: 0x55,
            len: 4 * 2 * 1024,
            layout: BlockLayout {
                block_bytes: 1024,
                layers: 2,
                blocks: 4,
            },
            blocks: vec![3, 1],
        }
    }

    #[test]
    fn qp_info_is_json_with_a_textual_gid_and_checks_its_ranges() {
        let text = serde_json::to_string(&qp()).unwrap();
        assert!(text.contains(r#""gid":"fe80::1""#), "{text}");
        assert_eq!(serde_json::from_str::<QpInfo>(&text).unwrap(), qp());
        assert!(qp().validate().is_ok());
        let bad = |f: fn(&mut QpInfo)| {
            let mut q = qp();
            f(&mut q);
            q.validate().unwrap_err().to_string()
        };
        assert!(bad(|q| q.qpn = 1 << 24).contains("24-bit"));
        assert!(bad(|q| q.qpn = 0).contains("24-bit"));
        assert!(bad(|q| q.psn = 1 << 24).contains("PSN"));
        assert!(bad(|q| q.mtu = 1500).contains("MTU"));
        assert!(bad(|q| q.gid = Ipv6Addr::UNSPECIFIED).contains("route"));
        assert!(
            serde_json::from_str::<QpInfo>(r#"{"qpn":1,"psn":1,"lid":1,"gid":"x","mtu":256}"#)
                .is_err()
        );
        assert_eq!(common_mtu(4096, 1024), 1024);
    }

    #[test]
    fn a_target_must_fit_the_offer_and_its_region() {
        let layout = BlockLayout {
            block_bytes: 1024,
            layers: 2,
            blocks: 9,
        };
        let t = target();
        assert!(t.validate(&layout, 2).is_ok());
        assert!(t
            .validate(&layout, 3)
            .unwrap_err()
            .to_string()
            .contains("landing blocks"));
        let other = BlockLayout {
            block_bytes: 2048,
            ..layout
        };
        assert!(t
            .validate(&other, 2)
            .unwrap_err()
            .to_string()
            .contains("layout"));
        let mut out = target();
        out.blocks = vec![4, 0];
        assert!(out
            .validate(&layout, 2)
            .unwrap_err()
            .to_string()
            .contains("outside"));
        let mut short = target();
        short.len = 1024;
        assert!(short
            .validate(&layout, 2)
            .unwrap_err()
            .to_string()
            .contains("smaller"));
        let round: RdmaTarget = serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
        assert_eq!(round, t);
    }
}
