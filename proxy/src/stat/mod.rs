//! `GET /debug/stat`: the fleet at a glance, from any sidecar's admin port, for `kvmesh stat`.
//!
//! [`report`] lists every pod this sidecar knows with
//! its role, models, load and staleness, each pod's cumulative counters
//! ([`PodStats`]: requests served, P/D splits and failures, prefix cache
//! queries and hits) and the state of every followed mesh stream
//! ([`PeerEntry`]). A pod's counters come from the pod's own sidecar: the
//! local ones from this sidecar's metrics and engine scrape, the peers' over
//! the mesh (`Msg::Stats`, sent with every load tick). Counters are
//! cumulative, so rates need two samples: the client side (`kvmesh stat`, in
//! the `kvmesh` CLI crate) takes them and turns them into one row per pod.

use std::time::Duration;

use kvmesh_filters::sched::view::Role;
use serde::{Deserialize, Serialize};

use crate::config::EngineKind;

/// The admin path the client asks.
pub const PATH: &str = "/debug/stat";

/// The version of the `/debug/stat` document; its presence marks a kvmesh
/// admin port.
pub const FORMAT: u32 = 1;

/// One pod's cumulative counters since its sidecar started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodStats {
    /// Inference requests the pod's engine served through its sidecar.
    pub requests: u64,
    /// Requests the pod's sidecar split into prefill + decode.
    pub pd_splits: u64,
    /// Of those, the ones not served disaggregated or by recompute.
    pub pd_failures: u64,
    /// Prompt tokens the engine looked up in its prefix cache (vLLM).
    pub prefix_queries: u64,
    /// Of those, the tokens found cached.
    pub prefix_hits: u64,
}

/// One followed mesh address and the state of its stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerEntry {
    pub mesh_addr: String,
    /// The pod id the peer announced, once it did.
    pub id: Option<String>,
    /// `connected` (in sync, heard within `stale_after`), `stale` (silent
    /// longer), `connecting` (never in sync) or `other_models` (not followed
    /// under `mesh.follow: same-models`).
    pub state: String,
    /// Milliseconds since the stream's last frame.
    pub last_frame_ms: Option<u64>,
}

/// One pod in the `/debug/stat` document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PodEntry {
    pub id: String,
    pub local: bool,
    pub role: String,
    pub models: Vec<String>,
    pub healthy: bool,
    pub waiting: u32,
    pub running: u32,
    /// KV cache usage, 0..1.
    pub kv_usage: f64,
    /// Milliseconds since the pod's load was reported (`None`: never).
    pub load_age_ms: Option<u64>,
    /// Requests in flight towards the pod, across the mesh.
    pub in_flight: u32,
    /// `local`, or the state of the peer's stream ([`PeerEntry::state`]);
    /// `unfollowed` for a pod no stream reports (added by hand).
    pub mesh: String,
    pub stats: PodStats,
}

/// The `/debug/stat` document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// [`FORMAT`].
    pub kvmesh_stat: u32,
    /// The answering sidecar's pod id.
    pub local: String,
    /// Whether the answering sidecar has the mesh on.
    pub mesh: bool,
    pub stale_after_ms: u64,
    pub pods: Vec<PodEntry>,
    /// Every followed address, including those that are not pods (yet).
    pub peers: Vec<PeerEntry>,
    /// With `index.backend: valkey`: where the index is and how the lookups
    /// went (absent on the mesh, and from sidecars that predate it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<IndexEntry>,
}

/// The Valkey index as the answering sidecar sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexEntry {
    pub backend: String,
    /// Whether the sidecar has a connection to Valkey now.
    pub up: bool,
    /// The server it is connected to ("" while down).
    pub server: String,
    /// Lookups answered by Valkey (from the cache included).
    pub lookups: u64,
    /// Lookups that failed (timeout, down, error): those requests were
    /// routed on what the sidecar knew.
    pub fallbacks: u64,
}

/// This pod's counters now: requests served (the mesh's count) and P/D's
/// splits and failures from the sidecar's metrics, the prefix cache's from
/// the last engine scrape (`scraped`).
pub fn local_stats(
    scraped: PodStats,
    served: u64,
    (pd_splits, pd_failures): (u64, u64),
) -> PodStats {
    PodStats {
        requests: served,
        pd_splits,
        pd_failures,
        ..scraped
    }
}

/// The engine's prefix cache counters (queried tokens, hit tokens) from its
/// metrics text, summed over label sets; `None` when it exports none (SGLang
/// reports only a hit-rate gauge).
pub fn prefix_counters(kind: EngineKind, text: &str) -> Option<(u64, u64)> {
    if kind != EngineKind::Vllm {
        return None;
    }
    let (mut queries, mut hits, mut seen) = (0.0f64, 0.0f64, false);
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let slot = match &line[..name_end] {
            "vllm:prefix_cache_queries_total" | "vllm:prefix_cache_queries" => &mut queries,
            "vllm:prefix_cache_hits_total" | "vllm:prefix_cache_hits" => &mut hits,
            _ => continue,
        };
        let value = line
            .rsplit_once('}')
            .map_or(&line[name_end..], |(_, v)| v)
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = value.filter(|v| v.is_finite() && *v >= 0.0) {
            *slot += v;
            seen = true;
        }
    }
    // Float counters to whole tokens (`as` saturates).
    seen.then_some((queries as u64, hits as u64))
}

pub(crate) fn role_name(r: Role) -> &'static str {
    match r {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Both => "both",
    }
}

pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests;
