//! The proxy's one error type. Each variant says who failed ([`Culprit`]) and
//! how far the request got ([`Retry`]), so the execute stage can decide on a
//! fallback and [`crate::respond::openai_error`] can pick a status without
//! guessing. Only that function turns an error into bytes for the client.

use std::time::Duration;

use http::Method;

/// The party whose behaviour caused a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Culprit {
    /// The request itself is wrong; retrying it unchanged fails the same way.
    Client,
    /// kvmesh could not do its part.
    Proxy,
    /// The local engine.
    Engine,
    /// Another pod's sidecar.
    Peer,
}

/// Whether another attempt (on this or another target) is safe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Nothing reached the upstream: any target may take the request.
    Safe,
    /// The upstream may have started work but the client has seen no byte:
    /// a retry is invisible to the client but may duplicate engine work.
    BeforeFirstByte,
    /// The client has seen bytes, or the request itself is at fault: never.
    Never,
}

/// Which upstream an attempt went to, for messages and the culprit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamName {
    Engine(String),
    Peer(String),
}

/// Everything that can go wrong on the request path.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("request body is not valid JSON for {route}: {source}")]
    MalformedJson {
        route: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge { limit: u64 },
    #[error("method {method} is not allowed on {route}; use {allow}")]
    MethodNotAllowed {
        method: Method,
        route: &'static str,
        allow: &'static str,
    },
    #[error("reading the request body failed: {0}")]
    ClientBody(String),
    #[error("the request body did not arrive within {after:?}")]
    ClientTimeout { after: Duration },
    #[error("{upstream} refused the connection: {reason}")]
    Connect {
        upstream: UpstreamName,
        reason: String,
    },
    #[error("{upstream} sent no response head within {after:?}")]
    FirstByteTimeout {
        upstream: UpstreamName,
        after: Duration,
    },
    #[error("{upstream} was silent for {after:?} in the middle of the response")]
    IdleTimeout {
        upstream: UpstreamName,
        after: Duration,
    },
    #[error("the request exceeded its overall deadline of {after:?}")]
    OverallTimeout {
        upstream: UpstreamName,
        after: Duration,
    },
    #[error("{upstream} failed before responding: {reason}")]
    UpstreamFailed {
        upstream: UpstreamName,
        reason: String,
    },
    #[error("{upstream} failed in the middle of the response: {reason}")]
    UpstreamDied {
        upstream: UpstreamName,
        reason: String,
    },
    #[error("the model {model:?} does not exist in this mesh (served: {known})")]
    ModelNotFound { model: String, known: String },
    #[error("no pod can take this request for model {model:?} now: filter {filter:?} in scheduling profile {profile:?} removed the last candidates")]
    NoEndpoint {
        model: String,
        filter: String,
        profile: String,
    },
    #[error("the request was forwarded between sidecars {hops} times (the limit is {limit}): a forwarding loop")]
    HopLimit { hops: u32, limit: u32 },
    #[error("the prefill leg at {upstream} answered {status}: {message}")]
    PrefillFailed {
        upstream: UpstreamName,
        status: u16,
        message: String,
        /// Whether another prefill attempt may succeed (429, 502, 503, 504, a deadline).
        retryable: bool,
    },
    #[error("x-prefiller-host-port {value:?} refused: {reason}")]
    BadPrefiller { value: String, reason: &'static str },
    #[error("internal proxy error: {0}")]
    Internal(String),
}

impl std::fmt::Display for UpstreamName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Engine(a) => write!(f, "the engine at {a}"),
            Self::Peer(a) => write!(f, "the peer sidecar at {a}"),
        }
    }
}

impl UpstreamName {
    fn culprit(&self) -> Culprit {
        match self {
            Self::Engine(_) => Culprit::Engine,
            Self::Peer(_) => Culprit::Peer,
        }
    }
}

impl ProxyError {
    /// Who failed.
    pub fn culprit(&self) -> Culprit {
        match self {
            Self::MalformedJson { .. }
            | Self::BodyTooLarge { .. }
            | Self::MethodNotAllowed { .. }
            | Self::ClientBody(_)
            | Self::ClientTimeout { .. }
            | Self::ModelNotFound { .. }
            | Self::HopLimit { .. }
            | Self::BadPrefiller { .. } => Culprit::Client,
            Self::PrefillFailed { upstream, .. } => upstream.culprit(),
            Self::Connect { upstream, .. }
            | Self::FirstByteTimeout { upstream, .. }
            | Self::IdleTimeout { upstream, .. }
            | Self::OverallTimeout { upstream, .. }
            | Self::UpstreamFailed { upstream, .. }
            | Self::UpstreamDied { upstream, .. } => upstream.culprit(),
            Self::NoEndpoint { .. } | Self::Internal(_) => Culprit::Proxy,
        }
    }

    /// How far the request got, hence whether another attempt is safe.
    pub fn retry(&self) -> Retry {
        match self {
            Self::Connect { .. } => Retry::Safe,
            Self::FirstByteTimeout { .. } | Self::UpstreamFailed { .. } => Retry::BeforeFirstByte,
            Self::OverallTimeout { .. }
            | Self::IdleTimeout { .. }
            | Self::UpstreamDied { .. }
            | Self::MalformedJson { .. }
            | Self::BodyTooLarge { .. }
            | Self::MethodNotAllowed { .. }
            | Self::ClientBody(_)
            | Self::ClientTimeout { .. }
            | Self::ModelNotFound { .. }
            | Self::HopLimit { .. }
            | Self::PrefillFailed { .. }
            | Self::BadPrefiller { .. }
            | Self::NoEndpoint { .. }
            | Self::Internal(_) => Retry::Never,
        }
    }
}

/// Whether the next fallback may take a request that failed with `e` before
/// anything reached the client: the upstream refused the connection (nothing
/// was sent), or the connection broke before a response head (a pooled
/// connection to a process that just died; at worst the dead upstream had
/// started work the client will never see). A deadline is not: a slow
/// upstream is not a dead one, and a second try would double its load.
pub fn next_target_may_serve(e: &ProxyError) -> bool {
    matches!(
        e,
        ProxyError::Connect { .. } | ProxyError::UpstreamFailed { .. }
    )
}

/// The error and its causes on one line: hyper's top-level message alone
/// ("client error (Connect)") does not say what happened.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    let mut depth = 0;
    while let Some(c) = cur {
        if depth == 8 {
            break;
        }
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
        depth += 1;
    }
    s
}
