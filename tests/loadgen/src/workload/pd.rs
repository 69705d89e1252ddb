//! Long prompts with short answers beside a steady stream of short requests
//! (llm-d's P/D benchmark, docs/field-benchmarks.md W7: ISL 5000 / OSL 250).
//! In an aggregated engine every long prefill stalls the decodes running
//! beside it; a disaggregated set-up keeps the short requests' inter-token
//! latency flat.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{text, Api, Prompt, RequestSpec, Size, Workload};
use crate::load::Load;

/// Parameters of the P/D workload. Prompts are random (no shared prefix).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdParams {
    pub long_requests: usize,
    pub long_input: usize,
    pub long_output: u32,
    /// Short requests per long one, interleaved at random.
    pub short_per_long: usize,
    pub short_input: usize,
    pub short_output: u32,
}

impl PdParams {
    /// 120 long requests of ISL 5000 / OSL 250, 3 short (100 / 100) per long one.
    pub fn full() -> Self {
        PdParams {
            long_requests: 120,
            long_input: 5000,
            long_output: 250,
            short_per_long: 3,
            short_input: 100,
            short_output: 100,
        }
    }

    /// 8 long requests of 1000 / 50, 3 short (32 / 32) per long one.
    pub fn small() -> Self {
        PdParams {
            long_requests: 8,
            long_input: 1000,
            long_output: 50,
            short_per_long: 3,
            short_input: 32,
            short_output: 32,
        }
    }

    /// [`Self::small`] or [`Self::full`].
    pub fn sized(size: Size) -> Self {
        match size {
            Size::Small => Self::small(),
            Size::Full => Self::full(),
        }
    }

    /// Long and short requests mixed at random (seeded), the long ones
    /// spread evenly in expectation. Every request is its own user.
    pub fn build(&self, seed: u64) -> Workload {
        let mut rng = StdRng::seed_from_u64(seed);
        let total = self.long_requests * (1 + self.short_per_long);
        let mut longs_left = self.long_requests;
        let mut requests = Vec::with_capacity(total);
        for i in 0..total {
            let left = total - i;
            // Pick "long" with probability longs_left / left: exactly
            // `long_requests` long ones, uniformly placed.
            let long = rng.random_range(0..left) < longs_left;
            let (input, output) = if long {
                longs_left -= 1;
                (self.long_input, self.long_output)
            } else {
                (self.short_input, self.short_output)
            };
            requests.push(RequestSpec {
                user: i as u32,
                api: Api::Completions,
                prompt: Prompt::Text(text::words(&mut rng, input).into()),
                max_tokens: output,
                stream: true,
            });
        }
        Workload {
            name: "pd".into(),
            requests,
            ordered_per_user: false,
        }
    }

    /// Steady Poisson arrivals, every request once: 6/s full (W7's constant
    /// rate scaled to a 2-core box), 4/s small.
    pub fn suggested_load(&self) -> Load {
        let n = self.long_requests * (1 + self.short_per_long);
        let rate = if self.long_input >= 5000 { 6.0 } else { 4.0 };
        Load::poisson(rate, n)
    }
}
