//! Prefill/decode disaggregation: carrying out a request the scheduler split
//! into a prefill pod and a decode pod, with unmodified engines.
//!
//! | connector | engines | protocol |
//! |---|---|---|
//! | `nixl` | vLLM `NixlConnector` | [`twoleg`]: prefill with `do_remote_decode`, then decode with the returned `kv_transfer_params` |
//! | `kvagent` | engines with the kvmesh connector | [`twoleg`], plus the transfer id and the decode node's agent in the parameters |
//! | `sglang` | SGLang PD | [`sglang`]: one body with bootstrap fields to both, concurrently |
//!
//! Failure rules (docs/pd.md): prefill is retried, with backoff, only after a
//! connect error or a retryable status, on the next prefill pod; a prefill
//! that answers without parameters lets decode recompute; a `nixl` decode
//! leg that fails before any byte is sent again, with the same parameters,
//! to another decode pod while the prefill pod's lease holds (after it, the
//! execute stage serves the request whole); a prefill that fails
//! for good serves the request aggregated on the decode pod, or fails it, as
//! `pd.on_prefill_failure` says; a client that disconnects drops both legs,
//! which cancels them; every leg has a deadline.
//!
//! A request carrying llm-d's `x-prefiller-host-port` ([`llmd`], checked by
//! the classify stage) is planned as such a split without scheduling: the
//! prefiller the header names, and the local engine decoding.

mod body;
pub mod llmd;
pub mod metrics;
mod sglang;
mod twoleg;

use http::Response;
use serde_json::{json, Map, Value};

use crate::body::ResponseBody;
use crate::config::PdConnector;
use crate::error::ProxyError;
use crate::request::{leg_upstream, Upstream};
use crate::request::{ClientBody, ClientRequest, Upstreams};
use crate::request::{Leg, RequestCtx};
use metrics::PdMetrics;

/// What a split takes: the upstream calls, and P/D's own counters.
#[derive(Clone, Copy)]
pub struct Pd<'a> {
    pub up: Upstreams<'a>,
    pub metrics: &'a PdMetrics,
    /// Where each leg counts in flight.
    pub fleet: &'a crate::fleet::Fleet,
    /// How long after the prefill answered a decode leg that failed before
    /// any byte is sent again with the same `kv_transfer_params`
    /// (`migration.pd_kv_lease`).
    pub lease: std::time::Duration,
    /// Most re-sends of one decode leg (`migration.max_migrations`).
    pub max_resends: u8,
    /// The next decode-capable pod, none of those given (the pods that
    /// failed this request): the execute stage's choice, as for a
    /// migrating stream.
    pub next_decode: &'a (dyn Fn(&[Upstream]) -> Option<Upstream> + Sync),
}

/// Where the legs of one disaggregated request go.
#[derive(Debug, Clone)]
pub struct PdPlan {
    /// Prefill pods, best first (retries walk this list).
    prefill: Vec<Upstream>,
    /// The decode pod; once a decode leg was re-sent, the pod it went to.
    decode: Upstream,
    /// Decode pods that failed this request before any byte, in order.
    failed: Vec<Upstream>,
    /// The decode leg that served, to send again as it was if its pod fails
    /// before any token (set where a re-send may use the prefill's blocks).
    kv_resend: Option<crate::request::migrate::KvResend>,
}

impl PdPlan {
    /// The scheduler's split: a prefill pod (with fallbacks) and a decode pod.
    pub fn scheduled(prefill: Leg, prefill_fallbacks: Vec<Leg>, decode: Leg) -> Self {
        Self {
            prefill: std::iter::once(prefill)
                .chain(prefill_fallbacks)
                .map(|leg| leg_upstream(&leg))
                .collect(),
            decode: leg_upstream(&decode),
            failed: Vec::new(),
            kv_resend: None,
        }
    }

    /// The decode leg to send again, as it was, if the decode pod's stream
    /// fails before its first token (`request::migrate::KvResend`).
    pub fn kv_resend(&self) -> Option<crate::request::migrate::KvResend> {
        self.kv_resend.clone()
    }

    /// The decode pod that served the request (after a re-send, not the
    /// planned one).
    pub fn decode(&self) -> &Upstream {
        &self.decode
    }

    /// The decode pods that failed before any byte, in order.
    pub fn failed_decodes(&self) -> &[Upstream] {
        &self.failed
    }
}

/// Runs the configured connector for one request.
pub async fn execute(
    h: Pd<'_>,
    ctx: &mut RequestCtx,
    plan: &mut PdPlan,
    req: &ClientRequest,
) -> Result<Response<ResponseBody>, ProxyError> {
    let up = h.up;
    let ClientBody::Buffered(bytes) = &req.body else {
        return Err(ProxyError::Internal(
            "P/D needs the inference body read whole".to_owned(),
        ));
    };
    let client = body::object(bytes)?;
    match up.pd.connector {
        PdConnector::Nixl => twoleg::run(h, ctx, plan, req, &client, "nixl", &Map::new()).await,
        PdConnector::Kvagent => {
            let extra = kvagent_params(up, plan);
            twoleg::run(h, ctx, plan, req, &client, "kvagent", &extra).await
        }
        PdConnector::Sglang => sglang::run(h, ctx, plan, req, &client).await,
    }
}

/// What the kvagent connector adds to the prefill leg: a transfer id both
/// engines' connectors use, and the decode node's agent that receives the
/// blocks ([`decode_agent`]).
fn kvagent_params(up: Upstreams<'_>, plan: &PdPlan) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert(
        "kvmesh_transfer_id".to_owned(),
        json!(uuid::Uuid::new_v4().to_string()),
    );
    m.insert(
        "kvmesh_dest_agent".to_owned(),
        json!(decode_agent(up, &plan.decode)),
    );
    m
}

/// The kvagent on the decode pod's node, `host:port`. The agents run as a
/// DaemonSet on the node's IP, not in the pod: a peer decoding is reached at
/// the agent it announced over the mesh (its `pod.node_ip`), this pod at its
/// own `pod.node_ip`. A pod that announced none (no node IP configured, or a
/// sidecar older than the announcement) is taken to share its host with its
/// agent: the peer's sidecar IP, the local engine's host, or the engine an
/// llm-d header named, at `pd.kvagent_port`.
fn decode_agent(up: Upstreams<'_>, decode: &Upstream) -> String {
    let port = up.pd.kvagent_port;
    match decode {
        Upstream::Engine => match up.pod.node_ip {
            Some(ip) => std::net::SocketAddr::new(ip, port).to_string(),
            None => format!("{}:{port}", up.engine_url.authority().host()),
        },
        Upstream::Peer(addr) => up
            .mesh_routes
            .kv_agent(*addr)
            .unwrap_or_else(|| std::net::SocketAddr::new(addr.ip(), port))
            .to_string(),
        Upstream::Direct(a) => format!("{}:{port}", a.host()),
    }
}

/// The span names of the two legs (children of `kvmesh.execute`).
pub(crate) const PREFILL: &str = "kvmesh.pd.prefill";
pub(crate) const DECODE: &str = "kvmesh.pd.decode";

/// The connector and the P/D outcome on the execute span.
fn traced(ctx: &RequestCtx, connector: &'static str, outcome: metrics::Outcome) {
    if let Some(t) = ctx.trace.as_deref() {
        let span = t.execute();
        span.set(opentelemetry::KeyValue::new(
            "kvmesh.pd.connector",
            connector,
        ));
        span.set(opentelemetry::KeyValue::new(
            "kvmesh.pd.outcome",
            outcome.label(),
        ));
    }
}
