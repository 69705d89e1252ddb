//! Series kept where a family lookup would cost too much on the request
//! path: a family lookup takes a lock shared by every worker thread and
//! hashes the labels. [`PerRoute`] keeps one series per [`Route`];
//! [`StaticSeries`] keeps those of `&'static str` label values by address.

use std::sync::OnceLock;

use prometheus_client::metrics::family::Family;

use super::{Route, RouteLabels};

/// One family's series per route, each created on first use (so the
/// exposition lists the same series as plain lookups would) and kept.
pub(super) struct PerRoute<M> {
    pub(super) family: Family<RouteLabels, M, fn() -> M>,
    series: [OnceLock<M>; Route::COUNT],
}

impl<M: Clone> PerRoute<M> {
    pub(super) fn new(family: Family<RouteLabels, M, fn() -> M>) -> Self {
        Self {
            family,
            series: Default::default(),
        }
    }

    pub(super) fn get(&self, route: Route) -> &M {
        self.series[route.index()]
            .get_or_init(|| self.family.get_or_create(&RouteLabels { route }).clone())
    }
}

/// A family whose label values are `&'static str`s named at a few call
/// sites on the request path (a routing decision and its reason, a tokenize
/// outcome, where a request ran). Its series are kept in a short list and
/// found by the strings' addresses, where a family lookup hashes the label
/// set (SipHash) under the family's lock: about 460 instructions per lookup,
/// three lookups per request. A value seen for the first time takes the
/// family's path, so the exposition is what plain lookups would give; a
/// value equal to a kept one at another address finds the same series.
pub struct StaticSeries<const N: usize, L, M> {
    family: Family<L, M>,
    labels: fn([&'static str; N]) -> L,
    seen: parking_lot::RwLock<Vec<([&'static str; N], M)>>,
}

/// Series kept by address; beyond it, lookups go to the family.
const STATIC_SERIES_KEPT: usize = 64;

impl<const N: usize, L, M> StaticSeries<N, L, M>
where
    L: Clone + std::hash::Hash + Eq,
    M: Clone + Default,
{
    pub fn new(labels: fn([&'static str; N]) -> L) -> Self {
        Self {
            family: Family::default(),
            labels,
            seen: parking_lot::RwLock::new(Vec::new()),
        }
    }

    /// The family, to register.
    pub fn family(&self) -> Family<L, M> {
        self.family.clone()
    }

    /// The series of `key` (a shared handle: updating it updates the family's).
    pub fn get(&self, key: [&'static str; N]) -> M {
        let same = |k: &[&'static str; N]| k.iter().zip(&key).all(|(a, b)| std::ptr::eq(*a, *b));
        if let Some((_, m)) = self.seen.read().iter().find(|(k, _)| same(k)) {
            return m.clone();
        }
        let m = self.family.get_or_create(&(self.labels)(key)).clone();
        let mut seen = self.seen.write();
        if seen.len() < STATIC_SERIES_KEPT && !seen.iter().any(|(k, _)| same(k)) {
            seen.push((key, m.clone()));
        }
        m
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use prometheus_client::encoding::EncodeLabelSet;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::registry::Registry;

    #[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
    struct TwoLabels {
        kind: &'static str,
        why: &'static str,
    }

    #[test]
    fn static_series_count_like_the_family_and_share_equal_values() {
        let series: StaticSeries<2, TwoLabels, Counter> =
            StaticSeries::new(|[kind, why]| TwoLabels { kind, why });
        let mut r = Registry::default();
        r.register("decisions", "test", series.family());
        for _ in 0..3 {
            series.get(["local", "best_score"]).inc();
        }
        // The same text at another address: a second entry, the same series.
        let elsewhere: &'static str = String::from("local").leak();
        series.get([elsewhere, "best_score"]).inc();
        series.get(["peer", "best_score"]).inc();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap();
        assert!(
            text.contains(r#"decisions_total{kind="local",why="best_score"} 4"#),
            "{text}"
        );
        assert!(text.contains(r#"decisions_total{kind="peer",why="best_score"} 1"#));
        assert_eq!(series.seen.read().len(), 3);
    }

    #[test]
    fn static_series_past_the_kept_list_still_count() {
        let series: StaticSeries<1, TwoLabels, Counter> =
            StaticSeries::new(|[kind]| TwoLabels { kind, why: "x" });
        for i in 0..STATIC_SERIES_KEPT + 5 {
            let kind: &'static str = format!("k{i}").leak();
            series.get([kind]).inc();
            series.get([kind]).inc();
        }
        assert_eq!(series.seen.read().len(), STATIC_SERIES_KEPT);
        let last: &'static str = format!("k{}", STATIC_SERIES_KEPT + 4).leak();
        assert_eq!(series.get([last]).get(), 2);
    }
}
