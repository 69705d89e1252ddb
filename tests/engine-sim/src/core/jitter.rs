//! The latency model's spread. A real engine is not a clock: the API server's time per request and
//! each step's duration vary with garbage collection, the OS scheduler and whatever else shares the
//! machine. The profile's `api_overhead_std_ms` and `step_std_ratio` give each request's API-server
//! time and each step's duration a normal deviation (as llm-d-inference-sim's `*-std-dev` knobs do),
//! cut at three standard deviations and floored at zero. Neither cut moves the median, which stays
//! where the profile puts it, whatever the spread: a calibrated profile whose API time is small next
//! to its spread (the simulator's own time already covers most of it) still scatters as measured
//! above its median. A slow step slows every sequence in it, as a pause does on a real engine. The draws come from a
//! seeded generator: the same seed and the same arrivals give the same timings. With both spreads
//! at 0 (every built-in profile) nothing is drawn and the model is exact.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::profile::LatencyProfile;

/// No draw is further than this many standard deviations from the modelled value.
const Z_LIMIT: f64 = 3.0;

pub(crate) struct Jitter {
    rng: StdRng,
    api_mean_ms: f64,
    api_std_ms: f64,
    step_ratio: f64,
}

impl Jitter {
    pub fn new(profile: &LatencyProfile, seed: u64) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
            api_mean_ms: profile.api_overhead_ms,
            api_std_ms: profile.api_overhead_std_ms,
            step_ratio: profile.step_std_ratio,
        }
    }

    /// Simulated seconds of API-server time for the next request.
    pub fn api_seconds(&mut self) -> f64 {
        let ms = if self.api_std_ms > 0.0 {
            (self.api_mean_ms + self.api_std_ms * self.normal()).max(0.0)
        } else {
            self.api_mean_ms
        };
        ms / 1000.0
    }

    /// The duration of a step whose modelled duration is `seconds`.
    pub fn step_seconds(&mut self, seconds: f64) -> f64 {
        if self.step_ratio > 0.0 {
            seconds * (1.0 + self.step_ratio * self.normal()).max(0.0)
        } else {
            seconds
        }
    }

    /// A standard normal draw (Box-Muller), cut at [`Z_LIMIT`].
    fn normal(&mut self) -> f64 {
        let u1: f64 = self.rng.random::<f64>().max(f64::MIN_POSITIVE);
        let u2: f64 = self.rng.random();
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        z.clamp(-Z_LIMIT, Z_LIMIT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(api_std: f64, step_ratio: f64) -> LatencyProfile {
        LatencyProfile {
            api_overhead_std_ms: api_std,
            step_std_ratio: step_ratio,
            ..LatencyProfile::vllm_cpu_tiny()
        }
    }

    fn quantile(v: &mut [f64], q: f64) -> f64 {
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * q).round() as usize]
    }

    #[test]
    fn no_spread_is_exact() {
        let mut j = Jitter::new(&profile(0.0, 0.0), 7);
        for _ in 0..100 {
            assert_eq!(j.api_seconds(), 14.8 / 1000.0);
            assert_eq!(j.step_seconds(0.003), 0.003);
        }
    }

    #[test]
    fn api_draws_keep_the_median_and_show_the_spread() {
        let mut j = Jitter::new(&profile(3.0, 0.0), 7);
        let mut v: Vec<f64> = (0..20_000).map(|_| j.api_seconds() * 1000.0).collect();
        let median = quantile(&mut v, 0.5);
        let iqr = quantile(&mut v, 0.75) - quantile(&mut v, 0.25);
        assert!((median - 14.8).abs() < 0.1, "median {median}");
        // A normal's interquartile range is 1.349 standard deviations.
        assert!((iqr / 1.349 - 3.0).abs() < 0.1, "iqr {iqr}");
    }

    #[test]
    fn draws_stay_within_three_deviations_and_never_go_negative() {
        let mut j = Jitter::new(&profile(2.0, 0.1), 7);
        for _ in 0..10_000 {
            let api = j.api_seconds() * 1000.0;
            assert!(
                (14.8 - 6.0 - 1e-9..=14.8 + 6.0 + 1e-9).contains(&api),
                "{api}"
            );
            let step = j.step_seconds(1.0);
            assert!((0.7 - 1e-12..=1.3 + 1e-12).contains(&step), "{step}");
        }
        // A spread larger than the time itself: floored at zero, the median kept.
        let mut j = Jitter::new(&profile(100.0, 5.0), 7);
        let mut v: Vec<f64> = (0..20_000)
            .map(|_| {
                let step = j.step_seconds(1.0);
                assert!(step >= 0.0, "{step}");
                j.api_seconds() * 1000.0
            })
            .collect();
        assert!(v.iter().all(|&a| a >= 0.0));
        let median = quantile(&mut v, 0.5);
        assert!((median - 14.8).abs() < 3.0, "median {median}");
        let p60 = quantile(&mut v, 0.6);
        assert!((p60 - (14.8 + 100.0 * 0.2533)).abs() < 5.0, "p60 {p60}");
    }

    #[test]
    fn the_same_seed_gives_the_same_timings() {
        let draws = |seed| {
            let mut j = Jitter::new(&profile(2.0, 0.2), seed);
            (0..50)
                .map(|i| j.api_seconds() + j.step_seconds(f64::from(i)))
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(1), draws(1));
        assert_ne!(draws(1), draws(2));
    }
}
