//! The multi-turn chat workload of the peers benchmark: sessions whose
//! prompts grow each turn, on the pressured fleet of shared-prefix-pressure.

use kvmesh_loadgen::workload::ChatParams;

use super::{peers_spec, Bench, PeersOpts, Router, Slo};
use crate::demo::fleet::FleetSpec;
use crate::demo::DemoError;

/// The multi-turn fleet and workload: 8 sessions per engine less one, each
/// a 512-token history after a 256-token system prompt all share, 64-token
/// questions and answers, `turns` turns (4 quick, 5 full). The sessions'
/// working set is about the fleet's KV (0.92 quick, 1.04 full): it fits when
/// each session stays on one pod, and thrashes when sessions spread.
///
/// The session count is coprime with the engines: requests go out turn by
/// turn over the sessions, so with a multiple of the engines a client that
/// spreads requests in turn (round-robin) would send every turn of a session
/// to the same pod by arithmetic, a session affinity no Service has.
pub fn chat_setup(engines: usize, turns: usize) -> Result<(FleetSpec, ChatParams), DemoError> {
    let mut spec = peers_spec(engines)?;
    spec.num_blocks = 512;
    let p = ChatParams {
        sessions: coprime_below(8 * engines, engines),
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
    // A turn waits for the session's previous answer (about 1.2 s here), so
    // the sessions themselves bound the load near 25 req/s: higher offered
    // rates only shorten the think time to nothing.
    let rates = opts.rates.clone().unwrap_or_else(|| {
        if opts.quick {
            vec![15.0, 30.0]
        } else {
            vec![10.0, 20.0, 30.0]
        }
    });
    // Quick: round-robin, SMG cache_aware and kvmesh (what the targets
    // compare); full: every shared-prefix router.
    let routers: Vec<Router> = opts
        .routers
        .iter()
        .copied()
        .filter(|r| {
            !opts.quick
                || matches!(
                    r,
                    Router::RoundRobin
                        | Router::SmgCacheAware
                        | Router::Kvmesh
                        | Router::KvmeshValkey
                )
        })
        .collect();
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
                 about 8 sessions per engine so that their working set is about the fleet's KV",
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
