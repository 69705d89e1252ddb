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

/// With the `cuda` feature: on a GPU machine, a real device buffer exported by this process
/// (as an engine would) is registered with an agent process, sent to a host region on the same
/// node (staged device → host) and received back into GPU memory (uploaded on `wait`), every
/// byte checked on the device. Without a GPU: the driver check fails with `cuda_unavailable`.
#[cfg(feature = "cuda")]
#[test]
fn a_gpu_buffer_round_trips_through_an_agent_when_a_gpu_exists() {
    use std::path::Path;

    use cudarc::driver::{result, sys};
    use kvmesh_kvagent::bench::ChildAgent;
    use kvmesh_kvagent::{LocalClient, SendArgs, TransferId};

    if let Err(e) = kvmesh_kvagent::cuda::available() {
        assert_eq!(e.code(), ErrorCode::CudaUnavailable, "{e}");
        return;
    }
    let len = LAYOUT.validate(u64::MAX).unwrap();
    let pattern: Vec<u8> = (0..len).map(|i| (i * 13 % 251) as u8).collect();
    // The "engine": a device buffer and its IPC handle.
    result::init().unwrap();
    let dev = result::device::get(0).unwrap();
    let ctx = unsafe { result::primary_ctx::retain(dev) }.unwrap();
    unsafe { result::ctx::set_current(ctx) }.unwrap();
    let dptr = unsafe { result::malloc_sync(len) }.unwrap();
    unsafe { result::memcpy_htod_sync(dptr, &pattern) }.unwrap();
    let mut raw = sys::CUipcMemHandle_st { reserved: [0; 64] };
    unsafe { sys::cuIpcGetMemHandle(&mut raw, dptr) }
        .result()
        .unwrap();
    let handle: [u8; 64] = std::array::from_fn(|i| raw.reserved[i] as u8);

    let dir = tempfile::tempdir().unwrap();
    let agent = ChildAgent::spawn(
        Path::new(common::EXE),
        dir.path(),
        "gpu",
        &["--rdma", "off"],
    )
    .unwrap();
    let mut c = LocalClient::connect(&agent.socket, Duration::from_secs(30)).unwrap();
    let gpu_id = c.register_gpu("engine-gpu", LAYOUT, 0, &handle).unwrap();
    let (host, host_id) = region(&mut c, "host", LAYOUT, 9);
    // GPU -> host: blocks 1 and 3 land in the host region with the device's bytes.
    let out = TransferId::new("gpu-out").unwrap();
    let send = |c: &mut LocalClient, region, tid: &TransferId, blocks: Vec<u32>, dst: &str| {
        c.send(
            &SendArgs {
                region,
                transfer: tid.clone(),
                blocks,
                peer: "local".into(),
                dst_region: Some(dst.into()),
            },
            Duration::from_secs(30),
        )
        .unwrap()
    };
    send(&mut c, gpu_id, &out, vec![1, 3], "host");
    let got = c
        .wait(Some(host_id), &out, Duration::from_secs(30))
        .unwrap();
    let seg = LAYOUT.block_len();
    let mut buf = vec![0u8; seg];
    for layer in 0..LAYOUT.layers {
        for (s, d) in [1u32, 3].iter().zip(&got.blocks) {
            host.read(LAYOUT.offset(layer, *d), &mut buf).unwrap();
            let off = LAYOUT.offset(layer, *s);
            assert_eq!(buf, pattern[off..off + seg], "layer {layer} block {s}");
        }
    }
    c.free(host_id, &out).unwrap();
    // host -> GPU: the host region's block 0 lands in a GPU block, on the device after `wait`.
    let back = TransferId::new("gpu-in").unwrap();
    send(&mut c, host_id, &back, vec![0], "engine-gpu");
    let got = c
        .wait(Some(gpu_id), &back, Duration::from_secs(30))
        .unwrap();
    let mut want = vec![0u8; seg];
    let mut dev_bytes = vec![0u8; seg];
    for layer in 0..LAYOUT.layers {
        host.read(LAYOUT.offset(layer, 0), &mut want).unwrap();
        let off = LAYOUT.offset(layer, got.blocks[0]) as u64;
        unsafe { result::memcpy_dtoh_sync(&mut dev_bytes, dptr + off) }.unwrap();
        assert_eq!(dev_bytes, want, "layer {layer} on the device");
    }
    drop(c);
    drop(agent);
    unsafe { result::free_sync(dptr) }.unwrap();
}
