//! Test helpers: in-process agents on their own runtime, child agent processes, patterned
//! regions and checksums.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvmesh_kvagent::agent::AgentHandle;
use kvmesh_kvagent::shm::Mapping;
use kvmesh_kvagent::{
    bind_local, Agent, AgentConfig, BlockLayout, Listeners, LocalClient, SocketConfig,
};

pub const EXE: &str = env!("CARGO_BIN_EXE_kvmesh-kvagent");

/// An agent running in this process on its own runtime; shut down on drop.
pub struct InProc {
    rt: tokio::runtime::Runtime,
    handle: Option<AgentHandle>,
    pub socket: PathBuf,
    pub peer: String,
    pub admin: String,
}

impl InProc {
    pub fn start(dir: &Path, name: &str, tweak: impl FnOnce(&mut AgentConfig)) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let socket = dir.join(format!("{name}.sock"));
        let mut cfg = AgentConfig {
            agent_id: name.into(),
            ..AgentConfig::default()
        };
        // TCP unless a test opts into RDMA, so the suite means the same on a machine with a
        // device (the RDMA tests set `rdma.enabled` themselves).
        cfg.rdma.enabled = false;
        tweak(&mut cfg);
        let handle = rt.block_on(async {
            let local = bind_local(&SocketConfig {
                path: socket.clone(),
                group: None,
            })
            .unwrap();
            let peer = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            Agent::start(
                cfg,
                Listeners {
                    local,
                    peer,
                    admin: Some(admin),
                },
            )
            .unwrap()
        });
        let peer = handle.peer_addr.to_string();
        let admin = handle.admin_addr.unwrap().to_string();
        Self {
            rt,
            handle: Some(handle),
            socket,
            peer,
            admin,
        }
    }

    pub fn client(&self) -> LocalClient {
        LocalClient::connect(&self.socket, Duration::from_secs(10)).unwrap()
    }
}

impl Drop for InProc {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            self.rt.block_on(h.shutdown());
        }
    }
}

/// A memfd region registered with `client`, filled with a pattern from `seed`.
pub fn region(
    client: &mut LocalClient,
    name: &str,
    layout: BlockLayout,
    seed: u64,
) -> (Mapping, u64) {
    let len = layout.validate(u64::MAX).unwrap();
    let map = Mapping::create(name, len).unwrap();
    let mut bytes = vec![0u8; len];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for b in bytes.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    map.write(0, &bytes).unwrap();
    let id = client.register(name, layout, map.fd()).unwrap();
    (map, id)
}

/// FNV-1a of one block across all layers.
pub fn block_sum(map: &Mapping, layout: &BlockLayout, block: u32) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut buf = vec![0u8; layout.block_len()];
    for layer in 0..layout.layers {
        map.read(layout.offset(layer, block), &mut buf).unwrap();
        for b in &buf {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

/// Assert that `dst` blocks hold exactly `src` blocks' bytes.
pub fn assert_same(
    src: &Mapping,
    sl: &BlockLayout,
    sb: &[u32],
    dst: &Mapping,
    dl: &BlockLayout,
    db: &[u32],
) {
    assert_eq!(sb.len(), db.len());
    for (s, d) in sb.iter().zip(db) {
        assert_eq!(
            block_sum(src, sl, *s),
            block_sum(dst, dl, *d),
            "block {s} -> {d} differs"
        );
    }
}

/// Poll `f` until it is true, at most `limit` (a readiness wait, not a sleep-for-readiness).
pub fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + limit;
    while Instant::now() < until {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    f()
}
