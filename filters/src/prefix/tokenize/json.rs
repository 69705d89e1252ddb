//! JSON that keeps the order of object keys, for what a chat template prints.
//!
//! Templates print tool schemas and tool-call arguments with `tojson`, which
//! in Python keeps the keys in the order the client sent them. `serde_json`'s
//! `Value` sorts them (the workspace builds it without `preserve_order`), so
//! the request fields a template may print are read into [`Json`] instead.

use std::fmt;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeMap, SerializeSeq, Serializer};
use serde::{Deserialize, Serialize};

/// Most nesting read; deeper values are refused (a template cannot need them
/// and a crafted body must not overflow the stack).
const MAX_DEPTH: usize = 64;

/// A JSON value whose objects keep their keys in order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Json {
    #[default]
    Null,
    Bool(bool),
    Number(serde_json::Number),
    String(String),
    Array(Vec<Json>),
    /// Keys in the order they were read; a repeated key keeps its first
    /// place and its last value, as Python's `json.loads` does.
    Object(Vec<(String, Json)>),
}

impl Json {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Json]> {
        match self {
            Self::Array(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_object(&self) -> Option<&[(String, Json)]> {
        match self {
            Self::Object(v) => Some(v),
            _ => None,
        }
    }

    /// The value of `key`, when this is an object that has it.
    pub fn get(&self, key: &str) -> Option<&Json> {
        self.as_object()?
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    }

    /// `get(key)`, with `null` read as absent (as pydantic reads an optional field).
    pub fn field(&self, key: &str) -> Option<&Json> {
        self.get(key).filter(|v| !v.is_null())
    }

    pub fn is_null(&self) -> bool {
        matches!(self, Self::Null)
    }

    /// Python's truthiness: `null`, `false`, `0`, `""`, `[]` and `{}` are false.
    pub fn truthy(&self) -> bool {
        match self {
            Self::Null => false,
            Self::Bool(b) => *b,
            Self::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
            Self::String(s) => !s.is_empty(),
            Self::Array(v) => !v.is_empty(),
            Self::Object(v) => !v.is_empty(),
        }
    }

    /// Parses JSON text, keeping key order.
    pub fn parse(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    fn insert(obj: &mut Vec<(String, Json)>, key: String, value: Json) {
        match obj.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => obj.push((key, value)),
        }
    }
}

impl From<&str> for Json {
    fn from(s: &str) -> Self {
        Self::String(s.to_owned())
    }
}

impl From<bool> for Json {
    fn from(b: bool) -> Self {
        Self::Bool(b)
    }
}

/// Written back with the keys in their order (a body for the engine's
/// `/tokenize` must print as the client's would).
impl Serialize for Json {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Null => s.serialize_unit(),
            Self::Bool(b) => s.serialize_bool(*b),
            Self::Number(n) => n.serialize(s),
            Self::String(v) => s.serialize_str(v),
            Self::Array(v) => {
                let mut seq = s.serialize_seq(Some(v.len()))?;
                for item in v {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Self::Object(o) => {
                let mut map = s.serialize_map(Some(o.len()))?;
                for (k, v) in o {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(JsonVisitor { depth: 0 })
    }
}

struct JsonVisitor {
    depth: usize,
}

impl<'de> de::DeserializeSeed<'de> for JsonVisitor {
    type Value = Json;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Json, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Json, E> {
        Ok(Json::Number(v.into()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Json, E> {
        Ok(Json::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Json, E> {
        serde_json::Number::from_f64(v)
            .map(Json::Number)
            .ok_or_else(|| E::custom("a number JSON cannot hold"))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Json, E> {
        Ok(Json::String(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Json, E> {
        Ok(Json::String(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let depth = self.depth + 1;
        if depth > MAX_DEPTH {
            return Err(de::Error::custom("JSON nested too deeply"));
        }
        let mut v = Vec::new();
        while let Some(item) = seq.next_element_seed(JsonVisitor { depth })? {
            v.push(item);
        }
        Ok(Json::Array(v))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let depth = self.depth + 1;
        if depth > MAX_DEPTH {
            return Err(de::Error::custom("JSON nested too deeply"));
        }
        let mut obj = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value_seed(JsonVisitor { depth })?;
            Json::insert(&mut obj, key, value);
        }
        Ok(Json::Object(obj))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn keeps_key_order_and_python_duplicates() {
        let j = Json::parse(r#"{"z":1,"a":[true,null,"s",1.5],"z":2}"#).unwrap();
        let keys: Vec<&str> = j
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(keys, ["z", "a"]);
        assert_eq!(j.get("z"), Some(&Json::Number(2.into())));
        assert!(!Json::parse("{}").unwrap().truthy());
        assert!(Json::parse(r#""x""#).unwrap().truthy());
    }

    #[test]
    fn writes_back_in_order() {
        let text = r#"{"z":1,"a":{"y":[true,null,"s",1.5],"b":-2}}"#;
        let j = Json::parse(text).unwrap();
        assert_eq!(serde_json::to_string(&j).unwrap(), text);
    }

    #[test]
    fn refuses_deep_nesting() {
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert!(Json::parse(&deep).is_err());
        let ok = "[".repeat(10) + &"]".repeat(10);
        assert!(Json::parse(&ok).is_ok());
    }
}
