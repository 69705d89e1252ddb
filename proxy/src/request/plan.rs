//! What the scheduler decides: a [`Plan`] of [`Target`]s, a disaggregated
//! target's [`Leg`]s, and the most attempts one request makes.

use std::net::SocketAddr;

use http::uri::Authority;

/// Most targets the execute stage tries for one request (the first plus fallbacks).
pub const MAX_ATTEMPTS: usize = 4;

/// Where a request (or one leg of it) runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// This pod's engine.
    LocalEngine,
    /// Another pod: forwarded to its sidecar, marked as already routed.
    Peer { sidecar_addr: SocketAddr },
    /// Prefill on one pod, decode on another, joined by a P/D connector.
    Disaggregated { prefill: Leg, decode: Leg },
}

/// One leg of a disaggregated request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leg {
    LocalEngine,
    Peer {
        sidecar_addr: SocketAddr,
    },
    /// An engine outside the mesh that an llm-d EPP named and
    /// `pd.allowed_prefillers` lists (prefill legs only).
    Direct(Authority),
}

impl Leg {
    /// The whole request on this leg's pod.
    pub fn whole(&self) -> Target {
        match self {
            // An engine outside the mesh is only ever a prefill leg; the
            // decode leg (where a whole request would go) is ours or a peer.
            Self::LocalEngine | Self::Direct(_) => Target::LocalEngine,
            Self::Peer { sidecar_addr } => Target::Peer {
                sidecar_addr: *sidecar_addr,
            },
        }
    }
}

/// The scheduler's answer: a target, what to try next, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub target: Target,
    /// Tried in order when a target refuses the connection before any byte was
    /// sent; at most `MAX_ATTEMPTS - 1` are used.
    pub fallbacks: Vec<Target>,
    /// For a disaggregated target: other prefill pods, best first, tried when
    /// the chosen prefill pod refuses or fails before answering.
    pub prefill_fallbacks: Vec<Leg>,
    /// A short, stable reason for logs and metric labels.
    pub reason: &'static str,
    /// The prompt tokens the request would compute on each pod of the plan
    /// (what its cache does not hold), by pod id: counted as waiting to be
    /// prefilled there while it is ([`crate::path::account::track`]).
    pub uncached_tokens: Vec<(String, u64)>,
    /// The pool its first leg runs in, as flow control sees it (`None`:
    /// flow control is off, or the request was not scheduled).
    pub pool: Option<Pool>,
}

/// The pods a request's first leg could run on: those of the role of the
/// pod chosen for it (its prefill pod when split) serving its model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool {
    pub role: kvmesh_filters::sched::Role,
    /// Every healthy pod of it is saturated (`crate::flow`).
    pub saturated: bool,
}

impl Plan {
    /// An llm-d EPP's split: prefill on `prefiller`, decode on the local
    /// engine, no fallbacks (the EPP chose both pods).
    pub fn epp(prefiller: Leg) -> Self {
        Self {
            target: Target::Disaggregated {
                prefill: prefiller,
                decode: Leg::LocalEngine,
            },
            fallbacks: Vec::new(),
            prefill_fallbacks: Vec::new(),
            reason: "prefiller_header",
            uncached_tokens: Vec::new(),
            pool: None,
        }
    }

    /// Everything on the local engine, no fallbacks.
    pub fn local(reason: &'static str) -> Self {
        Self {
            target: Target::LocalEngine,
            fallbacks: Vec::new(),
            prefill_fallbacks: Vec::new(),
            reason,
            uncached_tokens: Vec::new(),
            pool: None,
        }
    }

    /// The metric label of where the request goes: `local`, `peer` or `disaggregated`.
    pub fn decision(&self) -> &'static str {
        match self.target {
            Target::LocalEngine => "local",
            Target::Peer { .. } => "peer",
            Target::Disaggregated { .. } => "disaggregated",
        }
    }
}
