//! A weighted LRU map keyed by 64-bit hashes, shared by the token prefix
//! cache and the approximate index.
//!
//! Recency is a queue of (key, tick) with lazy deletion: touching a key pushes
//! a new pair and leaves the old one stale; eviction pops from the front and
//! skips stale pairs; the queue is compacted when stale pairs outnumber live
//! ones. Every operation is O(1) amortized and memory stays within a constant
//! factor of the live entries.

use std::collections::VecDeque;

use crate::prefix::index::MixMap;

#[derive(Debug)]
struct Slot<V> {
    value: V,
    tick: u64,
    weight: usize,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Lru<V> {
    map: MixMap<Slot<V>>,
    order: VecDeque<(u64, u64)>,
    tick: u64,
    weight: usize,
    max_weight: usize,
}

impl<V> Lru<V> {
    /// An LRU holding at most `max_weight` in total weight.
    pub(crate) fn new(max_weight: usize) -> Self {
        Self {
            map: MixMap::default(),
            order: VecDeque::new(),
            tick: 0,
            weight: 0,
            max_weight,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn weight(&self) -> usize {
        self.weight
    }

    pub(crate) fn max_weight(&self) -> usize {
        self.max_weight
    }

    /// The value of `key`, without refreshing it.
    pub(crate) fn peek(&self, key: u64) -> Option<&V> {
        self.map.get(&key).map(|s| &s.value)
    }

    /// The value of `key`, marked most recently used.
    pub(crate) fn get(&mut self, key: u64) -> Option<&V> {
        self.tick += 1;
        let tick = self.tick;
        let slot = self.map.get_mut(&key)?;
        slot.tick = tick;
        self.order.push_back((key, tick));
        self.maybe_compact();
        self.map.get(&key).map(|s| &s.value)
    }

    /// Inserts or replaces `key` as most recently used, then evicts the least
    /// recently used entries until the total weight fits; returns how many
    /// were evicted. An entry heavier than the whole budget is not kept.
    pub(crate) fn insert(&mut self, key: u64, value: V, weight: usize) -> usize {
        self.tick += 1;
        if let Some(old) = self.map.insert(
            key,
            Slot {
                value,
                tick: self.tick,
                weight,
            },
        ) {
            self.weight -= old.weight;
        }
        self.weight += weight;
        self.order.push_back((key, self.tick));
        let mut evicted = 0;
        while self.weight > self.max_weight {
            let Some((k, t)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&k).is_some_and(|s| s.tick == t) {
                if let Some(s) = self.map.remove(&k) {
                    self.weight -= s.weight;
                    evicted += 1;
                }
            }
        }
        self.maybe_compact();
        evicted
    }

    /// Marks `key` most recently used, inserting `value` with `weight` if it
    /// is absent, unless it was already marked within the last `fresh`
    /// insertions: then it is left where it is, which skips the queue push
    /// (and the compaction it leads to) for keys used over and over. Such a
    /// key ranks at most `fresh` insertions older than exact LRU would rank
    /// it. Returns how many entries were evicted.
    pub(crate) fn refresh(&mut self, key: u64, value: V, weight: usize, fresh: u64) -> usize {
        if let Some(slot) = self.map.get(&key) {
            if self.tick.saturating_sub(slot.tick) < fresh {
                return 0;
            }
        }
        self.insert(key, value, weight)
    }

    /// Live keys, least recently used first.
    pub(crate) fn keys_oldest_first(&self) -> Vec<u64> {
        self.order
            .iter()
            .filter(|(k, t)| self.map.get(k).is_some_and(|s| s.tick == *t))
            .map(|(k, _)| *k)
            .collect()
    }

    #[cfg(test)]
    pub(crate) fn remove(&mut self, key: u64) -> Option<V> {
        let s = self.map.remove(&key)?;
        self.weight -= s.weight;
        Some(s.value)
    }

    fn maybe_compact(&mut self) {
        if self.order.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.order
                .retain(|(k, t)| map.get(k).is_some_and(|s| s.tick == *t));
        }
    }

    /// Heap bytes of the map and queue, from capacities.
    pub(crate) fn memory_bytes(&self) -> usize {
        crate::prefix::index::map_bytes(self.map.capacity(), 8 + std::mem::size_of::<Slot<V>>())
            + self.order.capacity() * 16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used_by_weight() {
        let mut l = Lru::new(10);
        l.insert(1, "a", 4);
        l.insert(2, "b", 4);
        assert_eq!(l.get(1), Some(&"a"));
        assert_eq!(l.insert(3, "c", 4), 1, "2 was least recent");
        assert_eq!(l.peek(2), None);
        assert_eq!((l.peek(1), l.peek(3)), (Some(&"a"), Some(&"c")));
        assert_eq!(l.weight(), 8);
        l.insert(4, "huge", 11);
        assert_eq!(l.len(), 0, "an entry over budget evicts all and itself");
        for i in 0..10_000 {
            l.insert(5, "x", 1);
            l.get(5);
            assert!(
                l.order.len() <= 2 * l.len() + 65,
                "queue stays bounded at {i}"
            );
        }
        assert_eq!(l.remove(5), Some("x"));
        assert_eq!(l.weight(), 0);
    }

    #[test]
    fn refresh_skips_recent_keys_within_the_window() {
        let mut l = Lru::new(4);
        for k in 1..=4 {
            l.refresh(k, (), 1, 2);
        }
        let queued = l.order.len();
        // 4 was marked last: fresh, nothing queued.
        assert_eq!(l.refresh(4, (), 1, 2), 0);
        assert_eq!(l.order.len(), queued);
        // 1 is 3 insertions old, past the window: it becomes the newest.
        l.refresh(1, (), 1, 2);
        assert_eq!(l.order.len(), queued + 1);
        assert_eq!(l.insert(5, (), 1), 1, "2 is now the least recent");
        assert_eq!(l.peek(2), None);
        assert!(l.peek(1).is_some());
        // A window of 0 or 1 is exact LRU: every refresh of an older key moves it.
        let mut exact = Lru::new(2);
        exact.refresh(1, (), 1, 1);
        exact.refresh(2, (), 1, 1);
        exact.refresh(1, (), 1, 1);
        exact.refresh(3, (), 1, 1);
        assert!(exact.peek(1).is_some() && exact.peek(2).is_none());
    }
}
