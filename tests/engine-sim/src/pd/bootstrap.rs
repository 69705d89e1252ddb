//! SGLang P/D across engines: the bootstrap endpoint a prefill engine serves,
//! and the decode half that reaches it.
//!
//! In SGLang the prefill engine runs a bootstrap server
//! (`--disaggregation-bootstrap-port`); the decode half asks it where the
//! prefill engine is, registers its room with the prefill engine, and waits
//! for the KV. The simulator folds that into one long-polled call,
//! `POST /kvmesh-sim/sglang/bootstrap` with `{"room", "wait_ms"}`, on the
//! prefill engine's HTTP server (for the reasons `nixl.rs` gives): it marks
//! the decode half of the room as arrived in the prefill engine's process and
//! answers once the prefill half has finished (200), or when the wait is over
//! (504). So the request's `bootstrap_port` names the prefill engine's HTTP
//! port, as kvmesh's `pd.sglang_bootstrap_port` does in the tests.
//!
//! The decode half always goes through the endpoint, even to an engine in the
//! same process (a loopback call): the room map lives with the prefill engine,
//! and a decode given a wrong address must fail as SGLang's would.

use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::Instant;

use super::client::{self, SideError};
use super::Half;
use crate::config::{Flavor, Role};
use crate::faults::Verdict;
use crate::http::{json_response, Reply, Shared};

/// Where a prefill engine serves bootstrap.
pub(crate) const BOOTSTRAP_PATH: &str = "/kvmesh-sim/sglang/bootstrap";

/// Time allowed past the wait for the prefill engine's answer to come back.
const GRACE: Duration = Duration::from_secs(2);

/// The decode half's bootstrap fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Bootstrap {
    pub host: String,
    pub port: u16,
    pub room: u64,
}

impl Bootstrap {
    /// `bootstrap_host`, `bootstrap_port` (null: `default_port`, as SGLang
    /// falls back to its default) and `bootstrap_room` of a request body.
    pub fn from_body(body: &Value, default_port: u16) -> Option<Self> {
        let port = match body.get("bootstrap_port") {
            None | Some(Value::Null) => default_port,
            Some(p) => u16::try_from(p.as_u64()?).ok()?,
        };
        Some(Self {
            host: body.get("bootstrap_host")?.as_str()?.to_string(),
            port,
            room: body.get("bootstrap_room")?.as_u64()?,
        })
    }
}

/// SGLang's message for a half left alone past the bootstrap timeout.
pub(crate) fn timed_out(shared: &Shared, room: u64) -> String {
    format!(
        "KVTransferError(bootstrap_room={room}): Request {room} timed out after {:.1}s in KVPoll.Bootstrapping",
        shared.cfg.bootstrap_timeout_s
    )
}

/// Decode half: waits, at most the bootstrap timeout, until the prefill half
/// of its room has finished on the engine at `b.host:b.port`. The error is
/// SGLang's `KVTransferError` text.
pub(crate) async fn join(shared: &Shared, b: &Bootstrap) -> Result<(), String> {
    let wait = shared.clock.real_duration(shared.cfg.bootstrap_timeout_s);
    let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
    let body = json!({ "room": b.room, "wait_ms": wait_ms });
    let deadline = Instant::now() + wait + GRACE;
    let room = b.room;
    match client::post_json(&b.host, b.port, BOOTSTRAP_PATH, &body, deadline).await {
        Ok((200, _)) => Ok(()),
        Ok((504, _)) | Err(SideError::Timeout { .. }) => Err(timed_out(shared, room)),
        Ok((status, reply)) => Err(format!(
            "KVTransferError(bootstrap_room={room}): the bootstrap server at {}:{} answered {status}: {}",
            b.host,
            b.port,
            reply.get("error").and_then(Value::as_str).unwrap_or("")
        )),
        Err(SideError::Unreachable { addr, .. }) => Err(format!(
            "KVTransferError(bootstrap_room={room}): Could not fetch prefill parallel info from bootstrap_addr: {addr}"
        )),
        Err(e) => Err(format!("KVTransferError(bootstrap_room={room}): {e}")),
    }
}

/// Prefill side: `POST /kvmesh-sim/sglang/bootstrap` with `{"room",
/// "wait_ms"}`. Marks the decode half of `room` as arrived and answers 200 once
/// the prefill half finished, or 504 after `wait_ms` (at most this engine's own
/// bootstrap timeout). Only an SGLang prefill engine serves it (404 otherwise).
pub(crate) async fn serve(shared: &Shared, body: &[u8]) -> Reply {
    let none = Verdict::default();
    let reply = |status: u16, v: Value| json_response(status, &v, &none);
    if shared.cfg.flavor != Flavor::Sglang || shared.cfg.role != Role::Prefill {
        return reply(404, json!({ "error": "not an SGLang prefill engine" }));
    }
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let Some(room) = v.get("room").and_then(Value::as_u64) else {
        return reply(400, json!({ "error": "room is required" }));
    };
    let own = shared.clock.real_duration(shared.cfg.bootstrap_timeout_s);
    let wait = v
        .get("wait_ms")
        .and_then(Value::as_u64)
        .map_or(own, |ms| own.min(Duration::from_millis(ms)));
    if super::rendezvous(room, Half::Decode, wait).await {
        reply(200, json!({ "room": room }))
    } else {
        reply(504, json!({ "error": timed_out(shared, room) }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootstrap_fields_of_a_body() {
        let b = json!({"bootstrap_host": "10.0.0.2", "bootstrap_port": 8998, "bootstrap_room": 7});
        assert_eq!(
            Bootstrap::from_body(&b, 1),
            Some(Bootstrap {
                host: "10.0.0.2".into(),
                port: 8998,
                room: 7
            })
        );
        let null_port = json!({"bootstrap_host": "h", "bootstrap_port": null, "bootstrap_room": 7});
        assert_eq!(
            Bootstrap::from_body(&null_port, 8998).map(|b| b.port),
            Some(8998)
        );
        assert_eq!(
            Bootstrap::from_body(&json!({"bootstrap_room": 7}), 8998),
            None
        );
    }
}
