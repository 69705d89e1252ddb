use std::net::SocketAddr;
use std::time::Duration;

use super::*;
use crate::mesh::subscriber::PeerStatus;

#[test]
fn prefix_counters_from_vllm_text() {
    let text = "# HELP x\n\
        vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 56.0\n\
        vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"m\"} 4.0\n\
        vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 16.0\n\
        vllm:prefix_cache_hits_created{engine=\"0\"} 1.7e9\n";
    assert_eq!(prefix_counters(EngineKind::Vllm, text), Some((60, 16)));
    assert_eq!(prefix_counters(EngineKind::Sglang, text), None);
    assert_eq!(prefix_counters(EngineKind::Vllm, "other 1\n"), None);
}

#[test]
fn peer_states() {
    let now = tokio::time::Instant::now();
    let addr: SocketAddr = "127.0.0.1:7000".parse().unwrap();
    let stale = Duration::from_secs(1);
    let mut s = PeerStatus::default();
    let state = |s: &PeerStatus| PeerEntry::of(addr, s, now, stale).map(|e| e.state);
    assert_eq!(state(&s).as_deref(), Some("connecting"));
    s.synced = true;
    s.last_frame = Some(now);
    assert_eq!(state(&s).as_deref(), Some("connected"));
    s.last_frame = now.checked_sub(Duration::from_secs(2));
    assert_eq!(state(&s).as_deref(), Some("stale"));
    s.other_models = true;
    assert_eq!(state(&s).as_deref(), Some("other_models"));
    s.is_self = true;
    assert_eq!(state(&s), None);
}
