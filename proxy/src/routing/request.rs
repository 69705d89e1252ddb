//! The scheduler's inputs for one request: the fleet's pods as endpoint views
//! (load, health, freshness, prefix match) and the request as the
//! scheduler's [`RequestView`] (model or LoRA adapter, session, prompt size).
//!
//! Prefix match: the prefix stage's per-pod match of `ctx.block_keys`
//! (`PrefixState::matches`). Prompt size: exact when the prefix stage
//! tokenized the prompt, else estimated at 4 bytes of text per token, which
//! is what a load-only policy and the P/D decider need; prompt blocks are the
//! block keys when there are some.

use kvmesh_filters::sched::{EndpointView, PathKind, RequestView as SchedView};
use tokio::time::Instant;

use super::{Inputs, DEFAULT_BLOCK_SIZE};
use crate::metrics::Route;
use crate::request::{Prompt, RequestCtx, RequestView};

/// Bytes of prompt text per token in the estimate (English-ish text, BPE).
const BYTES_PER_TOKEN: usize = 4;

/// The request view and the endpoint views for one scheduling cycle.
pub fn build(
    h: Inputs<'_>,
    ctx: &RequestCtx,
    view: &RequestView,
    now: Instant,
) -> (SchedView, Vec<EndpointView>) {
    // The block size the prefix stage cut the keys with, so matches and
    // prompt blocks count the same blocks.
    let block_size = match h.prefix.block_size(h.engine_block_size) {
        0 => DEFAULT_BLOCK_SIZE,
        n => n,
    };
    let mut matches = h.prefix.matches(ctx);
    let endpoints = match &ctx.candidates {
        // The Valkey index named the candidates (and how much each holds);
        // pods a recent decision predicts stay candidates too.
        Some(found) => {
            for (id, depth) in found {
                let e = matches.entry(id.clone()).or_insert(0);
                *e = (*e).max(*depth);
            }
            h.fleet.endpoints_of(
                now,
                block_size,
                |id| matches.get(id).copied().unwrap_or(0),
                matches.keys().map(String::as_str),
            )
        }
        None => h
            .fleet
            .endpoints(now, block_size, |id| matches.get(id).copied().unwrap_or(0)),
    };
    let req = request_view(ctx, view, &endpoints, h.pod.models.first(), block_size);
    (req, endpoints)
}

/// The scheduler's view of the request. A body without `model` means the
/// engine's own model (vLLM's behaviour), so it is the local pod's first one.
pub fn request_view(
    ctx: &RequestCtx,
    view: &RequestView,
    endpoints: &[EndpointView],
    local_model: Option<&String>,
    block_size: u32,
) -> SchedView {
    let model = view
        .model
        .clone()
        .or_else(|| local_model.cloned())
        .unwrap_or_default();
    let is_base = endpoints.iter().any(|e| e.models.contains(&model));
    let lora_adapter = SchedView::adapter_from_model(&model, |m| {
        !is_base
            && endpoints
                .iter()
                .any(|e| e.lora_adapters.iter().any(|a| a == m))
    });
    let keyed_blocks = u32::try_from(ctx.block_keys.len()).unwrap_or(u32::MAX);
    let (prompt_tokens, exact) = match ctx.prompt_tokens {
        Some(n) => (n, true),
        None => (
            prompt_tokens(&view.prompt).max(keyed_blocks.saturating_mul(block_size)),
            false,
        ),
    };
    let prompt_blocks = if keyed_blocks > 0 {
        keyed_blocks
    } else {
        prompt_tokens / block_size.max(1)
    };
    SchedView {
        request_id: ctx.id().to_owned(),
        model,
        lora_adapter,
        path: match ctx.route {
            Route::Completions => PathKind::Completions,
            Route::ChatCompletions => PathKind::Chat,
            _ => PathKind::Other,
        },
        stream: view.stream,
        max_tokens: view
            .max_tokens
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
        cache_salt: view.cache_salt.clone(),
        session_key: ctx
            .session
            .as_ref()
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        prompt_tokens,
        prompt_tokens_exact: exact,
        prompt_blocks,
        block_keys: ctx.block_keys.clone(),
    }
}

/// Tokens in the prompt: exact for token prompts, estimated for text.
pub fn prompt_tokens(p: &Prompt) -> u32 {
    let bytes_to_tokens = |n: usize| n.div_ceil(BYTES_PER_TOKEN);
    let n = match p {
        Prompt::None => 0,
        Prompt::Text(s) => bytes_to_tokens(s.len()),
        Prompt::Texts(v) => v.iter().map(|s| bytes_to_tokens(s.len())).sum(),
        Prompt::Tokens(t) => t.len(),
        Prompt::TokenBatches(b) => b.iter().map(Vec::len).sum(),
        // A few template tokens per message around the content.
        Prompt::Chat(ms) => ms
            .iter()
            .map(|m| bytes_to_tokens(m.content.len()) + 4)
            .sum(),
    };
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_text_and_counts_tokens() {
        assert_eq!(prompt_tokens(&Prompt::Text("abcdefgh".into())), 2);
        assert_eq!(prompt_tokens(&Prompt::Text("abcdefghi".into())), 3);
        assert_eq!(prompt_tokens(&Prompt::Tokens(vec![1, 2, 3])), 3);
        assert_eq!(
            prompt_tokens(&Prompt::TokenBatches(vec![vec![1], vec![2, 3]])),
            3
        );
        assert_eq!(prompt_tokens(&Prompt::None), 0);
    }
}
