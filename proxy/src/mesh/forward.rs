//! After a response head, where a request ran as the mesh counts it; in
//! approximate mode the decision is recorded locally and published to the
//! peers. The forwarding rules themselves (hop limit, discovered peers
//! only) are the request core's ([`crate::request::hops`]).

use std::net::SocketAddr;

use crate::app::App;
use crate::request::RequestCtx;

pub use crate::request::hops::{check_arrival, hops, MAX_HOPS};

/// After a response head from `peer` (`None`: the local engine).
pub fn served(app: &App, ctx: &RequestCtx, peer: Option<SocketAddr>) {
    if ctx.view.is_none() {
        return;
    }
    let m = &app.metrics.mesh;
    let pod = match peer {
        None if ctx.already_routed => {
            m.request("received");
            return;
        }
        None => {
            m.request("local");
            app.fleet.local_id().to_owned()
        }
        Some(addr) => {
            m.request("forwarded");
            let Some(id) = app.fleet.peer_id(addr) else {
                return;
            };
            m.forwarded(&id);
            id
        }
    };
    if app.prefix.mode() == crate::prefix::Mode::Approximate && !ctx.block_keys.is_empty() {
        app.prefix.record(&pod, ctx);
        app.mesh.decision(app, &pod, &ctx.block_keys);
    }
}
