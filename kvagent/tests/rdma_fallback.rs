//! RDMA paths that run without hardware: an agent that cannot open a device says so and stays on
//! TCP; an RDMA offer to an agent without RDMA is answered "send it over TCP" on the same offer
//! and the bytes then arrive intact; an `rdma_written` for a transfer accepted over TCP is refused
//! and frees the blocks. (On a machine with a device, `scripts/kvagent-device-check` runs the
//! same suite with `--features rdma`, where the first test checks the device is announced.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{block_sum, region, InProc};
use kvmesh_kvagent::peer::proto::{self, Ctrl, DataHeader, Hello};
use kvmesh_kvagent::planner::Caps;
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
    let agent = InProc::start(dir.path(), "a", |_| {});
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
