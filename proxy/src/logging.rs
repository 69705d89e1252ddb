//! Structured logs with `tracing`: the level comes from `RUST_LOG` when set,
//! else from `logging.level`; text or JSON lines on stderr.
//!
//! Access lines (`logging.access_log`, target [`crate::access::TARGET`]) go
//! only to their own layer, [`AccessLayer`], which writes each one as the
//! bare JSON object the request path built, whatever `logging.format` and
//! `logging.level` say.

use std::io::Write as _;

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::access::TARGET as ACCESS;
use crate::config::{LogFormat, Logging};

/// Installs the global subscriber once; later calls (tests) are ignored.
pub fn init(cfg: &Logging) {
    let directives = match std::env::var("RUST_LOG") {
        Ok(s) if !s.is_empty() => s,
        _ => cfg.level.clone(),
    };
    let filter = EnvFilter::builder().parse_lossy(format!("{directives},{ACCESS}=off"));
    let main = match cfg.format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_writer(std::io::stderr)
            .boxed(),
    }
    .with_filter(filter);
    // Its own filter: the access layer alone must not enable other events.
    let access = cfg.access_log.then(|| {
        AccessLayer::new(std::io::stderr)
            .with_filter(Targets::new().with_target(ACCESS, LevelFilter::INFO))
    });
    let _ = tracing_subscriber::registry()
        .with(main)
        .with(access)
        .try_init();
}

/// Writes each access event's message, one line each, to `W`.
pub struct AccessLayer<W> {
    writer: W,
}

impl<W> AccessLayer<W> {
    pub fn new(writer: W) -> Self {
        Self { writer }
    }
}

impl<S, W> Layer<S> for AccessLayer<W>
where
    S: Subscriber,
    W: for<'a> MakeWriter<'a> + 'static,
{
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        if event.metadata().target() != ACCESS || *event.metadata().level() != tracing::Level::INFO
        {
            return;
        }
        let mut line = Message(String::new());
        event.record(&mut line);
        line.0.push('\n');
        let _ = self.writer.make_writer().write_all(line.0.as_bytes());
    }
}

/// The event's `message` field, as formatted.
struct Message(String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write as _;
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        }
    }
}
