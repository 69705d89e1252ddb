//! Prefill/decode handoff between simulated engines in one process.
//!
//! vLLM NixlConnector: a prefill engine that finishes a
//! `do_remote_decode` request holds its blocks and registers them here under
//! `(remote_engine_id, remote_request_id)`; a decode engine given those
//! `kv_transfer_params` takes the entry (the "fetch"), tells the prefill
//! engine to free the blocks, and skips the prefill. Unknown or expired
//! parameters fall back to recomputing, as vLLM does.
//!
//! SGLang bootstrap: both halves of a request carry the same
//! `bootstrap_room`; each half waits for the other here, and a lone half
//! fails after the bootstrap timeout like SGLang's `KVTransferError`.
//!
//! Both maps are process-global and bounded (`CAP` entries); a full map
//! refuses new entries (the request then recomputes, or fails as a lone half).

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

#[derive(Debug, Default)]
struct Room {
    prefill_done: bool,
    decode_arrived: bool,
    notify: Arc<Notify>,
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

/// Marks `half` of `room` as arrived (decode) or finished (prefill) and waits
/// up to `timeout` for the other half. Returns false on timeout.
pub(crate) async fn rendezvous(room: u64, half: Half, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    let notify = {
        let mut map = rooms().lock();
        if !map.contains_key(&room) && map.len() >= CAP {
            return false;
        }
        let r = map.entry(room).or_default();
        match half {
            Half::Prefill => r.prefill_done = true,
            Half::Decode => r.decode_arrived = true,
        }
        r.notify.notify_waiters();
        r.notify.clone()
    };
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
            // The decode half is the last to need the room.
            if half == Half::Decode {
                rooms().lock().remove(&room);
            }
            return true;
        }
        if tokio::time::timeout_at(deadline, waiting).await.is_err() {
            rooms().lock().remove(&room);
            return false;
        }
    }
}
