//! A compact hash table from `u64` to `u64`, for the index's two big maps
//! (block key → packed holders, and per pod engine hash → block key).
//!
//! Why not `std`'s `HashMap`: its tables grow in powers of two, so right after
//! a growth they sit half empty, and every lookup touches a control-byte group
//! and then the bucket, two cache misses on a cold table. This one is an open
//! addressing table with Robin Hood linear probing:
//!
//! * one 16-byte slot holds key and value, so a lookup usually costs one cache
//!   line;
//! * the slot count is any number (the home slot is `hash * n >> 64`), grown by
//!   a quarter at 7/8 full, so the table is always between 70% and 87.5% full
//!   (shrunk when a quarter full), about 20 bytes per entry instead of 22-36;
//! * Robin Hood order (a key never sits further from home than the keys it
//!   passed) ends a search for an absent key early, and deletion shifts the
//!   followers back, so there are no tombstones to clean.
//!
//! Key 0 marks an empty slot; an entry with key 0 (one hash in 2^64) is kept
//! aside in `zero`, so every key is representable.

use std::mem;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Slot {
    key: u64,
    value: u64,
}

const EMPTY: Slot = Slot { key: 0, value: 0 };

/// Fewest slots of a non-empty table.
const MIN_SLOTS: usize = 8;

/// See the module docs.
#[derive(Debug, Default, Clone)]
pub(crate) struct U64Map {
    slots: Vec<Slot>,
    /// Entries in `slots` (not counting `zero`).
    len: usize,
    zero: Option<u64>,
}

/// Spreads a key over the high bits (engine hashes of simulators are
/// sequential), which `home` then scales to the slot count.
fn mix(key: u64) -> u64 {
    key.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn home(key: u64, n: usize) -> usize {
    ((u128::from(mix(key)) * n as u128) >> 64) as usize
}

impl U64Map {
    pub(crate) fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        if key == 0 {
            return self.zero;
        }
        self.find(key).map(|i| self.slots[i].value)
    }

    /// The slot of `key` (non-zero), if present.
    fn find(&self, key: u64) -> Option<usize> {
        let n = self.slots.len();
        if n == 0 {
            return None;
        }
        let mut i = home(key, n);
        // Bounded: the table is never full, so an empty slot ends the walk.
        for dist in 0..n {
            let s = self.slots[i];
            if s.key == key {
                return Some(i);
            }
            if s.key == 0 || self.distance(s.key, i) < dist {
                return None;
            }
            i = self.next(i);
        }
        None
    }

    /// How far the key in slot `i` sits from its home slot.
    fn distance(&self, key: u64, i: usize) -> usize {
        let h = home(key, self.slots.len());
        // No `%`: a division would cost more than the rest of a probe.
        if i >= h {
            i - h
        } else {
            i + self.slots.len() - h
        }
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() {
            0
        } else {
            i + 1
        }
    }

    /// Inserts or replaces; returns the previous value.
    pub(crate) fn insert(&mut self, key: u64, value: u64) -> Option<u64> {
        if key == 0 {
            return self.zero.replace(value);
        }
        if let Some(i) = self.find(key) {
            return Some(mem::replace(&mut self.slots[i].value, value));
        }
        if (self.len + 1) * 8 > self.slots.len() * 7 {
            let n = self.slots.len();
            self.resize((n + n / 4).max(MIN_SLOTS));
        }
        self.place(Slot { key, value });
        self.len += 1;
        None
    }

    /// Puts an absent key in its Robin Hood place.
    fn place(&mut self, mut carry: Slot) {
        let n = self.slots.len();
        let mut i = home(carry.key, n);
        let mut dist = 0;
        for _ in 0..n {
            let resident = self.slots[i];
            if resident.key == 0 {
                self.slots[i] = carry;
                return;
            }
            let theirs = self.distance(resident.key, i);
            if theirs < dist {
                // Take the slot from a key closer to its home; carry it on.
                self.slots[i] = carry;
                carry = resident;
                dist = theirs;
            }
            i = self.next(i);
            dist += 1;
        }
    }

    /// Removes `key`; returns its value.
    pub(crate) fn remove(&mut self, key: u64) -> Option<u64> {
        if key == 0 {
            return self.zero.take();
        }
        let mut i = self.find(key)?;
        let value = self.slots[i].value;
        // Backward shift: followers that are not at home move one slot back.
        for _ in 0..self.slots.len() {
            let j = self.next(i);
            let follower = self.slots[j];
            if follower.key == 0 || self.distance(follower.key, j) == 0 {
                break;
            }
            self.slots[i] = follower;
            i = j;
        }
        self.slots[i] = EMPTY;
        self.len -= 1;
        let n = self.slots.len();
        if n > MIN_SLOTS * 4 && self.len * 4 < n {
            // Down to a quarter full: give memory back, landing at ~60%.
            self.resize((self.len * 5 / 3).max(MIN_SLOTS));
        }
        Some(value)
    }

    fn resize(&mut self, slots: usize) {
        let old = mem::replace(&mut self.slots, vec![EMPTY; slots]);
        for s in old {
            if s.key != 0 {
                self.place(s);
            }
        }
    }

    /// Every (key, value), in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.zero.map(|v| (0, v)).into_iter().chain(
            self.slots
                .iter()
                .filter(|s| s.key != 0)
                .map(|s| (s.key, s.value)),
        )
    }

    /// Heap bytes held.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.slots.capacity() * mem::size_of::<Slot>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u64),
        Remove(u64),
    }

    /// Keys from a small range collide and chain; 0 is the reserved marker.
    fn op() -> impl Strategy<Value = Op> {
        let key = prop_oneof![0u64..64, Just(0), any::<u64>()];
        prop_oneof![
            3 => (key.clone(), any::<u64>()).prop_map(|(k, v)| Op::Insert(k, v)),
            2 => key.prop_map(Op::Remove),
        ]
    }

    proptest! {
        #[test]
        fn behaves_like_a_hash_map(ops in proptest::collection::vec(op(), 0..600)) {
            let mut ours = U64Map::default();
            let mut model = HashMap::new();
            for op in ops {
                match op {
                    Op::Insert(k, v) => prop_assert_eq!(ours.insert(k, v), model.insert(k, v)),
                    Op::Remove(k) => prop_assert_eq!(ours.remove(k), model.remove(&k)),
                }
                prop_assert_eq!(ours.len(), model.len());
            }
            for (k, v) in &model {
                prop_assert_eq!(ours.get(*k), Some(*v));
            }
            let mut listed: Vec<_> = ours.iter().collect();
            let mut expected: Vec<_> = model.into_iter().collect();
            listed.sort_unstable();
            expected.sort_unstable();
            prop_assert_eq!(listed, expected);
        }
    }

    #[test]
    fn stays_between_70_and_88_percent_full_and_shrinks() {
        let mut m = U64Map::default();
        for k in 1..=100_000u64 {
            m.insert(k, k);
            let load = m.len() as f64 / m.slots.len() as f64;
            assert!(load <= 0.875, "{load} at {k}");
            if k > 1000 {
                assert!(load >= 0.69, "{load} at {k}");
            }
        }
        let per_entry = m.memory_bytes() as f64 / m.len() as f64;
        assert!(per_entry < 23.0, "{per_entry} bytes per entry");
        for k in 1..=99_000u64 {
            assert_eq!(m.remove(k), Some(k));
        }
        assert!(
            m.slots.len() < 4_000,
            "{} slots for 1000 entries",
            m.slots.len()
        );
        assert!((99_001..=100_000).all(|k| m.get(k) == Some(k)));
        assert_eq!(m.get(5), None);
    }
}
