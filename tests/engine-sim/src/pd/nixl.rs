//! vLLM NixlConnector across engines: a decode engine's fetch of the blocks a
//! prefill engine holds, and the side channel the prefill engine serves.
//!
//! In vLLM the decoder handshakes with the prefill engine over a ZMQ side
//! channel (`VLLM_NIXL_SIDE_CHANNEL_HOST:PORT`, reported as `remote_host` and
//! `remote_port`), reads the blocks by RDMA, then notifies the prefill engine,
//! which frees them. The simulator folds handshake, read and notification into
//! one call, `POST /kvmesh-sim/nixl/fetch` with the engine id and request id,
//! served on the prefill engine's own HTTP server rather than on a listener of
//! its own, because:
//! - there is no second port to allocate, configure and expose per engine (the
//!   demo runs many engines in one process, where a fixed 5600 would collide),
//!   and `remote_port` defaults to the HTTP port (`SimConfig::side_channel_port`);
//! - the HTTP server already has what the side channel needs: faults (an engine
//!   that refuses connections refuses its side channel too, as a dead pod
//!   would), recording of what it received, and shutdown with the engine.
//!
//! The price is a side channel on the API's port, which vLLM does not have;
//! nothing but a decode engine reads `remote_port`.
//!
//! The transfer's duration is the decode profile's `transfer_seconds`, paid in
//! simulated time by the core (`KvMode::ReceiveKv`); the fetch's own real round
//! trip is not simulated time. The fetch is bounded by
//! `SimConfig::side_channel_timeout`; a failed one recomputes the prompt and
//! counts `vllm:nixl_num_failed_transfers`, as vLLM with its default
//! `kv_load_failure_policy` (recompute) does.

use serde_json::{json, Value};
use tokio::time::Instant;

use super::client;
use crate::config::Flavor;
use crate::core::KvMode;
use crate::faults::Verdict;
use crate::http::{json_response, Reply, Shared};

/// Where a prefill engine serves the side channel.
pub(crate) const FETCH_PATH: &str = "/kvmesh-sim/nixl/fetch";

/// The parts of a decode request's `kv_transfer_params` that name a transfer.
#[derive(Debug, PartialEq, Eq)]
struct Remote<'a> {
    engine_id: &'a str,
    request_id: &'a str,
    host: &'a str,
    port: u16,
}

/// vLLM's `update_state_after_alloc`: `remote_block_ids` plus all of the
/// engine id, request id, host and port, or the parameters are invalid.
fn remote(p: &Value) -> Option<Remote<'_>> {
    if p.get("remote_block_ids").is_none_or(Value::is_null) {
        return None;
    }
    Some(Remote {
        engine_id: p.get("remote_engine_id")?.as_str()?,
        request_id: p.get("remote_request_id")?.as_str()?,
        host: p.get("remote_host")?.as_str()?,
        port: u16::try_from(p.get("remote_port")?.as_u64()?).ok()?,
    })
}

/// Decode side: [`KvMode::ReceiveKv`] when the transfer the parameters name
/// was fetched (the prefill engine then frees its blocks), [`KvMode::Local`]
/// (recompute) otherwise.
pub(crate) async fn pull(shared: &Shared, params: Option<&Value>) -> KvMode {
    let Some(r) = params.and_then(remote) else {
        // vLLM logs "Got invalid KVTransferParams" and computes locally.
        return KvMode::Local;
    };
    if shared.cfg.pd_in_process && super::fetch(r.engine_id, r.request_id).is_some() {
        return KvMode::ReceiveKv;
    }
    match fetch_remote(shared, &r).await {
        Ok(()) => KvMode::ReceiveKv,
        Err(reason) => {
            tracing::warn!(
                engine_id = r.engine_id,
                request_id = r.request_id,
                %reason,
                "KV transfer failed: recomputing the prompt"
            );
            shared.metrics.lock().nixl_failed_transfers += 1;
            KvMode::Local
        }
    }
}

async fn fetch_remote(shared: &Shared, r: &Remote<'_>) -> Result<(), String> {
    let deadline = Instant::now() + shared.cfg.side_channel_timeout;
    let body = json!({ "engine_id": r.engine_id, "request_id": r.request_id });
    match client::post_json(r.host, r.port, FETCH_PATH, &body, deadline).await {
        Ok((200, _)) => Ok(()),
        Ok((status, reply)) => Err(format!(
            "{}:{} answered {status}: {}",
            r.host,
            r.port,
            reply.get("error").and_then(Value::as_str).unwrap_or("")
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// Prefill side: `POST /kvmesh-sim/nixl/fetch` with `{"engine_id",
/// "request_id"}`. 200 with the transfer's prompt tokens when this engine held
/// it (its blocks are freed now); 404 when the engine id is not this engine's,
/// or the transfer is unknown, expired or already fetched.
pub(crate) fn serve_fetch(shared: &Shared, body: &[u8]) -> Reply {
    let none = Verdict::default();
    let reply = |status: u16, v: Value| json_response(status, &v, &none);
    if shared.cfg.flavor != Flavor::Vllm {
        return reply(404, json!({ "error": "not a NixlConnector engine" }));
    }
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let (Some(engine_id), Some(request_id)) = (
        v.get("engine_id").and_then(Value::as_str),
        v.get("request_id").and_then(Value::as_str),
    ) else {
        return reply(
            400,
            json!({ "error": "engine_id and request_id are required" }),
        );
    };
    if engine_id != shared.engine_id {
        let msg = format!(
            "engine id mismatch: asked for {engine_id}, this engine is {}",
            shared.engine_id
        );
        return reply(404, json!({ "error": msg }));
    }
    match super::fetch(engine_id, request_id) {
        Some(tokens) => reply(
            200,
            json!({ "engine_id": engine_id, "request_id": request_id, "num_tokens": tokens }),
        ),
        None => reply(
            404,
            json!({ "error": format!("no held transfer {request_id} (unknown, expired or already fetched)") }),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_need_every_key_vllm_needs() {
        let full = json!({"remote_block_ids": [[1, 2]], "remote_engine_id": "e", "remote_request_id": "r",
                          "remote_host": "10.0.0.1", "remote_port": 8000});
        assert_eq!(
            remote(&full),
            Some(Remote {
                engine_id: "e",
                request_id: "r",
                host: "10.0.0.1",
                port: 8000
            })
        );
        for key in [
            "remote_block_ids",
            "remote_engine_id",
            "remote_request_id",
            "remote_host",
            "remote_port",
        ] {
            let mut p = full.clone();
            p[key] = Value::Null;
            assert_eq!(remote(&p), None, "{key} null");
        }
        let mut p = full;
        p["remote_port"] = json!(70_000);
        assert_eq!(remote(&p), None, "port out of range");
    }
}
