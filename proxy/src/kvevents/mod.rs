//! Ingestion of the local engine's KV cache events into the prefix index.
//!
//! One task per sidecar ([`run`], owned by the sidecar's task set, stops on
//! shutdown) holds a ZMQ SUB on `engine.kv_events.endpoint`: it connects when
//! the engine binds (the endpoint has `*`, `::` or `ipc://`) and binds when
//! the engine connects (`engine.kv_events.socket` overrides). Each 3-frame
//! message is decoded with `kvmesh_filters::prefix::kvevents` (a frame that
//! does not decode is counted and skipped) and sequence-checked
//! ([`tracker`]):
//!
//! * first join: with a replay endpoint, everything the engine kept is
//!   replayed from 0 before live batches are applied;
//! * a gap: the missing batches are replayed from the engine's ROUTER
//!   (`replay_endpoint`), each step under `replay_timeout`; without one, or
//!   if the replay fails, the gap is counted and the stream goes on;
//! * a sequence going backwards (engine restart): the local pod is cleared,
//!   then resynced by a replay from 0 where possible;
//! * `AllBlocksCleared` clears the pod inside the index as the batch is
//!   applied; the stream itself is intact, so no replay is needed;
//! * silence: a gap only shows when a later batch arrives, so a stream that
//!   stops delivering (a PUB that never got this SUB's subscription, a link
//!   that drops everything) would show none. After `silence_check` without a
//!   live batch the replay socket is asked for what followed the last
//!   applied one; if it holds any, they are applied, counted
//!   (`kvmesh_kv_event_silent_streams_total`) and the socket is reopened, so
//!   a new subscription handshake replaces the one that went quiet.
//!
//! A socket error drops the socket and reopens it after a backoff that doubles
//! up to `engine.kv_events.reconnect_max`, with jitter ([`crate::backoff`]).
//!
//! With data parallelism (`engine.data_parallel_size` N > 1) there is one
//! such feed per rank, each its own socket, sequence and replay: rank r
//! publishes on the endpoints' port + r, as vLLM offsets them. A rank's
//! batches are applied to the pod (the union the fleet and the mesh see) and
//! to the rank's own entry, `<pod>#dp<rank>` (the batch's `dp_rank`, else the
//! feed's rank), which the sidecar's rank choice reads
//! ([`crate::prefix::rank_pod`]).
//!
//! Every applied local batch is also sent, in order, on the bounded broadcast
//! channel of [`crate::prefix::PrefixState::subscribe_local`] (the mesh
//! forwards it to peers). A receiver that lags loses updates and must resync
//! its peers from a snapshot of the index; a restart is sent as
//! [`LocalKvUpdate::Cleared`] before the replayed batches.

pub mod socket;
pub mod tracker;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_filters::prefix::kvevents::{decode_message, parse_topic, KvMessage};
use zeromq::SocketRecv;

use crate::config::Config;

use crate::backoff::Backoff;
use crate::config::prefix::{consumer_endpoint, dial};
use crate::config::KvEvents;
use crate::prefix::{LocalKvUpdate, PrefixState};
use crate::shutdown::Shutdown;
use tracker::{Step, Tracker};

/// First pause before reopening a failed socket.
const BACKOFF_START: Duration = Duration::from_millis(100);
/// Index size metrics are refreshed at most this often.
const STATS_EVERY: Duration = Duration::from_millis(250);

/// What the KV-event feed reads and writes: the engine's settings, the
/// prefix index it keeps whole, and the engine's block size it learns from
/// the events.
#[derive(Clone)]
pub struct Ingest {
    pub config: Arc<Config>,
    pub prefix: Arc<PrefixState>,
    /// The local engine's KV block size in tokens (0: not yet known).
    pub engine_block_size: Arc<std::sync::atomic::AtomicU32>,
}

struct Feed {
    app: Ingest,
    cfg: KvEvents,
    replay: Option<String>,
    tracker: Tracker,
    last_stats: std::time::Instant,
    /// With data parallelism: this feed's rank, and each rank's index entry.
    rank: Option<u32>,
    rank_pods: Vec<Option<kvmesh_filters::prefix::index::PodId>>,
}

/// The ingestion task (see the module docs): one feed, or one per
/// data-parallel rank, all in this task. Returns on shutdown.
pub async fn run(app: Ingest, shutdown: Shutdown) {
    let n = app.config.engine.data_parallel_size;
    if n <= 1 {
        return feed(app, shutdown, None).await;
    }
    let feeds = (0..n).map(|rank| feed(app.clone(), shutdown.clone(), Some(rank)));
    futures_util::future::join_all(feeds).await;
}

/// `endpoint` with its port raised by `rank`, as vLLM offsets a DP rank's
/// KV-event endpoints; endpoints without a numeric port are unchanged.
fn rank_endpoint(endpoint: &str, rank: u32) -> String {
    let Some((head, port)) = endpoint.rsplit_once(':') else {
        return endpoint.to_owned();
    };
    match port.parse::<u32>() {
        Ok(p) if p > 0 => format!("{head}:{}", p + rank),
        _ => endpoint.to_owned(),
    }
}

async fn feed(app: Ingest, shutdown: Shutdown, rank: Option<u32>) {
    let Some(mut cfg) = app.config.engine.kv_events.clone() else {
        return;
    };
    if let Some(r) = rank {
        cfg.endpoint = rank_endpoint(&cfg.endpoint, r);
        cfg.replay_endpoint = cfg.replay_endpoint.map(|e| rank_endpoint(&e, r));
    }
    let (endpoint, bind) = consumer_endpoint(&cfg.endpoint, cfg.socket);
    let rank_pods = match rank {
        None => Vec::new(),
        Some(_) => (0..app.config.engine.data_parallel_size)
            .map(|r| {
                let (_, local) = app.prefix.local_pod();
                app.prefix.pod_id(&crate::prefix::rank_pod(local, r))
            })
            .collect(),
    };
    let mut feed = Feed {
        replay: cfg.replay_endpoint.as_deref().map(dial),
        app,
        cfg,
        tracker: Tracker::default(),
        last_stats: std::time::Instant::now(),
        rank,
        rank_pods,
    };
    let mut backoff = Backoff::new(BACKOFF_START, feed.cfg.reconnect_max.get());
    let mut first_join = true;
    loop {
        let opened = tokio::select! {
            _ = shutdown.triggered() => return,
            r = socket::open_sub(&endpoint, bind, &feed.cfg.topic) => r,
        };
        let mut sub = match opened {
            Ok((sub, resolved)) => {
                tracing::info!(endpoint = %resolved, bind, "KV events: subscribed");
                feed.app.prefix.metrics.connected(true);
                backoff.reset();
                sub
            }
            Err(e) => {
                tracing::warn!(error = %e, "KV events: cannot open the socket; retrying");
                tokio::select! {
                    _ = shutdown.triggered() => return,
                    _ = tokio::time::sleep(backoff.next_delay()) => {}
                }
                continue;
            }
        };
        if first_join {
            first_join = false;
            if feed.replay.is_some() {
                feed.resync(&shutdown, 0).await;
            }
        }
        let silence = feed.silence_check();
        loop {
            let msg = tokio::select! {
                _ = shutdown.triggered() => {
                    feed.app.prefix.metrics.connected(false);
                    return;
                }
                m = sub.recv() => Some(m),
                _ = tokio::time::sleep(silence.unwrap_or_default()), if silence.is_some() => None,
            };
            let Some(msg) = msg else {
                if feed.silent(&shutdown).await {
                    tracing::warn!(
                        after = ?silence.unwrap_or_default(),
                        "KV events: the live stream missed batches the replay socket holds; reopening"
                    );
                    feed.app.prefix.metrics.connected(false);
                    break;
                }
                continue;
            };
            match msg {
                Ok(m) => {
                    let frames = m.into_vec();
                    match decode_message(&frames) {
                        Ok(m) => feed.live(&shutdown, m).await,
                        Err(e) => {
                            feed.app.prefix.metrics.decode_error();
                            tracing::debug!(error = %e, "KV events: undecodable message skipped");
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "KV events: socket failed; reopening");
                    feed.app.prefix.metrics.connected(false);
                    break;
                }
            }
        }
        drop(sub);
        tokio::select! {
            _ = shutdown.triggered() => return,
            _ = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}

impl Feed {
    async fn live(&mut self, shutdown: &Shutdown, m: KvMessage) {
        match self.tracker.on_live(m.seq) {
            Step::Apply => self.apply(&m),
            Step::Duplicate => {}
            Step::Gap { from } => {
                self.app.prefix.metrics.gap(m.seq - from);
                tracing::info!(from, to = m.seq, "KV events: sequence gap");
                if self.replay.is_some() {
                    self.resync(shutdown, from).await;
                }
                if self.tracker.wants(m.seq) {
                    self.apply(&m);
                }
            }
            Step::Restart => {
                let prefix = &self.app.prefix;
                tracing::info!(seq = m.seq, "KV events: engine restarted; clearing the pod");
                self.app.prefix.metrics.restart();
                prefix.index().clear_pod(prefix.local_pod().0);
                for id in self.rank_pods.iter().flatten() {
                    prefix.index().clear_pod(*id);
                }
                prefix.publish_local(LocalKvUpdate::Cleared);
                if self.replay.is_some() {
                    self.resync(shutdown, 0).await;
                }
                if self.tracker.wants(m.seq) {
                    self.apply(&m);
                }
            }
        }
    }

    /// How long the live stream may stay silent before [`Feed::silent`]
    /// asks the replay socket; `None` without one, or when configured off.
    fn silence_check(&self) -> Option<Duration> {
        let d = self.cfg.silence_check.get();
        (self.replay.is_some() && !d.is_zero()).then_some(d)
    }

    /// The live stream has been silent for the silence check: asks the
    /// replay socket for what followed the last applied batch and applies
    /// it. Returns whether there was any: a batch the engine published a
    /// whole check ago that the stream never delivered means the stream is
    /// not delivering (a gap only shows when a later batch arrives, so a
    /// stream that stopped shows none), and the caller reopens the socket.
    /// A batch sent in the last instant may arrive live after its replay;
    /// the tracker skips it as a duplicate.
    /// A check that finds nothing is not counted as a replay.
    async fn silent(&mut self, shutdown: &Shutdown) -> bool {
        let before = self.tracker.last_applied();
        let outcome = self.replay_from(shutdown, self.tracker.next()).await;
        let missed = self.tracker.last_applied() != before;
        let m = &self.app.prefix.metrics;
        m.silence_check(missed);
        if let Some(o) = outcome.filter(|&o| missed || o == "failed") {
            m.replay(o);
        }
        missed
    }

    /// Replays from `from`, applies what is new and counts the replay.
    async fn resync(&mut self, shutdown: &Shutdown, from: u64) {
        if let Some(outcome) = self.replay_from(shutdown, from).await {
            self.app.prefix.metrics.replay(outcome);
        }
    }

    /// Replays from `from` and applies what is new; returns the outcome (ok,
    /// incomplete, failed), `None` without a replay socket or on shutdown.
    async fn replay_from(&mut self, shutdown: &Shutdown, from: u64) -> Option<&'static str> {
        let ep = self.replay.clone()?;
        let got = tokio::select! {
            _ = shutdown.triggered() => return None,
            r = socket::replay(&ep, from, self.cfg.replay_timeout.get()) => r,
        };
        let replayed = match got {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, from, "KV events: replay failed; continuing with a gap");
                return Some("failed");
            }
        };
        let m = &self.app.prefix.metrics;
        for _ in 0..replayed.decode_errors {
            m.decode_error();
        }
        let mut contiguous = replayed.complete && replayed.decode_errors == 0;
        for b in &replayed.batches {
            if !b.topic.is_empty() && !b.topic.starts_with(&self.cfg.topic) {
                continue;
            }
            if !self.tracker.wants(b.seq) {
                continue;
            }
            if b.seq != self.tracker.next() {
                // The engine no longer holds the batches in between.
                contiguous = false;
            }
            self.apply(b);
        }
        Some(if contiguous { "ok" } else { "incomplete" })
    }

    fn apply(&mut self, m: &KvMessage) {
        let prefix = &self.app.prefix;
        let model: Arc<str> = Arc::from(prefix.event_model(parse_topic(&m.topic).map(|t| t.model)));
        let stats = prefix.ingest_local(m.seq, model.clone(), &m.batch);
        if let Some(feed_rank) = self.rank {
            let rank = m
                .batch
                .dp_rank
                .and_then(|r| usize::try_from(r).ok())
                .filter(|&r| r < self.rank_pods.len())
                .unwrap_or(feed_rank as usize);
            if let Some(Some(id)) = self.rank_pods.get(rank) {
                prefix.index().apply(*id, &model, &m.batch);
            }
        }
        self.tracker.applied(m.seq);
        let metrics = &self.app.prefix.metrics;
        metrics.batch();
        metrics.events("stored", stats.stored);
        metrics.events("removed", stats.removed);
        metrics.events("cleared", stats.cleared);
        let bs = prefix.index().block_size();
        if bs > 0 {
            // Events are the engine's own word; the metrics scraper agrees.
            self.app.engine_block_size.store(bs, Ordering::Relaxed);
        }
        if self.last_stats.elapsed() >= STATS_EVERY || stats.cleared > 0 {
            self.last_stats = std::time::Instant::now();
            metrics.index(prefix.index().stats());
        }
    }
}

#[cfg(test)]
mod dp_tests {
    use super::rank_endpoint;

    #[test]
    fn a_ranks_endpoint_is_offset_by_its_rank() {
        assert_eq!(rank_endpoint("tcp://*:5557", 0), "tcp://*:5557");
        assert_eq!(rank_endpoint("tcp://*:5557", 3), "tcp://*:5560");
        assert_eq!(
            rank_endpoint("tcp://10.0.0.1:5557", 1),
            "tcp://10.0.0.1:5558"
        );
        assert_eq!(rank_endpoint("ipc:///run/kv", 1), "ipc:///run/kv");
    }
}
