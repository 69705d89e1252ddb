//! The kvmesh KV connector (`kvagent/connector/kvmesh_connector.py`), as the
//! simulator speaks it: real bytes through the node's `kvmesh-kvagent`, so a
//! test sees KV cross the network between agents where a cluster puts them.
//!
//! * Prefill (the request's `kv_transfer_params` carry `kvmesh_transfer_id`
//!   and `kvmesh_dest_agent`): once the prompt is computed, the engine copies
//!   one staging block per prompt block (filled with a pattern derived from
//!   the transfer id) and asks its agent to send them to the destination
//!   agent, then answers with `{"kvmesh_transfer_id", "kvmesh_num_tokens"}`.
//!   The real connector sends after answering; the simulator sends first, so
//!   the blocks have landed (or the send failed) before decode starts.
//! * Decode (the transfer id and token count, no destination): the engine
//!   waits at its own agent for the transfer, checks the pattern and frees the
//!   blocks; the prompt then counts as received KV. A transfer that does not
//!   arrive within the deadline, or arrives with other bytes, is a failed
//!   load: the prompt is recomputed and `failed_kv_transfers` counts it, as
//!   the connector with `kv_load_failure_policy: recompute` does.
//!
//! The engine registers one staging region (a memfd of
//! `staging_blocks x block_bytes`, one layer) when it starts (again on the
//! next call should the agent's connection fail) and keeps its connection; calls are made one at a time (a test engine, not a fast one).

use std::sync::Arc;

use kvmesh_kvagent::shm::Mapping;
use kvmesh_kvagent::{BlockLayout, LocalClient, SendArgs, TransferId};
use parking_lot::Mutex;
use serde_json::{json, Value};

use crate::config::KvagentConfig;

/// What a request's `kv_transfer_params` ask of the kvagent connector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Leg {
    /// Prefill: send the prompt's blocks to `dest` (`host:port`).
    Send { transfer: String, dest: String },
    /// Decode: take the blocks of `transfer` from this node's agent.
    Receive { transfer: String },
}

impl Leg {
    /// The leg the parameters name, if they are the kvagent connector's.
    pub(crate) fn of(params: Option<&Value>) -> Option<Self> {
        let p = params?;
        let transfer = p.get("kvmesh_transfer_id")?.as_str()?.to_owned();
        match p.get("kvmesh_dest_agent").and_then(Value::as_str) {
            Some(dest) => Some(Leg::Send {
                transfer,
                dest: dest.to_owned(),
            }),
            None if p.get("kvmesh_num_tokens").is_some() => Some(Leg::Receive { transfer }),
            None => None,
        }
    }
}

/// The parameters a prefill answers with.
pub(crate) fn prefill_params(transfer: &str, prompt_tokens: usize) -> Value {
    json!({ "kvmesh_transfer_id": transfer, "kvmesh_num_tokens": prompt_tokens })
}

/// One engine's link to its node agent.
pub(crate) struct Link {
    cfg: KvagentConfig,
    conn: Mutex<Option<Conn>>,
}

struct Conn {
    client: LocalClient,
    region: u64,
    mem: Mapping,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("cfg", &self.cfg).finish()
    }
}

impl Link {
    pub(crate) fn new(cfg: KvagentConfig) -> Arc<Self> {
        Arc::new(Self {
            cfg,
            conn: Mutex::new(None),
        })
    }

    /// Connects and registers the staging region now, as the connector does
    /// when its worker starts: an agent lands arriving blocks only in a
    /// region registered before they arrive.
    pub(crate) async fn register(self: &Arc<Self>) -> Result<(), String> {
        let link = self.clone();
        tokio::task::spawn_blocking(move || link.with_conn(|_| Ok(())))
            .await
            .map_err(|e| e.to_string())?
    }

    /// Sends the blocks of a `prompt_tokens`-token prompt (`block_size` per
    /// block) to `dest`; the bytes sent, or why not.
    pub(crate) async fn send(
        self: &Arc<Self>,
        transfer: String,
        dest: String,
        prompt_tokens: usize,
        block_size: usize,
    ) -> Result<u64, String> {
        let link = self.clone();
        let blocks = prompt_tokens.div_ceil(block_size.max(1)).max(1);
        tokio::task::spawn_blocking(move || link.send_blocking(&transfer, &dest, blocks))
            .await
            .map_err(|e| e.to_string())?
    }

    /// Waits for `transfer` at this node's agent and checks its bytes.
    pub(crate) async fn receive(self: &Arc<Self>, transfer: String) -> Result<(), String> {
        let link = self.clone();
        tokio::task::spawn_blocking(move || link.receive_blocking(&transfer))
            .await
            .map_err(|e| e.to_string())?
    }

    fn send_blocking(&self, transfer: &str, dest: &str, blocks: usize) -> Result<u64, String> {
        let tid = TransferId::new(transfer).map_err(|e| e.to_string())?;
        let n = u32::try_from(blocks)
            .unwrap_or(u32::MAX)
            .min(self.cfg.staging_blocks);
        self.with_conn(|c| {
            let ids = c
                .client
                .reserve(c.region, &tid, n)
                .map_err(|e| e.to_string())?;
            let fill = vec![pattern(transfer); self.block_len()];
            for &b in &ids {
                c.mem
                    .write(self.offset(b), &fill)
                    .map_err(|e| e.to_string())?;
            }
            let args = SendArgs {
                region: c.region,
                transfer: tid.clone(),
                blocks: ids,
                peer: dest.to_owned(),
                dst_region: None,
            };
            let sent = c.client.send(&args, self.cfg.deadline);
            let freed = c.client.free(c.region, &tid);
            let report = sent.map_err(|e| format!("send to {dest}: {e}"))?;
            freed.map_err(|e| e.to_string())?;
            Ok(report.bytes)
        })
    }

    fn receive_blocking(&self, transfer: &str) -> Result<(), String> {
        let tid = TransferId::new(transfer).map_err(|e| e.to_string())?;
        self.with_conn(|c| {
            let got = c
                .client
                .wait(Some(c.region), &tid, self.cfg.deadline)
                .map_err(|e| format!("wait: {e}"))?;
            let want = pattern(transfer);
            let mut seen = vec![0u8; self.block_len()];
            let mut checked = Ok(());
            if got.region == c.region {
                for &b in &got.blocks {
                    c.mem
                        .read(self.offset(b), &mut seen)
                        .map_err(|e| e.to_string())?;
                    if seen.iter().any(|&x| x != want) {
                        checked = Err(format!("block {b} arrived with other bytes"));
                        break;
                    }
                }
            }
            c.client.free(got.region, &tid).map_err(|e| e.to_string())?;
            checked
        })
    }

    fn block_len(&self) -> usize {
        usize::try_from(self.cfg.block_bytes).unwrap_or(usize::MAX)
    }

    fn offset(&self, block: u32) -> usize {
        self.block_len().saturating_mul(block as usize)
    }

    /// Runs `f` on the connection, connecting and registering the staging
    /// region first if needed; a failed call drops the connection (and with
    /// it the region), so the next call starts afresh.
    fn with_conn<T>(&self, f: impl FnOnce(&mut Conn) -> Result<T, String>) -> Result<T, String> {
        let mut guard = self.conn.lock();
        if guard.is_none() {
            *guard = Some(self.connect()?);
        }
        let Some(conn) = guard.as_mut() else {
            return Err("no agent connection".to_owned());
        };
        let out = f(conn);
        if out.is_err() {
            *guard = None;
        }
        out
    }

    fn connect(&self) -> Result<Conn, String> {
        let layout = BlockLayout {
            block_bytes: self.cfg.block_bytes,
            layers: 1,
            blocks: self.cfg.staging_blocks,
        };
        let len = self
            .block_len()
            .saturating_mul(self.cfg.staging_blocks as usize);
        let mem = Mapping::create("kvmesh-engine-sim", len).map_err(|e| e.to_string())?;
        let mut client = LocalClient::connect(&self.cfg.socket, self.cfg.deadline)
            .map_err(|e| format!("agent socket {}: {e}", self.cfg.socket.display()))?;
        let region = client
            .register("engine-sim", layout, mem.fd())
            .map_err(|e| e.to_string())?;
        Ok(Conn {
            client,
            region,
            mem,
        })
    }
}

/// The byte a transfer's blocks are filled with (never 0, the memfd's fill).
fn pattern(transfer: &str) -> u8 {
    let h = transfer.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    (h % 255) as u8 + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_name_the_leg() {
        let send = json!({"do_remote_decode": true, "kvmesh_transfer_id": "t", "kvmesh_dest_agent": "10.0.0.2:7600"});
        assert_eq!(
            Leg::of(Some(&send)),
            Some(Leg::Send {
                transfer: "t".into(),
                dest: "10.0.0.2:7600".into()
            })
        );
        let recv = prefill_params("t", 40);
        assert_eq!(
            Leg::of(Some(&recv)),
            Some(Leg::Receive {
                transfer: "t".into()
            })
        );
        assert_eq!(Leg::of(Some(&json!({"kvmesh_transfer_id": "t"}))), None);
        assert_eq!(Leg::of(Some(&json!({"remote_engine_id": "e"}))), None);
        assert_eq!(Leg::of(None), None);
    }

    #[test]
    fn pattern_is_never_zero() {
        assert!((0..1000).all(|i| pattern(&format!("t{i}")) != 0));
    }
}
