//! Calibrating a profile's time to first token to one real engine, from TTFTs measured on it.
//!
//! A built-in profile is fitted once, on one machine; a real engine's fixed cost per request and its
//! prefill speed change with the machine and with what else runs on it. The fidelity check against
//! real vLLM therefore measures a calibration workload on the engine first (prompts of several
//! lengths, some partly cached), fits `ttft = fixed + per_token * uncached_tokens` to it, and runs the
//! simulator on a different workload, with the fitted costs corrected for the simulator's own time:
//! the simulator runs the calibration workload with the profile, its fit is compared with the real
//! one, and the profile moves by the difference ([`TtftFit::corrected`]). The fit is Theil-Sen (the median of the
//! slopes between pairs of samples, then the median intercept), so a few requests slowed down by a
//! busy machine move it little, where least squares would follow them. The spread of the samples
//! around the fit (a robust standard deviation) becomes the profile's `api_overhead_std_ms`, so the
//! simulator's TTFTs scatter as the engine's do.

use crate::profile::LatencyProfile;
use crate::SimError;

/// One measured request: the prompt tokens the engine had to compute (prompt minus cached) and the
/// time to its first token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TtftSample {
    pub uncached_tokens: usize,
    pub ttft_ms: f64,
}

/// `ttft_ms = fixed_ms + ms_per_token * uncached_tokens`, give or take `spread_ms`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TtftFit {
    pub fixed_ms: f64,
    pub ms_per_token: f64,
    /// How far the samples scatter around the line: 1.4826 x the median absolute residual, which
    /// is the standard deviation for normal scatter and ignores a few outliers.
    pub spread_ms: f64,
    /// Samples the fit used.
    pub samples: usize,
}

/// Pairs whose uncached lengths differ by less than this give no slope: their difference is
/// mostly noise.
const MIN_SPREAD_TOKENS: usize = 32;

/// Fits [`TtftFit`] to `samples` (Theil-Sen). Needs samples at least [`MIN_SPREAD_TOKENS`] apart
/// in length; both results are clamped at zero.
pub fn fit_ttft(samples: &[TtftSample]) -> Result<TtftFit, SimError> {
    if samples
        .iter()
        .any(|s| !s.ttft_ms.is_finite() || s.ttft_ms < 0.0)
    {
        return Err(SimError::Config(
            "calibration: every TTFT must be a finite, non-negative number of ms".into(),
        ));
    }
    let mut slopes = Vec::new();
    for (i, a) in samples.iter().enumerate() {
        for b in &samples[i + 1..] {
            if a.uncached_tokens.abs_diff(b.uncached_tokens) >= MIN_SPREAD_TOKENS {
                let dx = b.uncached_tokens as f64 - a.uncached_tokens as f64;
                slopes.push((b.ttft_ms - a.ttft_ms) / dx);
            }
        }
    }
    let Some(slope) = median(&mut slopes) else {
        return Err(SimError::Config(format!(
            "calibration: no two samples are {MIN_SPREAD_TOKENS} or more uncached tokens apart"
        )));
    };
    let slope = slope.max(0.0);
    let mut intercepts: Vec<f64> = samples
        .iter()
        .map(|s| s.ttft_ms - slope * s.uncached_tokens as f64)
        .collect();
    let fixed = median(&mut intercepts).unwrap_or(0.0).max(0.0);
    let mut residuals: Vec<f64> = samples
        .iter()
        .map(|s| (s.ttft_ms - fixed - slope * s.uncached_tokens as f64).abs())
        .collect();
    Ok(TtftFit {
        fixed_ms: fixed,
        ms_per_token: slope,
        spread_ms: 1.4826 * median(&mut residuals).unwrap_or(0.0),
        samples: samples.len(),
    })
}

impl TtftFit {
    /// One step of fitting a simulator to a real engine: this fit was the simulator's profile, the
    /// simulator then measured `got` on the calibration workload where the real engine measured
    /// `target`; the next profile adds the difference. The simulator's own time (HTTP, tokenizing;
    /// large in a debug build on a busy machine, and partly overlapping the simulated API time) is
    /// thereby taken out as it really behaves, not as a model of it. The spread moves by the
    /// difference of the variances, since the simulator's own scatter adds to the drawn one.
    /// Clamped at zero.
    pub fn corrected(&self, target: &TtftFit, got: &TtftFit) -> TtftFit {
        let variance = self.spread_ms.powi(2) + target.spread_ms.powi(2) - got.spread_ms.powi(2);
        TtftFit {
            fixed_ms: (self.fixed_ms + target.fixed_ms - got.fixed_ms).max(0.0),
            ms_per_token: (self.ms_per_token + target.ms_per_token - got.ms_per_token).max(0.0),
            spread_ms: variance.max(0.0).sqrt(),
            samples: target.samples,
        }
    }
}

/// The profile to try next after rounds `a` and then `b` (each the fit tried and what the
/// simulator measured with it): per component, the straight line through the two rounds solved
/// for `target` (a secant step), where the rounds tried different values and the simulator
/// answered in the same direction; otherwise [`TtftFit::corrected`] from `b`. The simulator's own
/// time is not a constant offset (a timer tick per sleep, work that grows with the prompt), so a
/// unit-slope correction overshoots, and one clamped at zero can swing between rounds; the
/// secant measures the slope instead of assuming it. Clamped at zero.
pub fn secant(a: (&TtftFit, &TtftFit), b: (&TtftFit, &TtftFit), target: &TtftFit) -> TtftFit {
    let fallback = b.0.corrected(target, b.1);
    let solve = |tried: [f64; 2], got: [f64; 2], want: f64, otherwise: f64| {
        let (dt, dg) = (tried[1] - tried[0], got[1] - got[0]);
        if dt.abs() > 1e-9 && dg / dt > 0.0 {
            (tried[1] + (want - got[1]) * dt / dg).max(0.0)
        } else {
            otherwise
        }
    };
    TtftFit {
        fixed_ms: solve(
            [a.0.fixed_ms, b.0.fixed_ms],
            [a.1.fixed_ms, b.1.fixed_ms],
            target.fixed_ms,
            fallback.fixed_ms,
        ),
        ms_per_token: solve(
            [a.0.ms_per_token, b.0.ms_per_token],
            [a.1.ms_per_token, b.1.ms_per_token],
            target.ms_per_token,
            fallback.ms_per_token,
        ),
        spread_ms: fallback.spread_ms,
        samples: target.samples,
    }
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

impl LatencyProfile {
    /// This profile with its TTFT costs replaced by `fit`: the prefill cost per token, and the fixed
    /// part split between the API server (`api_overhead_ms`) and the step (`step_base_ms`, kept unless
    /// the fixed cost is smaller), and the spread as the API server's (`api_overhead_std_ms`).
    /// Decode and transfer costs are left as they are.
    pub fn with_ttft_fit(&self, fit: &TtftFit) -> LatencyProfile {
        let step_base_ms = self.step_base_ms.min(fit.fixed_ms);
        LatencyProfile {
            name: format!("{}+calibrated", self.name),
            api_overhead_ms: fit.fixed_ms - step_base_ms,
            api_overhead_std_ms: fit.spread_ms,
            step_base_ms,
            prefill_ms_per_token: fit.ms_per_token,
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fit(fixed_ms: f64, ms_per_token: f64) -> TtftFit {
        TtftFit {
            fixed_ms,
            ms_per_token,
            spread_ms: 0.0,
            samples: 10,
        }
    }

    #[test]
    fn the_secant_step_hits_a_target_through_a_sloped_simulator() {
        // The simulator answers 2.9 ms + 1.6 x the fixed time it is given (one timer tick per
        // sleep, and sleeps that add up): a unit-slope correction overshoots, the secant lands.
        let sim = |f: &TtftFit| fit(2.9 + 1.6 * f.fixed_ms, 0.001 + f.ms_per_token);
        let target = fit(4.2, 0.0112);
        let a = target;
        let b = fit(0.0, 0.0097);
        let next = secant((&a, &sim(&a)), (&b, &sim(&b)), &target);
        assert!(
            (sim(&next).fixed_ms - target.fixed_ms).abs() < 1e-9,
            "{next:?}"
        );
        assert!((sim(&next).ms_per_token - target.ms_per_token).abs() < 1e-9);
        // Same value tried twice: no slope to measure, the plain correction.
        let same = secant((&b, &sim(&b)), (&b, &sim(&b)), &target);
        assert_eq!(same, b.corrected(&target, &sim(&b)));
    }

    fn s(uncached_tokens: usize, ttft_ms: f64) -> TtftSample {
        TtftSample {
            uncached_tokens,
            ttft_ms,
        }
    }

    #[test]
    fn an_exact_line_is_recovered() {
        let samples: Vec<_> = [20, 40, 300, 500]
            .iter()
            .map(|&x| s(x, 18.0 + 0.04 * x as f64))
            .collect();
        let fit = fit_ttft(&samples).unwrap();
        assert!((fit.fixed_ms - 18.0).abs() < 1e-9, "{fit:?}");
        assert!((fit.ms_per_token - 0.04).abs() < 1e-9, "{fit:?}");
        assert_eq!(fit.samples, 4);
        assert!(fit.spread_ms.abs() < 1e-9, "{fit:?}");
    }

    #[test]
    fn the_spread_is_the_scatter_around_the_line() {
        let samples: Vec<_> = [20, 300, 500]
            .iter()
            .flat_map(|&x| [-2.0, 2.0].map(|d| s(x, 18.0 + 0.04 * x as f64 + d)))
            .collect();
        let fit = fit_ttft(&samples).unwrap();
        assert!((fit.fixed_ms - 18.0).abs() < 1e-9, "{fit:?}");
        assert!((fit.spread_ms - 1.4826 * 2.0).abs() < 1e-9, "{fit:?}");
    }

    #[test]
    fn one_slow_outlier_moves_the_fit_little() {
        let mut samples: Vec<_> = [10, 20, 30, 250, 260, 270, 500, 510]
            .iter()
            .map(|&x| s(x, 20.0 + 0.05 * x as f64))
            .collect();
        samples.push(s(20, 400.0)); // one request stuck behind a compiler
        let fit = fit_ttft(&samples).unwrap();
        assert!((fit.fixed_ms - 20.0).abs() < 2.0, "{fit:?}");
        assert!((fit.ms_per_token - 0.05).abs() < 0.01, "{fit:?}");
    }

    #[test]
    fn a_correction_step_moves_the_profile_by_the_difference() {
        let fit = |fixed_ms, ms_per_token, spread_ms| TtftFit {
            fixed_ms,
            ms_per_token,
            spread_ms,
            samples: 18,
        };
        let real = fit(26.0, 0.09, 4.0);
        // The simulator, run with the real fit as its profile, came out 8 ms slower, a little
        // steeper and scattering a little more: its own time.
        let got = fit(34.0, 0.1, 5.0);
        let next = real.corrected(&real, &got);
        assert!((next.fixed_ms - 18.0).abs() < 1e-9, "{next:?}");
        assert!((next.ms_per_token - 0.08).abs() < 1e-9, "{next:?}");
        // 16 + 16 - 25: the simulator's own 3 ms of scatter is taken out of the drawn part.
        assert!((next.spread_ms - 7f64.sqrt()).abs() < 1e-9, "{next:?}");
        // Never negative.
        let next = fit(1.0, 0.0, 1.0).corrected(&real, &fit(40.0, 0.5, 9.0));
        assert_eq!(
            (next.fixed_ms, next.ms_per_token, next.spread_ms),
            (0.0, 0.0, 0.0)
        );
    }

    #[test]
    fn samples_without_spread_are_refused() {
        assert!(fit_ttft(&[s(100, 30.0), s(110, 31.0)]).is_err());
        assert!(fit_ttft(&[]).is_err());
        assert!(fit_ttft(&[s(10, f64::NAN), s(300, 40.0)]).is_err());
    }

    #[test]
    fn the_fit_replaces_only_ttft_costs() {
        let base = LatencyProfile::vllm_cpu_tiny();
        let fit = TtftFit {
            fixed_ms: 30.0,
            ms_per_token: 0.08,
            spread_ms: 2.5,
            samples: 8,
        };
        let p = base.with_ttft_fit(&fit);
        assert_eq!(p.name, "vllm-cpu-tiny+calibrated");
        let ttft =
            p.api_overhead_ms + p.step_seconds(&crate::profile::StepLoad::prefill(200)) * 1000.0;
        assert!((ttft - (30.0 + 0.08 * 200.0)).abs() < 1e-9, "{ttft}");
        assert_eq!(p.api_overhead_std_ms, 2.5);
        assert_eq!(p.decode_ms_per_seq, base.decode_ms_per_seq);
        assert_eq!(p.kv_transfer_base_ms, base.kv_transfer_base_ms);
        assert!(p.validate().is_ok());
        // A fixed cost below the step's base shrinks the base rather than going negative.
        let tiny = base.with_ttft_fit(&TtftFit {
            fixed_ms: 1.0,
            ..fit
        });
        assert_eq!((tiny.api_overhead_ms, tiny.step_base_ms), (0.0, 1.0));
    }
}
