//! Shared prefix under cache pressure: many system-prompt groups, more than
//! the fleet's KV cache holds at once, drawn with Zipf popularity. Each
//! request is one user of a group: the group's system prompt, then a fresh
//! question. Where the groups' system prompts together exceed the fleet's KV
//! capacity, a router decides which groups stay resident where, and a wrong
//! placement shows as prompt tokens computed again.
//!
//! Its *pressure* is its working set over the fleet's KV capacity: every
//! group's system prompt once (what a router could keep cached and reuse),
//! over the blocks the engines hold. llm-d's benchmark
//! (docs/field-benchmarks.md P1) states its "cache demand" with the questions
//! counted too; they are never reused, so they are left out here.
//!
//! The shape follows the field's prefix-caching benchmarks
//! (docs/field-benchmarks.md W1 and P15: the many-groups, skewed-popularity
//! set-ups of llm-d's and SGLang's routing benchmarks: long shared system
//! prompts, short questions, Zipf popularity), scaled to a few simulated
//! engines.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{text, Api, Prompt, RequestSpec, Workload};

/// Parameters of the shared-prefix-under-pressure workload.
#[derive(Debug, Clone, PartialEq)]
pub struct PressureParams {
    /// System-prompt groups (at least 4× the engines, for the field's shape).
    pub groups: usize,
    /// Requests in all.
    pub requests: usize,
    /// Zipf exponent of group popularity: group `k` (from 0) is drawn with
    /// probability ∝ `1 / (k + 1)^s`; 0 is uniform.
    pub zipf_s: f64,
    /// System prompt length in words (≈ tokens).
    pub system_tokens: usize,
    /// Question length in words (≈ tokens).
    pub question_tokens: usize,
    pub output_tokens: u32,
}

impl PressureParams {
    /// 32 groups of a 512-token system prompt, Zipf 0.8, 48-token questions,
    /// 32-token answers; sized for 4 engines of ~100 blocks of 16 tokens.
    pub fn small(requests: usize) -> Self {
        PressureParams {
            groups: 32,
            requests,
            zipf_s: 0.8,
            system_tokens: 512,
            question_tokens: 48,
            output_tokens: 32,
        }
    }

    /// Working set over the fleet's KV: every group's system prompt once, in
    /// blocks, over `engines × blocks_per_engine`.
    pub fn pressure(&self, engines: usize, blocks_per_engine: usize, block_size: usize) -> f64 {
        let demand = self.groups * self.system_tokens.div_ceil(block_size.max(1));
        demand as f64 / (engines * blocks_per_engine).max(1) as f64
    }

    /// Prompt tokens an ideal placement computes for `workload` (built from
    /// these parameters): each group's system prompt once, every question.
    pub fn ideal_computed_tokens(&self, workload: &Workload) -> u64 {
        let mut seen = std::collections::HashSet::new();
        for r in &workload.requests {
            if let Prompt::Text(t) = &r.prompt {
                let head: String = t.split_whitespace().take(16).collect::<Vec<_>>().join(" ");
                seen.insert(head);
            }
        }
        (seen.len() * self.system_tokens + workload.requests.len() * self.question_tokens) as u64
    }

    /// The requests, in arrival order; user ids are request indices (every
    /// request is its own user), and the group of request `i` is drawn from
    /// the Zipf law with `seed`.
    pub fn build(&self, seed: u64) -> Workload {
        let mut rng = StdRng::seed_from_u64(seed);
        let systems: Vec<String> = (0..self.groups)
            .map(|_| text::words(&mut rng, self.system_tokens))
            .collect();
        let cdf = zipf_cdf(self.groups, self.zipf_s);
        let requests = (0..self.requests)
            .map(|i| {
                let u: f64 = rng.random();
                let g = cdf.partition_point(|&c| c < u).min(self.groups - 1);
                let mut prompt = systems[g].clone();
                text::push_words(&mut prompt, &mut rng, self.question_tokens);
                RequestSpec {
                    user: i as u32,
                    api: Api::Completions,
                    prompt: Prompt::Text(prompt.into()),
                    max_tokens: self.output_tokens,
                    stream: true,
                }
            })
            .collect();
        Workload {
            name: "shared-prefix-pressure".into(),
            requests,
            ordered_per_user: false,
        }
    }
}

/// Cumulative Zipf probabilities of `n` ranks with exponent `s` (last = 1).
fn zipf_cdf(n: usize, s: f64) -> Vec<f64> {
    let weights: Vec<f64> = (0..n).map(|k| 1.0 / ((k + 1) as f64).powf(s)).collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    weights
        .iter()
        .map(|w| {
            acc += w / total;
            acc
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_favours_low_ranks_and_is_seeded() {
        let p = PressureParams::small(2_000);
        let a = p.build(1);
        assert_eq!(a, p.build(1));
        assert_ne!(a, p.build(2));
        let head = |w: &Workload, k: usize| {
            w.requests
                .iter()
                .filter(|r| match &r.prompt {
                    Prompt::Text(t) => t.starts_with(&*group_text(&p, 1, k)),
                    Prompt::Messages(_) => false,
                })
                .count()
        };
        let top = head(&a, 0);
        let tenth = head(&a, 9);
        // P(rank 0) / P(rank 9) = 10^0.8 ≈ 6.3.
        assert!(top > 3 * tenth, "rank 0: {top}, rank 9: {tenth}");
        assert!(tenth > 0);
    }

    fn group_text(p: &PressureParams, seed: u64, k: usize) -> String {
        let mut rng = StdRng::seed_from_u64(seed);
        let systems: Vec<String> = (0..p.groups)
            .map(|_| text::words(&mut rng, p.system_tokens))
            .collect();
        systems[k].clone()
    }

    #[test]
    fn pressure_is_working_set_over_capacity() {
        let p = PressureParams::small(10);
        // 32 groups × 32 blocks = 1024 blocks over 4 × 128.
        assert!((p.pressure(4, 128, 16) - 2.0).abs() < 1e-9);
    }

    #[test]
    fn ideal_counts_each_group_once() {
        let p = PressureParams {
            groups: 3,
            ..PressureParams::small(50)
        };
        let w = p.build(3);
        assert_eq!(p.ideal_computed_tokens(&w), 3 * 512 + 50 * 48);
    }

    #[test]
    fn uniform_when_s_is_zero() {
        let cdf = zipf_cdf(4, 0.0);
        assert!((cdf[1] - 0.5).abs() < 1e-9 && (cdf[3] - 1.0).abs() < 1e-9);
    }
}
