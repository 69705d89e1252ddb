//! Stage 2, prefix: turn the prompt into chained block keys so the scheduler
//! can match cached prefixes (`ctx.block_keys`, `ctx.prompt_tokens`).
//!
//! Only inference calls that this sidecar will route are tokenized: a
//! pass-through path has no view, and a request another sidecar already
//! routed runs here whatever its prefix. The work is in [`crate::prefix`];
//! it reads `ctx.view` and never re-serializes the body. It never fails the
//! request: an untokenizable prompt is routed without prefix information.

use super::context::RequestCtx;
use crate::app::App;
use crate::error::ProxyError;

pub async fn prefix(app: &App, ctx: &mut RequestCtx) -> Result<(), ProxyError> {
    if ctx.view.is_none() || ctx.already_routed {
        return Ok(());
    }
    app.prefix.compute(app, ctx).await;
    Ok(())
}
