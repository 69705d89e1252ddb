use std::time::Duration;

use super::table::{render, table, Sample};
use super::*;

fn pod(id: &str, local: bool, requests: u64, queries: u64, hits: u64) -> PodEntry {
    PodEntry {
        id: id.to_owned(),
        local,
        role: "both".to_owned(),
        models: vec!["m".to_owned()],
        healthy: true,
        waiting: 1,
        running: 2,
        kv_usage: 0.25,
        load_age_ms: Some(100),
        in_flight: 0,
        mesh: if local { "local" } else { "connected" }.to_owned(),
        stats: PodStats {
            requests,
            prefix_queries: queries,
            prefix_hits: hits,
            ..PodStats::default()
        },
    }
}

fn sample(pods: Vec<PodEntry>, peers: Vec<PeerEntry>, at: tokio::time::Instant) -> Sample {
    Sample {
        report: Report {
            kvmesh_stat: FORMAT,
            local: "a".to_owned(),
            mesh: true,
            stale_after_ms: 3000,
            pods,
            peers,
            index: None,
        },
        at,
    }
}

#[test]
fn rates_come_from_two_samples() {
    let t0 = tokio::time::Instant::now();
    let first = sample(vec![pod("a", true, 10, 100, 50)], vec![], t0);
    let second = sample(
        vec![pod("a", true, 30, 200, 140)],
        vec![PeerEntry {
            mesh_addr: "10.0.0.9:7000".to_owned(),
            id: None,
            state: "connecting".to_owned(),
            last_frame_ms: None,
        }],
        t0 + Duration::from_secs(2),
    );
    let t = table("x:1", Some(&first), &second);
    assert_eq!(t.pods.len(), 2);
    assert_eq!(t.pods[0].requests_per_s, Some(10.0));
    assert_eq!(t.pods[0].hit_rate, Some(0.9));
    assert_eq!(t.pods[1].pod, "mesh 10.0.0.9:7000");
    assert_eq!(t.pods[1].mesh, "connecting");
    // One sample: lifetime hit rate, no request rate.
    let alone = table("x:1", None, &second);
    assert_eq!(alone.pods[0].requests_per_s, None);
    assert_eq!(alone.pods[0].hit_rate, Some(0.7));
    let text = render(&t);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("POD"), "{text}");
    assert!(
        lines[1].contains("10.0") && lines[1].contains("90%"),
        "{text}"
    );
    assert!(lines[2].contains("connecting"), "{text}");
}

#[test]
fn a_restarted_pod_has_no_rate() {
    let t0 = tokio::time::Instant::now();
    let first = sample(vec![pod("a", true, 10, 0, 0)], vec![], t0);
    let second = sample(
        vec![pod("a", true, 3, 0, 0)],
        vec![],
        t0 + Duration::from_secs(1),
    );
    let t = table("x:1", Some(&first), &second);
    assert_eq!(t.pods[0].requests_per_s, None);
    assert_eq!(t.pods[0].hit_rate, None);
}

#[test]
fn the_valkey_index_is_a_line_under_the_table() {
    let t0 = tokio::time::Instant::now();
    let mut s = sample(vec![pod("a", true, 10, 100, 50)], vec![], t0);
    s.report.index = Some(IndexEntry {
        backend: "valkey".to_owned(),
        up: false,
        server: String::new(),
        lookups: 120,
        fallbacks: 7,
    });
    let text = render(&table("127.0.0.1:9090", None, &s));
    assert!(
        text.contains("index: valkey DOWN: routing on what this sidecar knows; 120 lookups answered, 7 routed without one"),
        "{text}"
    );
    let json = serde_json::to_value(table("127.0.0.1:9090", None, &s)).unwrap();
    assert_eq!(json["index"]["fallbacks"], 7);
}
