//! Prefill/decode handoff between simulated engines, in one process or across
//! processes.
//!
//! vLLM NixlConnector ([`nixl`]): a prefill engine that finishes a
//! `do_remote_decode` request holds its blocks and registers them here under
//! `(engine_id, request_id)`. A decode engine given those `kv_transfer_params`
//! takes the entry (the "fetch"): straight from this registry when the prefill
//! engine lives in the same process (the shortcut, `SimConfig::pd_in_process`),
//! otherwise over the side channel the prefill engine serves at
//! `remote_host:remote_port`. The fetch tells the prefill engine to free the
//! blocks. Unknown, expired or unreachable parameters fall back to
//! recomputing, as vLLM does.
//!
//! SGLang bootstrap ([`bootstrap`]): both halves of a request carry the same
//! `bootstrap_room`. The prefill engine keeps its rooms here; the decode half
//! reaches them through the bootstrap endpoint the prefill engine serves at
//! `bootstrap_host:bootstrap_port`, and each half waits for the other. A lone
//! half fails after the bootstrap timeout like SGLang's `KVTransferError`.
//!
//! The kvmesh KV connector ([`kvagent`]): real bytes through the node's
//! `kvmesh-kvagent`, prefill sending to the agent the proxy names.
//!
//! Both maps are process-global and bounded (`CAP` entries). A full map first
//! drops its expired entries, then refuses new ones (the request then
//! recomputes, or fails as a lone half).

pub(crate) mod bootstrap;
pub(crate) mod client;
pub(crate) mod kvagent;
pub(crate) mod nixl;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{mpsc, Notify};

use crate::core::Cmd;

const CAP: usize = 65_536;

/// A prefill engine's held request.
#[derive(Debug)]
pub(crate) struct Registered {
    pub release: mpsc::WeakSender<Cmd>,
    pub prompt_tokens: usize,
    pub expires: Instant,
}

type Key = (String, String);

fn held() -> &'static Mutex<HashMap<Key, Registered>> {
    static HELD: OnceLock<Mutex<HashMap<Key, Registered>>> = OnceLock::new();
    HELD.get_or_init(|| Mutex::new(HashMap::new()))
}

pub(crate) fn register(engine_id: &str, request_id: &str, entry: Registered) {
    let mut map = held().lock();
    if map.len() >= CAP {
        let now = Instant::now();
        map.retain(|_, r| r.expires > now);
        if map.len() >= CAP {
            return;
        }
    }
    map.insert((engine_id.to_string(), request_id.to_string()), entry);
}

pub(crate) fn forget(engine_id: &str, request_id: &str) {
    held()
        .lock()
        .remove(&(engine_id.to_string(), request_id.to_string()));
}

/// Takes a held transfer: `Some(prompt_tokens)` if it existed and had not
/// expired; the prefill engine is told to free its blocks.
pub(crate) fn fetch(engine_id: &str, request_id: &str) -> Option<usize> {
    let entry = held()
        .lock()
        .remove(&(engine_id.to_string(), request_id.to_string()))?;
    if entry.expires <= Instant::now() {
        return None;
    }
    let tx = entry.release.upgrade()?;
    let _ = tx.try_send(Cmd::ReleaseHeld(request_id.to_string()));
    Some(entry.prompt_tokens)
}

#[derive(Debug)]
struct Room {
    prefill_done: bool,
    decode_arrived: bool,
    notify: Arc<Notify>,
    /// The latest deadline of a half waiting here: past it, the room is
    /// stale and a full map may drop it.
    expires: Instant,
}

fn rooms() -> &'static Mutex<HashMap<u64, Room>> {
    static ROOMS: OnceLock<Mutex<HashMap<u64, Room>>> = OnceLock::new();
    ROOMS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Which half of an SGLang request is speaking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Half {
    Prefill,
    Decode,
}

/// Removes the room when its half gives up or is cancelled, so the other half
/// does not find a partner that is gone.
struct Leave {
    room: u64,
    armed: bool,
}

impl Drop for Leave {
    fn drop(&mut self) {
        if self.armed {
            rooms().lock().remove(&self.room);
        }
    }
}

/// Marks `half` of `room` as arrived (decode) or finished (prefill) and waits
/// up to `timeout` for the other half. Returns false on timeout or when the
/// map is full.
pub(crate) async fn rendezvous(room: u64, half: Half, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let notify = {
        let mut map = rooms().lock();
        if !map.contains_key(&room) && map.len() >= CAP {
            let now = Instant::now();
            map.retain(|_, r| r.expires > now);
            if map.len() >= CAP {
                return false;
            }
        }
        let r = map.entry(room).or_insert_with(|| Room {
            prefill_done: false,
            decode_arrived: false,
            notify: Arc::new(Notify::new()),
            expires: deadline,
        });
        r.expires = r.expires.max(deadline);
        match half {
            Half::Prefill => r.prefill_done = true,
            Half::Decode => r.decode_arrived = true,
        }
        r.notify.notify_waiters();
        r.notify.clone()
    };
    let mut leave = Leave { room, armed: true };
    loop {
        let waiting = notify.notified();
        tokio::pin!(waiting);
        waiting.as_mut().enable();
        let ready = {
            let map = rooms().lock();
            map.get(&room).is_none_or(|r| match half {
                Half::Prefill => r.decode_arrived,
                Half::Decode => r.prefill_done,
            })
        };
        if ready {
            // The decode half is the last to need the room: it removes it
            // (through `leave`); the prefill half leaves it for the decode.
            leave.armed = half == Half::Decode;
            return true;
        }
        let wait = tokio::time::timeout_at(deadline.into(), waiting);
        if wait.await.is_err() {
            return false;
        }
    }
}
