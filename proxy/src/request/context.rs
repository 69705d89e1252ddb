//! The per-request context every stage reads and fills in, in stage order.

use std::net::SocketAddr;

use http::{HeaderValue, Method, Request};
use tokio::time::Instant;

use super::plan::Leg;
use super::view::RequestView;
use crate::headers::{self, ROUTED, SESSION_ID};
use crate::metrics::{InFlight, Route};

/// One request's state on its way through the stages.
pub struct RequestCtx {
    // ---- accept ----
    /// Kept from the client or generated; sent upstream and back.
    pub request_id: HeaderValue,
    pub method: Method,
    pub route: Route,
    /// When the request head arrived; deadlines and TTFT count from here.
    pub started: Instant,
    /// Counts the request as in flight until its response body ends.
    pub in_flight: Option<InFlight>,
    // ---- classify ----
    /// Inference calls only: the parsed body.
    pub view: Option<RequestView>,
    /// `x-session-id`, for session affinity.
    pub session: Option<HeaderValue>,
    /// Another sidecar already routed this request here (`x-kvmesh-routed`):
    /// execute locally, skipping prefix and schedule.
    pub already_routed: bool,
    /// An llm-d EPP already split this request (`x-prefiller-host-port`,
    /// checked against the fleet): prefill on this leg, decode here, skipping
    /// prefix and schedule.
    pub epp_prefiller: Option<Leg>,
    // ---- prefix ----
    /// Chained block keys of the prompt (token blocks in precise mode, text
    /// chunks in approximate mode; empty when not computed).
    pub block_keys: Vec<u64>,
    /// Prompt tokens, when the prompt was tokenized (estimated past the cap).
    pub prompt_tokens: Option<u32>,
    // ---- schedule ----
    /// With `index.backend: valkey`, the pods the index lookup named, with
    /// the leading blocks of the prompt each holds: the decision is made
    /// among them (and the local pod, and pods a recent decision predicts).
    /// `None`: among every pod the fleet knows (the mesh, or a lookup that
    /// failed and fell back).
    pub candidates: Option<Vec<(String, u32)>>,
    /// Why the request goes where it goes ([`super::Plan::reason`]), for logs and metrics.
    pub route_reason: &'static str,
    /// The prompt tokens the request would compute on each pod of its plan
    /// ([`super::Plan::uncached_tokens`]).
    pub uncached_tokens: Vec<(String, u64)>,
    // ---- execute ----
    /// Where the response finally came from.
    pub served_by: Option<Served>,
    pub attempts: u8,
    /// The local engine's data-parallel rank, for whichever of the plan's
    /// targets runs on the local engine (`crate::routing::rank`); `None`
    /// without data parallelism.
    pub dp_rank: Option<u32>,
    // ---- observe ----
    /// The access record, when `logging.access_log` is on.
    pub access: Option<Box<crate::access::AccessLog>>,
    /// The request's spans, when `tracing` is configured (`crate::otel`).
    pub trace: Option<Box<crate::otel::RequestTrace>>,
}

/// The upstream that produced the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    LocalEngine,
    Peer(SocketAddr),
}

impl RequestCtx {
    pub fn new<B>(req: &Request<B>, in_flight: InFlight) -> Self {
        let h = req.headers();
        Self {
            request_id: headers::request_id(h),
            method: req.method().clone(),
            route: Route::of(req.uri().path()),
            started: Instant::now(),
            in_flight: Some(in_flight),
            view: None,
            session: h.get(&SESSION_ID).cloned(),
            already_routed: h.contains_key(&ROUTED),
            epp_prefiller: None,
            block_keys: Vec::new(),
            prompt_tokens: None,
            candidates: None,
            route_reason: "",
            uncached_tokens: Vec::new(),
            served_by: None,
            attempts: 0,
            dp_rank: None,
            access: None,
            trace: None,
        }
    }

    /// A migrating stream's continuation (`crate::request::migrate`), sent
    /// long after the client's request passed the stages: only what a call
    /// upstream reads (its id, route and arrival) is set.
    pub fn continuation(request_id: HeaderValue, route: Route, started: Instant) -> Self {
        Self {
            request_id,
            method: Method::POST,
            route,
            started,
            in_flight: None,
            view: None,
            session: None,
            already_routed: false,
            epp_prefiller: None,
            block_keys: Vec::new(),
            prompt_tokens: None,
            candidates: None,
            route_reason: "migration",
            uncached_tokens: Vec::new(),
            served_by: None,
            attempts: 0,
            dp_rank: None,
            access: None,
            trace: None,
        }
    }

    /// The request id as text for logs.
    pub fn id(&self) -> &str {
        self.request_id.to_str().unwrap_or("-")
    }
}

impl Route {
    /// The OpenAI route of a path; anything else passes through as `Other`.
    pub fn of(path: &str) -> Self {
        match path {
            "/v1/completions" => Self::Completions,
            "/v1/chat/completions" => Self::ChatCompletions,
            "/v1/responses" => Self::Responses,
            "/v1/embeddings" => Self::Embeddings,
            "/v1/models" => Self::Models,
            _ => Self::Other,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Completions => "/v1/completions",
            Self::ChatCompletions => "/v1/chat/completions",
            Self::Responses => "/v1/responses",
            Self::Embeddings => "/v1/embeddings",
            Self::Models => "/v1/models",
            Self::Other => "other",
        }
    }
}
