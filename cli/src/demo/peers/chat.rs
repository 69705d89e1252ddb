//! The multi-turn chat workload of the peers benchmark: sessions whose
//! prompts grow each turn, on the pressured fleet of shared-prefix-pressure.

use kvmesh_loadgen::workload::ChatParams;

use super::{peers_spec, quick_routers, Bench, PeersOpts, Router, Slo};
use crate::demo::fleet::FleetSpec;
use crate::demo::DemoError;

/// Sessions per engine (less one, for a count coprime with the engines).
pub const SESSIONS_PER_ENGINE: usize = 32;
/// KV blocks (of 16 tokens) per engine, for the working set of
/// [`SESSIONS_PER_ENGINE`] sessions.
pub const BLOCKS_PER_ENGINE: usize = 2048;

/// The multi-turn fleet and workload: [`SESSIONS_PER_ENGINE`] sessions per
/// engine less one, each a 512-token history after a 256-token system prompt
/// all share, 64-token questions and answers, `turns` turns (4 quick, 5
/// full), on engines of [`BLOCKS_PER_ENGINE`] blocks. The sessions' working
/// set is about the fleet's KV (0.92 quick, 1.04 full): it fits when each
/// session stays on one pod, and thrashes when sessions spread.
///
/// A turn waits for the session's previous answer, so the sessions bound the
/// load a run can offer: about sessions / (a turn's latency, 1.2 s unloaded
/// and more near capacity). 8 sessions per engine (the first version) capped
/// it near 25 req/s, below every router's capacity, and the workload
/// separated nobody. Sessions (and, to keep the working set about the
/// fleet's KV, the engines' blocks) are scaled 4x, every length as it was:
/// the bound is now near 80 req/s, where a turn's latency (about 1.6 s)
/// meets the think time (127 sessions / 80 req/s) and the sessions hold even
/// the fastest router back.
///
/// The session count is coprime with the engines: requests go out turn by
/// turn over the sessions, so with a multiple of the engines a client that
/// spreads requests in turn (round-robin) would send every turn of a session
/// to the same pod by arithmetic, a session affinity no Service has.
pub fn chat_setup(engines: usize, turns: usize) -> Result<(FleetSpec, ChatParams), DemoError> {
    let mut spec = peers_spec(engines)?;
    spec.num_blocks = BLOCKS_PER_ENGINE;
    let p = ChatParams {
        sessions: coprime_below(SESSIONS_PER_ENGINE * engines, engines),
        turns,
        system_tokens: 256,
        history_tokens: 512,
        question_tokens: 64,
        output_tokens: 64,
    };
    Ok((spec, p))
}

pub(super) fn multi_turn_chat(opts: &PeersOpts) -> Result<Bench, DemoError> {
    let (spec, mut p) = chat_setup(opts.engines, if opts.quick { 4 } else { 5 })?;
    if let Some(n) = opts.requests {
        p.sessions = coprime_below((n / p.turns).max(1), spec.engines);
    }
    let pressure = p.pressure(spec.engines, spec.num_blocks, spec.block_size);
    // Measured (--quick, 2 seeds): round-robin's capacity lies between 40 and
    // 60 req/s, SMG cache_aware's between 20 and 40, kvmesh's between 60 and
    // 80; at 80 the sessions hold every router back (a turn waits for the
    // previous answer), which the SLO counts as a miss (sweep::MIN_SENT_SHARE).
    let rates = opts.rates.clone().unwrap_or_else(|| {
        if opts.quick {
            vec![40.0, 80.0]
        } else {
            vec![30.0, 60.0, 90.0]
        }
    });
    // Quick: round-robin, SMG cache_aware, kvmesh and kvmesh on Valkey
    // (what the targets compare); full: every shared-prefix router.
    let routers = quick_routers(opts, &[Router::KvmeshValkey]);
    let think = |rate: f64| p.sessions as f64 / rate;
    Ok(Bench {
        name: "multi-turn-chat",
        description: format!(
            "{} sessions x {} turns: a {}-token system prompt all share, a {}-token history per session, \
             {}-token questions, {}-token answers, each turn carrying the whole conversation so far \
             (prompts {} to {} tokens); think time sessions / rate ({:.1} to {:.1} s); \
             {} engines of {} blocks of {} tokens ({}, x{} time); {} requests per run",
            p.sessions,
            p.turns,
            p.system_tokens,
            p.history_tokens,
            p.question_tokens,
            p.output_tokens,
            p.prompt_tokens(0),
            p.prompt_tokens(p.turns.saturating_sub(1)),
            think(rates.last().copied().unwrap_or(1.0)),
            think(rates.first().copied().unwrap_or(1.0)),
            spec.engines,
            spec.num_blocks,
            spec.block_size,
            spec.profile.name,
            spec.time_scale,
            p.sessions * p.turns,
        ),
        source: "production-stack multi-round QA (docs/field-benchmarks.md W13: 10 users x 5 rounds, \
                 1000-token shared system prompt, 2000-token user history, 100-token answers, each user's \
                 next round num_users / qps later) and GIE's multi-chat prefix-cache variants (W2: completion \
                 API, multi-turn, Poisson rates), scaled to 4 simulated engines: lengths 1.5-4x shorter, \
                 about 32 sessions per engine (so that they can offer the rates where routers separate) on \
                 engines whose KV their working set about fills",
        slo: Slo {
            ttft_p90_ms: 1000.0,
            itl_p99_ms: 200.0,
        },
        pressure: Some(pressure),
        spec,
        rates,
        routers,
        build: Box::new({
            let p = p.clone();
            move |seed| p.build(seed)
        }),
        ideal: Some(Box::new(move |_| p.ideal_computed_tokens())),
        // Each turn carries the engine's own answers: no text to replay.
        lru_reference: false,
        prefix_words: None,
    })
}

/// The largest count at most `n` (and at least 1) coprime with `engines`.
fn coprime_below(n: usize, engines: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    (1..=n.max(1))
        .rev()
        .find(|&k| gcd(k, engines) == 1)
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_counts_are_coprime_with_the_engines() {
        assert_eq!(coprime_below(32, 4), 31);
        assert_eq!(coprime_below(6, 4), 5);
        assert_eq!(coprime_below(5, 4), 5);
        assert_eq!(coprime_below(0, 4), 1);
        let (_, p) = chat_setup(4, 4).unwrap();
        assert_eq!(coprime_below(p.sessions, 4), p.sessions);
    }
}
