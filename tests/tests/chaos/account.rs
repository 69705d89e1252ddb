//! The chaos suite's accounting per fault: the requests that started under
//! it, those that failed although their client stayed connected (the bound
//! is 0), the clients cut with their own sidecar (bounded by what was in
//! flight on it), the streams that migrated with the tokens they carried and
//! their gaps; printed, and returned as the JSON's `faults` with every
//! violation.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::Instant;

use crate::load::{Outcome, Record};
use crate::migrations::{self, Migrated};

/// One fault's figures.
#[derive(Debug, Clone)]
pub struct Figure {
    pub fault: String,
    /// The requests in flight on what died, just before it died (0: nothing
    /// died). Only a client whose own sidecar died may lose its request,
    /// and those number at most this.
    pub bound: u64,
    pub converge_ms: u128,
    pub note: String,
    /// A front sidecar SIGKILLed, and when: its clients' connections are
    /// cut with no error said, the one failure allowed.
    pub killed_front: Option<(usize, Instant)>,
}

/// How long after a front sidecar's SIGKILL a request may still start on a
/// kept-alive connection to it and be cut (the suite's `POOL_NOTICE` and a margin).
const CUT_WINDOW: Duration = Duration::from_millis(200);

/// Whether `r` is a request whose client's own sidecar died under it.
fn cut_by_its_sidecar(r: &Record, figures: &[Figure]) -> bool {
    matches!(r.outcome, Outcome::Cut(_))
        && figures.iter().any(|f| {
            f.killed_front.is_some_and(|(front, at)| {
                r.front == Some(front) && r.started <= at + CUT_WINDOW && r.ended >= at
            })
        })
}

/// The figures of every fault in `figures` (the records' phases index it),
/// printed; returns the JSON rows and the violations.
pub fn per_fault(
    figures: &[Figure],
    records: &[Record],
    migrated: &[Migrated],
    started: Instant,
) -> (Vec<Value>, Vec<String>) {
    let mut table = Vec::new();
    let mut violations = Vec::new();
    for (i, f) in figures.iter().enumerate() {
        let mine: Vec<_> = records.iter().filter(|r| r.phase == i).collect();
        let failed: Vec<_> = mine
            .iter()
            .filter(|r| r.outcome.failed() && !cut_by_its_sidecar(r, figures))
            .collect();
        // Clients whose own sidecar this fault killed (whenever they began).
        let cut = records
            .iter()
            .filter(|r| cut_by_its_sidecar(r, std::slice::from_ref(f)))
            .count() as u64;
        let hung = mine.iter().filter(|r| r.outcome == Outcome::Hung).count();
        let abandoned = mine
            .iter()
            .filter(|r| r.outcome == Outcome::Abandoned)
            .count();
        let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
        for r in &failed {
            let k = match &r.outcome {
                Outcome::CleanError(m)
                | Outcome::StreamError(m)
                | Outcome::Cut(m)
                | Outcome::Wrong(m) => {
                    let short: String = m.chars().take(90).collect();
                    let kind = format!("{:?}", r.outcome);
                    let kind = kind.split('(').next().unwrap_or("");
                    format!("{kind}: {short}")
                }
                o => format!("{o:?}"),
            };
            *kinds.entry(k).or_default() += 1;
        }
        let lost = failed.len() as u64;
        let moved: Vec<_> = migrated.iter().filter(|m| m.phase == i).collect();
        let m = migrations::figures(&moved);
        println!(
        "chaos | {:<95} | requests {:>5} | lost {:>3} | cut with their own sidecar {:>3} | in flight on what died {:>3} | migrated {:>3} (carried {:>5} tokens, gap p50 {:>6} ms, p99 {:>6} ms) | abandoned {:>3} | converged in {:>5} ms {}",
        f.fault,
        mine.len(),
        lost,
        cut,
        f.bound,
        moved.len(),
        m["tokens_carried"],
        m["gap_ms"]["p50"],
        m["gap_ms"]["p99"],
        abandoned,
        f.converge_ms,
        f.note
    );
        for (k, n) in &kinds {
            println!("chaos |   {n} x {k}");
        }
        for r in failed.iter().take(5) {
            println!(
                "chaos |   failed: {} on front {:?}, from {} ms to {} ms",
                r.id,
                r.front,
                (r.started - started).as_millis(),
                (r.ended - started).as_millis()
            );
        }
        if hung > 0 {
            violations.push(format!("{}: {hung} requests hung", f.fault));
        }
        if lost > 0 {
            violations.push(format!(
                "{}: {lost} requests failed whose client stayed connected: {kinds:?}",
                f.fault
            ));
        }
        if cut > f.bound {
            violations.push(format!(
                "{}: {cut} clients cut with their sidecar, more than the {} in flight on it",
                f.fault, f.bound
            ));
        }
        table.push(json!({
            "fault": f.fault, "requests": mine.len(), "lost": lost,
            "cut_with_their_sidecar": cut,
            "in_flight_on_what_died": f.bound, "abandoned": abandoned,
            "converge_ms": f.converge_ms, "note": f.note,
            "failures": kinds, "migrated": m,
        }));
    }
    (table, violations)
}
