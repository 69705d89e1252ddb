//! The topologies built of [`ValkeyServer`]s: a primary with a replica, for
//! failover, and a cluster of three primaries, for slot routing.

use std::time::{Duration, Instant};

use super::{info_value, server_binary, ValkeyError, ValkeyServer, POLL};

/// How long a replica has to report its link to the primary up, and a
/// cluster to report `cluster_state:ok` on every node.
const TOPOLOGY_DEADLINE: Duration = Duration::from_secs(15);
/// The slot ranges of the three primaries of a [`ValkeyCluster`].
const SLOTS: [(u16, u16); 3] = [(0, 5460), (5461, 10922), (10923, 16383)];

/// A primary and one replica (`--replicaof`), for failover tests.
#[derive(Debug)]
pub struct ValkeyReplicaSet {
    primary: ValkeyServer,
    replica: ValkeyServer,
}

impl ValkeyReplicaSet {
    /// Starts both and waits until the replica reports
    /// `master_link_status:up` (its first sync done).
    pub async fn start() -> Result<Self, ValkeyError> {
        let binary = server_binary()?;
        // Diskless sync at once, not after the default 5 s for more replicas.
        let primary = ValkeyServer::start_binary(&binary, &["--repl-diskless-sync-delay", "0"]);
        let primary = primary.await?;
        let port = primary.port().to_string();
        let of = ["--replicaof", "127.0.0.1", &port];
        let replica = ValkeyServer::start_binary(&binary, &of).await?;
        let end = Instant::now() + TOPOLOGY_DEADLINE;
        loop {
            let link = replica.info_field("replication", "master_link_status");
            if link.await.is_ok_and(|s| s == "up") {
                return Ok(ValkeyReplicaSet { primary, replica });
            }
            if Instant::now() >= end {
                return Err(ValkeyError::State {
                    port: replica.port(),
                    what: format!("replica of {port}: link not up within {TOPOLOGY_DEADLINE:?}"),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    pub fn primary(&self) -> &ValkeyServer {
        &self.primary
    }

    pub fn replica(&self) -> &ValkeyServer {
        &self.replica
    }

    pub fn primary_mut(&mut self) -> &mut ValkeyServer {
        &mut self.primary
    }

    pub fn replica_mut(&mut self) -> &mut ValkeyServer {
        &mut self.replica
    }

    /// `[primary, replica]`.
    pub fn urls(&self) -> [String; 2] {
        [self.primary.url(), self.replica.url()]
    }

    /// Failover by hand: kills the primary, then `REPLICAOF NO ONE` on the
    /// replica, which then takes writes.
    pub async fn promote_replica(&mut self) -> Result<(), ValkeyError> {
        self.primary.kill();
        let () = self
            .replica
            .query(redis::cmd("REPLICAOF").arg("NO").arg("ONE"))
            .await?;
        Ok(())
    }
}

/// Three primaries (cluster mode) holding slots 0-5460, 5461-10922 and
/// 10923-16383, met and agreed.
#[derive(Debug)]
pub struct ValkeyCluster {
    nodes: Vec<ValkeyServer>,
}

impl ValkeyCluster {
    pub async fn start() -> Result<Self, ValkeyError> {
        Self::start_with(&[]).await
    }

    /// A cluster whose every node gets `extra`. Returns once every node says
    /// `cluster_state:ok`.
    pub async fn start_with(extra: &[&str]) -> Result<Self, ValkeyError> {
        let binary = server_binary()?;
        let mut nodes = Vec::with_capacity(SLOTS.len());
        for _ in SLOTS {
            nodes.push(ValkeyServer::launch(&binary, extra, true).await?);
        }
        // Distinct config epochs before meeting, as `valkey-cli --cluster
        // create` sets them, so no epoch collision has to be resolved.
        for (epoch, (node, (from, to))) in (1u64..).zip(nodes.iter().zip(SLOTS)) {
            let () = node
                .query(redis::cmd("CLUSTER").arg("SET-CONFIG-EPOCH").arg(epoch))
                .await?;
            let () = node
                .query(redis::cmd("CLUSTER").arg("ADDSLOTSRANGE").arg(from).arg(to))
                .await?;
        }
        if let Some((first, rest)) = nodes.split_first() {
            for node in rest {
                let mut meet = redis::cmd("CLUSTER");
                meet.arg("MEET").arg("127.0.0.1").arg(node.port());
                meet.arg(node.bus_port().unwrap_or_default());
                let () = first.query(&meet).await?;
            }
        }
        let cluster = ValkeyCluster { nodes };
        let end = Instant::now() + TOPOLOGY_DEADLINE;
        for node in &cluster.nodes {
            loop {
                let state = cluster_state(node).await;
                if state.as_deref().is_ok_and(|s| s == "ok") {
                    break;
                }
                if Instant::now() >= end {
                    return Err(ValkeyError::State {
                        port: node.port(),
                        what: format!(
                            "cluster_state not ok within {TOPOLOGY_DEADLINE:?} (last: {state:?})"
                        ),
                    });
                }
                tokio::time::sleep(POLL).await;
            }
        }
        Ok(cluster)
    }

    /// Every node's `redis://127.0.0.1:PORT`: the seeds for a cluster client.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(ValkeyServer::url).collect()
    }

    pub fn nodes(&self) -> &[ValkeyServer] {
        &self.nodes
    }

    pub fn nodes_mut(&mut self) -> &mut [ValkeyServer] {
        &mut self.nodes
    }
}

/// `cluster_state` of `node`'s `CLUSTER INFO`.
async fn cluster_state(node: &ValkeyServer) -> Result<String, ValkeyError> {
    let info: String = node.query(redis::cmd("CLUSTER").arg("INFO")).await?;
    info_value(&info, "cluster_state")
        .map(str::to_string)
        .ok_or_else(|| ValkeyError::State {
            port: node.port(),
            what: "CLUSTER INFO has no cluster_state".into(),
        })
}
