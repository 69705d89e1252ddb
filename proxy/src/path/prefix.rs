//! Stage 2, prefix: turn the prompt into chained block keys so the scheduler
//! can match cached prefixes.
//!
//! A no-op for now: `ctx.block_keys` stays empty. The prefix stage plugs in
//! here with a tokenizer (`kvmesh_filters::prefix::tokenize::Tokenizer`) and
//! the block hasher; it reads `ctx.view` and must never re-serialize the body.

use super::context::RequestCtx;
use crate::app::App;
use crate::error::ProxyError;

pub fn prefix(_app: &App, _ctx: &mut RequestCtx) -> Result<(), ProxyError> {
    Ok(())
}
