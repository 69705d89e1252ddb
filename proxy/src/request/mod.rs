//! The request core: what one request is on its way through the stages, and
//! how it is sent upstream. A leaf of the sidecar's modules: `path` (the
//! stages), `routing`, `pd`, `mesh`, `prefix` and `fleet` use it, and it
//! uses none of `path`, `routing`, `pd` or `mesh` (checked by
//! `tests::no_cycle`).
//!
//! | file | holds |
//! |---|---|
//! | `context.rs` | [`RequestCtx`], the per-request state, its fields in stage order |
//! | `view.rs` | [`RequestView`], the inference body parsed once |
//! | `shapes.rs` | chat and `/v1/responses` bodies whose template input is more than plain messages (tools, documents, tool-call history, kwargs), read as vLLM renders them |
//! | `client.rs` | [`ClientRequest`], the client's head and body after classify |
//! | `plan.rs` | [`Plan`], [`Target`], [`Leg`]: what the scheduler decided |
//! | `call.rs` | [`Upstream`], [`send`] (one call upstream under the first-byte deadline) and [`relay`] (the response back under the stream deadlines), through the narrow [`Upstreams`] handle |
//! | `hops.rs` | the forwarding rules every call to a peer obeys (hop limit, discovered peers only) |
//!
//! Errors are [`crate::error`], itself a leaf.

pub mod call;
pub mod client;
pub mod context;
pub mod hops;
pub mod plan;
mod shapes;
pub mod view;

pub use call::Upstreams;
pub(crate) use call::{leg_upstream, relay, send, Upstream, FORWARD};
pub use client::{ClientBody, ClientRequest};
pub use context::{RequestCtx, Served};
pub use plan::{Leg, Plan, Target, MAX_ATTEMPTS};
pub use view::{Prompt, RequestView};
