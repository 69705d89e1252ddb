//! The KV-admission workload of the peers benchmark: long prompts under
//! shared system prompts, on pods whose KV cache admits only a few of them
//! at a time. A pod's limit here is how many requests its KV holds, not how
//! fast it prefills: a router that counts requests sees a pod with three
//! long prompts running and a queue waiting for KV as no busier than one
//! with three short ones.

use kvmesh_loadgen::workload::PressureParams;

use super::{peers_spec, pressure_bench, quick_routers, Bench, PeersOpts};
use crate::demo::fleet::FleetSpec;
use crate::demo::DemoError;

/// The KV-admission fleet and workload: 2 groups per engine of a 3000-token
/// system prompt (Zipf 0.8), 600-token questions, 100-token answers, on
/// engines of 1024 blocks of 16 tokens. A pod holding its two groups'
/// prompts runs about 9 of their requests at once; one serving every group
/// (round-robin) about 4, each computing its 3000-token prompt again.
pub fn kv_bound_setup(
    engines: usize,
    requests: usize,
) -> Result<(FleetSpec, PressureParams), DemoError> {
    let mut spec = peers_spec(engines)?;
    spec.num_blocks = 1024;
    let p = PressureParams {
        groups: 2 * engines,
        requests,
        zipf_s: 0.8,
        system_tokens: 3000,
        question_tokens: 600,
        output_tokens: 100,
    };
    Ok((spec, p))
}

pub(super) fn kv_admission(opts: &PeersOpts) -> Result<Bench, DemoError> {
    let n = opts.requests.unwrap_or(if opts.quick { 80 } else { 300 });
    let (spec, p) = kv_bound_setup(opts.engines, n)?;
    let rates = opts.rates.clone().unwrap_or_else(|| {
        if opts.quick {
            // Round-robin's capacity lies below 8, kvmesh's and SMG's
            // cache_aware's near 16 (docs/benchmarks.md §7).
            vec![8.0, 16.0]
        } else {
            vec![4.0, 8.0, 12.0, 16.0]
        }
    });
    let held = spec.num_blocks * spec.block_size / (p.system_tokens + p.question_tokens);
    let bench = pressure_bench(
        "kv-admission",
        "llm-d precise prefix-cache benchmark (docs/field-benchmarks.md P1: 6000-token prefix + \
         1200-token question, 1000-token answers), lengths halved and answers cut to 100 tokens so a \
         run takes seconds, on pods with little free KV so that admission, not prefill, limits them",
        format!(": each pod's KV holds about {held} prompts at once"),
        (spec, p),
        rates,
        // Quick: what the target compares; full: every shared-prefix router.
        quick_routers(opts, &[]),
    );
    Ok(Bench {
        // Its groups fit the fleet's caches when requests come one at a
        // time: what it computes again is what requests in flight evict,
        // which a replay one at a time cannot show.
        lru_reference: false,
        ..bench
    })
}
