//! Registered regions, their free blocks and the leases that hold blocks for a transfer.
//!
//! Invariant: every block of a region is either on its free list or in exactly one lease. A lease
//! ends (its blocks go back to the free list) on `free`, on abort, when its peer disconnects, when
//! its region is unregistered, or when it expires; the reaper calls [`Registry::expire`] so nothing
//! stays stranded. A lease whose blocks a socket read may still be writing into is `Draining`: its
//! blocks are returned only once the last writer is done, so no new transfer can receive into them.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use crate::error::{Error, ErrorCode, Result};
use crate::shm::Mapping;
use crate::types::{BlockLayout, TransferId};

/// Most recent failures remembered so that a waiter learns why its blocks will not arrive.
const FAILURE_MEMORY: usize = 4096;

/// One registered region.
#[derive(Debug)]
pub struct Region {
    /// Agent-assigned id.
    pub id: u64,
    /// Client-chosen name (e.g. the engine id), unique on the agent.
    pub name: String,
    /// Block layout.
    pub layout: BlockLayout,
    /// The mapping.
    pub map: Arc<Mapping>,
    /// Local connection that registered it; its disconnect unregisters the region.
    pub owner: u64,
}

/// What a lease's blocks are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    /// Reserved by a client (staging for a send, or a landing place for an expected transfer).
    Reserved,
    /// Receiving a transfer.
    Receiving,
    /// All bytes arrived; waiting for the client to take and free them.
    Arrived,
    /// Aborted while a socket read may still write into the blocks.
    Draining,
}

/// Blocks held for one transfer id in one region.
#[derive(Debug, Clone)]
pub struct Lease {
    /// Region holding the blocks.
    pub region: u64,
    /// Block ids, in transfer order.
    pub blocks: Vec<u32>,
    /// State.
    pub state: LeaseState,
    /// When the reaper frees it.
    pub expires: Instant,
}

struct Entry {
    region: Arc<Region>,
    free: Vec<u32>,
}

/// Bounds of the registry.
#[derive(Debug, Clone, Copy)]
pub struct RegistryLimits {
    /// Most regions.
    pub max_regions: usize,
    /// Most leases at once.
    pub max_leases: usize,
    /// Largest region in bytes.
    pub max_region_bytes: u64,
}

/// Regions and leases (kept under the agent's lock).
pub struct Registry {
    limits: RegistryLimits,
    next_id: u64,
    regions: HashMap<u64, Entry>,
    leases: HashMap<(u64, TransferId), Lease>,
    failures: VecDeque<(TransferId, ErrorCode, String)>,
}

impl Registry {
    /// An empty registry.
    pub fn new(limits: RegistryLimits) -> Self {
        Self {
            limits,
            next_id: 1,
            regions: HashMap::new(),
            leases: HashMap::new(),
            failures: VecDeque::new(),
        }
    }

    /// The limits.
    pub fn limits(&self) -> RegistryLimits {
        self.limits
    }

    /// Register a mapped region; names are unique.
    pub fn register(
        &mut self,
        name: String,
        layout: BlockLayout,
        map: Arc<Mapping>,
        owner: u64,
    ) -> Result<Arc<Region>> {
        if self.regions.len() >= self.limits.max_regions {
            return Err(Error::Limit(format!(
                "{} regions registered",
                self.regions.len()
            )));
        }
        if name.is_empty() || name.len() > 128 {
            return Err(Error::BadRequest(
                "region name must be 1..=128 bytes".into(),
            ));
        }
        if self.regions.values().any(|e| e.region.name == name) {
            return Err(Error::BadRequest(format!(
                "region name {name:?} already registered"
            )));
        }
        let id = self.next_id;
        self.next_id += 1;
        let region = Arc::new(Region {
            id,
            name,
            layout,
            map,
            owner,
        });
        // Pop from the end hands out low block ids first.
        let free = (0..layout.blocks).rev().collect();
        self.regions.insert(
            id,
            Entry {
                region: Arc::clone(&region),
                free,
            },
        );
        Ok(region)
    }

    /// Remove a region and every lease in it; returns the transfer ids whose leases were dropped.
    pub fn unregister(&mut self, id: u64) -> Result<Vec<TransferId>> {
        self.regions
            .remove(&id)
            .ok_or_else(|| Error::UnknownRegion(id.to_string()))?;
        let keys: Vec<_> = self
            .leases
            .keys()
            .filter(|(r, _)| *r == id)
            .cloned()
            .collect();
        for k in &keys {
            self.leases.remove(k);
        }
        Ok(keys.into_iter().map(|(_, t)| t).collect())
    }

    /// Ids of the regions a local connection registered.
    pub fn owned_by(&self, owner: u64) -> Vec<u64> {
        self.regions
            .values()
            .filter(|e| e.region.owner == owner)
            .map(|e| e.region.id)
            .collect()
    }

    /// Ids of every region.
    pub fn owned_by_any(&self) -> Vec<u64> {
        self.regions.keys().copied().collect()
    }

    /// A region by id.
    pub fn region(&self, id: u64) -> Result<Arc<Region>> {
        self.regions
            .get(&id)
            .map(|e| Arc::clone(&e.region))
            .ok_or_else(|| Error::UnknownRegion(id.to_string()))
    }

    /// A region by name.
    pub fn region_by_name(&self, name: &str) -> Result<Arc<Region>> {
        self.regions
            .values()
            .find(|e| e.region.name == name)
            .map(|e| Arc::clone(&e.region))
            .ok_or_else(|| Error::UnknownRegion(name.to_string()))
    }

    /// Free blocks in a region.
    pub fn free_blocks(&self, id: u64) -> u32 {
        self.regions.get(&id).map_or(0, |e| e.free.len() as u32)
    }

    /// Total registered bytes.
    pub fn registered_bytes(&self) -> u64 {
        self.regions
            .values()
            .map(|e| e.region.map.len() as u64)
            .sum()
    }

    /// Take `n` free blocks of region `id` into a new lease for `tid`.
    pub fn reserve(
        &mut self,
        id: u64,
        tid: &TransferId,
        n: u32,
        state: LeaseState,
        expires: Instant,
    ) -> Result<Vec<u32>> {
        if n == 0 {
            return Err(Error::BadRequest("a lease needs at least one block".into()));
        }
        if self.leases.len() >= self.limits.max_leases {
            return Err(Error::Limit(format!("{} leases held", self.leases.len())));
        }
        let key = (id, tid.clone());
        if self.leases.contains_key(&key) {
            return Err(Error::BadRequest(format!(
                "transfer {tid} already holds blocks in region {id}"
            )));
        }
        let entry = self
            .regions
            .get_mut(&id)
            .ok_or_else(|| Error::UnknownRegion(id.to_string()))?;
        let n_us = n as usize;
        if entry.free.len() < n_us {
            return Err(Error::NoRoom {
                region: entry.region.name.clone(),
                wanted: n,
                free: entry.free.len() as u32,
            });
        }
        let at = entry.free.len() - n_us;
        let mut blocks = entry.free.split_off(at);
        blocks.reverse();
        self.leases.insert(
            key,
            Lease {
                region: id,
                blocks: blocks.clone(),
                state,
                expires,
            },
        );
        Ok(blocks)
    }

    /// Find or make the landing lease for an incoming transfer of `n` blocks of layout `layout`.
    ///
    /// A lease the client reserved for `tid` is used first; otherwise blocks come from the named
    /// region, or from the first compatible region with room (never `exclude`, the source region).
    pub fn land(
        &mut self,
        tid: &TransferId,
        layout: &BlockLayout,
        n: u32,
        dst: Option<&str>,
        exclude: Option<u64>,
        expires: Instant,
    ) -> Result<(Arc<Region>, Vec<u32>)> {
        let reserved = self
            .leases
            .iter()
            .find(|((r, t), l)| {
                t == tid
                    && Some(*r) != exclude
                    && l.state == LeaseState::Reserved
                    && l.blocks.len() == n as usize
            })
            .map(|((r, _), _)| *r);
        if let Some(rid) = reserved {
            let region = self.region(rid)?;
            if dst.is_none_or(|d| d == region.name) && region.layout.compatible(layout) {
                if let Some(l) = self.leases.get_mut(&(rid, tid.clone())) {
                    l.state = LeaseState::Receiving;
                    l.expires = expires;
                    return Ok((region, l.blocks.clone()));
                }
            }
        }
        let candidates: Vec<Arc<Region>> = match dst {
            Some(name) => vec![self.region_by_name(name)?],
            None => {
                let mut v: Vec<_> = self
                    .regions
                    .values()
                    .map(|e| Arc::clone(&e.region))
                    .filter(|r| Some(r.id) != exclude)
                    .collect();
                v.sort_by_key(|r| r.id);
                v
            }
        };
        let compatible: Vec<_> = candidates
            .into_iter()
            .filter(|r| r.layout.compatible(layout))
            .collect();
        if compatible.is_empty() {
            return Err(Error::LayoutMismatch(format!(
                "no region with block_bytes {} and {} layers",
                layout.block_bytes, layout.layers
            )));
        }
        let mut last = None;
        for r in compatible {
            match self.reserve(r.id, tid, n, LeaseState::Receiving, expires) {
                Ok(blocks) => return Ok((r, blocks)),
                Err(e @ Error::NoRoom { .. }) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::NoRoom {
            region: "any".into(),
            wanted: n,
            free: 0,
        }))
    }

    /// The lease for `tid` in region `id`.
    pub fn lease(&self, id: u64, tid: &TransferId) -> Option<&Lease> {
        self.leases.get(&(id, tid.clone()))
    }

    /// Change a lease's state and expiry.
    pub fn set_state(
        &mut self,
        id: u64,
        tid: &TransferId,
        state: LeaseState,
        expires: Instant,
    ) -> Result<()> {
        let l = self
            .leases
            .get_mut(&(id, tid.clone()))
            .ok_or_else(|| Error::UnknownTransfer(tid.to_string()))?;
        l.state = state;
        l.expires = expires;
        Ok(())
    }

    /// End a lease: its blocks go back to the free list. Returns false if there was none.
    pub fn release(&mut self, id: u64, tid: &TransferId) -> bool {
        let Some(lease) = self.leases.remove(&(id, tid.clone())) else {
            return false;
        };
        if let Some(entry) = self.regions.get_mut(&id) {
            entry.free.extend(lease.blocks.iter().rev());
        }
        true
    }

    /// Remember why `tid` failed, for its waiter.
    pub fn record_failure(&mut self, tid: &TransferId, code: ErrorCode, message: String) {
        if self.failures.len() >= FAILURE_MEMORY {
            self.failures.pop_front();
        }
        self.failures.push_back((tid.clone(), code, message));
    }

    /// Why `tid` failed, if it did recently.
    pub fn failure(&self, tid: &TransferId) -> Option<Error> {
        self.failures
            .iter()
            .rev()
            .find(|(t, _, _)| t == tid)
            .map(|(_, c, m)| Error::remote(*c, m.clone()))
    }

    /// Forget a recorded failure (a new transfer reuses the id).
    pub fn clear_failure(&mut self, tid: &TransferId) {
        self.failures.retain(|(t, _, _)| t != tid);
    }

    /// Leases past their expiry (not `Draining`, whose end the last writer decides).
    pub fn expired(&self, now: Instant) -> Vec<(u64, TransferId, LeaseState)> {
        self.leases
            .iter()
            .filter(|(_, l)| l.expires <= now && l.state != LeaseState::Draining)
            .map(|((r, t), l)| (*r, t.clone(), l.state))
            .collect()
    }

    /// Number of leases held.
    pub fn lease_count(&self) -> usize {
        self.leases.len()
    }
}

#[cfg(test)]
#[path = "regions_tests.rs"]
mod tests;
