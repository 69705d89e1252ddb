//! Header rules of a reverse proxy: hop-by-hop headers end at each hop (RFC 9110
//! section 7.6.1), and every request carries an `X-Request-Id`, kept from the
//! client or generated, so the engine's logs and ours line up.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Kept from the client or generated; sent upstream and back to the client.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// Session affinity key a client may send.
pub const SESSION_ID: HeaderName = HeaderName::from_static("x-session-id");
/// Set by a sidecar forwarding to a peer's sidecar: the peer must not route again.
pub const ROUTED: HeaderName = HeaderName::from_static("x-kvmesh-routed");
/// Sidecar hops a forwarded request took (set with [`ROUTED`]); over the
/// mesh's limit the request is refused, so forwarding can never loop.
pub const HOPS: HeaderName = HeaderName::from_static("x-kvmesh-hops");
/// On a peer sidecar's error response to a forwarded request: this pod did
/// not serve it and sent nothing before failing (its engine refused the
/// connection, or the connection broke before a response head), so the
/// forwarding sidecar may give the request to its next fallback. Never
/// reaches a client: forwarding is one hop, and the forwarder turns a marked
/// response into a refusal.
pub const UNSERVED: HeaderName = HeaderName::from_static("x-kvmesh-unserved");
/// Set by llm-d's `disagg-profile-handler`: `host:port` of the prefill engine
/// (a comma list is allowed; the first entry is used). For this sidecar
/// (`crate::pd::llmd`): never sent upstream.
pub const PREFILLER: HeaderName = HeaderName::from_static("x-prefiller-host-port");

/// The local engine's data-parallel rank a request runs on (vLLM 0.32 reads
/// it; `crate::routing::rank` chooses it).
pub const RANK: HeaderName = HeaderName::from_static("x-data-parallel-rank");

/// Longest client request id we keep; longer ones are replaced.
const MAX_REQUEST_ID: usize = 128;

/// Hop-by-hop by definition (RFC 9110 section 7.6.1, and the `keep-alive` and
/// `proxy-connection` of older clients); `transfer-encoding` too, since each
/// hop's codec frames its body itself. A match on the lowercase name, not a comparison with
/// each of a list of `HeaderName`s: it runs for every header of every request
/// and response, and was about 130 instructions a header that way (callgrind).
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "upgrade"
            | "transfer-encoding"
    )
}

/// Removes hop-by-hop headers ([`hop_by_hop`]), including any the
/// `Connection` header names.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    strip(h, |_| false);
}

/// [`strip_hop_by_hop`], and every header `also` names, in one pass over the
/// map: a request carries a handful of headers, so comparing each with the
/// hop-by-hop list is cheaper than a hashed removal per listed name.
pub fn strip(h: &mut HeaderMap, also: impl Fn(&HeaderName) -> bool) {
    // Names listed in Connection are hop-by-hop as well.
    let named = connection_named(h);
    let doomed: Vec<HeaderName> = h
        .keys()
        .filter(|k| hop_by_hop(k) || named.contains(k) || also(k))
        .cloned()
        .collect();
    for name in doomed {
        h.remove(name);
    }
}

/// Appends `from`'s end-to-end headers to `to`: those [`strip`] would keep,
/// without copying the whole map and removing from it (a removal shifts
/// the map's entries; copying what is kept touches each header once).
pub fn copy_end_to_end(from: &HeaderMap, to: &mut HeaderMap, also: impl Fn(&HeaderName) -> bool) {
    let named = connection_named(from);
    to.reserve(from.len());
    for (name, value) in from {
        if !(hop_by_hop(name) || named.contains(name) || also(name)) {
            to.append(name.clone(), value.clone());
        }
    }
}

/// The header names a `Connection` field lists (hop-by-hop as well); no
/// allocation when there are none.
fn connection_named(h: &HeaderMap) -> Vec<HeaderName> {
    h.get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect()
}

/// The client's `X-Request-Id` when it is usable, else a fresh UUID v4.
pub fn request_id(h: &HeaderMap) -> HeaderValue {
    if let Some(v) = h.get(&REQUEST_ID) {
        let ok = !v.is_empty()
            && v.len() <= MAX_REQUEST_ID
            && v.as_bytes().iter().all(|b| b.is_ascii_graphic());
        if ok {
            return v.clone();
        }
    }
    // A v4 UUID from the thread's CSPRNG (seeded once from the OS), not
    // `Uuid::new_v4`, which asks the kernel for 16 bytes on every request.
    let id = uuid::Builder::from_random_bytes(rand::random()).into_uuid();
    let mut buf = [0u8; uuid::fmt::Hyphenated::LENGTH];
    let s = id.hyphenated().encode_lower(&mut buf);
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("unknown"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn strips_listed_and_standard_hop_headers() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn strip_removes_the_extra_names_in_the_same_pass() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::HOST, HeaderValue::from_static("a"));
        h.append("x-kept", HeaderValue::from_static("1"));
        h.append("x-kept", HeaderValue::from_static("2"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        strip(&mut h, |n| n == header::HOST);
        assert_eq!(h.len(), 2, "{h:?}");
        assert_eq!(h.get_all("x-kept").iter().count(), 2);
    }

    #[test]
    fn copying_end_to_end_keeps_what_strip_keeps() {
        let mut from = HeaderMap::new();
        from.insert(header::CONNECTION, HeaderValue::from_static("x-secret"));
        from.insert("x-secret", HeaderValue::from_static("1"));
        from.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        from.insert(header::HOST, HeaderValue::from_static("a"));
        from.append("x-kept", HeaderValue::from_static("1"));
        from.append("x-kept", HeaderValue::from_static("2"));
        from.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let mut to = HeaderMap::new();
        to.insert("x-already", HeaderValue::from_static("there"));
        copy_end_to_end(&from, &mut to, |n| n == header::HOST);
        let mut stripped = from.clone();
        strip(&mut stripped, |n| n == header::HOST);
        stripped.insert("x-already", HeaderValue::from_static("there"));
        assert_eq!(to, stripped);
        assert_eq!(to.get_all("x-kept").iter().count(), 2);
    }

    #[test]
    fn request_id_kept_or_generated() {
        let mut h = HeaderMap::new();
        let a = request_id(&h);
        assert_eq!(a.len(), 36);
        let parsed = uuid::Uuid::parse_str(a.to_str().unwrap()).unwrap();
        assert_eq!(parsed.get_version_num(), 4);
        assert_ne!(request_id(&h), a, "fresh ids differ");
        h.insert(REQUEST_ID, HeaderValue::from_static("abc-1"));
        assert_eq!(request_id(&h), "abc-1");
        h.insert(REQUEST_ID, HeaderValue::from_static("has space"));
        assert_ne!(request_id(&h), "has space");
    }
}
