//! Multi-turn chat (production-stack's multi-round QA,
//! docs/field-benchmarks.md W13): users hold conversations; each turn's prompt
//! carries the whole conversation so far, so a user's previous turn is a
//! cached prefix of the next one — on the engine that served it.
//!
//! The assistant turns in later prompts are synthesized by the generator
//! (not the engine's actual answers), so the workload is fixed by its seed;
//! the engine still caches them, as they are part of the prompt it prefilled.

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::{text, Api, Message, Prompt, RequestSpec, Size, Workload};
use crate::load::Load;

/// Parameters of the multi-turn chat workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MultiTurnParams {
    pub users: usize,
    pub turns: usize,
    /// System prompt shared by all users, in words (≈ tokens).
    pub system_tokens: usize,
    /// Each user message, in words.
    pub question_tokens: usize,
    /// Each answer (`max_tokens`, and the synthesized assistant turn).
    pub output_tokens: u32,
}

impl MultiTurnParams {
    /// 20 users × 8 turns, 1000-token shared system prompt, 200-token
    /// questions, 100-token answers (W13's shape, more rounds).
    pub fn full() -> Self {
        MultiTurnParams {
            users: 20,
            turns: 8,
            system_tokens: 1000,
            question_tokens: 200,
            output_tokens: 100,
        }
    }

    /// 4 users × 3 turns, 128 / 32 / 16 tokens.
    pub fn small() -> Self {
        MultiTurnParams {
            users: 4,
            turns: 3,
            system_tokens: 128,
            question_tokens: 32,
            output_tokens: 16,
        }
    }

    /// [`Self::small`] or [`Self::full`].
    pub fn sized(size: Size) -> Self {
        match size {
            Size::Small => Self::small(),
            Size::Full => Self::full(),
        }
    }

    /// Turn 1 of every user, then turn 2 of every user, and so on; the
    /// workload is ordered per user, so turn k+1 waits for turn k.
    pub fn build(&self, seed: u64) -> Workload {
        let mut rng = StdRng::seed_from_u64(seed);
        let system = Message {
            role: "system".into(),
            content: text::words(&mut rng, self.system_tokens),
        };
        let mut convs: Vec<Vec<Message>> = vec![vec![system]; self.users];
        let mut requests = Vec::with_capacity(self.users * self.turns);
        for _turn in 0..self.turns {
            for (user, conv) in convs.iter_mut().enumerate() {
                conv.push(Message {
                    role: "user".into(),
                    content: text::words(&mut rng, self.question_tokens),
                });
                requests.push(RequestSpec {
                    user: user as u32,
                    api: Api::Chat,
                    prompt: Prompt::Messages(conv.clone()),
                    max_tokens: self.output_tokens,
                    stream: true,
                });
                conv.push(Message {
                    role: "assistant".into(),
                    content: text::words(&mut rng, self.output_tokens as usize),
                });
            }
        }
        Workload {
            name: "multi-turn".into(),
            requests,
            ordered_per_user: true,
        }
    }

    /// Closed loop with one worker per user (each user waits for its answer,
    /// as a person would), every request once.
    pub fn suggested_load(&self) -> Load {
        Load::closed(self.users.max(1), self.users * self.turns)
    }
}
