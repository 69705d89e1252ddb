//! The connection to Valkey: one multiplexed connection (every call of every
//! request pipelined on it) to the primary, or redis-rs's cluster client,
//! kept up by [`Store::run`].
//!
//! * A call never waits for a connection: while there is none it fails at
//!   once with [`StoreError::Down`], and the caller routes on what it knows.
//! * A call that fails with a connection error, `READONLY` (the primary
//!   became a replica) or a missing function (Valkey restarted empty) drops
//!   the connection; [`Store::run`] connects again, trying every URL and
//!   taking the one whose `ROLE` is primary, loads `functions.lua`, and
//!   backs off with jitter while none answers.
//! * With `index.valkey.sentinel`, the primary is the one the sentinels name
//!   ([`super::sentinel`]), asked at every connect; their `+switch-master`
//!   drops a connection to an old primary and cuts a reconnect's backoff
//!   short.
//! * Every call has a deadline; redis-rs's own timeouts are only a backstop.
//! * A connection that answers nothing is cut: after [`STALL_CALLS`] calls
//!   in a row miss their deadlines with no answer for [`STALL_AFTER`] (a
//!   server that hangs, or whose node went away without closing the
//!   socket), the connection is dropped and made again, and calls fail at
//!   once meanwhile instead of each waiting out its deadline. A server that
//!   is slow but alive answers the writers' longer calls and is never cut.
//! * `rediss://` URLs speak TLS (rustls): the server is verified against
//!   `index.valkey.tls.ca` or the system's roots, and `tls.cert`/`tls.key`
//!   are presented when the server asks for a client certificate.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use redis::aio::MultiplexedConnection;
use redis::cluster_async::ClusterConnection;
use redis::{FromRedisValue, RedisError, ToRedisArgs};
use tokio::sync::Notify;

use crate::backoff::Backoff;
use crate::config::index::Valkey as Config;
use crate::shutdown::Shutdown;

/// The server-side functions every call uses.
pub const FUNCTIONS: &str = include_str!("functions.lua");
/// The library version `functions.lua` reports (`kvmesh_version`).
pub const FUNCTIONS_VERSION: &str = "5";

/// Deadline of connecting and loading the functions.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Calls in a row that miss their deadlines before a silent connection is
/// cut (with [`STALL_AFTER`]).
pub const STALL_CALLS: u32 = 4;
/// How long a connection must have answered nothing before it is cut.
pub const STALL_AFTER: Duration = Duration::from_secs(1);

/// Why a call to Valkey did not answer.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("no connection to Valkey")]
    Down,
    #[error("Valkey did not answer within {0:?}")]
    Timeout(Duration),
    #[error("Valkey: {0}")]
    Redis(#[from] RedisError),
    #[error("unexpected reply from Valkey: {0}")]
    Reply(String),
    #[error("TLS to Valkey: {0}")]
    Tls(String),
}

impl StoreError {
    /// The metric label of the error.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Down => "down",
            Self::Timeout(_) => "timeout",
            Self::Redis(_) => "error",
            Self::Reply(_) => "bad_reply",
            Self::Tls(_) => "tls",
        }
    }
}

#[derive(Clone)]
pub(super) enum Link {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl Link {
    async fn query<T: FromRedisValue>(&mut self, cmd: &redis::Cmd) -> Result<T, RedisError> {
        match self {
            Self::Single(c) => cmd.query_async(c).await,
            Self::Cluster(c) => cmd.query_async(c).await,
        }
    }
}

/// See the module docs.
pub struct Store {
    cfg: Config,
    /// The live connection and its generation (`None`: down).
    link: RwLock<Option<(u64, Link)>>,
    generation: AtomicU64,
    /// Rung when the connection is dropped, so [`Store::run`] reconnects.
    lost: Notify,
    /// Rung when the sentinels switched the primary: a reconnect waiting
    /// out its backoff tries again at once.
    switched: Notify,
    /// Which URL the connection goes to (for `/debug/index` and logs).
    server: RwLock<String>,
    /// Why the last attempt to connect failed ("" once connected).
    last_error: RwLock<String>,
    /// Whether the live connection still answers ([`Silence`]).
    silence: Mutex<Silence>,
}

/// Calls that missed their deadlines on the live connection since its last
/// answer, and when that answer came (or the connection was made).
#[derive(Debug)]
struct Silence {
    missed: u32,
    since: Instant,
}

impl Silence {
    fn new() -> Self {
        Silence {
            missed: 0,
            since: Instant::now(),
        }
    }

    /// One more call missed its deadline at `now`: whether the connection
    /// has now been silent long enough to be cut.
    fn missed_at(&mut self, now: Instant) -> bool {
        self.missed = self.missed.saturating_add(1);
        self.missed >= STALL_CALLS && now.duration_since(self.since) >= STALL_AFTER
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("up", &self.is_up())
            .field("server", &*self.server.read())
            .finish()
    }
}

impl Store {
    pub fn new(cfg: Config) -> Self {
        Self {
            cfg,
            link: RwLock::new(None),
            generation: AtomicU64::new(0),
            lost: Notify::new(),
            switched: Notify::new(),
            server: RwLock::new(String::new()),
            last_error: RwLock::new(String::new()),
            silence: Mutex::new(Silence::new()),
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Whether a connection is up now.
    pub fn is_up(&self) -> bool {
        self.link.read().is_some()
    }

    /// The server the connection goes to ("" while down).
    pub fn server(&self) -> String {
        self.server.read().clone()
    }

    /// Why the last attempt to connect failed ("" while connected or before
    /// the first attempt): a refused connection, an untrusted certificate.
    pub fn last_error(&self) -> String {
        self.last_error.read().clone()
    }

    /// Times a connection was made (a change means a reconnect).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Calls function `name` with `keys` and `args`, within `deadline`.
    pub async fn fcall<T, A>(
        &self,
        name: &str,
        keys: &[String],
        args: A,
        deadline: Duration,
    ) -> Result<T, StoreError>
    where
        T: FromRedisValue,
        A: ToRedisArgs,
    {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(name).arg(keys.len()).arg(keys).arg(args);
        self.call(&cmd, deadline).await
    }

    /// Sends one command within `deadline` (see the module docs).
    pub async fn call<T: FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        deadline: Duration,
    ) -> Result<T, StoreError> {
        let Some((generation, mut link)) = self.link.read().clone() else {
            return Err(StoreError::Down);
        };
        let answer = tokio::time::timeout(deadline, link.query(cmd)).await;
        if answer.is_ok() {
            *self.silence.lock() = Silence::new();
        }
        match answer {
            Err(_) => {
                let live = self.link.read().as_ref().map(|(g, _)| *g) == Some(generation);
                if live && self.silence.lock().missed_at(Instant::now()) {
                    let why = format!(
                        "no answer for {STALL_AFTER:?} ({STALL_CALLS} calls in a row past their deadlines)"
                    );
                    self.drop_link(generation, &why);
                }
                Err(StoreError::Timeout(deadline))
            }
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                if must_reconnect(&e) {
                    self.drop_link(generation, &e);
                }
                Err(StoreError::Redis(e))
            }
        }
    }

    fn drop_link(&self, generation: u64, why: &dyn std::fmt::Display) {
        let mut link = self.link.write();
        if link.as_ref().is_some_and(|(g, _)| *g == generation) {
            tracing::warn!(server = %self.server.read(), error = %why, "valkey: connection lost; reconnecting");
            *link = None;
            self.server.write().clear();
            self.lost.notify_one();
        }
    }

    /// The sentinels switched the primary to `to` (`redis://host:port`): a
    /// connection to another server is dropped, and a reconnect waiting
    /// out its backoff tries again now.
    pub(super) fn primary_moved(&self, to: &str) {
        let mut link = self.link.write();
        let server = self.server.read().clone();
        if link.is_some() && server != to {
            tracing::warn!(from = %server, %to, "valkey: the sentinels switched the primary; reconnecting");
            *link = None;
            self.server.write().clear();
            self.lost.notify_one();
        }
        drop(link);
        self.switched.notify_one();
    }

    /// Keeps a connection up until shutdown (see the module docs), and
    /// with Sentinel follows its switches.
    pub async fn run(self: Arc<Self>, shutdown: Shutdown) {
        let watcher = self
            .cfg
            .sentinel
            .is_some()
            .then(|| tokio::spawn(super::sentinel::watch(self.clone(), shutdown.clone())));
        self.keep_up(&shutdown).await;
        if let Some(w) = watcher {
            let _ = w.await;
        }
    }

    async fn keep_up(&self, shutdown: &Shutdown) {
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
        // Failed attempts since the last connection: the first is a warning,
        // the retries after it are not.
        let mut failures = 0u32;
        loop {
            if !self.is_up() {
                let connected = tokio::select! {
                    _ = shutdown.triggered() => return,
                    c = self.connect() => c,
                };
                match connected {
                    Ok((link, server)) => {
                        backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
                        let g = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
                        tracing::info!(%server, "valkey: connected");
                        failures = 0;
                        self.last_error.write().clear();
                        *self.server.write() = server;
                        *self.silence.lock() = Silence::new();
                        *self.link.write() = Some((g, link));
                    }
                    Err(e) => {
                        if failures == 0 {
                            let sentinels = self.cfg.sentinel.as_ref().map(|s| s.urls.len());
                            tracing::warn!(urls = ?self.cfg.urls, ?sentinels, error = %e, "valkey: cannot connect; routing on what this sidecar knows until it can");
                        } else {
                            tracing::debug!(error = %e, "valkey: no server answered");
                        }
                        failures = failures.saturating_add(1);
                        *self.last_error.write() = e.to_string();
                        tokio::select! {
                            _ = shutdown.triggered() => return,
                            _ = tokio::time::sleep(backoff.next_delay()) => continue,
                            _ = self.switched.notified() => continue,
                        }
                    }
                }
            }
            tokio::select! {
                _ = shutdown.triggered() => return,
                _ = self.lost.notified() => {}
            }
        }
    }

    async fn connect(&self) -> Result<(Link, String), StoreError> {
        let certs = tls_files(&self.cfg)?;
        if let Some(s) = &self.cfg.sentinel {
            return super::sentinel::connect(s, certs).await;
        }
        if self.cfg.cluster {
            let mut builder = redis::cluster::ClusterClient::builder(self.cfg.urls.clone())
                .connection_timeout(CONNECT_TIMEOUT)
                .response_timeout(CONNECT_TIMEOUT)
                .retries(1);
            if let Some(certs) = certs {
                builder = builder.certs(certs);
            }
            let client = builder.build()?;
            let conn = timed(client.get_async_connection()).await?;
            let mut link = Link::Cluster(conn);
            // FUNCTION LOAD goes to every primary; a version check would ask one.
            load_functions(&mut link, true).await?;
            return Ok((link, format!("cluster {}", self.cfg.urls.join(","))));
        }
        let mut last = StoreError::Down;
        for url in &self.cfg.urls {
            let connected = match open(url.as_str(), certs.clone()) {
                Ok(client) => connect_primary(client, url).await,
                Err(e) => Err(e),
            };
            match connected {
                Ok(link) => return Ok((link, url.clone())),
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}

/// The files of `index.valkey.tls`, read at each connect (so a rotated
/// certificate is picked up by the next one); `None` without them, when a
/// `rediss://` server is verified against the system's roots.
pub(super) fn tls_files(cfg: &Config) -> Result<Option<redis::TlsCertificates>, StoreError> {
    let Some(t) = &cfg.tls else {
        return Ok(None);
    };
    let read = |p: &std::path::Path| {
        std::fs::read(p).map_err(|e| StoreError::Tls(format!("{}: {e}", p.display())))
    };
    let client_tls = match (&t.cert, &t.key) {
        (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
            client_cert: read(cert)?,
            client_key: read(key)?,
        }),
        _ => None,
    };
    let root_cert = t.ca.as_deref().map(read).transpose()?;
    Ok(Some(redis::TlsCertificates {
        client_tls,
        root_cert,
    }))
}

/// A client of `info`, over TLS with `certs` when given.
pub(super) fn open(
    info: impl redis::IntoConnectionInfo,
    certs: Option<redis::TlsCertificates>,
) -> Result<redis::Client, StoreError> {
    Ok(match certs {
        Some(certs) => redis::Client::build_with_tls(info, certs)?,
        None => redis::Client::open(info)?,
    })
}

/// Connects `client` (to `url`) and keeps the connection if the server is a
/// primary.
pub(super) async fn connect_primary(client: redis::Client, url: &str) -> Result<Link, StoreError> {
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(CONNECT_TIMEOUT)
        .set_response_timeout(CONNECT_TIMEOUT);
    let conn = timed(client.get_multiplexed_async_connection_with_config(&cfg)).await?;
    let mut link = Link::Single(conn);
    let role: Vec<redis::Value> = timed(link.query(&redis::cmd("ROLE"))).await?;
    match role.first() {
        Some(redis::Value::BulkString(r)) if r.as_slice() == b"master" => {}
        other => {
            return Err(StoreError::Reply(format!(
                "{url} is not a primary ({other:?})"
            )))
        }
    }
    load_functions(&mut link, false).await?;
    Ok(link)
}

/// Loads `functions.lua` (on every primary of a cluster), unless `always`
/// is false and the same version or a newer one is there already: during a
/// rolling upgrade the newer sidecars' library stays (each version only adds
/// functions), so old and new sidecars do not replace each other's.
async fn load_functions(link: &mut Link, always: bool) -> Result<(), StoreError> {
    if !always {
        let have: Result<String, _> =
            timed(link.query(redis::cmd("FCALL").arg("kvmesh_version").arg(0))).await;
        let ours: u32 = FUNCTIONS_VERSION.parse().unwrap_or(0);
        if matches!(&have, Ok(v) if v.parse::<u32>().is_ok_and(|v| v >= ours)) {
            return Ok(());
        }
    }
    let _: String = timed(
        link.query(
            redis::cmd("FUNCTION")
                .arg("LOAD")
                .arg("REPLACE")
                .arg(FUNCTIONS),
        ),
    )
    .await?;
    Ok(())
}

pub(super) async fn timed<T>(
    f: impl std::future::Future<Output = Result<T, RedisError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(CONNECT_TIMEOUT, f).await {
        Ok(r) => r.map_err(StoreError::from),
        Err(_) => Err(StoreError::Timeout(CONNECT_TIMEOUT)),
    }
}

/// Whether an error means this connection is no use any more.
fn must_reconnect(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
        || matches!(
            e.code(),
            Some("READONLY") | Some("MASTERDOWN") | Some("LOADING")
        )
        || e.to_string().contains("Function not found")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection is cut only after both enough calls in a row and long
    /// enough without an answer: a few slow calls, or a long quiet spell
    /// with one missed call, are not silence.
    #[test]
    fn silence_needs_both_missed_calls_and_time() {
        let mut s = Silence::new();
        let t0 = s.since;
        for _ in 1..STALL_CALLS {
            assert!(!s.missed_at(t0 + STALL_AFTER * 2), "too few calls");
        }
        let mut s = Silence::new();
        let t0 = s.since;
        for _ in 0..STALL_CALLS * 3 {
            assert!(!s.missed_at(t0 + STALL_AFTER / 2), "too soon");
        }
        assert!(s.missed_at(t0 + STALL_AFTER));
    }
}
