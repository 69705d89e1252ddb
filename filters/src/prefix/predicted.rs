//! Predicted blocks: where this sidecar just sent a prompt, before the engine's KV events say what
//! it cached.
//!
//! In precise mode the index learns a pod's blocks from its engine's events, which come after the
//! prefill. A burst of requests sharing a prefix (n-sampling sent as separate requests, an agent's
//! fan-out, a retry storm) arrives faster than that: without a prediction each is placed by load
//! alone, the burst spreads over the pods, and each pod computes the prefix again. So each routing
//! decision records the request's block keys against the pod it chose, and the prediction counts as
//! a match until it expires (`ttl`: long enough for the engine to prefill and report, after which
//! the events are the only truth). A prediction that was wrong (the request failed, the engine
//! evicted) dies with its entry.
//!
//! Bounded: at most `max_keys` keys per pod; past it the oldest predictions go first. Time is
//! passed in, so the index reads no clock.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::prefix::hash::BlockKey;

/// Predictions of one pod.
#[derive(Default)]
struct Pod {
    /// Key → when its newest prediction expires.
    expires: HashMap<BlockKey, Instant>,
    /// Every prediction in the order it was made (a key predicted twice is here twice; the entry
    /// whose time no longer matches `expires` is skipped when it comes out).
    order: VecDeque<(Instant, BlockKey)>,
}

impl Pod {
    /// Drops the oldest prediction (and its key, unless predicted again since).
    fn drop_oldest(&mut self) {
        if let Some((at, key)) = self.order.pop_front() {
            if self.expires.get(&key) == Some(&at) {
                self.expires.remove(&key);
            }
        }
    }

    fn expire(&mut self, now: Instant) {
        while self.order.front().is_some_and(|&(at, _)| at <= now) {
            self.drop_oldest();
        }
    }

    /// Drops the oldest predictions until at most `max` keys are left.
    fn shrink(&mut self, max: usize) {
        while self.expires.len() > max && !self.order.is_empty() {
            self.drop_oldest();
        }
    }
}

/// Per pod: the block keys of the prompts recently routed there (see the module docs).
pub struct PredictedIndex {
    ttl: Duration,
    max_keys: usize,
    pods: Mutex<HashMap<String, Pod>>,
}

impl PredictedIndex {
    /// Predictions live `ttl` (zero: none are kept); at most `max_keys` per pod.
    pub fn new(ttl: Duration, max_keys: usize) -> Self {
        Self {
            ttl,
            max_keys: max_keys.max(1),
            pods: Mutex::new(HashMap::new()),
        }
    }

    /// Whether predictions are kept at all.
    pub fn enabled(&self) -> bool {
        !self.ttl.is_zero()
    }

    /// Predicts that `pod` will hold `keys` (a request with them was just routed there).
    pub fn record(&self, pod: &str, keys: &[BlockKey], now: Instant) {
        if !self.enabled() || keys.is_empty() {
            return;
        }
        let at = now + self.ttl;
        let mut pods = self.pods.lock();
        let p = match pods.get_mut(pod) {
            Some(p) => p,
            None => pods.entry(pod.to_owned()).or_default(),
        };
        p.expire(now);
        for &k in keys.iter().take(self.max_keys) {
            p.expires.insert(k, at);
            p.order.push_back((at, k));
        }
        p.shrink(self.max_keys);
        // A key predicted over and over leaves stale queue entries behind; bound them too.
        if p.order.len() > 2 * self.max_keys {
            let live = &p.expires;
            p.order.retain(|(at, k)| live.get(k) == Some(at));
        }
    }

    /// Per pod with a live prediction of the first key: how many leading keys are predicted.
    pub fn match_prefix(&self, keys: &[BlockKey], now: Instant) -> Vec<(String, usize)> {
        let Some(first) = keys.first() else {
            return Vec::new();
        };
        let mut pods = self.pods.lock();
        pods.retain(|_, p| {
            p.expire(now);
            !p.expires.is_empty()
        });
        pods.iter()
            .filter(|(_, p)| p.expires.contains_key(first))
            .map(|(name, p)| {
                let n = keys
                    .iter()
                    .take_while(|k| p.expires.contains_key(k))
                    .count();
                (name.clone(), n)
            })
            .collect()
    }

    /// Forgets a pod.
    pub fn remove_pod(&self, pod: &str) {
        self.pods.lock().remove(pod);
    }

    /// Keys predicted now, over all pods.
    pub fn len(&self) -> usize {
        self.pods.lock().values().map(|p| p.expires.len()).sum()
    }

    /// Whether nothing is predicted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(mut v: Vec<(String, usize)>) -> Vec<(String, usize)> {
        v.sort();
        v
    }

    #[test]
    fn a_routed_prompt_matches_until_it_expires() {
        let p = PredictedIndex::new(Duration::from_secs(2), 1000);
        let t0 = Instant::now();
        p.record("a", &[1, 2, 3, 4], t0);
        p.record("b", &[1, 2], t0 + Duration::from_millis(500));
        assert_eq!(
            sorted(p.match_prefix(&[1, 2, 3, 9], t0 + Duration::from_secs(1))),
            vec![("a".to_owned(), 3), ("b".to_owned(), 2)]
        );
        // A prompt starting elsewhere matches nothing.
        assert!(p.match_prefix(&[7, 1, 2], t0).is_empty());
        // a's prediction is gone after 2 s, b's lives until 2.5 s.
        assert_eq!(
            p.match_prefix(&[1, 2, 3], t0 + Duration::from_millis(2100)),
            vec![("b".to_owned(), 2)]
        );
        assert!(p
            .match_prefix(&[1, 2, 3], t0 + Duration::from_millis(2600))
            .is_empty());
        assert!(p.is_empty());
    }

    #[test]
    fn predicting_again_extends_the_life_of_a_key() {
        let p = PredictedIndex::new(Duration::from_secs(2), 1000);
        let t0 = Instant::now();
        p.record("a", &[1, 2], t0);
        p.record("a", &[1], t0 + Duration::from_secs(1));
        let later = t0 + Duration::from_millis(2500);
        assert_eq!(p.match_prefix(&[1, 2], later), vec![("a".to_owned(), 1)]);
    }

    #[test]
    fn each_pod_keeps_at_most_max_keys_oldest_dropped_first() {
        let p = PredictedIndex::new(Duration::from_secs(60), 100);
        let t0 = Instant::now();
        for i in 0..50u64 {
            let keys: Vec<u64> = (i * 10..i * 10 + 10).collect();
            p.record("a", &keys, t0 + Duration::from_millis(i));
            // The same prompt again and again leaves no unbounded queue behind.
            p.record("a", &[5000, 5001], t0 + Duration::from_millis(i));
        }
        assert!(p.len() <= 100, "{}", p.len());
        let now = t0 + Duration::from_secs(1);
        assert_eq!(p.match_prefix(&[490, 491], now), vec![("a".to_owned(), 2)]);
        assert!(
            p.match_prefix(&[0, 1], now).is_empty(),
            "the oldest went first"
        );
        let pods = p.pods.lock();
        assert!(
            pods["a"].order.len() <= 200 + 12,
            "{}",
            pods["a"].order.len()
        );
    }

    #[test]
    fn a_zero_ttl_keeps_nothing_and_removed_pods_are_forgotten() {
        let off = PredictedIndex::new(Duration::ZERO, 100);
        assert!(!off.enabled());
        off.record("a", &[1], Instant::now());
        assert!(off.is_empty());
        let p = PredictedIndex::new(Duration::from_secs(5), 100);
        p.record("a", &[1], Instant::now());
        p.remove_pod("a");
        assert!(p.match_prefix(&[1], Instant::now()).is_empty());
    }
}
