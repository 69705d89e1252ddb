//! The `tracing` section of `proxy.yaml`: OpenTelemetry spans of the request
//! path, exported over OTLP (docs/observability.md#traces). Absent, the
//! sidecar records no spans and passes a client's `traceparent` through
//! unchanged.
//!
//! ```yaml
//! tracing:
//!   otlp_endpoint: http://otel-collector.monitoring:4317
//!   protocol: grpc        # or http: spans go to <otlp_endpoint>/v1/traces
//!   sample_ratio: 0.1     # of the traces this sidecar starts; a sampled parent is always followed
//! ```

use std::fmt;

use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize, Serializer};

/// See the module docs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tracing {
    /// The collector's OTLP endpoint (`http://host:port`).
    pub otlp_endpoint: OtlpEndpoint,
    /// `grpc` (OTLP/gRPC, usually port 4317) or `http` (OTLP/HTTP with
    /// protobuf bodies, usually port 4318, at `<otlp_endpoint>/v1/traces`).
    #[serde(default)]
    pub protocol: OtlpProtocol,
    /// The share of traces this sidecar starts itself (a request without a
    /// valid `traceparent`) that are recorded and exported, in [0, 1]. A
    /// request whose parent is sampled is always sampled, one whose parent
    /// is not never is (parent-based sampling).
    #[serde(default = "default_sample_ratio")]
    pub sample_ratio: f64,
}

// `sample_ratio` is validated finite, so comparing bits is an equivalence.
impl Eq for Tracing {}

/// How spans are sent to the collector.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OtlpProtocol {
    /// OTLP over gRPC (the OTLP default).
    #[default]
    Grpc,
    /// OTLP over HTTP/1.1 with protobuf bodies.
    Http,
}

/// A collector URL: `http://host:port[/path]`. Plain HTTP only: the exporter
/// is built without TLS, so an `https` endpoint is rejected at load rather
/// than failing every export (put a collector agent beside the pod or on
/// the node).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpEndpoint(http::Uri);

fn default_sample_ratio() -> f64 {
    1.0
}

impl Tracing {
    /// Rules the decoder cannot check; `(field, message)` on the first broken one.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let r = self.sample_ratio;
        if !(0.0..=1.0).contains(&r) {
            return Err((
                "tracing.sample_ratio".to_owned(),
                format!("{r} is not a ratio in [0, 1]"),
            ));
        }
        Ok(())
    }
}

impl OtlpEndpoint {
    /// The URL as configured, without a trailing `/`.
    pub fn as_str(&self) -> String {
        self.0.to_string().trim_end_matches('/').to_owned()
    }

    /// Where OTLP/HTTP spans are posted: `<endpoint>/v1/traces`.
    pub fn http_traces_url(&self) -> String {
        format!("{}/v1/traces", self.as_str())
    }

    fn parse(s: &str) -> Result<Self, String> {
        let uri: http::Uri = s.parse().map_err(|e| format!("{s:?} is not a URL: {e}"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(format!(
                    "{s:?}: https is not supported (the exporter is built without TLS); use an http:// collector"
                ))
            }
            _ => return Err(format!("{s:?} must start with http://")),
        }
        if uri.authority().is_none() {
            return Err(format!("{s:?} has no host"));
        }
        if uri.query().is_some() {
            return Err(format!("{s:?}: a query string is not allowed"));
        }
        Ok(Self(uri))
    }
}

impl fmt::Display for OtlpEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.as_str())
    }
}

impl std::str::FromStr for OtlpEndpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse(s)
    }
}

impl Serialize for OtlpEndpoint {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.as_str())
    }
}

impl<'de> Deserialize<'de> for OtlpEndpoint {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).map_err(de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use crate::config::from_yaml_str;

    #[test]
    fn defaults_and_urls() {
        let c = from_yaml_str("tracing:\n  otlp_endpoint: http://c:4318/\n", "p").unwrap();
        let t = c.tracing.unwrap();
        assert_eq!(t.protocol, super::OtlpProtocol::Grpc);
        assert_eq!(t.sample_ratio, 1.0);
        assert_eq!(t.otlp_endpoint.http_traces_url(), "http://c:4318/v1/traces");
        assert!(from_yaml_str("# none\n", "p").unwrap().tracing.is_none());
    }

    #[test]
    fn errors_name_line_and_field() {
        let src = "tracing:\n  otlp_endpoint: http://c:4317\n  sample_ratio: 1.5\n";
        let e = from_yaml_str(src, "p.yaml").unwrap_err();
        assert_eq!((e.path.as_str(), e.line), ("tracing.sample_ratio", Some(3)));
        let e = from_yaml_str("tracing:\n  otlp_endpoint: https://c:4317\n", "p").unwrap_err();
        assert_eq!(
            (e.path.as_str(), e.line),
            ("tracing.otlp_endpoint", Some(2))
        );
        assert!(e.message.contains("https is not supported"), "{e}");
        let e = from_yaml_str(
            "tracing:\n  otlp_endpoint: http://c\n  protocol: udp\n",
            "p",
        )
        .unwrap_err();
        assert_eq!((e.path.as_str(), e.line), ("tracing.protocol", Some(3)));
        let e = from_yaml_str("tracing:\n  endpoint: http://c\n", "p").unwrap_err();
        assert_eq!(e.path, "tracing.endpoint");
        let e = from_yaml_str("tracing:\n  protocol: http\n", "p").unwrap_err();
        assert!(e.message.contains("otlp_endpoint"), "{e}");
    }
}
