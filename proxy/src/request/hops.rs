//! Forwarding rules between sidecars, obeyed by every call to a peer.
//!
//! * A request forwarded to a peer carries `x-kvmesh-routed` (the peer runs
//!   it on its own engine, never routes it again) and `x-kvmesh-hops`, the
//!   number of sidecar hops so far. A request whose hops would exceed
//!   [`MAX_HOPS`] is refused with `508 loop_detected`, on arrival and before
//!   being sent, so no configuration can make requests circle.
//! * Only a discovered peer's sidecar address is a target
//!   ([`crate::fleet::Fleet::is_peer_addr`]): the address comes from the
//!   fleet, never from the request, so the sidecar is no open relay.

use std::net::SocketAddr;

use http::{HeaderMap, HeaderValue};

use crate::error::{ProxyError, UpstreamName};
use crate::headers::HOPS;

/// Most sidecar-to-sidecar hops a request may take: the first sidecar routes,
/// the second executes.
pub const MAX_HOPS: u32 = 1;

/// The hops a request arrived with (0 from a client; unparsable counts as over).
pub fn hops(h: &HeaderMap) -> u32 {
    match h.get(&HOPS) {
        None => 0,
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(u32::MAX),
    }
}

/// Refuses a request that already took more hops than allowed.
pub fn check_arrival(h: &HeaderMap) -> Result<(), ProxyError> {
    let hops = hops(h);
    if hops > MAX_HOPS {
        return Err(ProxyError::HopLimit {
            hops,
            limit: MAX_HOPS,
        });
    }
    Ok(())
}

/// Before forwarding to `addr`: it must be a discovered peer, and the hop
/// count must stay within the limit. Sets the hop header on `out`.
pub fn prepare(
    peers: &dyn super::Peers,
    addr: SocketAddr,
    incoming: &HeaderMap,
    out: &mut HeaderMap,
) -> Result<(), ProxyError> {
    if !peers.is_peer_addr(addr) {
        // Nothing was sent: the next fallback may take it.
        return Err(ProxyError::Connect {
            upstream: UpstreamName::Peer(addr.to_string()),
            reason: "not a discovered peer".to_owned(),
        });
    }
    let next = hops(incoming).saturating_add(1);
    if next > MAX_HOPS {
        return Err(ProxyError::HopLimit {
            hops: next,
            limit: MAX_HOPS,
        });
    }
    out.insert(HOPS, HeaderValue::from(next));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_header_parsing() {
        let mut h = HeaderMap::new();
        assert_eq!(hops(&h), 0);
        assert!(check_arrival(&h).is_ok());
        h.insert(HOPS, HeaderValue::from_static("1"));
        assert!(check_arrival(&h).is_ok());
        h.insert(HOPS, HeaderValue::from_static("2"));
        assert!(matches!(
            check_arrival(&h),
            Err(ProxyError::HopLimit { hops: 2, limit: 1 })
        ));
        h.insert(HOPS, HeaderValue::from_static("junk"));
        assert!(check_arrival(&h).is_err());
    }
}
