//! Access logs (`logging.access_log: true`): one JSON line per request, at
//! info level on the `kvmesh::access` target, written when the response body
//! ends (for a stream, when its last chunk went out, not when the head did)
//! or is dropped (the client went away).
//!
//! The request path fills one [`AccessLog`] as it goes: [`start`] at arrival
//! (request id, trace id from an incoming `traceparent`), the P/D legs in
//! execute, the outcome in observe; the response body then times the first
//! byte and writes the line on drop. With the key off nothing is allocated
//! and each stage's check is one branch on `None`.
//!
//! The P/D outcome is reported by `PdMetrics::outcome`, the one call every
//! connector makes, into the slot [`pd_scope`] puts around the P/D future
//! (a task-local: the connectors need no access-log parameter).

use std::sync::Arc;

use http::HeaderMap;
use parking_lot::Mutex;
use serde::Serialize;
use tokio::time::Instant;

/// The tracing target of access lines.
pub const TARGET: &str = "kvmesh::access";

tokio::task_local! {
    static PD_OUTCOME: Arc<Mutex<Option<&'static str>>>;
}

/// One request's access record, filled by the stages.
#[derive(Debug)]
pub struct AccessLog {
    started: Instant,
    line: Line,
    first_byte: Option<Instant>,
    /// The P/D connector's last reported outcome.
    pd: Option<Arc<Mutex<Option<&'static str>>>>,
}

/// The fields of the line, in this order.
#[derive(Debug, Default, Serialize)]
struct Line {
    /// When the response ended, UTC (RFC 3339, milliseconds).
    ts: String,
    request_id: String,
    trace_id: Option<String>,
    method: String,
    route: &'static str,
    model: Option<String>,
    status: u16,
    /// The scheduler's reason (`scheduled`, `routed_by_peer`, `passthrough`, ...).
    reason: &'static str,
    /// The pod that served the response (its id; the local pod's for the engine).
    pod: Option<String>,
    /// The local engine's data-parallel rank this sidecar named in
    /// `X-data-parallel-rank` (`engine.data_parallel_size` above 1).
    rank: Option<u32>,
    prefill: Option<String>,
    decode: Option<String>,
    /// `disaggregated`, `recompute`, `fallback_aggregated`, `decode_refused`,
    /// `decode_resent`, `decode_lease_expired`, `decode_kv_gone`, `failed`.
    pd: Option<&'static str>,
    attempts: u8,
    /// Times the stream went on on another pod after its upstream failed
    /// mid-way (docs/migration.md), and the tokens it had then, in all.
    migrations: u8,
    migrated_tokens: u64,
    /// Arrival to the first response body byte (the first token on streams).
    ttft_ms: Option<f64>,
    /// Arrival to the end of the response body.
    total_ms: f64,
    /// `complete`, `upstream_error` (the relay ended it) or `cancelled`
    /// (dropped before its end: the client went away).
    end: &'static str,
}

/// How a response body ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    Complete,
    UpstreamError,
    Cancelled,
}

/// A record for a request that arrived now, when access logs are on.
pub fn start(
    enabled: bool,
    method: &http::Method,
    headers: &HeaderMap,
    request_id: &str,
    route: &'static str,
) -> Option<Box<AccessLog>> {
    enabled.then(|| {
        Box::new(AccessLog {
            started: Instant::now(),
            line: Line {
                request_id: request_id.to_owned(),
                trace_id: trace_id(headers),
                method: method.as_str().to_owned(),
                route,
                ..Line::default()
            },
            first_byte: None,
            pd: None,
        })
    })
}

/// Runs a P/D future with a slot its connector reports the outcome into,
/// when `log` is on; the future alone otherwise.
pub async fn pd_scope<F: std::future::Future>(log: Option<&mut AccessLog>, fut: F) -> F::Output {
    match log {
        Some(log) => {
            let slot = log.pd.get_or_insert_with(Default::default).clone();
            PD_OUTCOME.scope(slot, fut).await
        }
        None => fut.await,
    }
}

/// Called by `PdMetrics::outcome`: records the outcome for the access line
/// of the request being served, if it has one.
pub fn pd_outcome(label: &'static str) {
    let _ = PD_OUTCOME.try_with(|slot| *slot.lock() = Some(label));
}

impl AccessLog {
    /// The trace this sidecar started for a request without a valid
    /// `traceparent` (`tracing` configured, the trace sampled); an incoming
    /// trace id stays.
    pub fn trace_started(&mut self, trace_id: String) {
        self.line.trace_id.get_or_insert(trace_id);
    }

    /// The P/D legs' pods.
    pub fn legs(&mut self, prefill: String, decode: String) {
        self.line.prefill = Some(prefill);
        self.line.decode = Some(decode);
    }

    /// The data-parallel rank the request was sent to (the first call's).
    pub fn rank(&mut self, rank: Option<u32>) {
        self.line.rank = rank;
    }

    /// What observe knows when the response head goes out.
    pub fn head(
        &mut self,
        status: u16,
        model: Option<&str>,
        reason: &'static str,
        pod: Option<String>,
        attempts: u8,
    ) {
        self.line.status = status;
        self.line.model = model.map(str::to_owned);
        self.line.reason = reason;
        self.line.pod = pod;
        self.line.attempts = attempts;
    }

    /// The stream migrated: `migrations` times so far, carrying `tokens` in all.
    pub fn migrated(&mut self, migrations: u8, tokens: u64) {
        self.line.migrations = migrations;
        self.line.migrated_tokens = tokens;
    }

    /// A body byte went out (the first one counts).
    pub fn byte_sent(&mut self) {
        if self.first_byte.is_none() {
            self.first_byte = Some(Instant::now());
        }
    }

    /// Writes the line.
    pub fn finish(mut self, end: End) {
        let now = Instant::now();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
        self.line.ts = rfc3339(std::time::SystemTime::now());
        self.line.ttft_ms = self.first_byte.map(|t| ms(t - self.started));
        self.line.total_ms = ms(now - self.started);
        self.line.pd = self.pd.and_then(|s| *s.lock());
        self.line.end = match end {
            End::Complete => "complete",
            End::UpstreamError => "upstream_error",
            End::Cancelled => "cancelled",
        };
        match serde_json::to_string(&self.line) {
            Ok(json) => tracing::info!(target: TARGET, "{json}"),
            Err(e) => tracing::warn!(target: TARGET, error = %e, "access line not written"),
        }
    }
}

/// `2026-12-01T16:31:00.123Z` for a wall-clock time (UTC).
fn rfc3339(t: std::time::SystemTime) -> String {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

/// The trace id of a valid W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`,
/// neither id all zeros).
pub fn trace_id(headers: &HeaderMap) -> Option<String> {
    let v = headers.get("traceparent")?.to_str().ok()?.trim();
    let mut parts = v.split('-');
    let (version, trace, parent, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let zero = |s: &str| s.bytes().all(|b| b == b'0');
    let valid = hex(version, 2)
        && version != "ff"
        && (parts.next().is_none() || version != "00")
        && hex(trace, 32)
        && !zero(trace)
        && hex(parent, 16)
        && !zero(parent)
        && hex(flags, 2);
    valid.then(|| trace.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(tp: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("traceparent", tp.parse().unwrap());
        h
    }

    #[test]
    fn trace_ids_from_valid_traceparents_only() {
        let id = "4bf92f3577b34da6a3ce929d0e0e4736";
        let tp = format!("00-{id}-00f067aa0ba902b7-01");
        assert_eq!(trace_id(&with(&tp)).as_deref(), Some(id));
        assert_eq!(trace_id(&HeaderMap::new()), None);
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e47-00f067aa0ba902b7-01",
            "garbage",
        ] {
            assert_eq!(trace_id(&with(bad)), None, "{bad}");
        }
        // A later version may append fields.
        let tp = format!("01-{id}-00f067aa0ba902b7-01-more");
        assert_eq!(trace_id(&with(&tp)).as_deref(), Some(id));
    }

    #[test]
    fn the_config_key_is_strict_and_off_by_default() {
        use crate::config::load::from_yaml_str;
        assert!(!crate::Config::default().logging.access_log);
        let c = from_yaml_str("logging:\n  access_log: true\n", "p.yaml").unwrap();
        assert!(c.logging.access_log);
        let e = from_yaml_str("logging:\n  acces_log: true\n", "p.yaml").unwrap_err();
        assert!(e.to_string().contains("acces_log"), "{e}");
    }

    #[test]
    fn timestamps_are_rfc3339_utc() {
        let at = |s: u64| std::time::UNIX_EPOCH + std::time::Duration::from_millis(s);
        assert_eq!(rfc3339(at(0)), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(at(951_782_400_007)), "2000-02-29T00:00:00.007Z");
        assert_eq!(rfc3339(at(1_796_142_660_123)), "2026-12-01T16:31:00.123Z");
    }

    #[tokio::test]
    async fn the_pd_outcome_reaches_the_record_only_inside_its_scope() {
        pd_outcome("failed"); // outside any scope: ignored
        let mut log = start(
            true,
            &http::Method::POST,
            &HeaderMap::new(),
            "r",
            "/v1/completions",
        )
        .unwrap();
        pd_scope(Some(&mut log), async { pd_outcome("disaggregated") }).await;
        assert_eq!(
            log.pd.as_ref().and_then(|s| *s.lock()),
            Some("disaggregated")
        );
        assert!(start(false, &http::Method::GET, &HeaderMap::new(), "r", "other").is_none());
    }
}
