//! Runs a workload against a set of targets under a load and collects one
//! record per request.
//!
//! Open-loop stages draw exponential gaps from a seeded RNG; closed-loop
//! stages run `concurrency` workers. Requests are taken from the workload in
//! order across stages (cycling), spread over the targets round-robin or by
//! user, and, for ordered workloads, a user's request waits for that user's
//! previous one. Every spawned task lives in a `JoinSet` owned by the run.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Uri;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use tokio::task::JoinSet;

use crate::client::{Client, ClientConfig, Target};
use crate::error::LoadgenError;
use crate::load::{Arrival, Load, Stage, MAX_RUN_REQUESTS};
use crate::progress::{Counters, Progress};
use crate::record::RequestRecord;
use crate::stats::Summary;
use crate::workload::{Api, Prompt, Workload};

/// How requests are spread over the targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Spread {
    /// In turn, request by request.
    RoundRobin,
    /// `user % targets`: a user always reaches the same target (clients
    /// spread over sidecars, each client talking to its own).
    StickyUser,
}

/// Everything a run needs besides the workload and the load.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub targets: Vec<Target>,
    pub spread: Spread,
    /// The `model` field of every request.
    pub model: String,
    /// Seeds the arrival times (workloads carry their own seed).
    pub seed: u64,
    /// Show a progress line on stderr.
    pub progress: bool,
    pub client: ClientConfig,
}

impl RunConfig {
    /// Parses `urls` into targets; round-robin, seed 0, no progress line.
    pub fn new(urls: &[String], model: &str) -> Result<RunConfig, LoadgenError> {
        let targets = urls
            .iter()
            .map(|u| Target::parse(u))
            .collect::<Result<Vec<_>, _>>()?;
        if targets.is_empty() {
            return Err(LoadgenError::NoTargets);
        }
        Ok(RunConfig {
            targets,
            spread: Spread::RoundRobin,
            model: model.to_string(),
            seed: 0,
            progress: false,
            client: ClientConfig::default(),
        })
    }
}

/// The time window of one stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageResult {
    pub label: String,
    /// Rate (req/s) or concurrency.
    pub level: f64,
    pub requests: usize,
    /// Open-loop arrivals that waited because `max_in_flight` was reached.
    pub late_arrivals: u64,
}

/// All records of a run, in workload-dispatch order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    pub workload: String,
    pub records: Vec<RequestRecord>,
    pub stages: Vec<StageResult>,
    /// First send to last completion.
    pub elapsed: Duration,
}

impl RunResult {
    /// Figures over the whole run.
    pub fn summary(&self) -> Summary {
        Summary::from_records(&self.records, self.elapsed)
    }

    /// Figures per stage, rated over each stage's span (its first send to its
    /// last completion; spans of open-loop stages overlap at the edges).
    pub fn stage_summaries(&self) -> Vec<(StageResult, Summary)> {
        self.stages
            .iter()
            .enumerate()
            .map(|(i, st)| {
                let recs: Vec<&RequestRecord> =
                    self.records.iter().filter(|r| r.stage == i).collect();
                let first = recs.iter().map(|r| r.start).min().unwrap_or_default();
                let last = recs
                    .iter()
                    .map(|r| r.start + r.e2e)
                    .max()
                    .unwrap_or_default();
                (
                    st.clone(),
                    Summary::from_records(recs, last.saturating_sub(first)),
                )
            })
            .collect()
    }
}

/// Runs `workload` under `load` against `cfg.targets`.
pub async fn run(
    cfg: &RunConfig,
    workload: &Workload,
    load: &Load,
) -> Result<RunResult, LoadgenError> {
    load.validate()?;
    if cfg.targets.is_empty() {
        return Err(LoadgenError::NoTargets);
    }
    if workload.is_empty() {
        return Err(LoadgenError::BadLoad(format!(
            "workload {} has no request",
            workload.name
        )));
    }
    let shared = Arc::new(Shared::prepare(cfg, workload)?);
    let counters = Arc::new(Counters::default());
    let labels = load.stages.iter().map(Stage::label).collect();
    let progress = Progress::start(cfg.progress, counters.clone(), labels);
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let t0 = Instant::now();
    let mut records = Vec::new();
    let mut stages = Vec::new();
    for (i, stage) in load.stages.iter().enumerate() {
        counters.stage.store(i, Ordering::Relaxed);
        let (recs, late) = match stage.arrival {
            Arrival::Poisson { rate } => {
                open_loop(
                    &shared,
                    &counters,
                    stage,
                    i,
                    rate,
                    load.max_in_flight,
                    &mut rng,
                    t0,
                )
                .await
            }
            Arrival::Closed { concurrency } => (
                closed_loop(&shared, &counters, stage, i, concurrency, t0).await,
                0,
            ),
        };
        stages.push(StageResult {
            label: stage.label(),
            level: stage.level(),
            requests: recs.len(),
            late_arrivals: late,
        });
        records.extend(recs);
    }
    progress.finish().await;
    records.sort_by_key(|r| r.index);
    let end = records
        .iter()
        .map(|r| r.start + r.e2e)
        .max()
        .unwrap_or_default();
    let first = records.iter().map(|r| r.start).min().unwrap_or_default();
    Ok(RunResult {
        workload: workload.name.clone(),
        records,
        stages,
        elapsed: end.saturating_sub(first),
    })
}

/// What the request tasks share: prepared bodies, URIs, the dispatch state.
struct Shared {
    client: Client,
    spread: Spread,
    /// Per request of the workload: body, stream flag, API, user.
    bodies: Vec<(Bytes, bool, Api, u32)>,
    /// Per target: URI of completions and of chat completions.
    uris: Vec<[Uri; 2]>,
    ordered: bool,
    dispatch: Mutex<Dispatch>,
}

#[derive(Default)]
struct Dispatch {
    next: usize,
    /// Completion signal of each user's latest dispatched request
    /// (ordered workloads only; one entry per user at most).
    chains: HashMap<u32, oneshot::Receiver<()>>,
}

/// One dispatched request, ready for a task.
struct Job {
    index: usize,
    after: Option<oneshot::Receiver<()>>,
    done: Option<oneshot::Sender<()>>,
}

impl Shared {
    fn prepare(cfg: &RunConfig, w: &Workload) -> Result<Shared, LoadgenError> {
        // Bodies are built before the clock starts, once per distinct
        // prompt: requests repeating an `Arc` prompt share one `Bytes`.
        let mut cache: HashMap<(usize, u32, bool), Bytes> = HashMap::new();
        let mut bodies = Vec::with_capacity(w.len());
        for r in &w.requests {
            let body = match &r.prompt {
                Prompt::Text(t) => {
                    let key = (Arc::as_ptr(t) as *const u8 as usize, r.max_tokens, r.stream);
                    match cache.get(&key) {
                        Some(b) => b.clone(),
                        None => {
                            let b = r.body(&cfg.model)?;
                            cache.insert(key, b.clone());
                            b
                        }
                    }
                }
                Prompt::Messages(_) => r.body(&cfg.model)?,
            };
            bodies.push((body, r.stream, r.api, r.user));
        }
        let uris = cfg
            .targets
            .iter()
            .map(|t| Ok([t.uri("/v1/completions")?, t.uri("/v1/chat/completions")?]))
            .collect::<Result<Vec<_>, LoadgenError>>()?;
        Ok(Shared {
            client: Client::new(cfg.client.clone()),
            spread: cfg.spread,
            bodies,
            uris,
            ordered: w.ordered_per_user,
            dispatch: Mutex::new(Dispatch::default()),
        })
    }

    fn next_job(&self) -> Job {
        // A poisoned lock only means another task panicked mid-dispatch; the
        // counter and map are still consistent, so carry on.
        let mut d = self.dispatch.lock().unwrap_or_else(|p| p.into_inner());
        let index = d.next;
        d.next += 1;
        if !self.ordered {
            return Job {
                index,
                after: None,
                done: None,
            };
        }
        let user = self.bodies[index % self.bodies.len()].3;
        let (tx, rx) = oneshot::channel();
        let after = d.chains.insert(user, rx);
        Job {
            index,
            after,
            done: Some(tx),
        }
    }

    async fn execute(&self, job: Job, stage: usize, t0: Instant, c: &Counters) -> RequestRecord {
        if let Some(prev) = job.after {
            // An error only means the previous task was dropped: go on.
            let _ = prev.await;
        }
        let (body, stream, api, user) = &self.bodies[job.index % self.bodies.len()];
        let target = match self.spread {
            Spread::RoundRobin => job.index % self.uris.len(),
            Spread::StickyUser => *user as usize % self.uris.len(),
        };
        let uri = self.uris[target][usize::from(*api == Api::Chat)].clone();
        c.sent.fetch_add(1, Ordering::Relaxed);
        let start = t0.elapsed();
        let mut rec = self.client.send(uri, body.clone(), *stream).await;
        if let Some(tx) = job.done {
            let _ = tx.send(());
        }
        c.done.fetch_add(1, Ordering::Relaxed);
        if !rec.is_ok() {
            c.errors.fetch_add(1, Ordering::Relaxed);
        }
        rec.index = job.index;
        rec.user = *user;
        rec.stage = stage;
        rec.target = target;
        rec.start = start;
        rec
    }
}

fn stage_done(stage: &Stage, started: usize, begun: Instant) -> bool {
    stage.max_requests.is_some_and(|n| started >= n)
        || stage.max_duration.is_some_and(|d| begun.elapsed() >= d)
        || started >= MAX_RUN_REQUESTS
}

#[allow(clippy::too_many_arguments)]
async fn open_loop(
    shared: &Arc<Shared>,
    counters: &Arc<Counters>,
    stage: &Stage,
    index: usize,
    rate: f64,
    max_in_flight: usize,
    rng: &mut StdRng,
    t0: Instant,
) -> (Vec<RequestRecord>, u64) {
    let begun = Instant::now();
    let mut tasks = JoinSet::new();
    let mut out = Vec::new();
    let (mut started, mut late) = (0usize, 0u64);
    let mut due = begun;
    loop {
        // Exponential gap: -ln(U) / rate with U in (0, 1].
        let u: f64 = 1.0 - rng.random::<f64>();
        due += Duration::from_secs_f64(-u.ln() / rate);
        let deadline = stage.max_duration.map(|d| begun + d);
        if deadline.is_some_and(|d| due >= d) || stage_done(stage, started, begun) {
            break;
        }
        tokio::time::sleep_until(due.into()).await;
        while let Some(Ok(rec)) = tasks.try_join_next() {
            out.push(rec);
        }
        if tasks.len() >= max_in_flight {
            late += 1;
            if let Some(Ok(rec)) = tasks.join_next().await {
                out.push(rec);
            }
        }
        let (s, c, job) = (shared.clone(), counters.clone(), shared.next_job());
        tasks.spawn(async move { s.execute(job, index, t0, &c).await });
        started += 1;
    }
    while let Some(res) = tasks.join_next().await {
        if let Ok(rec) = res {
            out.push(rec);
        }
    }
    (out, late)
}

async fn closed_loop(
    shared: &Arc<Shared>,
    counters: &Arc<Counters>,
    stage: &Stage,
    index: usize,
    concurrency: usize,
    t0: Instant,
) -> Vec<RequestRecord> {
    let begun = Instant::now();
    let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = JoinSet::new();
    for _ in 0..concurrency {
        let (s, c, st, n) = (
            shared.clone(),
            counters.clone(),
            stage.clone(),
            started.clone(),
        );
        workers.spawn(async move {
            let mut out = Vec::new();
            loop {
                let k = n.fetch_add(1, Ordering::Relaxed);
                if stage_done(&st, k, begun) {
                    break;
                }
                let job = s.next_job();
                out.push(s.execute(job, index, t0, &c).await);
            }
            out
        });
    }
    let mut out = Vec::new();
    while let Some(res) = workers.join_next().await {
        if let Ok(recs) = res {
            out.extend(recs);
        }
    }
    out
}
