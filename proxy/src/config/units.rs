//! Typed config values that validate while they are decoded, so a bad value is
//! reported with the line the YAML parser is standing on.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// A positive duration written as `250ms`, `5s`, `2m` or `1h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Duration(std::time::Duration);

/// A positive byte count written as an integer or with a unit: `512KiB`, `16MiB`, `1GiB`, `2MB`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

/// The engine's base URL: `http://host:port`, no path, no query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineUrl {
    authority: http::uri::Authority,
}

impl Duration {
    pub const fn from_millis(ms: u64) -> Self {
        Self(std::time::Duration::from_millis(ms))
    }

    pub const fn from_secs(s: u64) -> Self {
        Self(std::time::Duration::from_secs(s))
    }

    pub const fn get(self) -> std::time::Duration {
        self.0
    }

    fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let n: u64 = num.parse().map_err(|_| {
            format!("invalid duration {s:?}: expected a whole number followed by ms, s, m or h")
        })?;
        let ms = match unit {
            "ms" => Some(n),
            "s" => n.checked_mul(1000),
            "m" => n.checked_mul(60_000),
            "h" => n.checked_mul(3_600_000),
            _ => {
                return Err(format!(
                    "invalid duration {s:?}: the unit must be ms, s, m or h"
                ))
            }
        }
        .ok_or_else(|| format!("duration {s:?} is too large"))?;
        if ms == 0 {
            return Err(format!("duration {s:?} must be greater than zero"));
        }
        Ok(Self::from_millis(ms))
    }
}

impl fmt::Display for Duration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        if ms.is_multiple_of(3_600_000) {
            write!(f, "{}h", ms / 3_600_000)
        } else if ms.is_multiple_of(60_000) {
            write!(f, "{}m", ms / 60_000)
        } else if ms.is_multiple_of(1000) {
            write!(f, "{}s", ms / 1000)
        } else {
            write!(f, "{ms}ms")
        }
    }
}

impl Serialize for Duration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Duration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Duration::parse(&s).map_err(de::Error::custom)
    }
}

impl ByteSize {
    fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let n: u64 = num.parse().map_err(|_| {
            format!("invalid size {s:?}: expected a whole number with an optional unit")
        })?;
        let mult: u64 = match unit.trim() {
            "" | "B" => 1,
            "KiB" => 1 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            "KB" => 1000,
            "MB" => 1_000_000,
            "GB" => 1_000_000_000,
            _ => {
                return Err(format!(
                    "invalid size {s:?}: the unit must be B, KiB, MiB, GiB, KB, MB or GB"
                ))
            }
        };
        Self::positive(
            n.checked_mul(mult)
                .ok_or_else(|| format!("size {s:?} is too large"))?,
        )
    }

    fn positive(n: u64) -> Result<Self, String> {
        if n == 0 {
            Err("size must be greater than zero".to_owned())
        } else {
            Ok(Self(n))
        }
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte count such as 1048576 or \"16MiB\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                ByteSize::positive(v).map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                let v =
                    u64::try_from(v).map_err(|_| E::custom("size must be greater than zero"))?;
                ByteSize::positive(v).map_err(E::custom)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                ByteSize::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

impl EngineUrl {
    /// `http://127.0.0.1:PORT`.
    pub fn local(port: u16) -> Self {
        let authority = http::uri::Authority::from_maybe_shared(format!("127.0.0.1:{port}"));
        match authority {
            Ok(authority) => Self { authority },
            // A numeric loopback authority always parses; keep a fallback rather than a panic.
            Err(_) => Self {
                authority: http::uri::Authority::from_static("127.0.0.1:8200"),
            },
        }
    }

    /// `host:port` of the engine.
    pub fn authority(&self) -> &http::uri::Authority {
        &self.authority
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        let uri: http::Uri = s.parse().map_err(|e| format!("invalid URL {s:?}: {e}"))?;
        if uri.scheme_str() != Some("http") {
            return Err(format!("invalid URL {s:?}: the scheme must be http:// (the engine is a local, plain-HTTP listener)"));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("invalid URL {s:?}: no host"))?;
        if uri.path_and_query().is_some_and(|p| p.as_str() != "/") {
            return Err(format!(
                "invalid URL {s:?}: give only scheme, host and port (no path)"
            ));
        }
        if authority.port_u16().is_none() {
            return Err(format!("invalid URL {s:?}: give the port explicitly"));
        }
        Ok(Self { authority })
    }
}

impl fmt::Display for EngineUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}", self.authority)
    }
}

impl Serialize for EngineUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for EngineUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        EngineUrl::parse(&s).map_err(de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn durations_parse_and_print() {
        assert_eq!(Duration::parse("250ms").unwrap().get().as_millis(), 250);
        assert_eq!(Duration::parse("2m").unwrap().get().as_secs(), 120);
        assert_eq!(Duration::parse("90s").unwrap().to_string(), "90s");
        assert_eq!(Duration::parse("120s").unwrap().to_string(), "2m");
        assert!(Duration::parse("0s").is_err());
        assert!(Duration::parse("5").is_err());
        assert!(Duration::parse("5x").is_err());
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(ByteSize::parse("16MiB").unwrap().0, 16 << 20);
        assert_eq!(ByteSize::parse("2MB").unwrap().0, 2_000_000);
        assert!(ByteSize::parse("0").is_err());
        assert!(ByteSize::parse("3 furlongs").is_err());
    }

    #[test]
    fn engine_urls() {
        assert_eq!(
            EngineUrl::parse("http://127.0.0.1:8001")
                .unwrap()
                .to_string(),
            "http://127.0.0.1:8001"
        );
        assert!(EngineUrl::parse("https://x:1").is_err());
        assert!(EngineUrl::parse("http://x:1/v1").is_err());
        assert!(EngineUrl::parse("http://x").is_err());
    }
}

/// A number in (0, 1], such as a target utilization: `0.75`.
#[derive(Debug, Clone, Copy)]
pub struct Fraction(f64);

impl Fraction {
    pub const ONE: Fraction = Fraction(1.0);

    /// `v` when it lies in (0, 1].
    pub fn new(v: f64) -> Option<Self> {
        (v > 0.0 && v <= 1.0).then_some(Self(v))
    }

    pub const fn get(self) -> f64 {
        self.0
    }
}

// Values are finite by construction, so comparing bits is an equivalence.
impl PartialEq for Fraction {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}

impl Eq for Fraction {}

impl fmt::Display for Fraction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl Serialize for Fraction {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(self.0)
    }
}

impl<'de> Deserialize<'de> for Fraction {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = f64::deserialize(d)?;
        Fraction::new(v)
            .ok_or_else(|| de::Error::custom(format!("{v} is not a fraction in (0, 1]")))
    }
}
