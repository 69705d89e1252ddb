//! The one backoff of every loop that retries (mesh subscribers, the KV-event
//! socket and its replays, prefill legs): exponential from a start delay,
//! doubling up to a cap, each delay with random jitter added (between 0 and
//! the delay itself, so a delay `d` sleeps in `[d, 2d)`), from the `backon`
//! crate. Without jitter every sidecar retries a restarted peer or engine on
//! the same schedule; with it their attempts spread out.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// Retry delays, never exhausted: past the cap every delay is the cap (plus
/// jitter). [`Backoff::reset`] after a success starts over.
#[derive(Debug)]
pub struct Backoff {
    builder: ExponentialBuilder,
    delays: ExponentialBackoff,
    max: Duration,
}

impl Backoff {
    /// Delays from `start`, doubling, capped at `max` (at least `start`).
    pub fn new(start: Duration, max: Duration) -> Self {
        let max = max.max(start);
        let builder = ExponentialBuilder::default()
            .with_min_delay(start)
            .with_max_delay(max)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times();
        Self {
            builder,
            delays: builder.build(),
            max,
        }
    }

    /// The next delay to sleep before retrying.
    pub fn next_delay(&mut self) -> Duration {
        self.delays.next().unwrap_or(self.max)
    }

    /// Starts over from the start delay (the last attempt succeeded).
    pub fn reset(&mut self) {
        self.delays = self.builder.build();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_cap_with_jitter_below_the_delay() {
        let start = Duration::from_millis(100);
        let max = Duration::from_millis(800);
        let mut b = Backoff::new(start, max);
        let mut base = start;
        for _ in 0..10 {
            let d = b.next_delay();
            assert!(
                d >= base && d < base * 2,
                "{d:?} not in [{base:?}, {:?})",
                base * 2
            );
            base = (base * 2).min(max);
        }
        b.reset();
        let d = b.next_delay();
        assert!(d >= start && d < start * 2, "after reset: {d:?}");
    }

    #[test]
    fn two_backoffs_do_not_retry_in_lockstep() {
        let mut a = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let xs: Vec<_> = (0..8).map(|_| a.next_delay()).collect();
        let ys: Vec<_> = (0..8).map(|_| b.next_delay()).collect();
        assert_ne!(xs, ys, "jitter makes two sidecars' schedules differ");
    }
}
