//! A primary and a replica watched by Valkey Sentinel: the same
//! `valkey-server` binary run with `--sentinel` and a configuration file
//! that monitors the primary, short timings so a failover takes seconds.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::{server_binary, ValkeyError, ValkeyReplicaSet, ValkeyServer, POLL};

/// How long the sentinels have to see the primary, its replica and each
/// other, and then to fail over once the primary is gone.
const SENTINEL_DEADLINE: Duration = Duration::from_secs(30);

/// A [`ValkeyReplicaSet`] and sentinels monitoring it as
/// [`ValkeySentinelSet::MASTER`], with a quorum of a majority of them.
#[derive(Debug)]
pub struct ValkeySentinelSet {
    set: ValkeyReplicaSet,
    sentinels: Vec<ValkeyServer>,
}

impl ValkeySentinelSet {
    /// The name the sentinels monitor the primary under.
    pub const MASTER: &'static str = "kvmesh";

    /// Starts the primary, its replica and `sentinels` sentinels (at least
    /// one), and returns once every sentinel names the primary and knows
    /// the replica (and the other sentinels): a failover can happen.
    pub async fn start(sentinels: usize) -> Result<Self, ValkeyError> {
        let set = ValkeyReplicaSet::start().await?;
        let binary = server_binary()?;
        let n = sentinels.max(1);
        // A fast failover: down after 500 ms, and no wait on a failover
        // that went wrong before the next try.
        let conf = format!(
            "sentinel monitor {m} 127.0.0.1 {port} {quorum}\n\
             sentinel down-after-milliseconds {m} 500\n\
             sentinel failover-timeout {m} 2000\n\
             sentinel parallel-syncs {m} 1\n",
            m = Self::MASTER,
            port = set.primary().port(),
            quorum = n / 2 + 1,
        );
        let mut started = Vec::with_capacity(n);
        for _ in 0..n {
            let s = ValkeyServer::launch_conf(&binary, Some(conf.as_str()), &["--sentinel"], false);
            started.push(s.await?);
        }
        let s = ValkeySentinelSet {
            set,
            sentinels: started,
        };
        s.wait("see the primary, its replica and each other", |m| {
            let count = |f: &str| m.get(f).and_then(|v| v.parse::<usize>().ok());
            m.get("flags").is_some_and(|f| f == "master")
                && count("num-slaves") == Some(1)
                && count("num-other-sentinels") == Some(n - 1)
        })
        .await?;
        // The replica as the sentinels see it: linked and reporting.
        for sentinel in &s.sentinels {
            let end = Instant::now() + SENTINEL_DEADLINE;
            loop {
                let replicas: Vec<HashMap<String, String>> = sentinel
                    .query(redis::cmd("SENTINEL").arg("REPLICAS").arg(Self::MASTER))
                    .await?;
                let ready = replicas.iter().any(|r| {
                    r.get("flags").is_some_and(|f| f == "slave")
                        && r.get("master-link-status").is_some_and(|l| l == "ok")
                });
                if ready {
                    break;
                }
                if Instant::now() >= end {
                    return Err(ValkeyError::State {
                        port: sentinel.port(),
                        what: format!("sentinel: replica not ready: {replicas:?}"),
                    });
                }
                tokio::time::sleep(POLL).await;
            }
        }
        Ok(s)
    }

    /// The sentinels' `redis://127.0.0.1:PORT`.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(ValkeyServer::url).collect()
    }

    pub fn sentinels(&self) -> &[ValkeyServer] {
        &self.sentinels
    }

    pub fn primary(&self) -> &ValkeyServer {
        self.set.primary()
    }

    pub fn replica(&self) -> &ValkeyServer {
        self.set.replica()
    }

    /// Kills the primary (SIGKILL): the sentinels find it down and promote
    /// the replica.
    pub fn kill_primary(&mut self) {
        self.set.primary_mut().kill();
    }

    /// A failover by hand (`SENTINEL FAILOVER`, as an operator moves the
    /// primary for maintenance): the replica is promoted while the primary
    /// still runs, and the sentinels then turn the old primary into its
    /// replica. Returns at once; [`Self::wait_failover`] waits.
    pub async fn failover(&self) -> Result<(), ValkeyError> {
        let first = self.sentinels.first().ok_or_else(|| ValkeyError::State {
            port: 0,
            what: "no sentinel".into(),
        })?;
        let mut cmd = redis::cmd("SENTINEL");
        cmd.arg("FAILOVER").arg(Self::MASTER);
        let () = first.query(&cmd).await?;
        Ok(())
    }

    /// Waits until every sentinel names the replica as the primary and the
    /// replica says it is one. Returns how long that took.
    pub async fn wait_failover(&self) -> Result<Duration, ValkeyError> {
        let started = Instant::now();
        let port = self.replica().port().to_string();
        self.wait("promote the replica", |m| {
            m.get("port") == Some(&port) && m.get("flags").is_some_and(|f| f == "master")
        })
        .await?;
        let end = Instant::now() + SENTINEL_DEADLINE;
        loop {
            let role: Vec<redis::Value> = self.replica().query(&redis::cmd("ROLE")).await?;
            if matches!(role.first(), Some(redis::Value::BulkString(r)) if r.as_slice() == b"master")
            {
                return Ok(started.elapsed());
            }
            if Instant::now() >= end {
                return Err(ValkeyError::State {
                    port: self.replica().port(),
                    what: "named primary by the sentinels, but ROLE is not master".into(),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Polls every sentinel's `SENTINEL MASTER` until `ok` holds for it.
    async fn wait(
        &self,
        what: &str,
        ok: impl Fn(&HashMap<String, String>) -> bool,
    ) -> Result<(), ValkeyError> {
        for sentinel in &self.sentinels {
            let end = Instant::now() + SENTINEL_DEADLINE;
            loop {
                let master: HashMap<String, String> = sentinel
                    .query(redis::cmd("SENTINEL").arg("MASTER").arg(Self::MASTER))
                    .await?;
                if ok(&master) {
                    break;
                }
                if Instant::now() >= end {
                    return Err(ValkeyError::State {
                        port: sentinel.port(),
                        what: format!(
                            "sentinel did not {what} within {SENTINEL_DEADLINE:?}: {master:?}"
                        ),
                    });
                }
                tokio::time::sleep(POLL).await;
            }
        }
        Ok(())
    }
}
