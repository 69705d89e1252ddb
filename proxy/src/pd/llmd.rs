//! Interop with an llm-d EPP: a request that arrives with
//! `x-prefiller-host-port` was already split by the EPP, which chose this pod
//! to decode and names the prefill engine. The sidecar runs the P/D protocol
//! with that prefiller and its local engine, as llm-d's own P/D sidecar does;
//! the header never reaches the engine (the execute stage strips it).

use http::uri::Authority;
use http::{HeaderMap, HeaderName};

use crate::app::App;
use crate::error::ProxyError;

/// Set by llm-d's `disagg-profile-handler`: `host:port` of the prefill engine
/// (a comma list is allowed; the first entry is used).
pub const PREFILLER: HeaderName = HeaderName::from_static("x-prefiller-host-port");

/// The prefiller the header names, when the sidecar accepts the header and
/// the name is allowed (`pd.allowed_prefillers`).
pub fn prefiller(app: &App, headers: &HeaderMap) -> Result<Option<Authority>, ProxyError> {
    let pd = &app.config.pd;
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
    let bad = || ProxyError::BadPrefiller {
        value: first.to_owned(),
        reason: "not host:port",
    };
    let authority: Authority = first.parse().map_err(|_| bad())?;
    if authority.port_u16().is_none() {
        return Err(bad());
    }
    if !pd.allowed_prefillers.is_empty() && !pd.allowed_prefillers.iter().any(|a| a == first) {
        return Err(ProxyError::BadPrefiller {
            value: first.to_owned(),
            reason: "not in pd.allowed_prefillers",
        });
    }
    Ok(Some(authority))
}
