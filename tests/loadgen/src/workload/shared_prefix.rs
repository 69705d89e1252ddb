//! Shared prefix ("high system-prompt ratio", docs/field-benchmarks.md W1):
//! groups of users sharing a long system prompt, each user with their own
//! question. The
//! canonical prefix-routing benchmark: a router that keeps a group on the
//! engine that holds its system prompt wins.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::{text, Api, Prompt, RequestSpec, Size, Workload};
use crate::load::Load;

/// Parameters (docs/field-benchmarks.md W1 in the full size).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPrefixParams {
    pub groups: usize,
    pub users_per_group: usize,
    /// System prompt length in words (≈ tokens).
    pub system_tokens: usize,
    /// Question length in words (≈ tokens).
    pub question_tokens: usize,
    pub output_tokens: u32,
}

impl SharedPrefixParams {
    /// 150 groups × 5 users, 6000-token system prompt, 1200-token question,
    /// 1000-token answer.
    pub fn full() -> Self {
        SharedPrefixParams {
            groups: 150,
            users_per_group: 5,
            system_tokens: 6000,
            question_tokens: 1200,
            output_tokens: 1000,
        }
    }

    /// 8 groups × 4 users, 600 / 60 / 32 tokens: the same shape, seconds on 2 cores.
    pub fn small() -> Self {
        SharedPrefixParams {
            groups: 8,
            users_per_group: 4,
            system_tokens: 600,
            question_tokens: 60,
            output_tokens: 32,
        }
    }

    /// [`Self::small`] or [`Self::full`].
    pub fn sized(size: Size) -> Self {
        match size {
            Size::Small => Self::small(),
            Size::Full => Self::full(),
        }
    }

    /// One request per user, users of all groups interleaved in a seeded
    /// order (a router sees the groups mixed, as in production). User ids
    /// are `group * users_per_group + index`.
    pub fn build(&self, seed: u64) -> Workload {
        let mut rng = StdRng::seed_from_u64(seed);
        let systems: Vec<String> = (0..self.groups)
            .map(|_| text::words(&mut rng, self.system_tokens))
            .collect();
        let mut users: Vec<(usize, usize)> = (0..self.groups)
            .flat_map(|g| (0..self.users_per_group).map(move |u| (g, u)))
            .collect();
        users.shuffle(&mut rng);
        let requests = users
            .into_iter()
            .map(|(g, u)| {
                let mut prompt = systems[g].clone();
                text::push_words(&mut prompt, &mut rng, self.question_tokens);
                RequestSpec {
                    user: (g * self.users_per_group + u) as u32,
                    api: Api::Completions,
                    prompt: Prompt::Text(prompt.into()),
                    max_tokens: self.output_tokens,
                    stream: true,
                }
            })
            .collect();
        Workload {
            name: "shared-prefix".into(),
            requests,
            ordered_per_user: false,
        }
    }

    /// Poisson arrivals: the full size runs the W1 ladder's shape (3 → 60/s,
    /// 20 s a step, cycling the 750 prompts); the small size two steps of the
    /// workload's request count each.
    pub fn suggested_load(&self) -> Load {
        let n = self.groups * self.users_per_group;
        if n >= 500 {
            let steps: Vec<(f64, Duration)> = [3.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
                .iter()
                .map(|&r| (r, Duration::from_secs(20)))
                .collect();
            Load::poisson_ladder(&steps)
        } else {
            let mut load = Load::poisson(4.0, n);
            let mut second = load.stages[0].clone();
            second.arrival = crate::load::Arrival::Poisson { rate: 8.0 };
            load.stages.push(second);
            load
        }
    }
}
