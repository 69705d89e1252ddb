//! Faults: a peer killed mid-transfer (either side), a transfer that times out, a receiver
//! without room, garbage from a local client, version mismatches.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{eventually, region, InProc, EXE};
use kvmesh_kvagent::bench::ChildAgent;
use kvmesh_kvagent::peer::link::handshake;
use kvmesh_kvagent::peer::proto::{self, Hello};
use kvmesh_kvagent::planner::Caps;
use kvmesh_kvagent::{BlockLayout, Error, ErrorCode, LocalClient, SendArgs, TransferId};

const D: Duration = Duration::from_secs(10);
const LAYOUT: BlockLayout = BlockLayout {
    block_bytes: 64 * 1024,
    layers: 2,
    blocks: 32,
};

fn args(region: u64, tid: &TransferId, n: u32, peer: &str) -> SendArgs {
    SendArgs {
        region,
        transfer: tid.clone(),
        blocks: (0..n).collect(),
        peer: peer.into(),
        dst_region: None,
    }
}

#[test]
fn sender_killed_mid_transfer_frees_the_receivers_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let recv = InProc::start(dir.path(), "recv", |_| {});
    let mut sender = ChildAgent::spawn(
        Path::new(EXE),
        dir.path(),
        "sender",
        &["--fault-stall-after-bytes", "65536"],
    )
    .unwrap();
    let mut cs = LocalClient::connect(&sender.socket, D).unwrap();
    let mut cr = recv.client();
    let (_src, src_id) = region(&mut cs, "p", LAYOUT, 1);
    let (_dst, _dst_id) = region(&mut cr, "d", LAYOUT, 2);
    let tid = TransferId::new("req-killed").unwrap();
    let (a, peer) = (args(src_id, &tid, 16, &recv.peer), recv.peer.clone());
    let sending = std::thread::spawn(move || cs.send(&a, D));
    assert!(
        eventually(D, || cr.status().unwrap().incoming == 1),
        "transfer never started"
    );
    assert!(
        cr.status().unwrap().regions[0].free_blocks < 32,
        "blocks are held mid-transfer"
    );
    sender.kill();
    let err = cr.wait(None, &tid, D).unwrap_err();
    assert_eq!(err.code(), ErrorCode::PeerLost, "{err}");
    let st = cr.status().unwrap();
    assert_eq!(
        (st.incoming, st.leases, st.regions[0].free_blocks),
        (0, 0, 32),
        "nothing stranded"
    );
    assert!(
        sending.join().unwrap().is_err(),
        "the killed side's client saw its agent die ({peer})"
    );
}

#[test]
fn receiver_killed_mid_transfer_fails_the_send() {
    let dir = tempfile::tempdir().unwrap();
    let send = InProc::start(dir.path(), "send", |c| {
        c.faults.stall_data_after_bytes = Some(65536)
    });
    let mut recv =
        ChildAgent::spawn(Path::new(EXE), dir.path(), "recv", &["--rdma", "off"]).unwrap();
    let mut cs = send.client();
    let mut cr = LocalClient::connect(&recv.socket, D).unwrap();
    let (_src, src_id) = region(&mut cs, "p", LAYOUT, 1);
    let (_dst, _) = region(&mut cr, "d", LAYOUT, 2);
    let tid = TransferId::new("req-recv-killed").unwrap();
    let a = args(src_id, &tid, 16, &recv.peer);
    let sending = std::thread::spawn(move || {
        let t = Instant::now();
        (cs.send(&a, D), t.elapsed())
    });
    assert!(
        eventually(D, || cr.status().unwrap().incoming == 1),
        "transfer never started"
    );
    recv.kill();
    let (res, took) = sending.join().unwrap();
    let err = res.unwrap_err();
    assert_eq!(err.code(), ErrorCode::PeerLost, "{err}");
    assert!(
        took < D,
        "the sender learnt of the loss before its deadline ({took:?})"
    );
    let metrics = common_http(&send.admin);
    assert!(
        metrics.contains("kvagent_failures_total{cause=\"peer_lost\",side=\"send\"} 1"),
        "{metrics}"
    );
}

#[test]
fn a_transfer_that_times_out_is_freed_on_both_sides() {
    let dir = tempfile::tempdir().unwrap();
    let send = InProc::start(dir.path(), "send", |c| {
        c.faults.stall_data_after_bytes = Some(65536)
    });
    let recv = InProc::start(dir.path(), "recv", |_| {});
    let mut cs = send.client();
    let mut cr = recv.client();
    let (_src, src_id) = region(&mut cs, "p", LAYOUT, 1);
    let (_dst, _) = region(&mut cr, "d", LAYOUT, 2);
    let tid = TransferId::new("req-slow").unwrap();
    let t = Instant::now();
    let err = cs
        .send(
            &args(src_id, &tid, 16, &recv.peer),
            Duration::from_millis(400),
        )
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Timeout, "{err}");
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "the deadline held ({:?})",
        t.elapsed()
    );
    assert!(eventually(D, || {
        let st = cr.status().unwrap();
        st.incoming == 0 && st.leases == 0 && st.regions[0].free_blocks == 32
    }));
    let err = cr.wait(None, &tid, D).unwrap_err();
    assert!(
        matches!(err.code(), ErrorCode::Aborted | ErrorCode::Timeout),
        "{err}"
    );
    // A wait for a transfer that never comes ends at its own deadline.
    let mut c2 = recv.client();
    let err = c2
        .wait(
            None,
            &TransferId::new("never").unwrap(),
            Duration::from_millis(100),
        )
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Timeout);
}

#[test]
fn a_receiver_without_room_answers_no_room_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let send = InProc::start(dir.path(), "send", |_| {});
    let recv = InProc::start(dir.path(), "recv", |_| {});
    let mut cs = send.client();
    let mut cr = recv.client();
    let (_src, src_id) = region(&mut cs, "p", LAYOUT, 1);
    let small = BlockLayout {
        blocks: 4,
        ..LAYOUT
    };
    let (_dst, dst_id) = region(&mut cr, "d", small, 2);
    let hog = TransferId::new("hog").unwrap();
    cr.reserve(dst_id, &hog, 3).unwrap();
    let t = Instant::now();
    let err = cs
        .send(
            &args(src_id, &TransferId::new("big").unwrap(), 2, &recv.peer),
            D,
        )
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::NoRoom, "{err}");
    assert!(err.to_string().contains("2 blocks wanted, 1 free"), "{err}");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "no hang: {:?}",
        t.elapsed()
    );
    cr.free(dst_id, &hog).unwrap();
    cs.send(
        &args(src_id, &TransferId::new("fits").unwrap(), 2, &recv.peer),
        D,
    )
    .unwrap();
    let other = BlockLayout {
        block_bytes: 1000,
        ..LAYOUT
    };
    let (_m, odd) = region(&mut cs, "odd", other, 3);
    let err = cs
        .send(
            &args(odd, &TransferId::new("odd").unwrap(), 1, &recv.peer),
            D,
        )
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::LayoutMismatch, "{err}");
}

fn raw_call(s: &mut UnixStream, body: &[u8]) -> serde_json::Value {
    s.write_all(&(body.len() as u32).to_be_bytes()).unwrap();
    s.write_all(body).unwrap();
    read_frame(s).unwrap()
}

fn read_frame(s: &mut UnixStream) -> Option<serde_json::Value> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut buf = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut buf).ok()?;
    serde_json::from_slice(&buf).ok()
}

#[test]
fn garbage_from_a_client_gets_a_clear_error_and_others_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let agent = InProc::start(dir.path(), "solo", |_| {});
    let mut good = agent.client();
    let mut bad = UnixStream::connect(&agent.socket).unwrap();
    bad.set_read_timeout(Some(D)).unwrap();
    let r = raw_call(&mut bad, b"\x00\xffnot json at all");
    assert_eq!(
        (r["ok"].as_bool(), r["error"]["code"].as_str()),
        (Some(false), Some("bad_request")),
        "{r}"
    );
    let r = raw_call(&mut bad, br#"{"v":9,"id":4,"op":"status"}"#);
    assert_eq!(r["error"]["code"], "unsupported_version", "{r}");
    assert_eq!(r["id"], 4);
    let r = raw_call(&mut bad, br#"{"v":1,"id":5,"op":"register","name":"x","layout":{"block_bytes":8,"layers":1,"blocks":1}}"#);
    assert!(
        r["error"]["message"].as_str().unwrap().contains("memfd"),
        "register without an fd: {r}"
    );
    let r = raw_call(&mut bad, br#"{"v":1,"id":6,"op":"status"}"#);
    assert_eq!(r["ok"], true, "the connection survives bad messages: {r}");
    // A frame length over the limit breaks the framing: error, then close.
    bad.write_all(&u32::MAX.to_be_bytes()).unwrap();
    let r = read_frame(&mut bad).unwrap();
    assert_eq!(r["error"]["code"], "bad_request", "{r}");
    assert!(
        read_frame(&mut bad).is_none(),
        "connection closed after broken framing"
    );
    assert_eq!(
        good.status().unwrap().agent_id,
        "solo",
        "other clients are served"
    );
    assert_eq!(good.hello().unwrap().version, 1);
}

#[test]
fn handshake_version_mismatch_is_a_clear_error_on_both_sides() {
    let dir = tempfile::tempdir().unwrap();
    let agent = InProc::start(dir.path(), "v1", |_| {});
    // A peer speaking version 7 is told our version and refused.
    let mut s = std::net::TcpStream::connect(&agent.peer).unwrap();
    s.set_read_timeout(Some(D)).unwrap();
    s.write_all(
        &Hello {
            version: 7,
            kind: proto::KIND_CONTROL,
            caps: 1,
            session: 0,
        }
        .encode(),
    )
    .unwrap();
    let mut buf = [0u8; proto::HELLO_LEN];
    s.read_exact(&mut buf).unwrap();
    let reply = Hello::decode(&buf).unwrap();
    assert_eq!(
        (reply.kind, reply.version),
        (proto::ST_VERSION, proto::VERSION)
    );
    // We, connecting to an agent that answers with version 2, get VersionMismatch.
    let fake = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = fake.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let (mut c, _) = fake.accept().unwrap();
        let mut hello = [0u8; proto::HELLO_LEN];
        c.read_exact(&mut hello).unwrap();
        c.write_all(
            &Hello {
                version: 2,
                kind: proto::ST_VERSION,
                caps: 1,
                session: 0,
            }
            .encode(),
        )
        .unwrap();
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let err = rt
        .block_on(handshake(&addr, proto::KIND_CONTROL, Caps(Caps::TCP), 0, D))
        .unwrap_err();
    server.join().unwrap();
    assert!(
        matches!(err, Error::VersionMismatch { ours: 1, theirs: 2 }),
        "{err}"
    );
    assert!(err.to_string().contains("version 2"), "{err}");
}

fn common_http(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(D)).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}
