//! The request bodies of the P/D legs, derived from the client's body.
//!
//! These are the only places where kvmesh re-serializes a client's JSON: each
//! leg must carry fields the client did not send (docs/wire-formats.md §4).

use bytes::Bytes;
use serde_json::{json, Map, Value};

use crate::error::ProxyError;

/// Token-limit fields a prefill leg caps at one token (llm-d's sidecar set).
const TOKEN_LIMITS: [&str; 3] = ["max_tokens", "max_completion_tokens", "min_tokens"];

/// The client's body as a JSON object.
pub fn object(body: &[u8]) -> Result<Map<String, Value>, ProxyError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ProxyError::Internal(
            "a P/D request body is not a JSON object".to_owned(),
        )),
        Err(source) => Err(ProxyError::MalformedJson {
            route: "P/D",
            source,
        }),
    }
}

fn bytes(obj: Map<String, Value>) -> Result<Bytes, ProxyError> {
    serde_json::to_vec(&Value::Object(obj))
        .map(Bytes::from)
        .map_err(|e| ProxyError::Internal(format!("serializing a P/D leg body: {e}")))
}

/// The prefill leg of the two-leg protocol (vLLM `NixlConnector`, and the
/// kvagent connector with its `extra` parameters): `do_remote_decode`, no
/// streaming, every token limit at 1.
pub fn prefill_leg(
    client: &Map<String, Value>,
    path: &str,
    extra: &Map<String, Value>,
) -> Result<Bytes, ProxyError> {
    let mut obj = client.clone();
    let mut params = json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    });
    if let Value::Object(p) = &mut params {
        p.extend(extra.clone());
    }
    obj.insert("kv_transfer_params".to_owned(), params);
    obj.insert("stream".to_owned(), Value::Bool(false));
    obj.remove("stream_options");
    if path == "/v1/responses" {
        obj.insert("max_output_tokens".to_owned(), json!(1));
    } else {
        obj.insert("max_tokens".to_owned(), json!(1));
        for field in TOKEN_LIMITS.iter().skip(1) {
            if obj.contains_key(*field) {
                obj.insert((*field).to_owned(), json!(1));
            }
        }
    }
    bytes(obj)
}

/// The decode leg: the client's body with the `kv_transfer_params` prefill
/// returned, verbatim; without them (prefill sent none), the client's body
/// without any, so decode computes the prompt itself.
pub fn decode_leg(
    client: &Map<String, Value>,
    params: Option<&Value>,
) -> Result<Bytes, ProxyError> {
    let mut obj = client.clone();
    match params {
        Some(p) => obj.insert("kv_transfer_params".to_owned(), p.clone()),
        None => obj.remove("kv_transfer_params"),
    };
    bytes(obj)
}

/// SGLang's body for both legs: the client's body plus the bootstrap fields;
/// arrays of `n` distinct rooms when the request asks for `n > 1` choices.
pub fn sglang_legs(
    client: &Map<String, Value>,
    host: &str,
    port: u16,
    rooms: &[u64],
) -> Result<Bytes, ProxyError> {
    let mut obj = client.clone();
    if let [room] = rooms {
        obj.insert("bootstrap_host".to_owned(), json!(host));
        obj.insert("bootstrap_port".to_owned(), json!(port));
        obj.insert("bootstrap_room".to_owned(), json!(room));
    } else {
        obj.insert("bootstrap_host".to_owned(), json!(vec![host; rooms.len()]));
        obj.insert("bootstrap_port".to_owned(), json!(vec![port; rooms.len()]));
        obj.insert("bootstrap_room".to_owned(), json!(rooms));
    }
    bytes(obj)
}

/// How many bootstrap rooms a request needs (`n`, at least 1, at most 128).
pub fn rooms_needed(client: &Map<String, Value>) -> usize {
    client
        .get("n")
        .and_then(Value::as_u64)
        .map_or(1, |n| n.clamp(1, 128) as usize)
}

/// The `kv_transfer_params` of a prefill response, if it carries any.
pub fn transfer_params(response: &[u8]) -> Option<Value> {
    let v: Value = serde_json::from_slice(response).ok()?;
    match v.get("kv_transfer_params")? {
        Value::Null => None,
        p => Some(p.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client() -> Map<String, Value> {
        object(br#"{"model":"m","prompt":"hi","stream":true,"stream_options":{"include_usage":true},"max_tokens":64,"min_tokens":4,"max_completion_tokens":64}"#).unwrap()
    }

    #[test]
    fn prefill_leg_caps_every_limit_and_stops_streaming() {
        let b = prefill_leg(&client(), "/v1/completions", &Map::new()).unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["stream"], false);
        assert!(v.get("stream_options").is_none());
        for f in TOKEN_LIMITS {
            assert_eq!(v[f], 1, "{f}");
        }
        assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], false);
        assert_eq!(v["prompt"], "hi");
    }

    #[test]
    fn prefill_leg_does_not_invent_limits_the_client_did_not_send() {
        let c = object(br#"{"model":"m","messages":[]}"#).unwrap();
        let v: Value =
            serde_json::from_slice(&prefill_leg(&c, "/v1/chat/completions", &Map::new()).unwrap())
                .unwrap();
        assert_eq!(v["max_tokens"], 1);
        assert!(v.get("min_tokens").is_none());
        assert!(v.get("max_completion_tokens").is_none());
        let r: Value =
            serde_json::from_slice(&prefill_leg(&c, "/v1/responses", &Map::new()).unwrap())
                .unwrap();
        assert_eq!(r["max_output_tokens"], 1);
    }

    #[test]
    fn decode_leg_is_the_client_body_plus_the_params_verbatim() {
        let params =
            json!({"remote_block_ids": [[1, 2]], "remote_engine_id": "e", "odd": {"x": 1}});
        let v: Value =
            serde_json::from_slice(&decode_leg(&client(), Some(&params)).unwrap()).unwrap();
        assert_eq!(v["kv_transfer_params"], params);
        assert_eq!(v["stream"], true);
        assert_eq!(v["max_tokens"], 64);
        assert_eq!(v["stream_options"]["include_usage"], true);
        let none: Value = serde_json::from_slice(&decode_leg(&client(), None).unwrap()).unwrap();
        assert!(none.get("kv_transfer_params").is_none());
    }

    #[test]
    fn sglang_fields_are_scalars_or_arrays_for_n() {
        let one: Value =
            serde_json::from_slice(&sglang_legs(&client(), "10.0.0.9", 8998, &[7]).unwrap())
                .unwrap();
        assert_eq!(
            (
                one["bootstrap_host"].clone(),
                one["bootstrap_port"].clone(),
                one["bootstrap_room"].clone()
            ),
            (json!("10.0.0.9"), json!(8998), json!(7))
        );
        let c = object(br#"{"model":"m","prompt":"p","n":3}"#).unwrap();
        assert_eq!(rooms_needed(&c), 3);
        let many: Value =
            serde_json::from_slice(&sglang_legs(&c, "h", 1, &[1, 2, 3]).unwrap()).unwrap();
        assert_eq!(many["bootstrap_room"], json!([1, 2, 3]));
        assert_eq!(many["bootstrap_host"], json!(["h", "h", "h"]));
    }

    #[test]
    fn transfer_params_are_found_or_absent() {
        assert_eq!(
            transfer_params(br#"{"kv_transfer_params":{"a":1}}"#),
            Some(json!({"a":1}))
        );
        assert_eq!(transfer_params(br#"{"kv_transfer_params":null}"#), None);
        assert_eq!(transfer_params(br#"{"choices":[]}"#), None);
        assert_eq!(transfer_params(b"not json"), None);
    }
}
