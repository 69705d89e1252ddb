//! The network-partition fault: a meshed fleet over two "nodes" (network
//! namespaces joined by a veth pair, `kvmesh_tests::netns`), two aggregated
//! pods on each (engine and sidecar processes on the node's pod address),
//! steady load on both sides, each side's clients sending to their own
//! side's sidecars. Node a's end of the veth goes down (nothing crosses), the
//! load keeps running, then the link comes up again; repeated
//! `KVMESH_PARTITION_ROUNDS` times (default 1).
//!
//! Checked per request, as the chaos suite does: every request ends within
//! its deadline, and no request whose client stayed connected fails, before
//! a cut, across it or after the heal. The requests sent across a cut are
//! counted for the report: those in flight to the other side's pods when
//! the link went down (every sidecar's `/debug/fleet` `in_flight_local`,
//! read just before) and those forwarded there before the sides split
//! (every sidecar's `kvmesh_mesh_forwarded_total` to the other side's pods,
//! from just before the cut to the split: until its peers' streams go
//! stale, a sidecar does not know they are gone). Those still waiting for
//! their response head when the sides split are cut off with the pods
//! across the cut and go whole to a pod on their own side. While cut, each
//! side's sidecars drop the other side's pods from `/debug/fleet` (bounded
//! wait) instead of routing to them. After the heal, the time until every
//! sidecar's `/debug/fleet` lists all four pods, healthy, is the figure
//! (docs/robustness.md).
//!
//! A cut longer than the sidecars' `timeouts.stream_idle` ([`Cut::long`])
//! checks what a stream across it does: its owning sidecar hears nothing
//! from the pod across the cut for `stream_idle`, and the stream migrates to
//! a pod on its own side (the sides have split by then). What never got a
//! response head across it (a non-streamed request, whose head comes with
//! the whole answer; a stream forwarded into the cut before the sides
//! split) is retried whole on the client's side when the pod is cut off,
//! well before `timeouts.first_byte`. None is lost.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_tests::netns::NodePair;
use serde_json::json;
use tokio::runtime::Handle;
use tokio::time::Instant;

use crate::fleet::{Fleet, Place, Role};
use crate::load::{self, Control, Outcome};

/// Pods per node.
const PER_NODE: usize = 2;
/// Load before the first cut.
const BASELINE: Duration = Duration::from_millis(1000);

/// The cuts a run makes.
#[derive(Debug, Clone, Copy)]
pub struct Cut {
    /// How long each cut lasts.
    pub lasts: Duration,
    /// How many cuts and heals (env `KVMESH_PARTITION_ROUNDS`, else this).
    pub rounds: usize,
    /// Whether it outlasts `timeouts.stream_idle`: streams across it migrate.
    pub past_idle: bool,
}

impl Cut {
    /// Past the sidecars' `mesh.stale_after` (1 s), so each side forgets the
    /// other's pods, and short of `timeouts.stream_idle` (5 s): the streams
    /// across the cut stall and resume at the heal.
    pub fn short() -> Self {
        Self {
            lasts: Duration::from_millis(3000),
            rounds: env_num("KVMESH_PARTITION_ROUNDS", 1.0).max(1.0) as usize,
            past_idle: false,
        }
    }

    /// Past `timeouts.stream_idle` (5 s) by 2 s: every stream across the
    /// cut is silent long enough for its owning sidecar to migrate it.
    pub fn long() -> Self {
        Self {
            lasts: Duration::from_millis(7000),
            rounds: 1,
            past_idle: true,
        }
    }
}
/// Load after a heal, before the next cut.
const HEALED_FOR: Duration = Duration::from_millis(1500);
/// The load's seeds on node a and node b (their requests' ids start
/// `chaos-SEED-`).
const SEEDS: [u64; 2] = [29, 31];
/// Bounds on the waits for the mesh to notice.
const NOTICE_WITHIN: Duration = Duration::from_secs(20);

/// One cut and heal.
#[derive(Debug, Clone)]
pub struct Round {
    /// Requests in flight across the cut when it came.
    pub in_flight: u64,
    /// Requests forwarded across it from then until the sides split.
    pub sent_before_split: u64,
    /// From the link going down to every sidecar seeing only its own side.
    pub split_ms: u128,
    /// From the link coming up to every sidecar's `/debug/fleet` agreeing.
    pub converge_ms: u128,
    /// Requests started from the previous cut (or the start) to the heal,
    /// and how many of them failed (streams among them).
    pub requests: usize,
    pub lost: usize,
    pub streams_lost: usize,
}

impl Round {
    /// Requests sent across the cut: the bound on those it may lose.
    pub fn across(&self) -> u64 {
        self.in_flight + self.sent_before_split
    }
}

/// What a run measured; [`Report::check`] asserts the accounting.
pub struct Report {
    pub violations: Vec<String>,
    pub stuck: Vec<String>,
    pub total: usize,
    pub complete: usize,
}

impl Report {
    pub fn check(&self) {
        assert!(
            self.stuck.is_empty(),
            "in-flight gauges not back to 0: {:?}",
            self.stuck
        );
        assert!(
            self.complete > self.total / 2,
            "most requests complete: {} of {}",
            self.complete,
            self.total
        );
        assert!(
            self.violations.is_empty(),
            "partition accounting failed:\n{}",
            self.violations.join("\n")
        );
    }
}

fn env_num(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Requests every sidecar has outstanding to the other node's pods.
async fn across(fleet: &Fleet) -> u64 {
    let mut n = 0;
    for p in &fleet.pods {
        let Some(v) = p.fleet_json().await else {
            continue;
        };
        let mine = p.place.ip.to_string();
        for pod in v["pods"].as_array().into_iter().flatten() {
            let id = pod["info"]["id"].as_str().unwrap_or("");
            if !id.starts_with(&format!("{mine}:")) {
                n += pod["in_flight_local"].as_u64().unwrap_or(0);
            }
        }
    }
    n
}

/// Requests every sidecar has forwarded to the other node's pods so far.
async fn forwarded_across(fleet: &Fleet, nodes: [std::net::IpAddr; 2]) -> u64 {
    let mut n = 0.0;
    for p in &fleet.pods {
        for other in nodes.iter().filter(|ip| **ip != p.place.ip) {
            let series = format!("kvmesh_mesh_forwarded_total{{target=\"{other}:");
            n += p.metric_sum(&series).await;
        }
    }
    n as u64
}

/// Whether `r` is a stream that failed after its response began (an SSE
/// error event, a cut or short stream): what a migration should have saved.
fn began_and_failed(r: &load::Record) -> bool {
    matches!(
        r.outcome,
        Outcome::StreamError(_) | Outcome::Wrong(_) | Outcome::Cut(_)
    )
}

/// Waits (bounded) until every sidecar lists exactly its own node's pods,
/// healthy; returns how long that took.
async fn split(fleet: &Fleet, within: Duration) -> Duration {
    let start = Instant::now();
    let mut last = Vec::new();
    while start.elapsed() < within {
        let mut ok = true;
        last.clear();
        for p in &fleet.pods {
            let mut want: Vec<(String, bool)> = fleet
                .pods
                .iter()
                .filter(|q| q.place.ip == p.place.ip)
                .map(|q| (q.id(), true))
                .collect();
            want.sort();
            let view = p.fleet_view().await;
            ok &= view.as_ref() == Some(&want);
            last.push(view);
        }
        if ok {
            return start.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "during the partition the sidecars still listed pods across the cut after {within:?}: {last:?}"
    );
}

/// Runs the fault on `pair` (`a`, `b`: runtimes in its namespaces).
pub async fn run(
    pair: &NodePair,
    (a, b): (Handle, Handle),
    sim_bin: std::path::PathBuf,
    proxy_bin: std::path::PathBuf,
    cut: Cut,
) -> Report {
    let rounds = cut.rounds;
    let rate = env_num("KVMESH_PARTITION_RATE", 20.0);
    let load_before = loadavg();
    let node_a = Place {
        ip: pair.a.pod_ip,
        node: Some((pair.a.ns.clone(), a.clone())),
    };
    let node_b = Place {
        ip: pair.b.pod_ip,
        node: Some((pair.b.ns.clone(), b.clone())),
    };
    let placed: Vec<(Role, Place)> = (0..PER_NODE)
        .map(|_| (Role::Both, node_a.clone()))
        .chain((0..PER_NODE).map(|_| (Role::Both, node_b.clone())))
        .collect();
    let started = Instant::now();
    let fleet = Fleet::start_placed(&placed, sim_bin, proxy_bin, None).await;
    let startup_ms = started.elapsed().as_millis();

    // Each side's clients send to their own side's sidecars, on a runtime in
    // that side's namespace.
    let control = Arc::new(Control::default());
    let mut workers = Vec::new();
    for (seed, net, ip) in [(SEEDS[0], &a, pair.a.pod_ip), (SEEDS[1], &b, pair.b.pod_ip)] {
        let fronts: Vec<_> = fleet
            .pods
            .iter()
            .filter(|p| p.place.ip == ip)
            .map(|p| p.client_addr())
            .collect();
        let _in_node = net.enter();
        workers.extend(load::start(fronts, 6, rate / 2.0, seed, control.clone()));
    }
    tokio::time::sleep(BASELINE).await;

    let nodes = [pair.a.pod_ip, pair.b.pod_ip];
    let mut rounds_out = Vec::new();
    for r in 0..rounds {
        // Phase 2r: since the previous heal (or the start); 2r + 1: cut.
        // The forward counters first: a request sent between the two reads
        // is in the in-flight count, or in the counters' difference.
        let sent_before = forwarded_across(&fleet, nodes).await;
        let in_flight = across(&fleet).await;
        pair.a.set_link(false);
        let cut_at = Instant::now();
        control.phase.store(2 * r + 1, Ordering::Release);
        let split_ms = split(&fleet, NOTICE_WITHIN).await.as_millis();
        let sent_before_split = forwarded_across(&fleet, nodes)
            .await
            .saturating_sub(sent_before);
        let rest = cut.lasts.saturating_sub(cut_at.elapsed());
        tokio::time::sleep(rest).await;
        pair.a.set_link(true);
        let healed_at = Instant::now();
        control.phase.store(2 * r + 2, Ordering::Release);
        fleet.converged(NOTICE_WITHIN).await;
        let converge_ms = healed_at.elapsed().as_millis();
        rounds_out.push(Round {
            in_flight,
            sent_before_split,
            split_ms,
            converge_ms,
            requests: 0,
            lost: 0,
            streams_lost: 0,
        });
        tokio::time::sleep(HEALED_FOR).await;
    }

    let records = load::stop(&control, workers).await;
    let stuck = fleet.in_flight_settled().await;
    // Calls with no head yet whose pod was cut off, retried on their side.
    let mut cut_off = 0.0;
    for p in &fleet.pods {
        cut_off += p
            .metric_sum("kvmesh_migrations_total{outcome=\"retried_unreachable\"}")
            .await;
    }
    let load_after = loadavg();
    let migrated = crate::migrations::collect(&fleet, &records);
    fleet.shutdown().await;

    let mut violations = Vec::new();
    for rec in &records {
        match &rec.outcome {
            Outcome::Hung => violations.push(format!("phase {}: a request hung", rec.phase)),
            Outcome::Cut(m) => violations.push(format!(
                "phase {}: a request ended without a response or an error ({m}); no sidecar died",
                rec.phase
            )),
            _ => {}
        }
    }
    let count = |phases: &[usize]| {
        let mine: Vec<_> = records
            .iter()
            .filter(|x| phases.contains(&x.phase))
            .collect();
        let lost = mine.iter().filter(|x| x.outcome.failed()).count();
        let streams_lost = mine.iter().filter(|x| began_and_failed(x)).count();
        (mine.len(), lost, streams_lost)
    };
    for (r, round) in rounds_out.iter_mut().enumerate() {
        (round.requests, round.lost, round.streams_lost) = count(&[2 * r, 2 * r + 1]);
        let moved: Vec<_> = migrated
            .iter()
            .filter(|m| m.phase == 2 * r || m.phase == 2 * r + 1)
            .collect();
        let m = crate::migrations::figures(&moved);
        println!(
            "partition | round {} | cut for {} ms | requests {:>4} | lost {:>3} (streams that had begun {}) | migrated {} (gap p50 {} ms, p99 {} ms) | across the cut {:>3} ({} in flight, {} sent before the split) | sides split in {:>5} ms | converged after the heal in {:>5} ms",
            r + 1,
            cut.lasts.as_millis(),
            round.requests,
            round.lost,
            round.streams_lost,
            moved.len(),
            m["gap_ms"]["p50"],
            m["gap_ms"]["p99"],
            round.across(),
            round.in_flight,
            round.sent_before_split,
            round.split_ms,
            round.converge_ms
        );
        if round.lost > 0 {
            violations.push(format!(
                "round {}: {} requests whose client stayed connected failed ({} of them streams that had begun; {} requests were sent across the cut: {} in flight when it came, {} forwarded before the sides split)",
                r + 1,
                round.lost,
                round.streams_lost,
                round.across(),
                round.in_flight,
                round.sent_before_split
            ));
        }
    }
    let after = count(&[2 * rounds]);
    let after = (after.0, after.1);
    println!(
        "partition | after the last heal | requests {:>4} | lost {:>3}",
        after.0, after.1
    );
    if after.1 > 0 {
        violations.push(format!(
            "after the last heal: {} of {} requests lost",
            after.1, after.0
        ));
    }
    // What each side's clients saw, over the whole run.
    let mut sides = Vec::new();
    for (node, seed) in ["a", "b"].into_iter().zip(SEEDS) {
        let prefix = format!("chaos-{seed}-");
        let mine: Vec<_> = records
            .iter()
            .filter(|x| x.id.starts_with(&prefix))
            .collect();
        let lost = mine.iter().filter(|x| x.outcome.failed()).count();
        let moved = migrated
            .iter()
            .filter(|m| m.id.starts_with(&prefix))
            .count();
        println!(
            "partition | node {node}'s clients | requests {:>4} | lost {lost:>3} | streams migrated {moved:>3}",
            mine.len()
        );
        sides.push(json!({"node": node, "requests": mine.len(), "lost": lost, "migrated": moved}));
    }
    let mut kinds = std::collections::BTreeMap::<String, usize>::new();
    for rec in records.iter().filter(|x| x.outcome.failed()) {
        let k: String = format!("{:?}", rec.outcome).chars().take(110).collect();
        *kinds.entry(k).or_default() += 1;
    }
    for (k, n) in &kinds {
        println!("partition |   {n} x {k}");
    }
    let total = records.len();
    let complete = records
        .iter()
        .filter(|x| x.outcome == Outcome::Complete)
        .count();
    println!(
        "partition | {total} requests, {complete} complete; {cut_off} calls with no head cut off with their pod and retried; {} pods over two nodes up in {startup_ms} ms; load average {load_before} before, {load_after} after",
        2 * PER_NODE
    );
    let json = json!({
        "pods": 2 * PER_NODE, "rounds": rounds, "rate_per_s": rate,
        "requests": total, "complete": complete,
        "retried_unreachable": cut_off,
        "cut_for_ms": cut.lasts.as_millis(),
        "migrated": crate::migrations::figures(&migrated.iter().collect::<Vec<_>>()),
        "per_round": rounds_out.iter().map(|x| json!({
            "requests": x.requests, "lost": x.lost, "streams_lost": x.streams_lost,
            "across_cut": x.across(),
            "in_flight_at_cut": x.in_flight, "sent_before_split": x.sent_before_split,
            "split_ms": x.split_ms, "converge_ms": x.converge_ms,
        })).collect::<Vec<_>>(),
        "after_heal": {"requests": after.0, "lost": after.1},
        "clients": sides,
        "failures": kinds,
        "loadavg_before": load_before, "loadavg_after": load_after,
    });
    let json_env = if cut.past_idle {
        "KVMESH_PARTITION_LONG_JSON"
    } else {
        "KVMESH_PARTITION_JSON"
    };
    if let Ok(path) = std::env::var(json_env) {
        std::fs::write(&path, serde_json::to_vec_pretty(&json).expect("json"))
            .expect("write the partition JSON");
    }
    Report {
        violations,
        stuck,
        total,
        complete,
    }
}
