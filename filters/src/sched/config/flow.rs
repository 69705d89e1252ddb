//! `flowControl`: a sidecar holds a request while every pod that could run
//! it is saturated, and sends it, first come first served, to the first pod
//! that has room (llm-d's flow control, with its utilization detector's
//! thresholds). On only with `featureGates: [flowControl]`, as in llm-d.
//!
//! ```yaml
//! featureGates: [flowControl]
//! flowControl:
//!   maxRequests: 1000          # held at once per sidecar; past it, sent at once
//!   defaultRequestTTL: 60s     # held at most this long, then sent at once
//!   saturationDetector:
//!     queueDepthThreshold: 5       # a pod with this many queued is saturated
//!     kvCacheUtilThreshold: 0.8    # or with this much of its KV in use
//!     prefillTokensThreshold: 0    # or this many prompt tokens to prefill (0: off)
//! ```
//!
//! Where kvmesh differs from llm-d (docs/filters.md, "Flow control"): a
//! request past `maxRequests` or `defaultRequestTTL` is sent as if flow
//! control were off, never shed, so flow control adds no failure; the
//! detector's thresholds are written inline rather than as a plugin named
//! by `pluginRef`; `prefillTokensThreshold` is kvmesh's (the mesh's count of
//! prompt tokens sent to a pod and not yet prefilled); priority bands,
//! fairness and `maxBytes` are not implemented (rejected).

use std::time::Duration;

use serde::Deserialize;

use super::Errs;
use crate::sched::error::{ConfigError, ConfigErrorKind};

/// The feature gate that turns flow control on.
pub const GATE: &str = "flowControl";

/// Flow control, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowControl {
    /// Requests one sidecar holds at once; a request past them is sent at once.
    pub max_requests: u32,
    /// The longest a request is held; then it is sent at once.
    pub request_ttl: Duration,
    /// A pod is saturated when this many requests queue there: its engine's
    /// `waiting`, or the sidecars' requests in flight to it less its engine's
    /// `running`, whichever is larger.
    pub queue_depth_threshold: u32,
    /// Or when this share of its KV cache is in use (0..1; 1 or more: never).
    pub kv_cache_util_threshold: f64,
    /// Or when the mesh has sent it this many prompt tokens that wait to be
    /// prefilled (0: not used).
    pub prefill_tokens_threshold: u64,
}

impl Default for FlowControl {
    /// llm-d's defaults (`defaultRequestTTL` 60s; the utilization
    /// detector's queue depth 5 and KV utilization 0.8), 1000 held requests.
    fn default() -> Self {
        Self {
            max_requests: 1000,
            request_ttl: Duration::from_secs(60),
            queue_depth_threshold: 5,
            kv_cache_util_threshold: 0.8,
            prefill_tokens_threshold: 0,
        }
    }
}

/// `flowControl` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct RawFlowControl {
    max_requests: Option<u32>,
    #[serde(rename = "defaultRequestTTL")]
    default_request_ttl: Option<String>,
    saturation_detector: Option<RawDetector>,
}

/// `flowControl.saturationDetector` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawDetector {
    queue_depth_threshold: Option<u32>,
    kv_cache_util_threshold: Option<f64>,
    prefill_tokens_threshold: Option<u64>,
}

/// Whether `gates` turns `name` on: `name` or `name=true`, the last entry
/// naming it winning; a malformed entry is an error.
pub(crate) fn gate_on(gates: &[String], name: &str, errs: &Errs<'_>) -> Result<bool, ConfigError> {
    let mut on = false;
    for (i, g) in gates.iter().enumerate() {
        let (gate, value) = match g.split_once('=') {
            Some((gate, value)) => (gate, value),
            None => (g.as_str(), "true"),
        };
        let value = match value {
            "true" => true,
            "false" => false,
            other => {
                return Err(errs.at(
                    &format!("featureGates[{i}]"),
                    ConfigErrorKind::Invalid,
                    format!("{gate}={other}: a gate is `name`, `name=true` or `name=false`"),
                ))
            }
        };
        if gate == name {
            on = value;
        }
    }
    Ok(on)
}

/// The flow control `raw` and `gates` ask for: `None` when the gate is off.
pub(crate) fn resolve(
    raw: Option<RawFlowControl>,
    gates: &[String],
    errs: &Errs<'_>,
) -> Result<Option<FlowControl>, ConfigError> {
    let on = gate_on(gates, GATE, errs)?;
    let Some(raw) = raw else {
        return Ok(on.then(FlowControl::default));
    };
    if !on {
        return Err(errs.at(
            "flowControl",
            ConfigErrorKind::Invalid,
            format!("flowControl is set but featureGates does not turn it on; add `{GATE}` to featureGates"),
        ));
    }
    let mut flow = FlowControl::default();
    if let Some(n) = raw.max_requests {
        flow.max_requests = n;
    }
    if let Some(ttl) = raw.default_request_ttl {
        flow.request_ttl = parse_duration(&ttl).ok_or_else(|| {
            errs.at(
                "flowControl.defaultRequestTTL",
                ConfigErrorKind::Invalid,
                format!("{ttl:?} is not a duration (e.g. 60s, 1500ms, 2m)"),
            )
        })?;
    }
    if let Some(d) = raw.saturation_detector {
        if let Some(n) = d.queue_depth_threshold {
            if n == 0 {
                return Err(errs.at(
                    "flowControl.saturationDetector.queueDepthThreshold",
                    ConfigErrorKind::Invalid,
                    "must be at least 1 (0 would call every pod saturated)",
                ));
            }
            flow.queue_depth_threshold = n;
        }
        if let Some(u) = d.kv_cache_util_threshold {
            if !(u > 0.0 && u.is_finite()) {
                return Err(errs.at(
                    "flowControl.saturationDetector.kvCacheUtilThreshold",
                    ConfigErrorKind::Invalid,
                    "must be above 0 (1 or more: KV usage never saturates a pod)",
                ));
            }
            flow.kv_cache_util_threshold = u;
        }
        if let Some(t) = d.prefill_tokens_threshold {
            flow.prefill_tokens_threshold = t;
        }
    }
    Ok(Some(flow))
}

/// A Go-style duration: a number and a unit (`ms`, `s`, `m`, `h`), e.g.
/// `60s`, `1500ms`, `0.5s`, `2m`.
fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (number, unit) = s.split_at(split);
    let n: f64 = number.parse().ok()?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return None,
    };
    Duration::try_from_secs_f64(secs).ok()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use crate::sched::FilterConfig;

    use super::*;

    const HEAD: &str = "apiVersion: kvmesh.dev/v1alpha1\nkind: EndpointPickerConfig\n";

    fn load(rest: &str) -> Result<FilterConfig, ConfigError> {
        FilterConfig::from_yaml(&format!("{HEAD}{rest}"), "f.yaml")
    }

    #[test]
    fn off_without_the_gate_and_llm_d_defaults_with_it() {
        assert_eq!(load("").unwrap().flow_control, None);
        assert_eq!(
            load("featureGates: [flowControl]\n").unwrap().flow_control,
            Some(FlowControl::default())
        );
        assert_eq!(
            load("featureGates: [flowControl=false]\n")
                .unwrap()
                .flow_control,
            None
        );
    }

    #[test]
    fn every_key_is_read() {
        let cfg = load(
            "featureGates: [\"flowControl=true\"]\nflowControl:\n  maxRequests: 7\n  defaultRequestTTL: 1500ms\n  saturationDetector:\n    queueDepthThreshold: 2\n    kvCacheUtilThreshold: 0.9\n    prefillTokensThreshold: 8192\n",
        )
        .unwrap();
        assert_eq!(
            cfg.flow_control,
            Some(FlowControl {
                max_requests: 7,
                request_ttl: Duration::from_millis(1500),
                queue_depth_threshold: 2,
                kv_cache_util_threshold: 0.9,
                prefill_tokens_threshold: 8192,
            })
        );
    }

    #[test]
    fn bad_values_are_located_errors() {
        let cases = [
            (
                "flowControl:\n  maxRequests: 3\n",
                "flowControl",
                "does not turn it on",
            ),
            (
                "featureGates: [flowControl]\nflowControl:\n  defaultRequestTTL: soon\n",
                "flowControl.defaultRequestTTL",
                "not a duration",
            ),
            (
                "featureGates: [flowControl]\nflowControl:\n  saturationDetector:\n    queueDepthThreshold: 0\n",
                "flowControl.saturationDetector.queueDepthThreshold",
                "at least 1",
            ),
            (
                "featureGates: [flowControl]\nflowControl:\n  saturationDetector:\n    kvCacheUtilThreshold: -1\n",
                "flowControl.saturationDetector.kvCacheUtilThreshold",
                "above 0",
            ),
            (
                "featureGates: [flowControl=maybe]\n",
                "featureGates[0]",
                "name=true",
            ),
        ];
        for (text, path, message) in cases {
            let e = load(text).unwrap_err();
            assert_eq!(e.path, path, "{text}");
            assert!(e.message.contains(message), "{text}: {e}");
        }
        // llm-d's keys kvmesh does not implement are rejected, not ignored.
        let e = load("featureGates: [flowControl]\nflowControl:\n  maxBytes: 1Gi\n").unwrap_err();
        assert!(e.to_string().contains("maxBytes"), "{e}");
    }

    #[test]
    fn durations_read_as_go_writes_them() {
        assert_eq!(parse_duration("60s"), Some(Duration::from_secs(60)));
        assert_eq!(parse_duration("1500ms"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("0.5s"), Some(Duration::from_millis(500)));
        for bad in ["", "s", "10", "10 parsecs", "-1s", "1e400s"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }
}
