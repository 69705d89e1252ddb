//! Messages of the local API (version 1).
//!
//! A request is one JSON object: `{"v": 1, "id": N, "deadline_ms": D?, "op": "...", ...fields}`.
//! The reply echoes `v` and `id` with `"ok": true` and the op's result fields, or `"ok": false`
//! and `"error": {"code", "message", "retryable"}`. Ops and fields (unknown fields are refused):
//!
//! | op | fields | result |
//! |---|---|---|
//! | `hello` | | `agent_id`, `address`, `caps`, `version` |
//! | `register` | `name`, `layout {block_bytes, layers, blocks}` + one memfd (SCM_RIGHTS) | `region`, `bytes` |
//! | `register_gpu` | `name`, `layout`, `device`, `ipc_handle` (128 hex digits: a CUDA IPC handle) | `region`, `bytes` (`cuda_unavailable` without CUDA) |
//! | `unregister` | `region` | |
//! | `reserve` | `region`, `transfer`, `blocks` (count) | `blocks` (ids) |
//! | `send` | `region`, `transfer`, `blocks` (ids), `peer`, `dst_region?` | `path`, `reason`, `bytes`, `micros` |
//! | `wait` | `transfer`, `region?` | `region`, `blocks` |
//! | `free` | `region`, `transfer` | |
//! | `status` | | `agent_id`, `address`, `caps`, `regions`, `leases`, `incoming` |

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::local::wire::VERSION;
use crate::transfer::SendArgs;
use crate::types::{BlockLayout, TransferId};

/// A request's operation.
#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Who is the agent.
    Hello {},
    /// Register the memfd sent with this frame.
    Register {
        /// Region name (unique on the agent).
        name: String,
        /// Block layout.
        layout: BlockLayout,
    },
    /// Register GPU memory an engine exported with `cudaIpcGetMemHandle` (feature `cuda`).
    RegisterGpu {
        /// Region name (unique on the agent).
        name: String,
        /// Block layout of the buffer.
        layout: BlockLayout,
        /// CUDA device ordinal the buffer lives on.
        device: i32,
        /// The 64-byte IPC handle as 128 hex digits.
        ipc_handle: String,
    },
    /// Unregister a region.
    Unregister {
        /// Region id.
        region: u64,
    },
    /// Reserve blocks for a transfer.
    Reserve {
        /// Region id.
        region: u64,
        /// Transfer id.
        transfer: TransferId,
        /// Number of blocks.
        blocks: u32,
    },
    /// Send blocks to a peer (or to this node).
    Send(SendArgs),
    /// Wait for a transfer's blocks to arrive.
    Wait {
        /// Transfer id.
        transfer: TransferId,
        /// Region id, if the client knows where they land.
        #[serde(default)]
        region: Option<u64>,
    },
    /// Free a transfer's blocks.
    Free {
        /// Region id.
        region: u64,
        /// Transfer id.
        transfer: TransferId,
    },
    /// Regions, leases, transfers.
    Status {},
}

/// A parsed request with its envelope.
#[derive(Debug)]
pub struct Envelope {
    /// Client's request id, echoed in the reply.
    pub id: u64,
    /// Deadline the client asked for.
    pub deadline_ms: Option<u64>,
    /// The operation.
    pub req: Request,
}

/// Parse a frame. On error, also return the id if one could be read, for the reply.
pub fn parse(frame: &[u8]) -> std::result::Result<Envelope, (u64, Error)> {
    let value: Value = serde_json::from_slice(frame)
        .map_err(|e| (0, Error::BadRequest(format!("not JSON: {e}"))))?;
    let Value::Object(mut obj) = value else {
        return Err((0, Error::BadRequest("a request is a JSON object".into())));
    };
    let id = obj.remove("id").and_then(|v| v.as_u64()).unwrap_or(0);
    let v = obj.remove("v").and_then(|v| v.as_u64());
    match v {
        Some(v) if v == u64::from(VERSION) => {}
        Some(v) => {
            return Err((
                id,
                Error::UnsupportedVersion {
                    got: u32::try_from(v).unwrap_or(u32::MAX),
                    want: VERSION,
                },
            ));
        }
        None => {
            return Err((
                id,
                Error::BadRequest("missing \"v\" (the API version)".into()),
            ))
        }
    }
    let deadline_ms = match obj.remove("deadline_ms") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| {
            (
                id,
                Error::BadRequest("deadline_ms must be an integer".into()),
            )
        })?),
    };
    let req = serde_json::from_value(Value::Object(obj))
        .map_err(|e| (id, Error::BadRequest(e.to_string())))?;
    Ok(Envelope {
        id,
        deadline_ms,
        req,
    })
}

/// Build a success reply.
pub fn ok_reply(id: u64, result: Value) -> Vec<u8> {
    let mut obj = match result {
        Value::Object(m) => m,
        _ => Map::new(),
    };
    obj.insert("v".into(), VERSION.into());
    obj.insert("id".into(), id.into());
    obj.insert("ok".into(), true.into());
    serde_json::to_vec(&Value::Object(obj)).unwrap_or_default()
}

/// Build an error reply.
pub fn err_reply(id: u64, e: &Error) -> Vec<u8> {
    let body = serde_json::json!({
        "v": VERSION, "id": id, "ok": false,
        "error": {"code": e.code(), "message": e.to_string(), "retryable": e.code().retryable()},
    });
    serde_json::to_vec(&body).unwrap_or_default()
}

/// Read a reply (client side): the result object, or the agent's error.
pub fn read_reply(frame: &[u8], want_id: u64) -> Result<Map<String, Value>> {
    let value: Value =
        serde_json::from_slice(frame).map_err(|e| Error::Protocol(format!("bad reply: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(Error::Protocol("reply is not an object".into()));
    };
    let id = obj.get("id").and_then(Value::as_u64).unwrap_or(0);
    if obj.get("ok").and_then(Value::as_bool) == Some(true) {
        if id != want_id {
            return Err(Error::Protocol(format!(
                "reply id {id}, expected {want_id}"
            )));
        }
        return Ok(obj);
    }
    let err = obj.get("error").cloned().unwrap_or_default();
    let code = serde_json::from_value(err.get("code").cloned().unwrap_or_default())
        .map_err(|_| Error::Protocol("error reply without a known code".into()))?;
    let message = err
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    Err(Error::remote(code, message))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::error::ErrorCode;

    #[test]
    fn parses_requests_and_names_what_is_wrong() {
        let env = parse(br#"{"v":1,"id":7,"op":"reserve","region":1,"transfer":"r1","blocks":2}"#)
            .unwrap();
        assert_eq!(env.id, 7);
        assert!(matches!(env.req, Request::Reserve { blocks: 2, .. }));
        let (id, e) = parse(br#"{"v":2,"id":3,"op":"status"}"#).unwrap_err();
        assert_eq!((id, e.code()), (3, ErrorCode::UnsupportedVersion));
        let (_, e) = parse(br#"{"v":1,"id":3,"op":"status","extra":1}"#).unwrap_err();
        assert_eq!(e.code(), ErrorCode::BadRequest);
        let env = parse(
            format!(
                r#"{{"v":1,"id":8,"op":"register_gpu","name":"g","layout":{{"block_bytes":4096,"layers":2,"blocks":8}},"device":0,"ipc_handle":"{}"}}"#,
                "0f".repeat(64)
            )
            .as_bytes(),
        )
        .unwrap();
        assert!(
            matches!(&env.req, Request::RegisterGpu { device: 0, ipc_handle, .. } if ipc_handle.len() == 128),
            "{:?}",
            env.req
        );
        let (_, e) = parse(br#"{"v":1,"id":9,"op":"register_gpu","name":"g"}"#).unwrap_err();
        assert_eq!(e.code(), ErrorCode::BadRequest, "{e}");
        let (_, e) = parse(b"\xff\x00garbage").unwrap_err();
        assert!(e.to_string().contains("not JSON"), "{e}");
        let (_, e) = parse(br#"{"id":1,"op":"status"}"#).unwrap_err();
        assert!(e.to_string().contains("missing \"v\""));
    }

    #[test]
    fn replies_round_trip_through_the_client_reader() {
        let ok = ok_reply(5, serde_json::json!({"blocks": [1, 2]}));
        assert_eq!(
            read_reply(&ok, 5).unwrap()["blocks"],
            serde_json::json!([1, 2])
        );
        let e = Error::NoRoom {
            region: "d".into(),
            wanted: 4,
            free: 1,
        };
        let err = read_reply(&err_reply(5, &e), 5).unwrap_err();
        assert_eq!(err.code(), ErrorCode::NoRoom);
        assert!(err.to_string().contains("4 blocks wanted"), "{err}");
    }
}
