//! The writer: one pod's blocks and record, kept in Valkey.
//!
//! It reads a pod's blocks from a [`PrefixIndex`] that already applied the
//! pod's KV events (the sidecar's own index, whose local pod is fed by the
//! engine's events; `kvmesh bench scale` feeds emulated pods the same way).
//! Each applied batch names the keys it touched; the writer gathers them
//! and, every `flush_interval`, writes each one's present state (the media
//! the pod holds it in, or 0) under its model's tag. Writing state rather
//! than the change makes every write idempotent: a write retried after a
//! timeout, or a key written twice, leaves the same index.
//!
//! The pod is a *member*: a random id registered with the pod's record and
//! a lease ([`Writer::renew`]). Whenever what Valkey holds for the member
//! cannot be trusted, the writer starts a new member and rewrites the pod's
//! blocks under it, after a random delay of up to `resync_jitter` and at
//! most `resync_rate` blocks a second:
//!
//! | reason | when |
//! |---|---|
//! | `start` | the first registration |
//! | `lease_lost` | the record was gone at a renewal or a write (lease lapsed while Valkey was unreachable, Valkey restarted empty or failed over without it) |
//! | `cleared` | the engine restarted or dropped its cache |
//! | `lagged` | the writer missed local updates |
//! | `overflow` | more than `max_pending` changes waited while Valkey was unreachable |
//!
//! The old member's record is gone or abandoned, so lookups fence it at once
//! and its block entries expire (`block_ttl`). Every `block_ttl / 2` the
//! writer also rewrites the pod's blocks under the same member, so a block
//! the pod keeps for hours does not expire.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use kvmesh_filters::prefix::hash::BlockKey;
use kvmesh_filters::prefix::index::{PodId, PrefixIndex, Touched};
use kvmesh_filters::prefix::kvevents::{EventBatch, KvEvent};
use tokio::time::Instant;

use super::keys::{new_member, ring_pos, stripe_of, Tag};
use super::metrics::IndexMetrics;
use super::record::PodRecord;
use super::store::{Store, StoreError};

/// Most block keys one write carries.
const WRITE_BATCH: usize = 512;
/// Deadline of one write or renewal. Longer than a lookup's: nobody waits
/// for it, and a slow write is still worth finishing.
const WRITE_DEADLINE: Duration = Duration::from_millis(500);
/// Most namespaces (models and adapters) one pod registers under; a model
/// or adapter past it is served but not registered.
const MAX_NAMESPACES: usize = 64;

/// Builds the pod's record at each renewal.
pub type RecordFn = Box<dyn Fn() -> PodRecord + Send + Sync>;

/// See the module docs.
pub struct Writer {
    store: Arc<Store>,
    index: Arc<PrefixIndex>,
    pod: PodId,
    record: RecordFn,
    stripe: u16,
    /// The models (and adapters) the record is registered under.
    namespaces: BTreeSet<Arc<str>>,
    /// The key model of blocks whose event named none.
    default_ns: Arc<str>,
    member: String,
    /// Namespaces the current member is registered in.
    registered: BTreeSet<Arc<str>>,
    /// Members given up while their lease still ran, with the records hash
    /// each is in, to delete (so lookups fence them now, not when the lease
    /// lapses).
    retired: Vec<(String, String)>,
    /// Why the next registration happens.
    reason: &'static str,
    /// The member has not been registered everywhere yet: once it is, the
    /// pod's blocks are rewritten under it.
    fresh: bool,
    /// Keys to write, with their model.
    dirty: HashMap<BlockKey, Arc<str>>,
    /// Keys stored under a LoRA adapter's name, with it (removals name none).
    lora: HashMap<BlockKey, Arc<str>>,
    /// Keys left to rewrite, and when the rewrite may start.
    rewrite: Vec<BlockKey>,
    rewrite_at: Option<Instant>,
    refresh_at: Instant,
    /// Rewrite allowance carried between flushes (fractions of a block).
    allowance: f64,
    last_flush: Instant,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("member", &self.member)
            .field("pending", &self.dirty.len())
            .finish()
    }
}

impl Writer {
    /// A writer for pod `pod` of `index`, named `pod_name`, registered under
    /// `namespaces` (its models and adapters; the first is where blocks go
    /// whose event names no model).
    pub fn new(
        store: Arc<Store>,
        index: Arc<PrefixIndex>,
        pod: PodId,
        pod_name: &str,
        namespaces: Vec<String>,
        record: RecordFn,
    ) -> Self {
        let stripes = store.config().stripes;
        let mut namespaces: Vec<Arc<str>> = namespaces.into_iter().map(Arc::from).collect();
        if namespaces.is_empty() {
            namespaces.push(Arc::from(""));
        }
        let now = Instant::now();
        let half = store.config().block_ttl.get() / 2;
        Self {
            stripe: stripe_of(pod_name, stripes),
            default_ns: namespaces[0].clone(),
            namespaces: namespaces.into_iter().collect(),
            store,
            index,
            pod,
            record,
            member: new_member(),
            registered: BTreeSet::new(),
            retired: Vec::new(),
            reason: "start",
            fresh: true,
            dirty: HashMap::new(),
            lora: HashMap::new(),
            rewrite: Vec::new(),
            rewrite_at: None,
            // The first refresh at a random point of the period, so a
            // fleet started at once does not refresh at once.
            refresh_at: now + half.mul_f64(0.5 + rand::random::<f64>() / 2.0),
            allowance: 0.0,
            last_flush: now,
        }
    }

    /// The member id the pod is registered under now.
    pub fn member(&self) -> &str {
        &self.member
    }

    /// Block changes waiting to be written (rewrites not counted).
    pub fn pending(&self) -> usize {
        self.dirty.len()
    }

    /// Whether a flush has anything to do (a change or a rewrite waits).
    pub fn has_work(&self) -> bool {
        !self.dirty.is_empty() || !self.rewrite.is_empty()
    }

    /// Blocks left to rewrite.
    pub fn rewriting(&self) -> usize {
        self.rewrite.len()
    }

    /// Whether the pod is registered in every namespace it serves (a model
    /// first seen in a batch is registered at the next renewal; until then
    /// nothing is written).
    pub fn is_registered(&self) -> bool {
        self.registered.len() == self.namespaces.len()
    }

    /// Takes a batch the index applied for the pod: `model` is the key
    /// model of its events, `touched` what [`PrefixIndex::apply_touching`]
    /// reported.
    pub fn batch(
        &mut self,
        m: &IndexMetrics,
        model: &Arc<str>,
        batch: &EventBatch,
        touched: &[Touched],
    ) {
        if batch
            .events
            .iter()
            .any(|e| matches!(e, KvEvent::AllBlocksCleared))
        {
            self.start_over(m, "cleared");
        }
        if !self.namespaces.contains(model) && self.namespaces.len() < MAX_NAMESPACES {
            self.namespaces.insert(model.clone());
        }
        for t in touched {
            let lora = usize::try_from(t.event)
                .ok()
                .and_then(|i| batch.events.get(i))
                .and_then(|e| match e {
                    KvEvent::BlockStored(s) => s.lora_name.as_deref(),
                    _ => None,
                });
            let ns = match lora {
                Some(name) => {
                    let ns: Arc<str> = Arc::from(name);
                    self.lora.insert(t.key, ns.clone());
                    if self.namespaces.len() < MAX_NAMESPACES {
                        self.namespaces.insert(ns.clone());
                    }
                    ns
                }
                None => self
                    .lora
                    .get(&t.key)
                    .cloned()
                    .unwrap_or_else(|| model.clone()),
            };
            self.dirty.insert(t.key, ns);
        }
        if self.dirty.len() > self.store.config().max_pending {
            self.start_over(m, "overflow");
        }
        m.pending(self.dirty.len());
    }

    /// The writer missed updates: everything is rewritten under a new member.
    pub fn lagged(&mut self, m: &IndexMetrics) {
        self.start_over(m, "lagged");
    }

    /// The engine restarted (the KV-event feed saw its sequence start over):
    /// a new member, whose blocks are what the engine stores from now on.
    pub fn cleared(&mut self, m: &IndexMetrics) {
        self.start_over(m, "cleared");
    }

    /// Forgets the member; the next renewal registers a new one and the
    /// pod's blocks are rewritten under it.
    fn start_over(&mut self, m: &IndexMetrics, reason: &'static str) {
        tracing::info!(reason, old = %self.member, "valkey: registering this pod again");
        let cfg = self.store.config();
        for ns in &self.registered {
            if self.retired.len() < 256 {
                let tag = Tag::new(&cfg.key_prefix, ns, self.stripe);
                self.retired.push((tag.records(), self.member.clone()));
            }
        }
        self.member = new_member();
        self.registered.clear();
        self.reason = reason;
        self.fresh = true;
        self.dirty.clear();
        self.rewrite.clear();
        self.rewrite_at = None;
        m.pending(0);
    }

    /// Renews the pod's record in every namespace (registering the member
    /// where it is not yet). Returns the first error.
    pub async fn renew(&mut self, m: &IndexMetrics) -> Result<(), StoreError> {
        self.retire().await?;
        let now = Instant::now();
        if now >= self.refresh_at {
            let half = self.store.config().block_ttl.get() / 2;
            self.refresh_at = now + half.mul_f64(0.9 + rand::random::<f64>() / 5.0);
            if self.rewrite.is_empty() && self.is_registered() {
                self.rewrite_all(now);
            }
        }
        let cfg = self.store.config().clone();
        let ttl = ms(cfg.lease_ttl.get());
        let mut record = (self.record)();
        record.ttl_ms = ttl;
        // An adapter the engine loaded at run time: registered under it too, so a
        // lookup for it finds this pod before the pod has stored a block of it.
        for adapter in &record.adapters {
            if self.namespaces.len() >= MAX_NAMESPACES {
                break;
            }
            if !self.namespaces.contains(adapter.as_str()) {
                self.namespaces.insert(Arc::from(adapter.as_str()));
            }
        }
        let json = serde_json::to_string(&record)
            .map_err(|e| StoreError::Reply(format!("record: {e}")))?;
        let pos = ring_pos(&self.member);
        let namespaces: Vec<Arc<str>> = self.namespaces.iter().cloned().collect();
        for ns in namespaces {
            let tag = Tag::new(&cfg.key_prefix, &ns, self.stripe);
            let renewing = self.registered.contains(&ns);
            let keys = [tag.records(), tag.members(), tag.ring()];
            let mode = if renewing { "renew" } else { "new" };
            let ok: i64 = self
                .store
                .fcall(
                    "kvmesh_register",
                    &keys,
                    (&self.member, &json, ttl, pos, mode),
                    WRITE_DEADLINE,
                )
                .await?;
            match (ok, renewing) {
                (1, false) => {
                    self.registered.insert(ns);
                    if self.fresh && self.is_registered() {
                        self.fresh = false;
                        self.registered_whole(m);
                    }
                }
                (1, true) => {}
                (_, true) => {
                    self.start_over(m, "lease_lost");
                    return Ok(());
                }
                // A member id taken already (48 random bits: never, in practice).
                (_, false) => {
                    self.member = new_member();
                    self.registered.clear();
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// The member is registered everywhere: its blocks are rewritten, after
    /// the jitter when Valkey lost what it had (a fleet rewrites at once
    /// otherwise), at once on start.
    fn registered_whole(&mut self, m: &IndexMetrics) {
        m.registered(self.reason);
        let jitter = if self.reason == "start" {
            Duration::ZERO
        } else {
            self.store
                .config()
                .resync_jitter
                .get()
                .mul_f64(rand::random::<f64>())
        };
        self.rewrite_all(Instant::now() + jitter);
    }

    fn rewrite_all(&mut self, at: Instant) {
        self.rewrite = self
            .index
            .pod_blocks(self.pod)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        self.rewrite_at = Some(at);
    }

    /// Writes what changed (and the next slice of a rewrite). Returns the
    /// first error; what was not written stays pending.
    pub async fn flush(&mut self, m: &IndexMetrics) -> Result<(), StoreError> {
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(self.last_flush);
        self.last_flush = now;
        if !self.is_registered() {
            return Ok(());
        }
        self.feed_rewrite(m, now, elapsed);
        while !self.dirty.is_empty() {
            let keys: Vec<BlockKey> = self.dirty.keys().take(WRITE_BATCH).copied().collect();
            let mut by_ns: HashMap<Arc<str>, Vec<BlockKey>> = HashMap::new();
            for k in &keys {
                if let Some(ns) = self.dirty.remove(k) {
                    by_ns.entry(ns).or_default().push(*k);
                }
            }
            for (ns, keys) in by_ns {
                if let Err(e) = self.write(m, &ns, &keys).await {
                    for k in keys {
                        self.dirty.entry(k).or_insert_with(|| ns.clone());
                    }
                    m.pending(self.dirty.len());
                    return Err(e);
                }
                if !self.is_registered() {
                    // Fenced: everything is rewritten under a new member.
                    return Ok(());
                }
            }
        }
        m.pending(0);
        Ok(())
    }

    /// Moves the part of a rewrite the rate allows into the pending set.
    fn feed_rewrite(&mut self, m: &IndexMetrics, now: Instant, elapsed: Duration) {
        if self.rewrite.is_empty() || self.rewrite_at.is_some_and(|at| now < at) {
            self.allowance = 0.0;
            return;
        }
        let rate = f64::from(self.store.config().resync_rate);
        // At least one write's worth per flush, and no more than a second's.
        self.allowance = (self.allowance + rate * elapsed.as_secs_f64()).clamp(0.0, rate);
        let n = (self.allowance as usize)
            .max(WRITE_BATCH.min(self.rewrite.len()))
            .min(self.rewrite.len());
        self.allowance -= n as f64;
        let start = self.rewrite.len() - n;
        for k in self.rewrite.drain(start..) {
            let ns = self
                .lora
                .get(&k)
                .cloned()
                .unwrap_or_else(|| self.default_ns.clone());
            self.dirty.entry(k).or_insert(ns);
        }
        m.rewritten(n);
    }

    /// One write of `keys`' present state under namespace `ns`.
    async fn write(
        &mut self,
        m: &IndexMetrics,
        ns: &Arc<str>,
        keys: &[BlockKey],
    ) -> Result<(), StoreError> {
        let cfg = self.store.config();
        let tag = Tag::new(&cfg.key_prefix, ns, self.stripe);
        let mut names = Vec::with_capacity(keys.len() + 1);
        names.push(tag.records());
        let mut args: Vec<String> = Vec::with_capacity(keys.len() + 2);
        args.push(self.member.clone());
        args.push(ms(cfg.block_ttl.get()).to_string());
        for &k in keys {
            names.push(tag.block(k));
            let mask = self.index.pod_mediums(self.pod, k);
            if mask == 0 {
                self.lora.remove(&k);
            }
            args.push(mask.to_string());
        }
        match self
            .store
            .fcall::<i64, _>("kvmesh_write", &names, &args, WRITE_DEADLINE)
            .await
        {
            Ok(-1) => {
                m.write("fenced", 0);
                self.start_over(m, "lease_lost");
                Ok(())
            }
            Ok(_) => {
                m.write("ok", keys.len());
                Ok(())
            }
            Err(e) => {
                m.write(e.label(), 0);
                Err(e)
            }
        }
    }

    /// Deletes the records of retired members.
    async fn retire(&mut self) -> Result<(), StoreError> {
        while let Some((records, member)) = self.retired.last() {
            let _: i64 = self
                .store
                .call(redis::cmd("HDEL").arg(records).arg(member), WRITE_DEADLINE)
                .await?;
            self.retired.pop();
        }
        Ok(())
    }

    /// Removes the pod's record at shutdown, so lookups leave it out at once
    /// rather than when its lease lapses.
    pub async fn leave(&mut self) {
        let cfg = self.store.config().clone();
        for ns in std::mem::take(&mut self.registered) {
            let tag = Tag::new(&cfg.key_prefix, &ns, self.stripe);
            self.retired.push((tag.records(), self.member.clone()));
        }
        let _ = self.retire().await;
    }
}

/// The renewal timer of a writer: every `every`, from a random point of the
/// first period, so that writers started together (a fleet rolled out, or
/// emulated) do not renew in one burst that a lookup would queue behind.
pub fn lease_timer(every: Duration) -> tokio::time::Interval {
    let first = Instant::now() + every.mul_f64(rand::random::<f64>());
    let mut t = tokio::time::interval_at(first, every);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    t
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
