//! A blocking client of the local API, for engine connectors written in Rust, the proxy's
//! `kvagent` P/D connector, the benchmark and the tests.
//!
//! One call at a time per client; open one client per concurrent call. Every call has a deadline:
//! the agent enforces it and the socket read waits at most that long plus a small margin.

use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::error::{Error, Result};
use crate::local::msg::read_reply;
use crate::local::wire::{self, MAX_FRAME, VERSION};
use crate::transfer::{SendArgs, SendReport};
use crate::types::{BlockLayout, TransferId};

/// Slack on top of a call's deadline before the client gives up reading the reply.
const MARGIN: Duration = Duration::from_secs(2);

/// Who the agent is (the `hello` reply).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AgentInfo {
    /// Agent id.
    pub agent_id: String,
    /// Address peers (and the `peer` field of a send) use for it.
    pub address: String,
    /// Capabilities.
    pub caps: Vec<String>,
    /// Local API version.
    pub version: u32,
}

/// Where a transfer's blocks arrived.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arrival {
    /// Region id.
    pub region: u64,
    /// Block ids, in transfer order.
    pub blocks: Vec<u32>,
}

/// The agent's `status` reply.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    /// Agent id.
    pub agent_id: String,
    /// Address.
    pub address: String,
    /// Capabilities.
    pub caps: Vec<String>,
    /// Regions with their free blocks.
    pub regions: Vec<RegionInfo>,
    /// Leases held.
    pub leases: usize,
    /// Transfers being received.
    pub incoming: usize,
}

/// One region in a status.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RegionInfo {
    /// Id.
    pub id: u64,
    /// Name.
    pub name: String,
    /// Layout.
    pub layout: BlockLayout,
    /// Free blocks.
    pub free_blocks: u32,
}

/// A connection to the local agent.
#[derive(Debug)]
pub struct LocalClient {
    stream: UnixStream,
    next_id: u64,
    deadline: Duration,
}

impl LocalClient {
    /// Connect; `deadline` is the default deadline of each call.
    pub fn connect(path: impl AsRef<Path>, deadline: Duration) -> Result<Self> {
        let stream = UnixStream::connect(path)?;
        stream.set_write_timeout(Some(deadline + MARGIN))?;
        Ok(Self {
            stream,
            next_id: 1,
            deadline,
        })
    }

    /// Send one raw request object (adds `v`, `id`, `deadline_ms`) and return the result fields.
    pub fn call(
        &mut self,
        mut req: Map<String, Value>,
        fd: Option<BorrowedFd<'_>>,
        deadline: Option<Duration>,
    ) -> Result<Map<String, Value>> {
        let deadline = deadline.unwrap_or(self.deadline);
        let id = self.next_id;
        self.next_id += 1;
        req.insert("v".into(), VERSION.into());
        req.insert("id".into(), id.into());
        req.insert("deadline_ms".into(), (deadline.as_millis() as u64).into());
        let body = serde_json::to_vec(&Value::Object(req))
            .map_err(|e| Error::BadRequest(e.to_string()))?;
        let frame = wire::encode(&body);
        match fd {
            Some(fd) => {
                let n = wire::send_with_fd(self.stream.as_fd(), &frame, fd)?;
                self.stream.write_all(&frame[n..])?;
            }
            None => self.stream.write_all(&frame)?,
        }
        self.stream.set_read_timeout(Some(deadline + MARGIN))?;
        let mut len = [0u8; 4];
        self.stream.read_exact(&mut len).map_err(timeout_or_io)?;
        let len = u32::from_be_bytes(len) as usize;
        if len > MAX_FRAME {
            return Err(Error::Protocol(format!("reply of {len} bytes")));
        }
        let mut buf = vec![0u8; len];
        self.stream.read_exact(&mut buf).map_err(timeout_or_io)?;
        read_reply(&buf, id)
    }

    fn op(&mut self, v: Value, deadline: Option<Duration>) -> Result<Map<String, Value>> {
        let Value::Object(m) = v else {
            return Err(Error::BadRequest("request must be an object".into()));
        };
        self.call(m, None, deadline)
    }

    /// Who the agent is.
    pub fn hello(&mut self) -> Result<AgentInfo> {
        decode(self.op(json!({"op": "hello"}), None)?)
    }

    /// Register the memfd `fd` (sealed with `F_SEAL_SHRINK`) with `layout`; returns the region id.
    pub fn register(&mut self, name: &str, layout: BlockLayout, fd: BorrowedFd<'_>) -> Result<u64> {
        let Value::Object(m) = json!({"op": "register", "name": name, "layout": layout}) else {
            return Err(Error::BadRequest("unreachable".into()));
        };
        let r = self.call(m, Some(fd), None)?;
        r.get("region")
            .and_then(Value::as_u64)
            .ok_or_else(|| Error::Protocol("no region in reply".into()))
    }

    /// Register GPU memory from a CUDA IPC handle (`cudaIpcGetMemHandle`'s 64 bytes) on `device`;
    /// returns the region id. Without CUDA on the agent this is a `cuda_unavailable` error.
    pub fn register_gpu(
        &mut self,
        name: &str,
        layout: BlockLayout,
        device: i32,
        ipc_handle: &[u8; 64],
    ) -> Result<u64> {
        let hex: String = ipc_handle.iter().map(|b| format!("{b:02x}")).collect();
        let r = self.op(
            json!({"op": "register_gpu", "name": name, "layout": layout,
                   "device": device, "ipc_handle": hex}),
            None,
        )?;
        r.get("region")
            .and_then(Value::as_u64)
            .ok_or_else(|| Error::Protocol("no region in reply".into()))
    }

    /// Unregister a region.
    pub fn unregister(&mut self, region: u64) -> Result<()> {
        self.op(json!({"op": "unregister", "region": region}), None)
            .map(|_| ())
    }

    /// Reserve `blocks` blocks of `region` for `transfer`; returns their ids.
    pub fn reserve(&mut self, region: u64, transfer: &TransferId, blocks: u32) -> Result<Vec<u32>> {
        let r = self.op(
            json!({"op": "reserve", "region": region, "transfer": transfer, "blocks": blocks}),
            None,
        )?;
        decode(r.get("blocks").cloned().unwrap_or_default())
    }

    /// Send blocks to a peer agent (`host:port`) or to this node (`local`); returns when every
    /// byte has arrived at the destination.
    pub fn send(&mut self, args: &SendArgs, deadline: Duration) -> Result<SendReport> {
        let mut v = serde_json::to_value(args).map_err(|e| Error::BadRequest(e.to_string()))?;
        if let Value::Object(m) = &mut v {
            m.insert("op".into(), "send".into());
        }
        decode(self.op(v, Some(deadline))?)
    }

    /// Wait until `transfer`'s blocks have arrived (in `region`, or anywhere on this agent).
    pub fn wait(
        &mut self,
        region: Option<u64>,
        transfer: &TransferId,
        deadline: Duration,
    ) -> Result<Arrival> {
        decode(self.op(
            json!({"op": "wait", "region": region, "transfer": transfer}),
            Some(deadline),
        )?)
    }

    /// Free `transfer`'s blocks in `region`.
    pub fn free(&mut self, region: u64, transfer: &TransferId) -> Result<()> {
        self.op(
            json!({"op": "free", "region": region, "transfer": transfer}),
            None,
        )
        .map(|_| ())
    }

    /// Regions, leases and transfers.
    pub fn status(&mut self) -> Result<Status> {
        decode(self.op(json!({"op": "status"}), None)?)
    }
}

fn timeout_or_io(e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            Error::Timeout("agent reply".into())
        }
        _ => Error::Io(e),
    }
}

fn decode<T: serde::de::DeserializeOwned>(v: impl Into<Value>) -> Result<T> {
    serde_json::from_value(v.into()).map_err(|e| Error::Protocol(format!("unexpected reply: {e}")))
}
