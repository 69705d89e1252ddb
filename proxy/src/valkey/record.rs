//! A pod's record in Valkey: who it is (the mesh's announce), its load and
//! in-flight count, rewritten every `lease_interval` under a lease of
//! `lease_ttl`. A lookup returns the records of the pods it names, so a
//! sidecar learns of a pod the moment it is a candidate, and forgets it
//! when no lookup names it any more.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use kvmesh_filters::sched::view::Role;
use serde::{Deserialize, Serialize};

use crate::fleet::{EngineLoad, EngineWork, PodInfo};

/// See the module docs. Field names are short: a lookup returns a record
/// for every candidate, on every routing decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PodRecord {
    /// The pod's identity (its sidecar's advertised client address).
    pub id: String,
    /// The mesh port, for forwarding over mutual TLS (empty: none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mesh: String,
    /// The node's KV agent, `ip:port` (empty: none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub kv_agent: String,
    pub role: Role,
    #[serde(default)]
    pub models: Vec<String>,
    /// The LoRA adapters the engine has loaded as of the write: the configured
    /// ones and those it loaded at run time (`fleet::adapters`), so a lookup
    /// sees a load or unload within one `lease_interval`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// The engine's queue, running batch and KV usage.
    pub waiting: u32,
    pub running: u32,
    pub kv: f64,
    #[serde(default)]
    pub block_size: u32,
    #[serde(default)]
    pub blocks: u32,
    pub healthy: bool,
    /// Requests in flight to the pod, as its own sidecar counts them (every
    /// request a pod runs passes its sidecar).
    pub in_flight: u32,
    /// Milliseconds the load was old when the record was written.
    pub load_age_ms: u64,
    /// The lease the record was written with, to age it by its PTTL.
    pub ttl_ms: u64,
    /// The engine's work counters (finished, prompt, cached and generated
    /// tokens; `EngineWork`), for the autoscaling hook; absent when the
    /// engine exports none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work: Option<[u64; 4]>,
}

impl PodRecord {
    /// The record as the fleet holds a peer; `None` when its identity is
    /// not `ip:port` (a name would need resolving on every decision).
    pub fn info(&self) -> Option<PodInfo> {
        let addr: SocketAddr = self.id.parse().ok()?;
        Some(PodInfo {
            id: self.id.clone(),
            sidecar_addr: Some(addr),
            role: self.role,
            models: self.models.clone(),
            lora_adapters: self.adapters.clone(),
            labels: self.labels.clone(),
        })
    }

    pub fn load(&self) -> EngineLoad {
        EngineLoad {
            waiting: self.waiting,
            running: self.running,
            kv_usage: self.kv,
            block_size: self.block_size,
            num_blocks: self.blocks,
            work: self.work.map(
                |[finished, prompt_tokens, cached_tokens, generation_tokens]| EngineWork {
                    finished,
                    prompt_tokens,
                    cached_tokens,
                    generation_tokens,
                    // Not in the record: the hook assumes a spread there.
                    prompt_spread: None,
                },
            ),
        }
    }

    /// How old the record's load is, given the key's remaining lease.
    pub fn age_ms(&self, pttl_ms: i64) -> u64 {
        let since_write = self
            .ttl_ms
            .saturating_sub(u64::try_from(pttl_ms.max(0)).unwrap_or(0));
        since_write.saturating_add(self.load_age_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_and_ages_by_its_lease() {
        let r = PodRecord {
            id: "10.0.0.7:8000".into(),
            mesh: String::new(),
            kv_agent: "10.0.0.7:7600".into(),
            role: Role::Decode,
            models: vec!["m".into()],
            adapters: vec![],
            labels: BTreeMap::new(),
            waiting: 2,
            running: 5,
            kv: 0.5,
            block_size: 16,
            blocks: 1000,
            healthy: true,
            in_flight: 7,
            load_age_ms: 40,
            ttl_ms: 3000,
            work: Some([3, 300, 100, 30]),
        };
        let json = serde_json::to_string(&r).unwrap();
        assert!(!json.contains("mesh"), "{json}");
        let back: PodRecord = serde_json::from_str(&json).unwrap();
        assert_eq!(back, r);
        assert_eq!(back.age_ms(2500), 540);
        assert_eq!(
            back.info().unwrap().sidecar_addr,
            "10.0.0.7:8000".parse().ok()
        );
        let named = PodRecord {
            id: "pod-3:8000".into(),
            ..r
        };
        assert!(named.info().is_none());
    }
}
