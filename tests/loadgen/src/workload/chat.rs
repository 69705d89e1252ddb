//! Multi-turn chat under cache pressure: many sessions hold conversations at
//! once; each turn's prompt is the shared system prompt, the session's own
//! history, every previous question and answer, and a new question, so a
//! session's previous turn is a cached prefix of its next one on the engine
//! that served it, for as long as that engine keeps it.
//!
//! The shape follows the field's multi-turn benchmarks: production-stack's
//! `benchmarks/multi-round-qa` (docs/field-benchmarks.md W13: a shared system
//! prompt, a per-user history, short answers, rounds that append the previous
//! question and answer; each user sends its next round `num_users / qps`
//! seconds after the last) and the Gateway API Inference Extension's
//! multi-chat prefix-cache variants (W2: completion API, multi-turn, Poisson
//! rates). Prompts are text sent to
//! `/v1/completions`, as in those inference-perf configs, so that every
//! router sees the same tokens.
//!
//! Requests are ordered turn by turn over the sessions (turn 1 of every
//! session, then turn 2, ...) and the workload is ordered per user: under
//! Poisson arrivals at `rate`, a session's next turn comes about
//! `sessions / rate` seconds after its previous one (its think time), and
//! never before the previous answer ended.
//!
//! Its *pressure* is its working set over the fleet's KV: the system prompt
//! once plus every session's longest prompt beyond it, in blocks. While a
//! session thinks, the others' turns compete for its blocks.

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::{text, Api, Prompt, RequestSpec, Workload};

/// Parameters of the multi-turn chat workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatParams {
    /// Concurrent conversations.
    pub sessions: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// System prompt shared by every session, in words (≈ tokens).
    pub system_tokens: usize,
    /// Each session's own history before its first question, in words.
    pub history_tokens: usize,
    /// Each user message, in words.
    pub question_tokens: usize,
    /// Each answer (`max_tokens`, and the synthesized assistant turn the next
    /// prompt carries).
    pub output_tokens: u32,
}

impl ChatParams {
    /// Prompt words of turn `t` (from 0).
    pub fn prompt_tokens(&self, t: usize) -> usize {
        self.system_tokens
            + self.history_tokens
            + t * (self.question_tokens + self.output_tokens as usize)
            + self.question_tokens
    }

    /// Working set over the fleet's KV: the system prompt once and every
    /// session's last prompt beyond it, in blocks, over
    /// `engines × blocks_per_engine`.
    pub fn pressure(&self, engines: usize, blocks_per_engine: usize, block_size: usize) -> f64 {
        let bs = block_size.max(1);
        let last = self.prompt_tokens(self.turns.saturating_sub(1));
        let own = last.saturating_sub(self.system_tokens);
        let demand = self.system_tokens.div_ceil(bs) + self.sessions * own.div_ceil(bs);
        demand as f64 / (engines * blocks_per_engine).max(1) as f64
    }

    /// Prompt tokens an ideal placement computes (every session on one
    /// engine that never evicts): the system prompt once, each session's
    /// history once, and each turn's new part (the previous answer, which the
    /// engine did not generate itself here, and the new question).
    pub fn ideal_computed_tokens(&self) -> u64 {
        let per_session = self.history_tokens
            + self.turns * self.question_tokens
            + self.turns.saturating_sub(1) * self.output_tokens as usize;
        (self.system_tokens + self.sessions * per_session) as u64
    }

    /// The requests, turn by turn over the sessions; user ids are session
    /// indices, and the workload is ordered per user.
    pub fn build(&self, seed: u64) -> Workload {
        let mut rng = StdRng::seed_from_u64(seed);
        let system = text::words(&mut rng, self.system_tokens);
        let mut convs: Vec<String> = (0..self.sessions)
            .map(|_| {
                let mut c = system.clone();
                text::push_words(&mut c, &mut rng, self.history_tokens);
                c
            })
            .collect();
        let mut requests = Vec::with_capacity(self.sessions * self.turns);
        for _turn in 0..self.turns {
            for (session, conv) in convs.iter_mut().enumerate() {
                text::push_words(conv, &mut rng, self.question_tokens);
                requests.push(RequestSpec {
                    user: session as u32,
                    api: Api::Completions,
                    prompt: Prompt::Text(conv.as_str().into()),
                    max_tokens: self.output_tokens,
                    stream: true,
                });
                text::push_words(conv, &mut rng, self.output_tokens as usize);
            }
        }
        Workload {
            name: "multi-turn-chat".into(),
            requests,
            ordered_per_user: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> ChatParams {
        ChatParams {
            sessions: 3,
            turns: 4,
            system_tokens: 32,
            history_tokens: 16,
            question_tokens: 8,
            output_tokens: 4,
        }
    }

    fn text(r: &RequestSpec) -> &str {
        match &r.prompt {
            Prompt::Text(t) => t,
            Prompt::Messages(_) => "",
        }
    }

    #[test]
    fn each_turn_extends_the_previous_one_and_sessions_share_the_system_prompt() {
        let p = small();
        let w = p.build(7);
        assert_eq!(w, p.build(7));
        assert!(w.ordered_per_user);
        assert_eq!(w.len(), p.sessions * p.turns);
        for s in 0..p.sessions as u32 {
            let turns: Vec<&RequestSpec> = w.requests.iter().filter(|r| r.user == s).collect();
            assert_eq!(turns.len(), p.turns);
            for (t, r) in turns.iter().enumerate() {
                assert_eq!(r.prompt_words(), p.prompt_tokens(t));
            }
            for pair in turns.windows(2) {
                assert!(text(pair[1]).starts_with(text(pair[0])));
            }
        }
        // Turn-major: the first `sessions` requests are every session's first turn.
        let firsts: Vec<u32> = w.requests[..p.sessions].iter().map(|r| r.user).collect();
        assert_eq!(firsts, vec![0, 1, 2]);
        let words = |i: usize| text(&w.requests[i]).split(' ').collect::<Vec<_>>();
        let (a, b) = (words(0), words(1));
        let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        assert!(common >= p.system_tokens && common < p.system_tokens + 4);
    }

    #[test]
    fn pressure_and_ideal_count_what_a_router_could_keep() {
        let p = small();
        // Last prompt 32 + 16 + 3 × 12 + 8 = 92 words; 60 beyond the system
        // prompt = 4 blocks of 16 per session, 2 for the system prompt.
        assert_eq!(p.prompt_tokens(3), 92);
        assert!((p.pressure(1, 14, 16) - 1.0).abs() < 1e-9);
        assert_eq!(p.ideal_computed_tokens(), 32 + 3 * (16 + 4 * 8 + 3 * 4));
    }
}
