//! Very long bodies at rising concurrency (docs/field-benchmarks.md W6, the
//! router-overhead case users report): 200 KB prompts, streaming completions,
//! concurrency ladder. What it shows is how a proxy's per-byte work grows with
//! load.

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::{text, Api, Prompt, RequestSpec, Size, Workload};
use crate::load::Load;

/// Parameters of the long-body workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LongBodyParams {
    /// Prompt size in bytes (words, ~7 bytes each).
    pub prompt_bytes: usize,
    pub output_tokens: u32,
    /// Concurrency of each stage.
    pub concurrency: Vec<usize>,
    /// Requests per stage.
    pub requests_per_stage: usize,
    /// Distinct prompts generated (requests cycle over them; 200 KB each).
    pub distinct_prompts: usize,
    pub stream: bool,
}

impl LongBodyParams {
    /// 200 KB prompts at concurrency 20, 60, 100, 150, 200, 400 requests a stage.
    pub fn full() -> Self {
        LongBodyParams {
            prompt_bytes: 200_000,
            output_tokens: 16,
            concurrency: vec![20, 60, 100, 150, 200],
            requests_per_stage: 400,
            distinct_prompts: 64,
            stream: true,
        }
    }

    /// 200 KB prompts at concurrency 1, 4, 8, 16, 32 requests a stage.
    pub fn small() -> Self {
        LongBodyParams {
            prompt_bytes: 200_000,
            output_tokens: 8,
            concurrency: vec![1, 4, 8],
            requests_per_stage: 32,
            distinct_prompts: 8,
            stream: true,
        }
    }

    /// [`Self::small`] or [`Self::full`].
    pub fn sized(size: Size) -> Self {
        match size {
            Size::Small => Self::small(),
            Size::Full => Self::full(),
        }
    }

    /// `requests_per_stage × stages` requests cycling over
    /// `distinct_prompts` random prompts; every request its own user.
    pub fn build(&self, seed: u64) -> Workload {
        let mut rng = StdRng::seed_from_u64(seed);
        let prompts: Vec<Arc<str>> = (0..self.distinct_prompts.max(1))
            .map(|_| text::words_of_bytes(&mut rng, self.prompt_bytes).into())
            .collect();
        let total = self.requests_per_stage * self.concurrency.len().max(1);
        let requests = (0..total)
            .map(|i| RequestSpec {
                user: i as u32,
                api: Api::Completions,
                prompt: Prompt::Text(prompts[i % prompts.len()].clone()),
                max_tokens: self.output_tokens,
                stream: self.stream,
            })
            .collect();
        Workload {
            name: "long-body".into(),
            requests,
            ordered_per_user: false,
        }
    }

    /// The concurrency ladder.
    pub fn suggested_load(&self) -> Load {
        let steps: Vec<(usize, usize)> = self
            .concurrency
            .iter()
            .map(|&c| (c, self.requests_per_stage))
            .collect();
        Load::closed_ladder(&steps)
    }
}
