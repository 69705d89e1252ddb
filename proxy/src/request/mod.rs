//! The request core: what one request is on its way through the stages, and
//! how it is sent upstream. A leaf of the sidecar's modules: `path` (the
//! stages), `routing`, `pd`, `mesh`, `prefix` and `fleet` use it, and it
//! uses none of them but `upstream` (the connections): what it needs of the
//! fleet (who the local pod is, which addresses are peers) it asks through
//! [`Peers`], which the fleet implements (`graph_tests.rs` keeps it so).
//!
//! | file | holds |
//! |---|---|
//! | `context.rs` | [`RequestCtx`], the per-request state, its fields in stage order |
//! | `view.rs` | [`RequestView`], the inference body parsed once |
//! | `shapes.rs` | chat and `/v1/responses` bodies whose template input is more than plain messages (tools, documents, tool-call history, kwargs), read as vLLM renders them |
//! | `client.rs` | [`ClientRequest`], the client's head and body after classify |
//! | `plan.rs` | [`Plan`], [`Target`], [`Leg`]: what the scheduler decided |
//! | `call.rs` | [`Upstream`], [`send`] (one call upstream under the first-byte deadline) and [`relay`] (the response back under the stream deadlines), through the narrow [`Upstreams`] handle |
//! | `migrate/` | a stream that fails after bytes reached the client goes on on another pod: its transcript, the continuation's body, its events rewritten as the first stream's |
//! | `hops.rs` | the forwarding rules every call to a peer obeys (hop limit, discovered peers only) |
//!
//! Errors are [`crate::error`], itself a leaf.

pub mod call;
pub mod client;
pub mod context;
pub mod hops;
pub mod migrate;
pub mod plan;
mod shapes;
pub mod view;

pub use call::Upstreams;

/// What the request core asks of the fleet: the local pod's id and which
/// sidecar addresses belong to discovered peers (`crate::fleet::Fleet`).
pub trait Peers: Sync {
    fn local_id(&self) -> &str;
    /// The pod id of the peer whose sidecar is at `addr`.
    fn peer_id(&self, addr: std::net::SocketAddr) -> Option<String>;
    /// Whether `addr` is a discovered peer's sidecar (forwarding goes
    /// nowhere else, so the sidecar is no open relay).
    fn is_peer_addr(&self, addr: std::net::SocketAddr) -> bool;
    /// A token cancelled when the peer whose sidecar is at `addr` is
    /// declared unreachable; `None` when no current peer is there.
    fn lost_signal(
        &self,
        addr: std::net::SocketAddr,
    ) -> Option<tokio_util::sync::CancellationToken>;
}
pub(crate) use call::{leg_upstream, relay, send, send_traced, Upstream, FORWARD};
pub use client::{ClientBody, ClientRequest};
pub use context::{RequestCtx, Served};
pub use plan::{Leg, Plan, Pool, Target, MAX_ATTEMPTS};
pub use view::{Prompt, RequestView};
