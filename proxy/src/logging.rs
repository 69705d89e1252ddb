//! Structured logs with `tracing`: the level comes from `RUST_LOG` when set,
//! else from `logging.level`; text or JSON lines on stderr.

use tracing_subscriber::EnvFilter;

use crate::config::{LogFormat, Logging};

/// Installs the global subscriber once; later calls (tests) are ignored.
pub fn init(cfg: &Logging) {
    let filter = match std::env::var("RUST_LOG") {
        Ok(s) if !s.is_empty() => EnvFilter::builder().parse_lossy(s),
        _ => EnvFilter::builder().parse_lossy(&cfg.level),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match cfg.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}
