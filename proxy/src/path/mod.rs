//! The request path: every client request passes the stages of [`handle`], in
//! order, each in its own file, sharing one [`RequestCtx`].
//!
//! | stage | file | job |
//! |---|---|---|
//! | classify | `classify.rs` | method check, bounded body read, parse the [`RequestView`] once |
//! | prefix | `prefix.rs` | prompt to block keys, once, inference calls only (`crate::prefix`) |
//! | schedule | `schedule.rs` | choose a [`Target`] and fallbacks |
//! | admit | `admit.rs` | flow control: hold the request while its pool is saturated, then schedule it again |
//! | execute | `execute.rs` | walk the plan's targets, each call and relay through [`crate::request`], or run a P/D split (`crate::pd`) |
//! | account | `account.rs` | called by execute as it goes: predictions, in-flight counts, outlier calls, mesh counters, the approximate index, the mesh publish |
//! | observe | `observe.rs` | map errors to responses, metrics, logs |
//! | (migrate) | `migrate.rs` | after execute: where a stream that failed mid-way goes on, and the call (`crate::request::migrate`) |
//!
//! The types every stage shares ([`RequestCtx`], [`RequestView`], [`Plan`])
//! are the request core's, re-exported here.

pub mod account;
pub mod admit;
pub mod classify;
pub mod execute;
pub mod handles;
pub mod migrate;
pub mod observe;
pub mod prefix;
pub mod schedule;

use std::sync::Arc;

use crate::app::App;
use crate::body::{IncomingBody, ResponseBody};
pub use crate::request::view;
pub use crate::request::{Leg, Plan, Prompt, RequestCtx, RequestView, Served, Target};
use http::{Request, Response};

/// One request, top to bottom.
pub async fn handle(app: Arc<App>, req: Request<IncomingBody>) -> Response<ResponseBody> {
    let mut ctx = RequestCtx::new(&req, app.metrics.requests.in_flight());
    ctx.access = crate::access::start(
        app.config.logging.access_log,
        req.method(),
        req.headers(),
        ctx.id(),
        ctx.route.as_str(),
    );
    ctx.trace = crate::otel::request::start(
        app.tracer.as_ref(),
        req.headers(),
        req.method().as_str(),
        ctx.route.as_str(),
    );
    if let (Some(log), Some(t)) = (ctx.access.as_deref_mut(), ctx.trace.as_deref()) {
        if let Some(id) = t.sampled_trace_id() {
            log.trace_started(id);
        }
    }
    let result = async {
        let req = classify::classify(handles::classify(&app), &mut ctx, req).await?;
        prefix::prefix(handles::prefix(&app), &mut ctx).await?;
        let plan = schedule::schedule(handles::schedule(&app), &mut ctx).await?;
        let plan = admit::admit(handles::admit(&app), &mut ctx, plan).await?;
        execute::execute(handles::execute_migrating(&app), &mut ctx, plan, req).await
    }
    .await;
    observe::observe(handles::observe(&app), ctx, result)
}
