//! The local API server: one task per client connection, requests answered in order, each under
//! its deadline. A client that sends garbage gets an error reply (and, if the framing itself is
//! broken, its connection closed); other clients are not affected. Regions die with the
//! connection that registered them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::net::{UnixListener, UnixStream};

use crate::agent::Agent;
use crate::error::{Error, Result};
use crate::local::msg::{self, Request};
use crate::local::wire::{self, FrameReader};
use crate::transfer;

/// Accept local clients until shutdown.
pub(crate) async fn serve(agent: Arc<Agent>, listener: UnixListener) {
    let live = Arc::new(AtomicUsize::new(0));
    loop {
        let accepted = tokio::select! {
            () = agent.stop.cancelled() => return,
            a = listener.accept() => a,
        };
        let Ok((stream, _)) = accepted else { continue };
        if live.load(Ordering::SeqCst) >= agent.cfg.max_local_conns {
            tracing::warn!("local connection refused: limit reached");
            continue;
        }
        live.fetch_add(1, Ordering::SeqCst);
        let (a, l) = (Arc::clone(&agent), Arc::clone(&live));
        agent.tasks.spawn(async move {
            let conn = a.next_id();
            if let Err(e) = connection(&a, stream, conn).await {
                tracing::info!(conn, error = %e, "local connection ended");
            }
            a.drop_owner(conn);
            l.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

async fn connection(agent: &Arc<Agent>, mut stream: UnixStream, conn: u64) -> Result<()> {
    let mut reader = FrameReader::new();
    let io = agent.cfg.io_timeout;
    loop {
        let frame = tokio::select! {
            () = agent.stop.cancelled() => return Ok(()),
            f = reader.next(&stream, io) => f,
        };
        let reply = match frame {
            Ok(Some(f)) => match msg::parse(&f) {
                Ok(env) => {
                    let deadline = agent.deadline(env.deadline_ms);
                    let res = tokio::time::timeout(
                        deadline,
                        dispatch(agent, conn, env.req, &mut reader, deadline),
                    )
                    .await;
                    let res = res.unwrap_or_else(|_| {
                        Err(Error::Timeout(format!("call took over {deadline:?}")))
                    });
                    match res {
                        Ok(v) => msg::ok_reply(env.id, v),
                        Err(e) => {
                            agent.metrics.failure(e.code(), "local");
                            msg::err_reply(env.id, &e)
                        }
                    }
                }
                Err((id, e)) => {
                    tracing::info!(conn, error = %e, "bad local request");
                    agent.metrics.failure(e.code(), "local");
                    msg::err_reply(id, &e)
                }
            },
            Ok(None) => return Ok(()),
            Err(e) => {
                // The framing is broken: say why, then close (we cannot find the next frame).
                agent.metrics.failure(e.code(), "local");
                let _ = tokio::time::timeout(
                    io,
                    stream.write_all(&wire::encode(&msg::err_reply(0, &e))),
                )
                .await;
                return Err(e);
            }
        };
        tokio::time::timeout(io, stream.write_all(&wire::encode(&reply)))
            .await
            .map_err(|_| Error::Timeout("client did not read its reply".into()))??;
    }
}

async fn dispatch(
    agent: &Arc<Agent>,
    conn: u64,
    req: Request,
    reader: &mut FrameReader,
    deadline: std::time::Duration,
) -> Result<serde_json::Value> {
    Ok(match req {
        Request::Hello {} => json!({
            "agent_id": agent.cfg.agent_id, "address": agent.address,
            "caps": agent.caps.names(), "version": wire::VERSION,
        }),
        Request::Register { name, layout } => {
            let fd = reader.fds.pop_front().ok_or_else(|| {
                Error::BadRequest("register needs a memfd sent with SCM_RIGHTS".into())
            })?;
            let region = agent.register(conn, name, layout, fd)?;
            json!({"region": region.id, "bytes": region.map.len()})
        }
        Request::RegisterGpu {
            name,
            layout,
            device,
            ipc_handle,
        } => {
            let region = agent.register_gpu(conn, name, layout, device, &ipc_handle)?;
            json!({"region": region.id, "bytes": region.map.len()})
        }
        Request::Unregister { region } => {
            agent.unregister(region)?;
            json!({})
        }
        Request::Reserve {
            region,
            transfer,
            blocks,
        } => {
            json!({"blocks": agent.reserve(region, &transfer, blocks)?})
        }
        Request::Send(args) => serde_json::to_value(transfer::send(agent, args, deadline).await?)
            .map_err(|e| Error::Protocol(e.to_string()))?,
        Request::Wait { transfer, region } => {
            let (region, blocks) = agent.wait(region, &transfer, deadline).await?;
            json!({"region": region, "blocks": blocks})
        }
        Request::Free { region, transfer } => {
            agent.free(region, &transfer)?;
            json!({})
        }
        Request::Status {} => {
            serde_json::to_value(agent.status()).map_err(|e| Error::Protocol(e.to_string()))?
        }
    })
}
