//! The engine core: one task per engine running a vLLM-style batch scheduler
//! in virtual time.
//!
//! Requests arrive over a bounded channel. Each loop either runs one step
//! (decode every running sequence, continue or start chunked prefills within
//! the token budget, admit waiting requests while `max_num_seqs` and free
//! blocks allow), sleeps until the step's simulated end maps to real time,
//! then delivers tokens and KV events; or, when nothing can run, waits for a
//! command or the next timer (a request's API overhead elapsing, a KV
//! transfer finishing, a held block expiring). Virtual time `v` maps to real
//! time as `start + v / time_scale`; every latency the engine reports is in
//! virtual seconds.

mod jitter;
mod step;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::config::{KvEventsFormat, SimConfig};
use crate::kv::cache::BlockPool;
use crate::kv::events::{encode_batch, Encoding};
use crate::kv::hash::BlockExtras;
use crate::kv::publisher::PublisherTx;
use crate::metrics::EngineMetrics;

/// Why a request ended without finishing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    #[error("the engine restarted while the request was running")]
    Restarted,
    #[error("the engine is shutting down")]
    Shutdown,
    #[error("the request needs {need} KV blocks but the engine has {have}")]
    TooLarge { need: usize, have: usize },
}

/// How the request's KV relates to other engines.
#[derive(Debug, Clone, PartialEq)]
pub enum KvMode {
    Local,
    /// Prefill side of P/D: keep the blocks after finishing, for a decoder.
    HoldForDecode {
        remote_request_id: String,
    },
    /// Decode side of P/D: the prompt's KV arrives from a prefill engine.
    ReceiveKv,
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Length,
    Stop,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
        }
    }
}

/// A request as the core sees it (already tokenized and hashed).
#[derive(Debug)]
pub struct CoreRequest {
    pub prompt: Vec<u32>,
    /// Full-block hashes of `prompt`.
    pub hashes: Vec<u64>,
    pub extras: BlockExtras,
    pub max_tokens: usize,
    /// Reason reported when `max_tokens` is reached.
    pub limit_reason: FinishReason,
    /// Send a `Token` event per token (streaming); otherwise only `Finished`.
    pub stream: bool,
    pub kv: KvMode,
    pub arrival: Instant,
    pub out: mpsc::UnboundedSender<CoreEvent>,
}

/// What the HTTP side hears about its request. The channel is unbounded but
/// carries at most `max_tokens + 1` events (max_tokens <= max_model_len).
#[derive(Debug)]
pub enum CoreEvent {
    /// A sampled token, sent at the end of the step that produced it (the prefill step for the
    /// first). `last` when it reaches `max_tokens`: `Finished` follows, and vLLM's final chunk
    /// carries this token's text with the `finish_reason`.
    Token {
        id: u32,
        last: bool,
    },
    Finished(Box<Outcome>),
    Failed(CoreError),
}

/// A finished request, in virtual seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub prompt_tokens: usize,
    pub output: Vec<u32>,
    pub finish_reason: FinishReason,
    /// Prompt tokens served from the local prefix cache.
    pub cached_tokens: usize,
    /// Prompt tokens received from a prefill engine.
    pub external_tokens: usize,
    pub queue_s: f64,
    pub ttft_s: f64,
    pub e2e_s: f64,
    /// Block ids held for a decoder (prefill side of P/D).
    pub held_blocks: Option<Vec<u32>>,
}

/// Commands to the core.
#[derive(Debug)]
pub(crate) enum Cmd {
    Submit(Box<CoreRequest>),
    /// A decoder took the held blocks of this request: free them.
    ReleaseHeld(String),
    ResetPrefixCache(oneshot::Sender<bool>),
    Restart(oneshot::Sender<()>),
}

/// Maps virtual seconds to real instants.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    start: Instant,
    scale: f64,
}

impl Clock {
    pub fn new(scale: f64) -> Self {
        Self {
            start: Instant::now(),
            scale,
        }
    }

    pub fn to_virtual(self, t: Instant) -> f64 {
        t.saturating_duration_since(self.start).as_secs_f64() * self.scale
    }

    pub fn to_real(self, v: f64) -> Instant {
        let secs = (v / self.scale).clamp(0.0, 1.0e9);
        self.start + std::time::Duration::from_secs_f64(secs)
    }

    /// Real duration of `v` virtual seconds.
    pub fn real_duration(self, v: f64) -> std::time::Duration {
        std::time::Duration::from_secs_f64((v / self.scale).clamp(0.0, 1.0e9))
    }
}

/// A request inside the scheduler.
#[derive(Debug)]
struct Seq {
    req: CoreRequest,
    blocks: Vec<u32>,
    /// Hashes of every full block so far (prompt, then output-filled).
    hashes: Vec<u64>,
    /// How many of `blocks` are committed to the cache.
    committed: usize,
    /// Tokens whose KV is computed.
    computed: usize,
    cached_tokens: usize,
    external_tokens: usize,
    output: Vec<u32>,
    arrival_v: f64,
    ready_v: f64,
    scheduled_v: Option<f64>,
    first_token_v: Option<f64>,
    last_token_v: f64,
    transfer_done_v: Option<f64>,
    /// A hash of every token so far (prompt, then output): the next token
    /// is a function of it alone, as greedy decoding is of the context
    /// (`step::next_token`).
    context: u64,
    /// Set once the sequence has been preempted: the request as the client
    /// sent it, which the recompute's longer prompt hides.
    resumed: Option<Resumed>,
}

/// What a preempted sequence had before it went back to wait. Recompute
/// preemption (vLLM's) prefills the prompt and the tokens generated so far
/// together, so the simulator appends those to the prompt; the client still
/// gets its whole answer, and its usage counts the prompt it sent, the
/// tokens it got, and what its first lookup found cached.
#[derive(Debug)]
struct Resumed {
    prompt_len: usize,
    output: Vec<u32>,
    max_tokens: usize,
    cached_tokens: usize,
}

struct Held {
    blocks: Vec<u32>,
    expiry_v: f64,
}

/// The scheduler state owned by the core task.
pub(crate) struct Core {
    cfg: SimConfig,
    engine_id: String,
    clock: Clock,
    vnow: f64,
    pool: BlockPool,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    held: HashMap<String, Held>,
    metrics: Arc<Mutex<EngineMetrics>>,
    publisher: Option<PublisherTx>,
    encoding: Encoding,
    /// Our own command channel, for the P/D registry to release held blocks.
    self_tx: mpsc::WeakSender<Cmd>,
    /// The spread of API-server and step times (none with the built-in profiles).
    jitter: jitter::Jitter,
}

impl Core {
    pub fn new(
        cfg: SimConfig,
        engine_id: String,
        clock: Clock,
        metrics: Arc<Mutex<EngineMetrics>>,
        publisher: Option<PublisherTx>,
        self_tx: mpsc::WeakSender<Cmd>,
    ) -> Self {
        let format = cfg
            .kv_events
            .as_ref()
            .map_or(KvEventsFormat::Map, |k| k.format);
        let encoding = Encoding {
            flavor: cfg.flavor,
            format,
        };
        Self {
            pool: BlockPool::new(cfg.num_blocks, cfg.block_size),
            jitter: jitter::Jitter::new(&cfg.profile, cfg.seed),
            cfg,
            engine_id,
            clock,
            vnow: 0.0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            held: HashMap::new(),
            metrics,
            publisher,
            encoding,
            self_tx,
        }
    }

    /// The core loop; returns when `cancel` fires or every sender is gone.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Cmd>, cancel: CancellationToken) {
        loop {
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
            self.expire_holds();
            if let Some(plan) = self.plan_step() {
                let end_v = self.vnow + plan.cost;
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep_until(self.clock.to_real(end_v).into()) => {}
                }
                self.vnow = end_v;
                self.finish_step(plan);
            } else {
                self.publish();
                self.update_gauges();
                let wake = self.next_wake_v();
                let sleep = async {
                    match wake {
                        Some(v) => tokio::time::sleep_until(self.clock.to_real(v).into()).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    cmd = rx.recv() => match cmd {
                        Some(cmd) => {
                            self.vnow = self.vnow.max(self.clock.to_virtual(Instant::now()));
                            self.handle(cmd);
                        }
                        None => break,
                    },
                    _ = sleep => {
                        if let Some(v) = wake {
                            self.vnow = self.vnow.max(v);
                        }
                    }
                }
            }
        }
        self.fail_all(CoreError::Shutdown);
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Submit(req) => self.submit(*req),
            Cmd::ReleaseHeld(id) => {
                if let Some(h) = self.held.remove(&id) {
                    self.pool.release(&h.blocks);
                }
            }
            Cmd::ResetPrefixCache(reply) => {
                // vLLM refuses while blocks are in use.
                let ok =
                    self.running.is_empty() && self.held.is_empty() && self.pool.usage() == 0.0;
                if ok {
                    self.pool.clear();
                    self.publish();
                }
                let _ = reply.send(ok);
            }
            Cmd::Restart(reply) => {
                self.fail_all(CoreError::Restarted);
                for (id, _) in self.held.drain() {
                    crate::pd::forget(&self.engine_id, &id);
                }
                self.pool.reset_all();
                if let Some(p) = &self.publisher {
                    p.reset();
                }
                *self.metrics.lock() = EngineMetrics::new(&self.cfg);
                let _ = reply.send(());
            }
        }
    }

    fn submit(&mut self, req: CoreRequest) {
        let arrival_v = self
            .clock
            .to_virtual(req.arrival)
            .min(self.vnow.max(self.clock.to_virtual(Instant::now())));
        let need = req.prompt.len().div_ceil(self.cfg.block_size);
        if need > self.cfg.num_blocks {
            let _ = req.out.send(CoreEvent::Failed(CoreError::TooLarge {
                need,
                have: self.cfg.num_blocks,
            }));
            return;
        }
        let context = step::context_of(&req.prompt);
        let hashes = req.hashes.clone();
        self.waiting.push_back(Seq {
            req,
            blocks: Vec::new(),
            hashes,
            committed: 0,
            computed: 0,
            cached_tokens: 0,
            external_tokens: 0,
            output: Vec::new(),
            arrival_v,
            ready_v: arrival_v + self.jitter.api_seconds(),
            scheduled_v: None,
            first_token_v: None,
            last_token_v: 0.0,
            transfer_done_v: None,
            context,
            resumed: None,
        });
    }

    fn fail_all(&mut self, err: CoreError) {
        for s in self.running.drain(..).chain(self.waiting.drain(..)) {
            let _ = s.req.out.send(CoreEvent::Failed(err.clone()));
            self.pool.release(&s.blocks);
        }
    }

    fn expire_holds(&mut self) {
        let now = self.vnow;
        let expired: Vec<String> = self
            .held
            .iter()
            .filter(|(_, h)| h.expiry_v <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for id in expired {
            if let Some(h) = self.held.remove(&id) {
                crate::pd::forget(&self.engine_id, &id);
                self.pool.release(&h.blocks);
            }
        }
    }

    fn next_wake_v(&self) -> Option<f64> {
        let waiting = self.waiting.front().map(|s| s.ready_v);
        let transfers = self
            .running
            .iter()
            .filter_map(|s| s.transfer_done_v)
            .reduce(f64::min);
        let holds = self.held.values().map(|h| h.expiry_v).reduce(f64::min);
        [waiting, transfers, holds]
            .into_iter()
            .flatten()
            .reduce(f64::min)
    }

    /// Sends this step's KV events as one batch.
    fn publish(&mut self) {
        let events = self.pool.take_events();
        if events.is_empty() {
            return;
        }
        let Some(p) = &self.publisher else { return };
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let payload = encode_batch(ts, &events, self.cfg.dp_rank, self.encoding);
        let sent = p.send(payload);
        let mut m = self.metrics.lock();
        if sent {
            m.kv_batches_published += 1;
        } else {
            m.kv_batches_dropped += 1;
        }
    }

    fn update_gauges(&self) {
        let mut m = self.metrics.lock();
        m.running = self.running.len();
        m.waiting = self.waiting.len();
        m.kv_usage = self.pool.usage();
        m.used_blocks = self.pool.num_blocks() - self.pool.num_free();
        m.held_transfers = self.held.len();
        m.cached_blocks = self.pool.num_cached();
        if self.cfg.max_loras > 0 {
            let names = |seqs: &mut dyn Iterator<Item = &Seq>| {
                let set: std::collections::BTreeSet<&str> = seqs
                    .filter_map(|s| s.req.extras.lora_name.as_deref())
                    .collect();
                set.into_iter().collect::<Vec<_>>().join(",")
            };
            let running = names(&mut self.running.iter());
            let waiting = names(&mut self.waiting.iter());
            let at = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            m.set_lora(running, waiting, at);
        }
    }
}
