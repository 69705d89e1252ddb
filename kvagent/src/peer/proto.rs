//! The agent-to-agent wire protocol (version 1).
//!
//! Every TCP connection opens with a 24-byte hello and a 24-byte reply (all integers big-endian):
//! `magic "KVAG" | version u16 | kind u8 (0 control, 1 data) | 0 u8 | caps u32 | session u64 | 0 u32`.
//! The reply has the same shape with `status` (0 ok, 1 version mismatch, 2 unknown session,
//! 3 bad hello, 4 limit) in the `kind` byte and the session the server assigned. A version
//! mismatch is answered with the server's version and closed, so both sides can say which
//! versions met.
//!
//! Control frames: `u32 length | JSON` ([`Ctrl`]), at most [`MAX_CTRL_FRAME`] bytes. Data frames on
//! data connections: a 24-byte [`DataHeader`] then `len` raw bytes of one segment (or part of it).

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{Error, ErrorCode, Result};
use crate::rdma::wire::{QpInfo, RdmaTarget};
use crate::types::TransferId;

/// Magic bytes of a hello.
pub const MAGIC: [u8; 4] = *b"KVAG";
/// Protocol version this build speaks.
pub const VERSION: u16 = 1;
/// Largest control frame.
pub const MAX_CTRL_FRAME: usize = 64 * 1024;
/// Size of a hello, a reply and a data header.
pub const HELLO_LEN: usize = 24;

/// Connection kinds.
pub const KIND_CONTROL: u8 = 0;
/// A data stream joining a control session.
pub const KIND_DATA: u8 = 1;

/// Reply status codes.
pub const ST_OK: u8 = 0;
/// The versions differ.
pub const ST_VERSION: u8 = 1;
/// A data stream named a session the server does not know.
pub const ST_SESSION: u8 = 2;
/// The hello was malformed.
pub const ST_BAD: u8 = 3;
/// The server is at its connection limit.
pub const ST_LIMIT: u8 = 4;

/// A hello or its reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version.
    pub version: u16,
    /// Kind (hello) or status (reply).
    pub kind: u8,
    /// Capability bits.
    pub caps: u32,
    /// Session id.
    pub session: u64,
}

impl Hello {
    /// Encode.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&self.version.to_be_bytes());
        b[6] = self.kind;
        b[8..12].copy_from_slice(&self.caps.to_be_bytes());
        b[12..20].copy_from_slice(&self.session.to_be_bytes());
        b
    }

    /// Decode; a wrong magic is a protocol error (something that is not an agent).
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self> {
        if b[0..4] != MAGIC {
            return Err(Error::Protocol(format!(
                "bad magic {:02x?} (not a kvagent)",
                &b[0..4]
            )));
        }
        Ok(Self {
            version: u16::from_be_bytes([b[4], b[5]]),
            kind: b[6],
            caps: u32::from_be_bytes([b[8], b[9], b[10], b[11]]),
            session: u64::from_be_bytes([b[12], b[13], b[14], b[15], b[16], b[17], b[18], b[19]]),
        })
    }
}

/// Control messages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case", deny_unknown_fields)]
pub enum Ctrl {
    /// Sender: I want to send `blocks` blocks of this layout for `transfer`.
    Offer {
        /// Sender-chosen sequence number within the session.
        seq: u64,
        /// Transfer id.
        transfer: TransferId,
        /// Destination region by name, if the sender knows it.
        dst_region: Option<String>,
        /// Bytes of one block in one layer.
        block_bytes: u64,
        /// Layers.
        layers: u32,
        /// Blocks.
        blocks: u32,
        /// How long the receiver holds the landing blocks for the data.
        deadline_ms: u64,
        /// The sender's RDMA queue pair, when both agents announced RDMA: the receiver may answer
        /// with an [`RdmaTarget`] instead of waiting for TCP data. Absent otherwise (the frame is
        /// then what agents without RDMA exchange).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rdma: Option<QpInfo>,
    },
    /// Receiver: blocks are reserved, send the data.
    Accept {
        /// Sequence.
        seq: u64,
        /// Where to RDMA-WRITE, when the offer carried a queue pair and the receiver connected
        /// its own; absent means "send the data over TCP".
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rdma: Option<Box<RdmaTarget>>,
    },
    /// Sender: every RDMA WRITE of this transfer completed (RC: the bytes are in the receiver's
    /// memory); the receiver marks the blocks arrived and answers `done`.
    RdmaWritten {
        /// Sequence.
        seq: u64,
    },
    /// Receiver: cannot take it (no room, layout mismatch...).
    Reject {
        /// Sequence.
        seq: u64,
        /// Why.
        code: ErrorCode,
        /// Details.
        message: String,
    },
    /// Receiver: every byte arrived.
    Done {
        /// Sequence.
        seq: u64,
    },
    /// Receiver: gave up (timeout, region gone).
    Failed {
        /// Sequence.
        seq: u64,
        /// Why.
        code: ErrorCode,
        /// Details.
        message: String,
    },
    /// Sender: gave up; free the blocks.
    Abort {
        /// Sequence.
        seq: u64,
        /// Why.
        reason: String,
    },
}

/// Header of a data frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    /// Transfer sequence in the session.
    pub seq: u64,
    /// Index of the block within the transfer.
    pub block: u32,
    /// Layer.
    pub layer: u32,
    /// Byte offset within the segment.
    pub offset: u32,
    /// Payload length.
    pub len: u32,
}

impl DataHeader {
    /// Encode.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..8].copy_from_slice(&self.seq.to_be_bytes());
        b[8..12].copy_from_slice(&self.block.to_be_bytes());
        b[12..16].copy_from_slice(&self.layer.to_be_bytes());
        b[16..20].copy_from_slice(&self.offset.to_be_bytes());
        b[20..24].copy_from_slice(&self.len.to_be_bytes());
        b
    }

    /// Decode.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Self {
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Self {
            seq: u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
            block: u32_at(8),
            layer: u32_at(12),
            offset: u32_at(16),
            len: u32_at(20),
        }
    }
}

/// Write one control frame.
pub async fn write_ctrl<W: AsyncWrite + Unpin>(w: &mut W, msg: &Ctrl) -> Result<()> {
    let body = serde_json::to_vec(msg).map_err(|e| Error::Protocol(e.to_string()))?;
    let len = u32::try_from(body.len()).map_err(|_| Error::Protocol("frame too large".into()))?;
    let mut frame = Vec::with_capacity(body.len() + 4);
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame).await?;
    Ok(())
}

/// Read one control frame into `buf` (reused); `Ok(None)` on a clean end of stream.
pub async fn read_ctrl<R: AsyncRead + Unpin>(r: &mut R, buf: &mut Vec<u8>) -> Result<Option<Ctrl>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_CTRL_FRAME {
        return Err(Error::Protocol(format!(
            "control frame of {len} bytes (max {MAX_CTRL_FRAME})"
        )));
    }
    buf.resize(len, 0);
    r.read_exact(buf).await?;
    serde_json::from_slice(buf)
        .map(Some)
        .map_err(|e| Error::Protocol(format!("bad control frame: {e}")))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn hello_and_header_round_trip() {
        let h = Hello {
            version: VERSION,
            kind: KIND_DATA,
            caps: 5,
            session: 77,
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode();
        bad[0] = b'X';
        assert!(Hello::decode(&bad).is_err());
        let d = DataHeader {
            seq: 9,
            block: 3,
            layer: 2,
            offset: 4096,
            len: 65536,
        };
        assert_eq!(DataHeader::decode(&d.encode()), d);
    }

    #[test]
    fn rdma_fields_are_absent_unless_used_and_round_trip_when_set() {
        let offer = Ctrl::Offer {
            seq: 1,
            transfer: TransferId::new("t").unwrap(),
            dst_region: None,
            block_bytes: 4096,
            layers: 2,
            blocks: 3,
            deadline_ms: 1000,
            rdma: None,
        };
        let text = serde_json::to_string(&offer).unwrap();
        assert!(!text.contains("rdma"), "{text}");
        // A frame from an agent that predates RDMA parses as "no RDMA".
        let old = r#"{"t":"accept","seq":5}"#;
        assert_eq!(
            serde_json::from_str::<Ctrl>(old).unwrap(),
            Ctrl::Accept { seq: 5, rdma: None }
        );
        let qp = QpInfo {
            qpn: 0x11,
            psn: 0x22,
            lid: 0,
            gid: "::ffff:10.0.0.7".parse().unwrap(),
            mtu: 4096,
        };
        let target = RdmaTarget {
            qp: qp.clone(),
            addr: 0x1000,
            rkey: 9,
            len: 4096 * 2 * 8,
            layout: crate::types::BlockLayout {
                block_bytes: 4096,
                layers: 2,
                blocks: 8,
            },
            blocks: vec![4, 5, 6],
        };
        for msg in [
            Ctrl::Offer {
                seq: 2,
                transfer: TransferId::new("t").unwrap(),
                dst_region: Some("d".into()),
                block_bytes: 4096,
                layers: 2,
                blocks: 3,
                deadline_ms: 1000,
                rdma: Some(qp),
            },
            Ctrl::Accept {
                seq: 2,
                rdma: Some(Box::new(target)),
            },
            Ctrl::RdmaWritten { seq: 2 },
        ] {
            let text = serde_json::to_string(&msg).unwrap();
            assert_eq!(serde_json::from_str::<Ctrl>(&text).unwrap(), msg, "{text}");
        }
        assert!(serde_json::to_string(&Ctrl::RdmaWritten { seq: 3 })
            .unwrap()
            .contains(r#""t":"rdma_written""#));
    }

    #[tokio::test]
    async fn control_frames_round_trip_and_bound() {
        let msg = Ctrl::Reject {
            seq: 4,
            code: ErrorCode::NoRoom,
            message: "full".into(),
        };
        let mut wire = Vec::new();
        write_ctrl(&mut wire, &msg).await.unwrap();
        let mut buf = Vec::new();
        let got = read_ctrl(&mut wire.as_slice(), &mut buf).await.unwrap();
        assert_eq!(got, Some(msg));
        let huge = (MAX_CTRL_FRAME as u32 + 1).to_be_bytes();
        assert!(read_ctrl(&mut huge.as_slice(), &mut buf).await.is_err());
        assert_eq!(
            read_ctrl(&mut [0u8; 0].as_slice(), &mut buf).await.unwrap(),
            None
        );
    }
}
