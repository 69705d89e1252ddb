//! Stage 2, prefix: turn the prompt into chained block keys so the scheduler
//! can match cached prefixes (`ctx.block_keys`, `ctx.prompt_tokens`).
//!
//! Only inference calls that this sidecar will route are tokenized: a
//! pass-through path has no view, and a request whose route came with it (a
//! peer routed it here, or an llm-d EPP split it) runs where it says whatever
//! its prefix. The work is in [`crate::prefix`];
//! it reads `ctx.view` and never re-serializes the body. It never fails the
//! request: an untokenizable prompt is routed without prefix information.

use crate::error::ProxyError;
use crate::otel::Stage;
use crate::prefix::{Compute, PrefixState};
use crate::request::RequestCtx;
use opentelemetry::KeyValue;

/// What the prefix stage reads: the prefix state, and what computing keys
/// needs besides it (the engine's tokenizer endpoint, counters, block size).
#[derive(Clone, Copy)]
pub struct Prefix<'a> {
    pub state: &'a PrefixState,
    pub compute: Compute<'a>,
}

pub async fn prefix(h: Prefix<'_>, ctx: &mut RequestCtx) -> Result<(), ProxyError> {
    if ctx.view.is_none() || ctx.already_routed || ctx.epp_prefiller.is_some() {
        return Ok(());
    }
    let span = Stage::of(ctx.trace.as_deref(), "kvmesh.prefix");
    h.state.compute(h.compute, ctx).await;
    if span.recording() {
        // The per-pod match is the schedule stage's work; a sampled request
        // looks it up once more here, so the span says what was matched.
        let best = h
            .state
            .matches(ctx)
            .into_iter()
            .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0)));
        if let Some(t) = ctx.prompt_tokens {
            span.set(KeyValue::new("kvmesh.prefix.tokens", i64::from(t)));
        }
        let blocks = i64::try_from(ctx.block_keys.len()).unwrap_or(i64::MAX);
        span.set(KeyValue::new("kvmesh.prefix.blocks", blocks));
        let (pod, matched) = best.unwrap_or_default();
        span.set(KeyValue::new(
            "kvmesh.prefix.matched_blocks",
            i64::from(matched),
        ));
        if matched > 0 {
            span.set(KeyValue::new("kvmesh.prefix.matched_pod", pod));
        }
    }
    Ok(())
}
