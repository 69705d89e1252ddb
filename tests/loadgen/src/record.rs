//! What the client measured for one request.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Most inter-token gaps kept per request; a longer stream keeps its first
/// ones (bounded memory whatever the engine sends).
pub const MAX_ITL_SAMPLES: usize = 65_536;

/// The measurements of one request, successful or not.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Index of the request in its workload.
    pub index: usize,
    /// The workload's user (session) id.
    pub user: u32,
    /// Stage of a rate ladder (0 for a single-stage load).
    pub stage: usize,
    /// Index of the target (base URL) it was sent to.
    pub target: usize,
    /// When it was sent, from the start of the run.
    pub start: Duration,
    /// Time to the first chunk carrying content (streaming only).
    pub ttft: Option<Duration>,
    /// Gaps between successive content chunks (streaming only).
    pub itl: Vec<Duration>,
    /// Time to the end of the response body.
    pub e2e: Duration,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.completion_tokens` (or the content chunks counted, when the
    /// engine sent no usage).
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// HTTP status, when a response head arrived.
    pub status: Option<u16>,
    /// Why it failed; `None` when it succeeded.
    pub error: Option<String>,
}

impl RequestRecord {
    /// A 2xx response, read to its end, with no error in the stream.
    pub fn is_ok(&self) -> bool {
        self.error.is_none() && matches!(self.status, Some(s) if (200..300).contains(&s))
    }
}
