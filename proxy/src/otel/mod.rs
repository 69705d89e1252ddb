//! OpenTelemetry spans of the request path, exported over OTLP
//! (`tracing` in proxy.yaml, docs/observability.md#traces).
//!
//! The request path speaks the OpenTelemetry API directly ([`request`]),
//! not through `tracing` spans bridged by `tracing-opentelemetry`: with
//! `tracing` absent from the config no tracer exists, `RequestCtx::trace` is
//! `None` and each stage pays one branch; every sidecar in one process (the
//! tests, the demo) owns its own tracer, with no global provider; and the
//! span whose id goes out in `traceparent` is a value the execute stage holds.
//!
//! Export ([`Exporter`]): the SDK's batch processor on its own thread, with a
//! bounded queue ([`MAX_QUEUE`] spans; when it is full, new spans are dropped
//! and counted by the SDK, never waited for), sending batches with the OTLP
//! exporter (gRPC through tonic, or HTTP/protobuf through hyper) on a small
//! runtime of its own, so an unreachable or slow collector never touches a
//! request's worker thread. [`Exporter::shutdown`] flushes what is queued.

pub mod request;

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider, SpanData,
    SpanExporter,
};
use opentelemetry_sdk::Resource;
use parking_lot::Mutex;

use crate::config::{OtlpProtocol, Tracing};
pub use request::{Hop, RequestTrace, Stage};

/// Spans queued for export at most; past it new spans are dropped.
pub const MAX_QUEUE: usize = 2048;
/// Spans per export request at most.
pub const MAX_BATCH: usize = 512;
/// How long queued spans wait for a batch to fill.
pub const BATCH_DELAY: Duration = Duration::from_secs(1);
/// Deadline of one export request to the collector.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// Deadline of the final flush at shutdown.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// At most one warning per this interval while exports fail.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Why the exporter could not be built.
#[derive(Debug, thiserror::Error)]
pub enum OtelError {
    #[error("OTLP exporter for {endpoint}: {reason}")]
    Build { endpoint: String, reason: String },
}

/// The tracer requests use; cheap to clone.
#[derive(Clone, Debug)]
pub struct Tracer {
    tracer: SdkTracer,
}

/// Owns the span pipeline; flushes it on [`Exporter::shutdown`].
#[derive(Debug)]
pub struct Exporter {
    provider: SdkTracerProvider,
}

/// Builds the tracer and its export pipeline for `config` (`pod`: this pod's
/// id, the spans' `service.instance.id`).
pub fn build(config: &Tracing, pod: &str) -> Result<(Tracer, Exporter), OtelError> {
    let endpoint = config.otlp_endpoint.to_string();
    let fail = |reason: String| OtelError::Build {
        endpoint: endpoint.clone(),
        reason,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .thread_name("kvmesh-otlp")
        .build()
        .map_err(|e| fail(format!("runtime: {e}")))?;
    let inner = {
        // tonic's lazy channel spawns its worker onto the runtime it is
        // built in: the exporter's own.
        let _entered = runtime.enter();
        match config.protocol {
            OtlpProtocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint.clone())
                .with_timeout(EXPORT_TIMEOUT)
                .build(),
            OtlpProtocol::Http => opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_endpoint(config.otlp_endpoint.http_traces_url())
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_timeout(EXPORT_TIMEOUT)
                .build(),
        }
        .map_err(|e| fail(e.to_string()))?
    };
    let exporter = OwnRuntime {
        inner,
        runtime: Some(runtime),
        endpoint,
        last_warning: Mutex::new(None),
    };
    let batch = BatchConfigBuilder::default()
        .with_max_queue_size(MAX_QUEUE)
        .with_max_export_batch_size(MAX_BATCH)
        .with_scheduled_delay(BATCH_DELAY)
        .build();
    let processor = BatchSpanProcessor::builder(exporter)
        .with_batch_config(batch)
        .build();
    let resource = Resource::builder()
        .with_service_name("kvmesh-proxy")
        .with_attribute(KeyValue::new("service.instance.id", pod.to_owned()))
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            config.sample_ratio,
        ))))
        .with_resource(resource)
        .build();
    let tracer = Tracer {
        tracer: provider.tracer("kvmesh-proxy"),
    };
    Ok((tracer, Exporter { provider }))
}

impl Exporter {
    /// Exports every queued span (bounded by [`FLUSH_TIMEOUT`]) and stops the
    /// pipeline. Blocks: call it off the request runtime's workers.
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown_with_timeout(FLUSH_TIMEOUT) {
            tracing::warn!(error = %e, "flushing the OTLP span exporter at shutdown");
        }
    }
}

/// The OTLP exporter driven by a current-thread runtime of its own, on the
/// batch processor's thread.
#[derive(Debug)]
struct OwnRuntime {
    inner: opentelemetry_otlp::SpanExporter,
    /// `Some` until dropped (then shut down without blocking).
    runtime: Option<tokio::runtime::Runtime>,
    endpoint: String,
    last_warning: Mutex<Option<std::time::Instant>>,
}

impl OwnRuntime {
    fn warn(&self, spans: usize, e: &dyn std::fmt::Display) {
        let now = std::time::Instant::now();
        let mut last = self.last_warning.lock();
        if last.is_some_and(|t| now.duration_since(t) < WARN_EVERY) {
            return;
        }
        *last = Some(now);
        tracing::warn!(endpoint = %self.endpoint, spans, error = %e, "OTLP span export failed; the spans are dropped (at most one such warning a minute)");
    }
}

impl SpanExporter for OwnRuntime {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let spans = batch.len();
        let r = match &self.runtime {
            Some(rt) => rt.block_on(self.inner.export(batch)),
            None => Ok(()),
        };
        if let Err(e) = &r {
            self.warn(spans, e);
        }
        std::future::ready(r)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let _entered = self.runtime.as_ref().map(|rt| rt.enter());
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Tracer {
    pub(crate) fn sdk(&self) -> &SdkTracer {
        &self.tracer
    }
}
