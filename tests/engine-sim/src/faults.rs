//! Scriptable faults: what the next requests should suffer.
//!
//! Counted over inference requests (`/v1/completions`, `/v1/chat/completions`,
//! `/v1/responses`)
//! received since the engine started, 1-based. Set from a test through
//! [`crate::SimHandle::faults`] or over HTTP at `POST /sim/faults`.

use std::collections::BTreeMap;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Deserialize;

/// What happens to one request, decided when it arrives.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Answer with this status and a vLLM-shaped error instead of serving.
    pub status: Option<u16>,
    /// Hold the response's first byte this long (real time).
    pub first_byte_delay: Option<Duration>,
    /// Close the connection after this many body chunks (SSE events; 0 for a
    /// non-streaming body: headers, then the connection drops).
    pub die_after_chunks: Option<usize>,
}

#[derive(Debug, Default)]
struct State {
    seen: u64,
    status_for: BTreeMap<u64, u16>,
    status_always: Option<u16>,
    first_byte_delay: Option<Duration>,
    die_after_chunks: Option<usize>,
    refuse: bool,
}

/// The fault script of one engine.
#[derive(Debug, Default)]
pub struct Faults {
    state: Mutex<State>,
}

/// The JSON body of `POST /sim/faults` (every field optional).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultScript {
    /// `[[n, status], ...]`: the n-th request (counting from now) gets `status`.
    #[serde(default)]
    pub fail_nth: Vec<(u64, u16)>,
    pub fail_all: Option<u16>,
    pub first_byte_delay_ms: Option<u64>,
    pub die_after_chunks: Option<usize>,
    pub refuse_connections: Option<bool>,
    /// Clear everything first.
    #[serde(default)]
    pub clear: bool,
    /// Restart the engine (cache, event sequence, running requests).
    #[serde(default)]
    pub restart: bool,
}

impl Faults {
    /// The n-th inference request from now (1 = the next) gets `status`.
    pub fn fail_nth(&self, n: u64, status: u16) {
        let mut s = self.state.lock();
        let at = s.seen + n.max(1);
        s.status_for.insert(at, status);
    }

    /// The next inference request gets `status`.
    pub fn fail_next(&self, status: u16) {
        self.fail_nth(1, status);
    }

    /// Every inference request gets `status` until cleared (`None`).
    pub fn fail_all(&self, status: Option<u16>) {
        self.state.lock().status_always = status;
    }

    /// Delay before the first response byte of every inference request.
    pub fn delay_first_byte(&self, delay: Option<Duration>) {
        self.state.lock().first_byte_delay = delay;
    }

    /// Drop every inference response's connection after `k` body chunks.
    pub fn die_after_chunks(&self, k: Option<usize>) {
        self.state.lock().die_after_chunks = k;
    }

    /// Accept and immediately close every new connection while true.
    pub fn refuse_connections(&self, refuse: bool) {
        self.state.lock().refuse = refuse;
    }

    /// No faults.
    pub fn clear(&self) {
        let seen = self.state.lock().seen;
        *self.state.lock() = State {
            seen,
            ..State::default()
        };
    }

    pub fn refusing(&self) -> bool {
        self.state.lock().refuse
    }

    /// Counts one inference request and says what happens to it.
    pub fn next_verdict(&self) -> Verdict {
        let mut s = self.state.lock();
        s.seen += 1;
        let n = s.seen;
        let status = s.status_for.remove(&n).or(s.status_always);
        Verdict {
            status,
            first_byte_delay: s.first_byte_delay,
            die_after_chunks: s.die_after_chunks,
        }
    }

    /// Applies a script (without its `restart`, which the server handles).
    pub fn apply(&self, script: &FaultScript) {
        if script.clear {
            self.clear();
        }
        for (n, status) in &script.fail_nth {
            self.fail_nth(*n, *status);
        }
        if let Some(st) = script.fail_all {
            self.fail_all(Some(st));
        }
        if let Some(ms) = script.first_byte_delay_ms {
            self.delay_first_byte(Some(Duration::from_millis(ms)));
        }
        if let Some(k) = script.die_after_chunks {
            self.die_after_chunks(Some(k));
        }
        if let Some(r) = script.refuse_connections {
            self.refuse_connections(r);
        }
    }
}
