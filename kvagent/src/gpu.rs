//! GPU regions (registered with `register_gpu`, feature `cuda`): the engine's device buffer,
//! opened from its CUDA IPC handle, plus a host shadow of the same layout that the agent owns.
//!
//! Every path that moves bytes through host memory (TCP, same-node copy, RDMA through host
//! memory) works on the shadow: before a send the sent blocks are copied device → host
//! ([`GpuRegions::stage`]); when a transfer into a GPU region is taken with `wait`, the landed
//! blocks are copied host → device ([`GpuRegions::upload`]) before the reply, so the client finds
//! them in its own GPU memory. GPU-direct RDMA registers the device buffer itself (a dma-buf MR)
//! on the sending side; see `transfer.rs`.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::cuda::GpuRegion;
use crate::error::{Error, Result};
use crate::shm::Mapping;
use crate::types::BlockLayout;

/// GPU buffers by region id.
#[derive(Default)]
pub struct GpuRegions {
    by_region: Mutex<HashMap<u64, Arc<GpuRegion>>>,
}

impl GpuRegions {
    /// Remember region `id`'s device buffer.
    pub fn insert(&self, id: u64, gpu: Arc<GpuRegion>) {
        self.by_region.lock().insert(id, gpu);
    }

    /// Forget region `id` (unregistered); the buffer closes when its last user drops it.
    pub fn remove(&self, id: u64) {
        self.by_region.lock().remove(&id);
    }

    /// Region `id`'s device buffer, if it is a GPU region.
    pub fn get(&self, id: u64) -> Option<Arc<GpuRegion>> {
        self.by_region.lock().get(&id).cloned()
    }

    /// Copy `blocks` (every layer) device → host shadow, on the blocking pool.
    pub async fn stage(
        gpu: Arc<GpuRegion>,
        shadow: Arc<Mapping>,
        layout: BlockLayout,
        blocks: Vec<u32>,
    ) -> Result<()> {
        each_block(layout, blocks, move |off, buf| {
            gpu.copy_to_host(off, buf)?;
            shadow.write(off, buf)
        })
        .await
    }

    /// Copy `blocks` (every layer) host shadow → device, on the blocking pool.
    pub async fn upload(
        gpu: Arc<GpuRegion>,
        shadow: Arc<Mapping>,
        layout: BlockLayout,
        blocks: Vec<u32>,
    ) -> Result<()> {
        each_block(layout, blocks, move |off, buf| {
            shadow.read(off, buf)?;
            gpu.copy_from_host(off, buf)
        })
        .await
    }
}

/// Calls `copy(offset, buffer)` for every layer of every block, through one
/// block-sized buffer, on the blocking pool (CUDA copies block the thread).
async fn each_block(
    layout: BlockLayout,
    blocks: Vec<u32>,
    mut copy: impl FnMut(usize, &mut [u8]) -> Result<()> + Send + 'static,
) -> Result<()> {
    blocking(move || {
        let mut buf = vec![0u8; layout.block_len()];
        for layer in 0..layout.layers {
            for &b in &blocks {
                copy(layout.offset(layer, b), &mut buf)?;
            }
        }
        Ok(())
    })
    .await
}

async fn blocking(f: impl FnOnce() -> Result<()> + Send + 'static) -> Result<()> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Io(std::io::Error::other(e.to_string())))?
}
