//! GPU regions through the local API without a GPU: `register_gpu` is answered with a clear
//! `cuda_unavailable` (or, on a GPU machine, a handle that is not a real export is refused by the
//! driver), malformed requests with `bad_request`, and the same connection keeps serving.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{region, InProc};
use kvmesh_kvagent::{BlockLayout, ErrorCode};
use serde_json::json;

const LAYOUT: BlockLayout = BlockLayout {
    block_bytes: 4096,
    layers: 2,
    blocks: 4,
};

#[test]
fn register_gpu_without_cuda_is_a_clear_error_and_the_agent_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let agent = InProc::start(dir.path(), "g", |_| {});
    let mut client = agent.client();
    let cuda = kvmesh_kvagent::cuda::available();
    let err = client
        .register_gpu("kv-gpu", LAYOUT, 0, &[0x5a; 64])
        .unwrap_err();
    if cuda.is_err() {
        assert_eq!(err.code(), ErrorCode::CudaUnavailable, "{err}");
        assert!(
            err.to_string().contains("cuda") || err.to_string().contains("CUDA"),
            "{err}"
        );
    } else {
        // A GPU machine: a made-up handle is not an export the driver can open.
        assert_eq!(err.code(), ErrorCode::CudaUnavailable, "{err}");
    }
    // Malformed: a short handle, a negative device, unknown fields.
    let mut bad = |req: serde_json::Value| {
        let serde_json::Value::Object(m) = req else {
            unreachable!()
        };
        client
            .call(m, None, Some(Duration::from_secs(5)))
            .unwrap_err()
    };
    let e = bad(json!({"op": "register_gpu", "name": "x", "layout": LAYOUT,
                       "device": 0, "ipc_handle": "abcd"}));
    assert_eq!(e.code(), ErrorCode::BadRequest, "{e}");
    let e = bad(json!({"op": "register_gpu", "name": "x", "layout": LAYOUT,
                       "device": -1, "ipc_handle": "00".repeat(64)}));
    assert_eq!(e.code(), ErrorCode::BadRequest, "{e}");
    let e = bad(json!({"op": "register_gpu", "name": "x", "layout": LAYOUT,
                       "device": 0, "ipc_handle": "00".repeat(64), "fd": 3}));
    assert_eq!(e.code(), ErrorCode::BadRequest, "{e}");
    // Nothing was registered, and the same connection still registers host memory.
    let status = client.status().unwrap();
    assert!(status.regions.is_empty(), "{status:?}");
    let (_map, id) = region(&mut client, "host", LAYOUT, 1);
    let status = client.status().unwrap();
    assert_eq!(status.regions.len(), 1);
    assert_eq!(status.regions[0].id, id);
}
