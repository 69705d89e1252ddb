//! The two ZMQ sockets of KV event ingestion: the SUB for the live stream
//! (bound or connected by vLLM's rule seen from the consumer's side) and a
//! short-lived DEALER per replay (`["", start_seq]`, both reply layouts, the
//! end marker, a deadline on every step).

use std::time::Duration;

use bytes::Bytes;
use kvmesh_filters::prefix::kvevents::{
    decode_replay_reply, replay_request, KvMessage, ReplayReply,
};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Deadline of connecting or binding the SUB socket.
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(2);
/// Most batches one replay returns (vLLM keeps 10 000 by default).
pub const MAX_REPLAY_BATCHES: usize = 100_000;
/// A whole replay never takes longer than this, however steadily it streams.
pub const MAX_REPLAY_TOTAL: Duration = Duration::from_secs(60);

/// Why a socket step failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SocketError {
    #[error("{what} {endpoint}: {reason}")]
    Zmq {
        what: &'static str,
        endpoint: String,
        reason: String,
    },
    #[error("{what} {endpoint}: no answer within {after:?}")]
    Timeout {
        what: &'static str,
        endpoint: String,
        after: Duration,
    },
}

fn zmq_err(what: &'static str, endpoint: &str, e: impl std::fmt::Display) -> SocketError {
    SocketError::Zmq {
        what,
        endpoint: endpoint.to_owned(),
        reason: e.to_string(),
    }
}

fn timeout(what: &'static str, endpoint: &str, after: Duration) -> SocketError {
    SocketError::Timeout {
        what,
        endpoint: endpoint.to_owned(),
        after,
    }
}

/// `tcp://*:N` as the zeromq crate can bind it.
fn bindable(endpoint: &str) -> String {
    endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1)
}

/// Opens the SUB socket, subscribed to topics starting with `topic`.
/// Returns it and the endpoint actually bound or dialled.
///
/// The subscription comes first, before the bind or the dial. The zeromq
/// crate sends a connecting peer the subscriptions it holds at that moment,
/// and `subscribe` sends only to the peers it already lists, so a peer whose
/// handshake ends between a bind and a later `subscribe` is sent neither, and
/// its PUB drops every message. vLLM's PUB redials a bound sidecar every
/// 100 ms, so on a loaded machine (the thread pre-empted between the two
/// calls) it can land there: the failure this closes read as a socket open,
/// a replay answered and no live batch ever (real vLLM with data
/// parallelism, docs/vllm-e2e.md).
pub async fn open_sub(
    endpoint: &str,
    bind: bool,
    topic: &str,
) -> Result<(SubSocket, String), SocketError> {
    let mut sub = SubSocket::new();
    sub.subscribe(topic)
        .await
        .map_err(|e| zmq_err("subscribe", endpoint, e))?;
    let resolved = if bind {
        let ep = tokio::time::timeout(OPEN_TIMEOUT, sub.bind(&bindable(endpoint)))
            .await
            .map_err(|_| timeout("bind", endpoint, OPEN_TIMEOUT))?
            .map_err(|e| zmq_err("bind", endpoint, e))?;
        ep.to_string()
    } else {
        tokio::time::timeout(OPEN_TIMEOUT, sub.connect(endpoint))
            .await
            .map_err(|_| timeout("connect", endpoint, OPEN_TIMEOUT))?
            .map_err(|e| zmq_err("connect", endpoint, e))?;
        endpoint.to_owned()
    };
    Ok((sub, resolved))
}

/// What one replay brought.
#[derive(Debug, Default)]
pub struct Replayed {
    pub batches: Vec<KvMessage>,
    /// Replies that could not be decoded (skipped).
    pub decode_errors: usize,
    /// The end marker arrived (else the batch limit stopped it).
    pub complete: bool,
}

/// Asks the engine's replay socket for every kept batch from `start_seq`.
/// `step` bounds the connect and the wait for each reply.
pub async fn replay(
    endpoint: &str,
    start_seq: u64,
    step: Duration,
) -> Result<Replayed, SocketError> {
    let total = tokio::time::Instant::now() + MAX_REPLAY_TOTAL;
    let mut d = DealerSocket::new();
    tokio::time::timeout(step, d.connect(endpoint))
        .await
        .map_err(|_| timeout("replay connect", endpoint, step))?
        .map_err(|e| zmq_err("replay connect", endpoint, e))?;
    let frames: Vec<Bytes> = replay_request(start_seq)
        .into_iter()
        .map(Bytes::from)
        .collect();
    let req = ZmqMessage::try_from(frames).map_err(|e| zmq_err("replay request", endpoint, e))?;
    tokio::time::timeout(step, d.send(req))
        .await
        .map_err(|_| timeout("replay send", endpoint, step))?
        .map_err(|e| zmq_err("replay send", endpoint, e))?;
    let mut out = Replayed::default();
    while out.batches.len() < MAX_REPLAY_BATCHES {
        let until = (tokio::time::Instant::now() + step).min(total);
        let msg = tokio::time::timeout_at(until, d.recv())
            .await
            .map_err(|_| timeout("replay reply", endpoint, step))?
            .map_err(|e| zmq_err("replay reply", endpoint, e))?;
        let frames = msg.into_vec();
        match decode_replay_reply(&frames) {
            Ok(ReplayReply::Batch(m)) => out.batches.push(m),
            Ok(ReplayReply::End) => {
                out.complete = true;
                return Ok(out);
            }
            Err(_) => out.decode_errors += 1,
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use zeromq::PubSocket;

    use super::*;

    /// A publisher already dialling when the SUB binds (vLLM's PUB redials every 100 ms) gets the
    /// subscription, so what it publishes arrives. Each round dials as fast as it can, so its
    /// handshake ends as close to the bind as this machine allows. (On an idle machine the
    /// pre-emption that opened the gap `open_sub` closes is rare, so this is the contract, not a
    /// reproduction of the race.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_publisher_dialling_before_the_bind_gets_the_subscription() {
        for round in 0..20 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let endpoint = format!("tcp://127.0.0.1:{port}");
            let dial = endpoint.clone();
            let dialler = tokio::spawn(async move {
                let mut publ = PubSocket::new();
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                while publ.connect(&dial).await.is_err() {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "round {round}: the publisher never connected"
                    );
                    tokio::task::yield_now().await;
                }
                publ
            });
            let (mut sub, _) = open_sub(&endpoint, true, "kv@").await.unwrap();
            let mut publ = dialler.await.unwrap();
            let received = tokio::time::timeout(Duration::from_secs(3), async {
                loop {
                    let msg = ZmqMessage::try_from(vec![
                        Bytes::from_static(b"kv@pod@model"),
                        Bytes::from_static(b"batch"),
                    ])
                    .unwrap();
                    publ.send(msg).await.unwrap();
                    if let Ok(Ok(m)) =
                        tokio::time::timeout(Duration::from_millis(20), sub.recv()).await
                    {
                        return m;
                    }
                }
            })
            .await;
            assert!(
                received.is_ok(),
                "round {round}: the publisher that dialled before the bind was never sent the \
                 subscription, so it dropped every message"
            );
        }
    }
}
