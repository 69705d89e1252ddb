//! The typed errors of the load generator.
//!
//! A failed *request* is not an error of the run: it is recorded in its
//! [`crate::RequestRecord`] and counted. These errors stop a run or a tool
//! before it produces a result (bad target, unreadable process, I/O).

use std::path::PathBuf;

/// What stopped the load generator.
#[derive(Debug, thiserror::Error)]
pub enum LoadgenError {
    /// A target base URL that is not `http://host:port[/prefix]`.
    #[error("bad target URL {url:?}: {reason}")]
    BadTarget { url: String, reason: String },
    /// A run was asked for with nothing to send to.
    #[error("no targets given")]
    NoTargets,
    /// A load description that cannot run (rate <= 0, concurrency 0, no bound).
    #[error("bad load: {0}")]
    BadLoad(String),
    /// A workload asked for with an unknown name or size.
    #[error("unknown workload {0:?} (expected shared-prefix, multi-turn, pd, long-body or tiny)")]
    UnknownWorkload(String),
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A socket or process operation failed.
    #[error("{what}: {source}")]
    Net {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A child process (nginx, kvmesh-proxy) could not be used.
    #[error("{name}: {reason}")]
    Child { name: String, reason: String },
    /// Drawing the PNG failed.
    #[error("plot {path}: {reason}")]
    Plot { path: PathBuf, reason: String },
    /// Serializing a report failed.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
}
