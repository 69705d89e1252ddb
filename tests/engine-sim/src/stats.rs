//! What an engine received and what it served, for test assertions.
//! Both logs are bounded rings of the most recent `LOG_CAP` entries.

use std::collections::VecDeque;
use std::time::Instant;

use bytes::Bytes;
use parking_lot::Mutex;

const LOG_CAP: usize = 4096;

/// One HTTP request as the engine received it.
#[derive(Debug, Clone)]
pub struct ReceivedRequest {
    pub method: String,
    pub path: String,
    /// Header names lower-cased, in arrival order.
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
    pub at: Instant,
}

impl ReceivedRequest {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body parsed as JSON, if it is JSON.
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.body).ok()
    }
}

/// One finished inference request, times in simulated seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletedRequest {
    pub request_id: String,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    pub external_tokens: usize,
    pub queue_s: f64,
    pub ttft_s: f64,
    pub e2e_s: f64,
}

/// Counters and logs of one engine.
#[derive(Debug, Default)]
pub struct Recorder {
    received: Mutex<VecDeque<ReceivedRequest>>,
    completed: Mutex<VecDeque<CompletedRequest>>,
}

fn push<T>(q: &Mutex<VecDeque<T>>, item: T) {
    let mut q = q.lock();
    if q.len() == LOG_CAP {
        q.pop_front();
    }
    q.push_back(item);
}

impl Recorder {
    pub fn received(&self, r: ReceivedRequest) {
        push(&self.received, r);
    }

    pub fn completed(&self, c: CompletedRequest) {
        push(&self.completed, c);
    }

    pub fn received_list(&self) -> Vec<ReceivedRequest> {
        self.received.lock().iter().cloned().collect()
    }

    pub fn completed_list(&self) -> Vec<CompletedRequest> {
        self.completed.lock().iter().cloned().collect()
    }
}

/// A snapshot of the engine's state.
#[derive(Debug, Clone, PartialEq)]
pub struct SimStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub cached_blocks: usize,
    pub held_transfers: usize,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    /// Prompt tokens preempted requests looked up again when they resumed,
    /// and those they found cached: their difference is the recompute
    /// preemption cost (not in `prefix_queries`, as in vLLM).
    pub preempted_queries: u64,
    pub preempted_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub external_kv_tokens: u64,
    /// P/D fetches that failed on this (decode) engine and were recomputed.
    pub failed_kv_transfers: u64,
    pub preemptions: u64,
    pub kv_batches_published: u64,
    pub kv_batches_dropped: u64,
}
