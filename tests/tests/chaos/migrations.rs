//! The migrations of a chaos run, accounted for (docs/migration.md): which
//! requests' streams went on on another pod (the sidecars' access lines,
//! joined to the client's records by `x-request-id`), the tokens each
//! carried there, the gap each left in its stream (the client's longest wait
//! between two events with tokens: from the last token before the fault to
//! the first after), and whether each read, token for token, what an engine
//! nobody interrupted generates for the same request (greedy decoding: the
//! simulator's output is a function of the context alone).

use std::collections::{HashMap, HashSet};

use futures_util::StreamExt;
use kvmesh_engine_sim::SimConfig;
use kvmesh_tests::client::{fetch, http1, post_json};
use kvmesh_tests::route::{sim_with, MODEL};
use serde_json::{json, Value};

use crate::fleet::Fleet;
use crate::load::{Outcome, Record};

/// One request whose stream migrated.
#[derive(Debug, Clone)]
pub struct Migrated {
    pub id: String,
    pub phase: usize,
    pub migrations: u64,
    /// Tokens the continuations carried, in all.
    pub tokens: u64,
    /// The longest wait between two token events the client saw.
    pub gap_ms: f64,
    pub complete: bool,
}

/// Streams that did not migrate checked against the reference too, so that
/// a mismatch of the comparison itself shows.
const CONTROL_STREAMS: usize = 20;

/// The migrated requests among `records`, by the access lines of every
/// sidecar of `fleet`.
pub fn collect(fleet: &Fleet, records: &[Record]) -> Vec<Migrated> {
    let mut by_id: HashMap<String, (u64, u64)> = HashMap::new();
    for p in &fleet.pods {
        for (id, n, tokens) in p.migrations() {
            let e = by_id.entry(id).or_default();
            e.0 += n;
            e.1 += tokens;
        }
    }
    records
        .iter()
        .filter_map(|r| {
            let (migrations, tokens) = *by_id.get(&r.id)?;
            Some(Migrated {
                id: r.id.clone(),
                phase: r.phase,
                migrations,
                tokens,
                gap_ms: r.read.as_ref().map_or(0.0, |s| s.max_gap_ms),
                complete: r.outcome == Outcome::Complete,
            })
        })
        .collect()
}

/// Sends every complete stream in `migrated` (and [`CONTROL_STREAMS`] that
/// did not migrate) again, whole, to a fresh engine, and compares the token
/// ids and text the client read with that uninterrupted run's. Returns the
/// requests checked and a line per mismatch.
pub async fn against_reference(records: &[Record], migrated: &[Migrated]) -> (usize, Vec<String>) {
    let migrated: HashSet<&str> = migrated.iter().map(|m| m.id.as_str()).collect();
    let complete = |r: &&Record| r.outcome == Outcome::Complete && r.read.is_some();
    let mut chosen: Vec<&Record> = records
        .iter()
        .filter(complete)
        .filter(|r| migrated.contains(r.id.as_str()))
        .collect();
    chosen.extend(
        records
            .iter()
            .filter(complete)
            .filter(|r| !migrated.contains(r.id.as_str()))
            .take(CONTROL_STREAMS),
    );
    let engine = sim_with(SimConfig::new(MODEL).with_time_scale(1000.0)).await;
    let addr = engine.addr();
    let client = http1();
    let checks = futures_util::stream::iter(chosen.iter().map(|r| {
        let client = client.clone();
        async move {
            let mut body: Value = serde_json::from_str(&r.body).expect("the request's body");
            body["stream"] = json!(false);
            body.as_object_mut().map(|o| o.remove("stream_options"));
            let w = fetch(
                &client,
                post_json(addr, "/v1/completions", &body.to_string()),
            )
            .await;
            let v = w.json();
            let want_ids: Vec<u64> = v["choices"][0]["token_ids"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_u64)
                .collect();
            let want_text = v["choices"][0]["text"].as_str().unwrap_or("").to_owned();
            let got = r.read.as_ref().expect("a stream");
            if got.token_ids == want_ids && got.text == want_text {
                return None;
            }
            let first = got
                .token_ids
                .iter()
                .zip(&want_ids)
                .position(|(a, b)| a != b);
            Some(format!(
                "{}: {} ids read, {} uninterrupted, first differing at {first:?}; text equal: {}",
                r.id,
                got.token_ids.len(),
                want_ids.len(),
                got.text == want_text
            ))
        }
    }))
    .buffer_unordered(16)
    .collect::<Vec<_>>()
    .await;
    engine.shutdown().await;
    (chosen.len(), checks.into_iter().flatten().collect())
}

/// The `q` quantile (0..=1) of `v`, nearest rank; 0 for none.
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

/// The figures of some migrated requests: how many, how many migrations,
/// the tokens carried, and the gap's p50, p99 and max (ms).
pub fn figures(m: &[&Migrated]) -> Value {
    let gaps: Vec<f64> = m.iter().map(|x| x.gap_ms).collect();
    json!({
        "streams": m.len(),
        "migrations": m.iter().map(|x| x.migrations).sum::<u64>(),
        "tokens_carried": m.iter().map(|x| x.tokens).sum::<u64>(),
        "gap_ms": {
            "p50": round(quantile(&gaps, 0.5)),
            "p99": round(quantile(&gaps, 0.99)),
            "max": round(quantile(&gaps, 1.0)),
        },
    })
}

fn round(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}
