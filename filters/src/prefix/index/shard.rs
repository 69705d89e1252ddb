//! One shard of the global block map: block key → the pods holding it.
//!
//! Memory is the constraint here (the index holds millions of blocks), so a
//! map value is one packed `u64`: either a single [`Holder`] inline (the
//! common case: a block cached on one pod, in one medium) or, with the top bit
//! set, an index into this shard's overflow slab of holder lists.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::table::U64Map;
use crate::prefix::kvevents::Medium;

/// Keys are already uniform 64-bit hashes; one multiply spreads them over the
/// bits hashbrown uses (low bits for the bucket, top 7 for the tag), which also
/// keeps sequential engine hashes (simulators) cheap.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

pub(crate) type MixMap<V> = HashMap<u64, V, BuildHasherDefault<MixHasher>>;

/// Most copies of one block counted on one pod (more are not counted).
const MAX_REFS: u16 = (1 << 12) - 1;
const MANY: u64 = 1 << 63;

/// One pod's copies of a block in one medium.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Holder {
    pub pod: u16,
    pub medium: Medium,
    /// Physical copies stored and not yet removed (1..=4095).
    pub refs: u16,
    /// The pod's store epoch when this was last stored (for eviction).
    pub epoch: u32,
}

fn medium_code(m: Medium) -> u64 {
    u64::from(m.code())
}

fn medium_of(code: u64) -> Medium {
    // Three bits wide: always fits.
    Medium::from_code(u8::try_from(code).unwrap_or(u8::MAX))
}

impl Holder {
    fn pack(self) -> u64 {
        u64::from(self.epoch)
            | u64::from(self.refs.min(MAX_REFS)) << 32
            | medium_code(self.medium) << 44
            | u64::from(self.pod) << 47
    }

    fn unpack(v: u64) -> Self {
        Holder {
            epoch: v as u32,
            refs: ((v >> 32) & u64::from(MAX_REFS)) as u16,
            medium: medium_of((v >> 44) & 0x7),
            pod: ((v >> 47) & 0xffff) as u16,
        }
    }
}

/// What a removal left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Removal {
    /// Holders (pod, medium) that disappeared.
    pub holders_gone: usize,
    /// Whether the pod still holds the block in some medium.
    pub pod_still_holds: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Shard {
    map: U64Map,
    overflow: Vec<Vec<Holder>>,
    free: Vec<u32>,
}

impl Shard {
    /// The packed holders of `key`, 0 when absent (a live single holder has
    /// `refs >= 1`, so it never packs to 0).
    pub(crate) fn raw(&self, key: u64) -> u64 {
        self.map.get(key).unwrap_or(0)
    }

    /// Calls `f` with each holder in a value from [`Shard::raw`].
    #[cfg(test)]
    pub(crate) fn for_each_raw(&self, v: u64, mut f: impl FnMut(Holder)) {
        if v == 0 {
        } else if v & MANY == 0 {
            f(Holder::unpack(v));
        } else if let Some(list) = self.overflow.get((v & !MANY) as usize) {
            list.iter().copied().for_each(f);
        }
    }

    /// Calls `f(pod, on_gpu)` for each holder in a value from [`Shard::raw`]
    /// (the matcher's hot path: no full unpacking).
    #[inline]
    pub(crate) fn for_each_pod(&self, v: u64, mut f: impl FnMut(u16, bool)) {
        if v == 0 {
        } else if v & MANY == 0 {
            f(
                (v >> 47) as u16,
                (v >> 44) & 0x7 == medium_code(Medium::Gpu),
            );
        } else if let Some(list) = self.overflow.get((v & !MANY) as usize) {
            for h in list {
                f(h.pod, h.medium == Medium::Gpu);
            }
        }
    }

    /// The media `pod` holds in a value from [`Shard::raw`], one bit per
    /// medium code.
    pub(crate) fn pod_mediums(&self, v: u64, pod: u16) -> u8 {
        let bit = |m: Medium| 1u8 << medium_code(m);
        if v == 0 {
            0
        } else if v & MANY == 0 {
            let h = Holder::unpack(v);
            if h.pod == pod {
                bit(h.medium)
            } else {
                0
            }
        } else if let Some(list) = self.overflow.get((v & !MANY) as usize) {
            list.iter()
                .filter(|h| h.pod == pod)
                .fold(0, |acc, h| acc | bit(h.medium))
        } else {
            0
        }
    }

    /// Loads the holder list behind a value from [`Shard::raw`] into the
    /// cache (the value is meaningless; see `PrefixIndex::match_prefix`).
    pub(crate) fn touch(&self, v: u64) -> u16 {
        if v & MANY == 0 {
            return 0;
        }
        self.overflow
            .get((v & !MANY) as usize)
            .and_then(|list| list.first())
            .map_or(0, |h| h.pod)
    }

    /// Calls `f` with each holder of `key`.
    #[cfg(test)]
    pub(crate) fn for_each_holder(&self, key: u64, f: impl FnMut(Holder)) {
        self.for_each_raw(self.raw(key), f);
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Adds one copy of `key` on (`pod`, `medium`) stamped with `epoch`;
    /// returns whether that holder is new.
    pub(crate) fn store(&mut self, key: u64, pod: u16, medium: Medium, epoch: u32) -> bool {
        let fresh = Holder {
            pod,
            medium,
            refs: 1,
            epoch,
        };
        let Some(v) = self.map.get(key) else {
            self.map.insert(key, fresh.pack());
            return true;
        };
        if v & MANY == 0 {
            let mut h = Holder::unpack(v);
            if h.pod == pod && h.medium == medium {
                h.refs = (h.refs + 1).min(MAX_REFS);
                h.epoch = epoch;
                self.map.insert(key, h.pack());
                return false;
            }
            let slot = self.alloc(vec![h, fresh]);
            self.map.insert(key, MANY | slot);
            return true;
        }
        let Some(list) = self.overflow.get_mut((v & !MANY) as usize) else {
            return false;
        };
        if let Some(h) = list.iter_mut().find(|h| h.pod == pod && h.medium == medium) {
            h.refs = (h.refs + 1).min(MAX_REFS);
            h.epoch = epoch;
            false
        } else {
            list.push(fresh);
            true
        }
    }

    /// Drops one copy on (`pod`, `medium`).
    pub(crate) fn remove_one(&mut self, key: u64, pod: u16, medium: Medium) -> Removal {
        self.retain(key, pod, |h| {
            if h.medium == medium {
                h.refs = h.refs.saturating_sub(1);
            }
            h.refs > 0
        })
    }

    /// Drops every holder of `pod` for which `drop` says so.
    pub(crate) fn remove_pod_where(
        &mut self,
        key: u64,
        pod: u16,
        drop: impl Fn(&Holder) -> bool,
    ) -> Removal {
        self.retain(key, pod, |h| !drop(h))
    }

    /// Keeps the holders of `pod` for which `keep` (which may edit them) says
    /// so; other pods' holders are untouched.
    fn retain(&mut self, key: u64, pod: u16, mut keep: impl FnMut(&mut Holder) -> bool) -> Removal {
        let Some(v) = self.map.get(key) else {
            return Removal::default();
        };
        if v & MANY == 0 {
            let mut h = Holder::unpack(v);
            if h.pod != pod {
                return Removal::default();
            }
            if keep(&mut h) {
                self.map.insert(key, h.pack());
                return Removal {
                    holders_gone: 0,
                    pod_still_holds: true,
                };
            }
            self.map.remove(key);
            return Removal {
                holders_gone: 1,
                pod_still_holds: false,
            };
        }
        let slot = (v & !MANY) as usize;
        let Some(list) = self.overflow.get_mut(slot) else {
            return Removal::default();
        };
        let before = list.len();
        list.retain_mut(|h| h.pod != pod || keep(h));
        let out = Removal {
            holders_gone: before - list.len(),
            pod_still_holds: list.iter().any(|h| h.pod == pod),
        };
        match list.len() {
            0 => {
                self.map.remove(key);
                self.release(slot);
            }
            1 => {
                let only = list[0];
                self.map.insert(key, only.pack());
                self.release(slot);
            }
            _ => {}
        }
        out
    }

    fn alloc(&mut self, list: Vec<Holder>) -> u64 {
        if let Some(i) = self.free.pop() {
            if let Some(slot) = self.overflow.get_mut(i as usize) {
                *slot = list;
                return u64::from(i);
            }
        }
        self.overflow.push(list);
        (self.overflow.len() - 1) as u64
    }

    fn release(&mut self, slot: usize) {
        if let Some(list) = self.overflow.get_mut(slot) {
            *list = Vec::new();
            self.free.push(slot as u32);
        }
    }

    /// Heap bytes held, from capacities (see `docs/prefix.md`).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.map.memory_bytes()
            + self.overflow.capacity() * std::mem::size_of::<Vec<Holder>>()
            + self
                .overflow
                .iter()
                .map(|l| l.capacity() * std::mem::size_of::<Holder>())
                .sum::<usize>()
            + self.free.capacity() * 4
    }
}

/// Heap bytes of a hashbrown table with `capacity` and `entry` bytes per slot:
/// buckets are a power of two at most 7/8 full, plus one control byte each.
pub(crate) fn map_bytes(capacity: usize, entry: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (entry + 1) + 16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_pack_losslessly() {
        let h = Holder {
            pod: 65_535,
            medium: Medium::External,
            refs: 4095,
            epoch: u32::MAX,
        };
        assert_eq!(Holder::unpack(h.pack()), h);
        assert_eq!(h.pack() & MANY, 0);
    }

    #[test]
    fn refcounts_mediums_and_overflow() {
        let mut s = Shard::default();
        assert!(s.store(1, 3, Medium::Gpu, 0));
        assert!(!s.store(1, 3, Medium::Gpu, 1));
        assert!(s.store(1, 3, Medium::Cpu, 1));
        assert!(s.store(1, 4, Medium::Gpu, 1));
        let mut seen = Vec::new();
        s.for_each_holder(1, |h| seen.push((h.pod, h.medium, h.refs)));
        assert_eq!(
            seen,
            [
                (3, Medium::Gpu, 2),
                (3, Medium::Cpu, 1),
                (4, Medium::Gpu, 1)
            ]
        );
        // First removal of a duplicated copy keeps the holder.
        assert_eq!(
            s.remove_one(1, 3, Medium::Gpu),
            Removal {
                holders_gone: 0,
                pod_still_holds: true
            }
        );
        assert_eq!(
            s.remove_one(1, 3, Medium::Gpu),
            Removal {
                holders_gone: 1,
                pod_still_holds: true
            }
        );
        assert_eq!(
            s.remove_one(1, 3, Medium::Cpu),
            Removal {
                holders_gone: 1,
                pod_still_holds: false
            }
        );
        // Back to one inline holder, slot recycled.
        assert_eq!(s.map.get(1).map(|v| v & MANY), Some(0));
        assert_eq!(s.remove_pod_where(1, 4, |_| true).holders_gone, 1);
        assert_eq!(s.len(), 0);
        assert_eq!(s.free.len(), 1);
    }
}
