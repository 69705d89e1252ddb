//! One routing decision's question to Valkey: for a request's block keys,
//! which pods hold how much of the prefix, and the records (load, in-flight,
//! who they are) of those pods and of a few others: the ring's homes for the
//! prefix and a random sample (power of d choices). One `FCALL kvmesh_lookup`
//! per stripe of the request's model, all at once, under one deadline; the
//! cost of a decision does not grow with the fleet.
//!
//! Answers are kept for `cache_ttl` per (model, keys), so a burst of the same
//! prompt costs one round trip; the sidecar's own in-flight counts keep
//! moving underneath, so a cached answer does not herd requests.
//!
//! In approximate mode ([`Lookup::approximate`]) the keys are text chunks
//! and a pod "holds" one while a routing decision's guess that sent it there
//! has not expired ([`super::guesses`]); the same function answers.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_filters::prefix::hash::BlockKey;
use parking_lot::Mutex;
use redis::Value;
use tokio::time::Instant;
use xxhash_rust::xxh3::Xxh3;

use super::keys::Tag;
use super::metrics::IndexMetrics;
use super::record::PodRecord;
use super::store::{Store, StoreError};

/// Most leading block keys a lookup sends (32k tokens at 16 per block); a
/// match that deep is deep for every purpose.
pub const MAX_LOOKUP_BLOCKS: usize = 2048;
/// Answers kept at most.
const CACHE_ENTRIES: usize = 1024;
/// How many blocks past the deepest match the ring anchor is taken, as the
/// prefix-affinity scorer takes its anchor a few blocks past what most
/// candidates hold.
const RING_AHEAD: u32 = 2;

/// One pod a lookup returned.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub member: String,
    /// Leading blocks of the request it holds (0: a ring or random pick).
    pub depth: u32,
    pub record: PodRecord,
    /// How old its record's load is.
    pub age_ms: u64,
}

/// A lookup's answer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Found {
    /// The deepest block any live pod holds.
    pub deepest: u32,
    pub candidates: Vec<Candidate>,
    /// Some stripes did not answer: the others' pods only.
    pub partial: bool,
}

/// See the module docs.
pub struct Lookup {
    store: Arc<Store>,
    /// The keys are approximate (text chunks, guessed by routing decisions).
    approx: bool,
    cache: Mutex<HashMap<u64, (Instant, Arc<Found>)>>,
}

impl std::fmt::Debug for Lookup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lookup").finish_non_exhaustive()
    }
}

impl Lookup {
    /// Lookups of block keys from KV events (precise mode).
    pub fn new(store: Arc<Store>) -> Self {
        Self {
            store,
            approx: false,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Lookups of approximate keys, held by the guesses of routing
    /// decisions (`prefix.tokenizer: none`).
    pub fn approximate(store: Arc<Store>) -> Self {
        Self {
            approx: true,
            ..Self::new(store)
        }
    }

    /// The pods for a request of `model` whose prompt has block keys `keys`
    /// (see the module docs). Fails when no stripe answered in time.
    pub async fn find(
        &self,
        m: &IndexMetrics,
        model: &str,
        keys: &[BlockKey],
    ) -> Result<Arc<Found>, StoreError> {
        let started = std::time::Instant::now();
        let keys = &keys[..keys.len().min(MAX_LOOKUP_BLOCKS)];
        let cfg = self.store.config();
        let now = Instant::now();
        let id = cache_key(model, keys);
        if let Some((at, found)) = self.cache.lock().get(&id) {
            if now.saturating_duration_since(*at) < cfg.cache_ttl.get() {
                m.lookup(
                    "cached",
                    started.elapsed().as_secs_f64(),
                    found.candidates.len(),
                );
                return Ok(found.clone());
            }
        }
        let deadline = cfg.lookup_deadline.get();
        let asks = (0..cfg.stripes).map(|s| self.ask(model, s, keys, deadline));
        let answers = futures_util::future::join_all(asks).await;
        let mut found = Found::default();
        let mut first_err = None;
        let mut answered = 0;
        for a in answers {
            match a {
                Ok(part) => {
                    answered += 1;
                    found.deepest = found.deepest.max(part.deepest);
                    found.candidates.extend(part.candidates);
                }
                Err(e) => {
                    found.partial = true;
                    first_err.get_or_insert(e);
                }
            }
        }
        let secs = started.elapsed().as_secs_f64();
        if answered == 0 {
            let e = first_err.unwrap_or(StoreError::Down);
            m.lookup(e.label(), secs, 0);
            return Err(e);
        }
        // Deepest first, as the stripes each returned theirs.
        found
            .candidates
            .sort_by(|a, b| b.depth.cmp(&a.depth).then(a.member.cmp(&b.member)));
        let outcome = if found.partial { "partial" } else { "ok" };
        m.lookup(outcome, secs, found.candidates.len());
        let found = Arc::new(found);
        self.remember(id, now, found.clone());
        Ok(found)
    }

    fn remember(&self, id: u64, now: Instant, found: Arc<Found>) {
        let ttl = self.store.config().cache_ttl.get();
        let mut cache = self.cache.lock();
        if cache.len() >= CACHE_ENTRIES {
            cache.retain(|_, (at, _)| now.saturating_duration_since(*at) < ttl);
            if cache.len() >= CACHE_ENTRIES {
                cache.clear();
            }
        }
        cache.insert(id, (now, found));
    }

    /// One stripe's `kvmesh_lookup`.
    async fn ask(
        &self,
        model: &str,
        stripe: u16,
        keys: &[BlockKey],
        deadline: Duration,
    ) -> Result<Found, StoreError> {
        let cfg = self.store.config();
        let tag = Tag::new(&cfg.key_prefix, model, stripe);
        let mut names = Vec::with_capacity(keys.len() + 3);
        names.push(tag.members());
        names.push(tag.ring());
        names.push(tag.records());
        match self.approx {
            true => names.extend(keys.iter().map(|&k| tag.guess(k))),
            false => names.extend(keys.iter().map(|&k| tag.block(k))),
        }
        let mode = if self.approx { "approx" } else { "precise" };
        let reply: Value = self
            .store
            .fcall(
                "kvmesh_lookup",
                &names,
                (cfg.matched, cfg.random, cfg.ring, RING_AHEAD, mode),
                deadline,
            )
            .await?;
        parse(reply)
    }
}

fn cache_key(model: &str, keys: &[BlockKey]) -> u64 {
    let mut h = Xxh3::new();
    h.update(model.as_bytes());
    h.update(&[0xff]);
    for k in keys {
        h.update(&k.to_le_bytes());
    }
    h.digest()
}

/// Reads `kvmesh_members`' reply: (record, ms left of its lease) per live
/// member; a record that does not decode is skipped.
pub fn parse_members(reply: Value) -> Result<Vec<(PodRecord, i64)>, StoreError> {
    let bad = |what: &str| StoreError::Reply(format!("kvmesh_members: {what}"));
    let Value::Array(items) = reply else {
        return Err(bad("not an array"));
    };
    let mut out = Vec::with_capacity(items.len() / 3);
    let mut it = items.into_iter();
    loop {
        let (record, pttl) = match (it.next(), it.next(), it.next()) {
            (None, ..) => break,
            (Some(Value::BulkString(_)), Some(Value::BulkString(r)), Some(Value::Int(t))) => (r, t),
            _ => return Err(bad("an entry is not (member, record, pttl)")),
        };
        if let Ok(record) = serde_json::from_slice::<PodRecord>(&record) {
            out.push((record, pttl));
        }
    }
    Ok(out)
}

/// Reads `kvmesh_lookup`'s reply: the deepest block, then (member, depth,
/// record, pttl) per pod. A record that does not decode is skipped.
pub fn parse(reply: Value) -> Result<Found, StoreError> {
    let bad = |what: &str| StoreError::Reply(format!("kvmesh_lookup: {what}"));
    let Value::Array(items) = reply else {
        return Err(bad("not an array"));
    };
    let mut it = items.into_iter();
    let deepest = match it.next() {
        Some(Value::Int(n)) => u32::try_from(n).unwrap_or(0),
        _ => return Err(bad("no deepest block")),
    };
    let mut found = Found {
        deepest,
        ..Found::default()
    };
    loop {
        let (member, depth, record, pttl) = match (it.next(), it.next(), it.next(), it.next()) {
            (None, ..) => break,
            (
                Some(Value::BulkString(m)),
                Some(Value::Int(d)),
                Some(Value::BulkString(r)),
                Some(Value::Int(t)),
            ) => (m, d, r, t),
            _ => return Err(bad("a pod entry is not (member, depth, record, pttl)")),
        };
        let Ok(record) = serde_json::from_slice::<PodRecord>(&record) else {
            tracing::debug!("valkey: a pod record does not decode; skipped");
            continue;
        };
        let c = Candidate {
            member: String::from_utf8_lossy(&member).into_owned(),
            depth: u32::try_from(depth).unwrap_or(0),
            age_ms: record.age_ms(pttl),
            record,
        };
        // A pod that registered again (its engine restarted) until its old
        // record is deleted: the fresher record is the live one.
        match found
            .candidates
            .iter_mut()
            .find(|o| o.record.id == c.record.id)
        {
            Some(old) if c.age_ms < old.age_ms => *old = c,
            Some(_) => {}
            None => found.candidates.push(c),
        }
    }
    Ok(found)
}
