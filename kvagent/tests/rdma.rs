//! RDMA between agents. Without a device (this build machine): an agent that cannot open one says
//! so and stays on TCP; two agents with RDMA on still move every byte (over TCP, reason given); an
//! RDMA offer to an agent without RDMA is answered "send it over TCP" on the same offer and the
//! bytes arrive intact; an `rdma_written` for a transfer accepted over TCP is refused and frees the
//! blocks. With a device (`scripts/kvagent-device-check`, `--features rdma`): the first test checks
//! the device is announced and the second that the transfer really went `rdma_host`, every byte
//! checked. `KVAGENT_RDMA_GID_INDEX` picks the GID (RoCE v2 usually needs 1 or 3).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{block_sum, region, InProc};
use kvmesh_kvagent::peer::proto::{self, Ctrl, DataHeader, Hello};
use kvmesh_kvagent::planner::{Caps, Path as XferPath};
use kvmesh_kvagent::rdma::wire::QpInfo;
use kvmesh_kvagent::rdma::{RdmaConfig, RdmaEngine};
use kvmesh_kvagent::{BlockLayout, ErrorCode, TransferId};

const D: Duration = Duration::from_secs(10);
const LAYOUT: BlockLayout = BlockLayout {
    block_bytes: 16 * 1024,
    layers: 2,
    blocks: 8,
};

fn scrape(admin: &str) -> String {
    let mut s = TcpStream::connect(admin).unwrap();
    s.set_read_timeout(Some(D)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn an_agent_without_an_rdma_device_says_why_and_announces_tcp_only() {
    let opened = RdmaEngine::open(&RdmaConfig::default());
    let dir = tempfile::tempdir().unwrap();
    let agent = InProc::start(dir.path(), "a", |c| c.rdma = rdma_config());
    let caps = agent.client().hello().unwrap().caps;
    let metrics = scrape(&agent.admin);
    match opened {
        Err(e) => {
            // This machine (and any build without the feature): a clear error, no panic.
            assert_eq!(e.code(), ErrorCode::RdmaUnavailable, "{e}");
            assert!(!caps.contains(&"rdma".to_string()), "{caps:?}");
            assert!(metrics.contains("kvagent_rdma_available 0"), "{metrics}");
        }
        Ok(engine) => {
            assert!(!engine.device().is_empty());
            assert!(caps.contains(&"rdma".to_string()), "{caps:?}");
            assert!(metrics.contains("kvagent_rdma_available 1"), "{metrics}");
        }
    }
    assert!(caps.contains(&"tcp".to_string()));
    // `--rdma off` never opens a device, whatever the machine has.
    let off = InProc::start(dir.path(), "off", |c| c.rdma.enabled = false);
    assert!(scrape(&off.admin).contains("kvagent_rdma_available 0"));
}

fn rdma_config() -> RdmaConfig {
    RdmaConfig {
        enabled: true,
        gid_index: std::env::var("KVAGENT_RDMA_GID_INDEX")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        ..RdmaConfig::default()
    }
}

#[test]
fn two_agents_with_rdma_on_move_every_byte_by_rdma_when_there_is_a_device_else_tcp() {
    let device = RdmaEngine::open(&rdma_config()).is_ok();
    let dir = tempfile::tempdir().unwrap();
    let a = InProc::start(dir.path(), "node-a", |c| c.rdma = rdma_config());
    let b = InProc::start(dir.path(), "node-b", |c| c.rdma = rdma_config());
    let (mut ca, mut cb) = (a.client(), b.client());
    let layout = BlockLayout {
        block_bytes: 96 * 1024,
        layers: 3,
        blocks: 16,
    };
    let (src, src_id) = region(&mut ca, "prefill", layout, 11);
    let (dst, dst_id) = region(&mut cb, "decode", layout, 12);
    let tid = TransferId::new("req-rdma-1").unwrap();
    // Blocks 4,5,6 are contiguous (one WRITE per layer when they land contiguously); 0 and 15
    // are not.
    let sent = vec![4, 5, 6, 0, 15];
    let report = ca
        .send(
            &kvmesh_kvagent::SendArgs {
                region: src_id,
                transfer: tid.clone(),
                blocks: sent.clone(),
                peer: b.peer.clone(),
                dst_region: None,
            },
            D,
        )
        .unwrap();
    assert_eq!(report.bytes, layout.transfer_bytes(sent.len()));
    let got = cb.wait(None, &tid, D).unwrap();
    assert_eq!(got.region, dst_id);
    for (s, d) in sent.iter().zip(&got.blocks) {
        assert_eq!(
            block_sum(&src, &layout, *s),
            block_sum(&dst, &layout, *d),
            "block {s} -> {d} differs"
        );
    }
    let received = scrape(&b.admin);
    if device {
        assert_eq!(report.path, XferPath::RdmaHost, "{report:?}");
        assert!(
            received.contains(r#"kvagent_transfers_total{path="rdma_host"} 1"#),
            "{received}"
        );
        assert!(!scrape(&a.admin).contains("kvagent_rdma_fallbacks_total{"));
    } else {
        assert_eq!(report.path, XferPath::Tcp, "{report:?}");
        assert!(report.reason.contains("no RDMA"), "{report:?}");
        assert!(
            received.contains(r#"kvagent_transfers_total{path="tcp"} 1"#),
            "{received}"
        );
    }
}

fn connect(addr: &str, kind: u8, session: u64) -> (TcpStream, Hello) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(D)).unwrap();
    let hello = Hello {
        version: proto::VERSION,
        kind,
        caps: Caps::TCP | Caps::RDMA,
        session,
    };
    s.write_all(&hello.encode()).unwrap();
    let mut buf = [0u8; proto::HELLO_LEN];
    s.read_exact(&mut buf).unwrap();
    let reply = Hello::decode(&buf).unwrap();
    assert_eq!(reply.kind, proto::ST_OK);
    (s, reply)
}

fn send_ctrl(s: &mut TcpStream, msg: &Ctrl) {
    let body = serde_json::to_vec(msg).unwrap();
    s.write_all(&(body.len() as u32).to_be_bytes()).unwrap();
    s.write_all(&body).unwrap();
}

fn read_ctrl(s: &mut TcpStream) -> Ctrl {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    serde_json::from_slice(&body).unwrap()
}

fn offer(seq: u64, tid: &str, blocks: u32) -> Ctrl {
    Ctrl::Offer {
        seq,
        transfer: TransferId::new(tid).unwrap(),
        dst_region: None,
        block_bytes: LAYOUT.block_bytes,
        layers: LAYOUT.layers,
        blocks,
        deadline_ms: 10_000,
        rdma: Some(QpInfo {
            qpn: 0x42,
            psn: 0x100,
            lid: 7,
            gid: "fe80::2".parse().unwrap(),
            mtu: 4096,
        }),
    }
}

#[test]
fn an_rdma_offer_to_an_agent_without_rdma_is_answered_for_tcp_and_arrives_intact() {
    let dir = tempfile::tempdir().unwrap();
    let recv = InProc::start(dir.path(), "recv", |c| c.rdma.enabled = false);
    let mut client = recv.client();
    let (dst_map, dst) = region(&mut client, "dst", LAYOUT, 0);
    // The pattern a sender would have: another region's bytes, kept here in memory.
    let src_layout = BlockLayout {
        blocks: 3,
        ..LAYOUT
    };
    let src_map = kvmesh_kvagent::shm::Mapping::create("src", 3 * 2 * 16 * 1024).unwrap();
    let pattern: Vec<u8> = (0..src_map.len()).map(|i| (i * 7 % 251) as u8).collect();
    src_map.write(0, &pattern).unwrap();

    let (mut ctrl, reply) = connect(&recv.peer, proto::KIND_CONTROL, 0);
    assert!(
        !Caps(reply.caps).has(Caps::RDMA),
        "an agent with RDMA off must not announce it"
    );
    send_ctrl(&mut ctrl, &offer(1, "rdma-declined", 3));
    assert_eq!(
        read_ctrl(&mut ctrl),
        Ctrl::Accept { seq: 1, rdma: None },
        "no RDMA target: the sender must use TCP on this offer"
    );
    let (mut data, _) = connect(&recv.peer, proto::KIND_DATA, reply.session);
    let seg = LAYOUT.block_bytes as usize;
    for layer in 0..2u32 {
        for block in 0..3u32 {
            let h = DataHeader {
                seq: 1,
                block,
                layer,
                offset: 0,
                len: seg as u32,
            };
            data.write_all(&h.encode()).unwrap();
            let off = src_layout.offset(layer, block);
            data.write_all(&pattern[off..off + seg]).unwrap();
        }
    }
    assert_eq!(read_ctrl(&mut ctrl), Ctrl::Done { seq: 1 });
    let arrived = client
        .wait(Some(dst), &TransferId::new("rdma-declined").unwrap(), D)
        .unwrap();
    for (i, b) in arrived.blocks.iter().enumerate() {
        assert_eq!(
            block_sum(&src_map, &src_layout, i as u32),
            block_sum(&dst_map, &LAYOUT, *b),
            "block {i} differs"
        );
    }
    client
        .free(dst, &TransferId::new("rdma-declined").unwrap())
        .unwrap();

    // Claiming RDMA completion for a transfer accepted over TCP is a protocol error that frees
    // the landing blocks at once.
    send_ctrl(&mut ctrl, &offer(2, "bogus-written", 2));
    assert_eq!(read_ctrl(&mut ctrl), Ctrl::Accept { seq: 2, rdma: None });
    send_ctrl(&mut ctrl, &Ctrl::RdmaWritten { seq: 2 });
    match read_ctrl(&mut ctrl) {
        Ctrl::Failed { seq: 2, code, .. } => assert_eq!(code, ErrorCode::Protocol),
        other => panic!("want failed, got {other:?}"),
    }
    let status = client.status().unwrap();
    assert_eq!(status.regions[0].free_blocks, LAYOUT.blocks, "{status:?}");
}
