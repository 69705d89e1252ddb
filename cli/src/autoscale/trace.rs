//! The load the closed loop runs under: a request rate that moves like a
//! production trace's, and request sizes drawn like that trace's.
//!
//! The shape is the Azure LLM inference trace 2023, conversation
//! (`AzureLLMInferenceTrace_conv.csv` in Azure/AzurePublicDataset, one hour of
//! 19,366 requests on 2023-11-16): its 58 whole minutes' arrival counts,
//! each over their mean ([`CONV_MINUTES`]). It ramps from 0.71x to 1.51x in
//! its first half and ends in a trough at 0.60-0.82x. Into it goes one burst
//! of 3x for four minutes (minutes 38-41, where the trace runs at ~1x): the
//! code trace of the same dataset (`AzureLLMInferenceTrace_code.csv`) has
//! minutes at 2.95x its mean, so a 3x minute is in the field's range.
//!
//! Each trace minute lasts `minute` simulated seconds: the run replays the
//! hour faster than real time (see docs/autoscaling.md for what that does
//! to a reactive scaler).
//!
//! Request sizes are lognormal, fitted to the traces' median and mean
//! (a lognormal's mean is `median × exp(σ²/2)`), and clipped to the
//! engine's context:
//!
//! | trace | prompt median / mean | output median / mean |
//! |---|---|---|
//! | conversation | 1020 / 1155 tokens | 129 / 211 |
//! | code | 1469 / 2048 | 13 / 28 |

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Arrivals per minute of the conversation trace's 58 whole minutes
/// (18:16-19:13), each over their mean (333.4 a minute).
pub const CONV_MINUTES: [f64; 58] = [
    0.71, 0.79, 1.04, 0.98, 0.96, 0.77, 0.80, 0.87, 0.92, 0.88, 0.91, 0.91, 1.01, 0.98, 0.83, 0.82,
    0.87, 0.94, 1.06, 1.02, 1.06, 1.08, 1.22, 1.22, 1.18, 1.14, 1.30, 1.51, 1.40, 1.30, 1.43, 1.47,
    1.39, 1.14, 1.23, 1.36, 1.30, 0.96, 0.94, 0.96, 1.03, 1.06, 0.98, 1.00, 1.04, 1.12, 0.90, 0.74,
    0.71, 0.74, 0.82, 0.80, 0.82, 0.73, 0.73, 0.77, 0.73, 0.60,
];

/// The burst: trace minutes `BURST.0..BURST.1` run at `BURST.2` times the
/// trace's mean rate.
pub const BURST: (usize, usize, f64) = (38, 42, 3.0);

/// Request sizes: a lognormal prompt and output length (median, mean).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sizes {
    pub name: &'static str,
    pub prompt: (f64, f64),
    pub output: (f64, f64),
}

/// The conversation trace's sizes.
pub const CONV_SIZES: Sizes = Sizes {
    name: "azure-2023-conv",
    prompt: (1020.0, 1155.0),
    output: (129.0, 211.0),
};

/// The code trace's sizes: long prompts, short answers (where P/D pays).
pub const CODE_SIZES: Sizes = Sizes {
    name: "azure-2023-code",
    prompt: (1469.0, 2048.0),
    output: (13.0, 28.0),
};

/// One request to send: when (simulated seconds from the start) and how big.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arrival {
    pub at_s: f64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
}

/// The rate schedule: `base` req/s at the trace's mean, one trace minute
/// every `minute`.
#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    pub base: f64,
    pub minute: Duration,
}

impl Schedule {
    /// How long the whole trace runs (simulated).
    pub fn duration(&self) -> Duration {
        self.minute * CONV_MINUTES.len() as u32
    }

    /// The multiplier of trace minute `m` (the burst included).
    pub fn multiplier(m: usize) -> f64 {
        if (BURST.0..BURST.1).contains(&m) {
            BURST.2
        } else {
            CONV_MINUTES.get(m).copied().unwrap_or(0.0)
        }
    }

    /// The rate at `t_s` simulated seconds, req/s.
    pub fn rate_at(&self, t_s: f64) -> f64 {
        let m = (t_s / self.minute.as_secs_f64()).floor();
        if m < 0.0 {
            return 0.0;
        }
        self.base * Self::multiplier(m as usize)
    }

    /// The highest rate from `from_s` to `to_s` simulated seconds, req/s.
    pub fn highest_rate(&self, from_s: f64, to_s: f64) -> f64 {
        let minute = self.minute.as_secs_f64();
        let (first, last) = ((from_s / minute).floor(), (to_s / minute).floor());
        (first.max(0.0) as usize..=last.max(0.0) as usize)
            .map(|m| self.base * Self::multiplier(m))
            .fold(0.0, f64::max)
    }

    /// The highest and the mean rate over the run, req/s.
    pub fn peak_and_mean(&self) -> (f64, f64) {
        let all: Vec<f64> = (0..CONV_MINUTES.len()).map(Self::multiplier).collect();
        let peak = all.iter().copied().fold(0.0, f64::max);
        let mean = all.iter().sum::<f64>() / all.len() as f64;
        (self.base * peak, self.base * mean)
    }

    /// Every arrival of the run: a Poisson process whose rate follows the
    /// schedule (piecewise constant per trace minute), sizes drawn from
    /// `sizes` and clipped so prompt + output fit `max_model_len`.
    pub fn arrivals(&self, sizes: &Sizes, max_model_len: u32, seed: u64) -> Vec<Arrival> {
        let mut rng = StdRng::seed_from_u64(seed);
        let prompt = lognormal(sizes.prompt);
        let output = lognormal(sizes.output);
        let minute = self.minute.as_secs_f64();
        let mut out = Vec::new();
        for m in 0..CONV_MINUTES.len() {
            let rate = self.base * Self::multiplier(m);
            if rate <= 0.0 {
                continue;
            }
            let end = (m + 1) as f64 * minute;
            let mut t = m as f64 * minute;
            loop {
                // Exponential gaps: -ln(U) / rate, U in (0, 1].
                let u: f64 = 1.0 - rng.random::<f64>();
                t += -u.ln() / rate;
                if t >= end {
                    break;
                }
                let out_tokens = (output.draw(&mut rng).round() as u32).clamp(1, 1024);
                // The engine's tokenizer adds a BOS token to the prompt's words.
                let room = max_model_len.saturating_sub(out_tokens + 1).max(16);
                let prompt_tokens = (prompt.draw(&mut rng).round() as u32).clamp(16, room);
                out.push(Arrival {
                    at_s: t,
                    prompt_tokens,
                    output_tokens: out_tokens,
                });
            }
        }
        out
    }
}

/// A lognormal by its median and mean: `μ = ln median`, `σ² = 2 ln(mean /
/// median)`.
#[derive(Debug, Clone, Copy)]
struct LogNormal {
    mu: f64,
    sigma: f64,
}

fn lognormal((median, mean): (f64, f64)) -> LogNormal {
    LogNormal {
        mu: median.ln(),
        sigma: (2.0 * (mean / median).ln()).max(0.0).sqrt(),
    }
}

impl LogNormal {
    /// One draw, through a standard normal by Box-Muller.
    fn draw(&self, rng: &mut impl Rng) -> f64 {
        let u1: f64 = 1.0 - rng.random::<f64>(); // (0, 1]
        let u2: f64 = rng.random();
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        (self.mu + self.sigma * z).exp()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trace_table_is_over_its_mean_and_the_burst_is_three_times_it() {
        let mean = CONV_MINUTES.iter().sum::<f64>() / CONV_MINUTES.len() as f64;
        assert!((mean - 1.0).abs() < 0.01, "{mean}");
        assert_eq!(Schedule::multiplier(38), 3.0);
        assert_eq!(Schedule::multiplier(37), 0.96);
        let s = Schedule {
            base: 4.0,
            minute: Duration::from_secs(10),
        };
        assert_eq!(s.duration(), Duration::from_secs(580));
        assert_eq!(s.rate_at(385.0), 12.0);
        let (peak, mean) = s.peak_and_mean();
        assert_eq!(peak, 12.0);
        assert!(mean > 4.4 && mean < 4.7, "{mean}"); // 1.14x with the burst
        let ahead = s.highest_rate(370.0, 379.9);
        // Ahead of the burst: its rate shows once the span reaches it.
        assert_eq!(ahead, 4.0 * 0.96);
        assert_eq!(s.highest_rate(375.0, 381.0), 12.0);
        assert_eq!(s.highest_rate(415.0, 425.0), 12.0);
        assert_eq!(s.highest_rate(600.0, 700.0), 0.0, "past the end");
    }

    #[test]
    fn arrivals_follow_the_rate_and_sizes_the_trace() {
        let s = Schedule {
            base: 20.0,
            minute: Duration::from_secs(10),
        };
        let a = s.arrivals(&CONV_SIZES, 8192, 7);
        assert_eq!(a, s.arrivals(&CONV_SIZES, 8192, 7), "seeded");
        let in_minute = |m: usize| {
            a.iter()
                .filter(|r| (r.at_s / 10.0).floor() as usize == m)
                .count() as f64
        };
        // Minute 27 (1.51x) against minute 57 (0.60x): 302 and 120 expected.
        assert!(
            in_minute(27) > 1.8 * in_minute(57),
            "{} {}",
            in_minute(27),
            in_minute(57)
        );
        assert!(in_minute(39) > 500.0, "the burst: {}", in_minute(39));
        let n = a.len() as f64;
        let mean_prompt = a.iter().map(|r| f64::from(r.prompt_tokens)).sum::<f64>() / n;
        let mean_out = a.iter().map(|r| f64::from(r.output_tokens)).sum::<f64>() / n;
        assert!((mean_prompt - 1155.0).abs() < 60.0, "{mean_prompt}");
        assert!((mean_out - 211.0).abs() < 25.0, "{mean_out}");
        assert!(a.iter().all(|r| r.prompt_tokens + r.output_tokens < 8192));
    }
}
