//! Interop with an llm-d EPP: a request that arrives with
//! `x-prefiller-host-port` was already split by the EPP, which chose this pod
//! to decode and names the prefill engine. The classify stage checks the
//! header ([`prefiller`]); the request skips prefix and schedule, and the
//! sidecar runs the P/D protocol with that prefiller and its local engine, as
//! llm-d's own P/D sidecar does; the header never reaches the engine (the
//! execute stage strips it).
//!
//! No open relay: the header names a target, so it is followed only to a pod
//! the fleet knows or to an entry of `pd.allowed_prefillers`; anything else
//! is refused (403) before any connection is made. A known pod is matched by
//! its sidecar's address, or by its IP when exactly one peer has that IP (the
//! EPP names the engine's port, which the fleet does not track); its prefill
//! leg then goes to that pod's sidecar, which runs it on its engine, over the
//! mesh's mutual TLS when `mesh.tls` is set. An allow-listed `host:port` is
//! called directly (an engine outside the mesh), over plain HTTP.

use std::net::{IpAddr, SocketAddr};

use http::uri::Authority;
use http::HeaderMap;

use crate::config::Pd;
use crate::error::ProxyError;
use crate::fleet::Fleet;
use crate::request::Leg;

pub use crate::headers::PREFILLER;

/// Where the prefill leg goes for the prefiller the header names, when the
/// sidecar accepts the header; refused unless the fleet knows the pod or
/// `pd.allowed_prefillers` lists it.
pub(crate) fn prefiller(
    pd: &Pd,
    fleet: &Fleet,
    headers: &HeaderMap,
) -> Result<Option<Leg>, ProxyError> {
    let Some(value) = headers.get(&PREFILLER) else {
        return Ok(None);
    };
    if !pd.accept_prefiller_header {
        return Ok(None);
    }
    let first = value
        .to_str()
        .ok()
        .and_then(|v| v.split(',').map(str::trim).find(|s| !s.is_empty()))
        .unwrap_or_default();
    let refused = |reason| ProxyError::BadPrefiller {
        value: first.to_owned(),
        reason,
    };
    let authority: Authority = first.parse().map_err(|_| refused("not host:port"))?;
    if authority.port_u16().is_none() {
        return Err(refused("not host:port"));
    }
    if pd.allowed_prefillers.iter().any(|a| a == first) {
        return Ok(Some(Leg::Direct(authority)));
    }
    known_peer(fleet, &authority)
        .map(|sidecar_addr| Some(Leg::Peer { sidecar_addr }))
        .ok_or(refused(
            "not a pod the fleet knows, nor in pd.allowed_prefillers",
        ))
}

/// The sidecar of the peer `authority` names: by sidecar address, else by an
/// IP only one peer has.
fn known_peer(fleet: &Fleet, authority: &Authority) -> Option<SocketAddr> {
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let ip: IpAddr = host.parse().ok()?;
    let exact = SocketAddr::new(ip, authority.port_u16()?);
    if fleet.is_peer_addr(exact) {
        return Some(exact);
    }
    let mut at_ip = fleet.peer_addrs_at(ip);
    match (at_ip.pop(), at_ip.is_empty()) {
        (Some(addr), true) => Some(addr),
        _ => None,
    }
}
