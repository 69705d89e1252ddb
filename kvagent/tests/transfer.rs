//! Moving blocks: between two agent processes over TCP, on one node by copy, concurrently; every
//! byte checked.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use common::{assert_same, eventually, region, InProc, EXE};
use kvmesh_kvagent::bench::ChildAgent;
use kvmesh_kvagent::planner::Path as XferPath;
use kvmesh_kvagent::{BlockLayout, LocalClient, SendArgs, TransferId};

const D: Duration = Duration::from_secs(10);

#[test]
fn tcp_between_two_agent_processes_moves_every_byte() {
    let dir = tempfile::tempdir().unwrap();
    let a = ChildAgent::spawn(Path::new(EXE), dir.path(), "node-a", &["--rdma", "off"]).unwrap();
    let b = ChildAgent::spawn(Path::new(EXE), dir.path(), "node-b", &["--rdma", "off"]).unwrap();
    let mut ca = LocalClient::connect(&a.socket, D).unwrap();
    let mut cb = LocalClient::connect(&b.socket, D).unwrap();
    let layout = BlockLayout {
        block_bytes: 48 * 1024 + 8,
        layers: 3,
        blocks: 32,
    };
    let (src, src_id) = region(&mut ca, "prefill", layout, 1);
    let (dst, dst_id) = region(&mut cb, "decode", layout, 2);
    let tid = TransferId::new("req-tcp-1").unwrap();
    let sent = vec![5, 9, 0, 31, 17, 18, 2, 3, 11, 12];
    let report = ca
        .send(
            &SendArgs {
                region: src_id,
                transfer: tid.clone(),
                blocks: sent.clone(),
                peer: b.peer.clone(),
                dst_region: None,
            },
            D,
        )
        .unwrap();
    assert_eq!(report.path, XferPath::Tcp);
    assert_eq!(report.bytes, layout.transfer_bytes(sent.len()));
    let got = cb.wait(None, &tid, D).unwrap();
    assert_eq!(got.region, dst_id);
    assert_same(&src, &layout, &sent, &dst, &layout, &got.blocks);
    cb.free(dst_id, &tid).unwrap();
    let st = cb.status().unwrap();
    assert_eq!(
        (st.leases, st.regions[0].free_blocks),
        (0, 32),
        "freed blocks return"
    );
}

#[test]
fn same_node_copy_moves_every_byte_and_reservations_are_used() {
    let dir = tempfile::tempdir().unwrap();
    let agent = InProc::start(dir.path(), "solo", |_| {});
    let mut prefill = agent.client();
    let mut decode = agent.client();
    let layout = BlockLayout {
        block_bytes: 4096,
        layers: 4,
        blocks: 16,
    };
    let (src, src_id) = region(&mut prefill, "engine-p", layout, 3);
    let (dst, dst_id) = region(&mut decode, "engine-d", layout, 4);
    let tid = TransferId::new("req-local").unwrap();
    let landing = decode.reserve(dst_id, &tid, 3).unwrap();
    let args = SendArgs {
        region: src_id,
        transfer: tid.clone(),
        blocks: vec![7, 1, 15],
        peer: "local".into(),
        dst_region: Some("engine-d".into()),
    };
    let report = prefill.send(&args, D).unwrap();
    assert_eq!(report.path, XferPath::SameNode);
    let got = decode.wait(Some(dst_id), &tid, D).unwrap();
    assert_eq!(
        got.blocks, landing,
        "the blocks the decode side reserved are the ones filled"
    );
    assert_same(&src, &layout, &[7, 1, 15], &dst, &layout, &got.blocks);
    decode.free(dst_id, &tid).unwrap();
    let err = decode.free(dst_id, &tid).unwrap_err();
    assert_eq!(err.code(), kvmesh_kvagent::ErrorCode::UnknownTransfer);
}

#[test]
fn concurrent_transfers_all_arrive_intact_and_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let a = InProc::start(dir.path(), "a", |_| {});
    let b = InProc::start(dir.path(), "b", |c| c.data_streams = 3);
    let layout = BlockLayout {
        block_bytes: 20000,
        layers: 2,
        blocks: 64,
    };
    let mut ca = a.client();
    let mut cb = b.client();
    let (src, src_id) = region(&mut ca, "p", layout, 5);
    let (dst, dst_id) = region(&mut cb, "d", layout, 6);
    let threads: Vec<_> = (0..8u32)
        .map(|i| {
            let (sock, peer) = (a.socket.clone(), b.peer.clone());
            std::thread::spawn(move || {
                let mut c = LocalClient::connect(&sock, D).unwrap();
                let blocks: Vec<u32> = (0..6).map(|k| i * 6 + k).collect();
                let tid = TransferId::new(format!("req-c{i}")).unwrap();
                let args = SendArgs {
                    region: src_id,
                    transfer: tid.clone(),
                    blocks: blocks.clone(),
                    peer,
                    dst_region: None,
                };
                c.send(&args, D).unwrap();
                (tid, blocks)
            })
        })
        .collect();
    for t in threads {
        let (tid, blocks) = t.join().unwrap();
        let got = cb.wait(Some(dst_id), &tid, D).unwrap();
        assert_same(&src, &layout, &blocks, &dst, &layout, &got.blocks);
        cb.free(dst_id, &tid).unwrap();
    }
    assert_eq!(cb.status().unwrap().regions[0].free_blocks, 64);
    let metrics = http_get(&b.admin, "/metrics");
    assert!(
        metrics.contains("kvagent_transfers_total{path=\"tcp\"} 8"),
        "{metrics}"
    );
    let metrics = http_get(&a.admin, "/metrics");
    assert!(
        metrics.contains("kvagent_plans_total{path=\"tcp\",reason=\"no RDMA on this node\"} 8"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvagent_registered_memory_bytes "),
        "{metrics}"
    );
}

#[test]
fn regions_die_with_the_connection_that_registered_them() {
    let dir = tempfile::tempdir().unwrap();
    let agent = InProc::start(dir.path(), "solo", |_| {});
    let layout = BlockLayout {
        block_bytes: 1024,
        layers: 1,
        blocks: 4,
    };
    {
        let mut c = agent.client();
        let (_map, _id) = region(&mut c, "short-lived", layout, 1);
        assert_eq!(c.status().unwrap().regions.len(), 1);
    }
    let mut c = agent.client();
    assert!(
        eventually(D, || c.status().unwrap().regions.is_empty()),
        "region outlived its connection"
    );
}

pub fn http_get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(D)).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}
