//! Finding the primary through Valkey Sentinel (`index.valkey.sentinel`).
//!
//! * [`connect`]: at every (re)connect of [`super::Store`], the sentinels are
//!   asked in order `SENTINEL GET-MASTER-ADDR-BY-NAME master`, and the
//!   address one names is connected to and kept if its `ROLE` is primary
//!   (a sentinel that has not seen a failover yet may name the old one). An
//!   address is tried once per round however many sentinels name it.
//! * [`watch`]: one sentinel's `+switch-master` channel, so that a switch
//!   the sidecar did not notice through an error (the old primary is
//!   still up and reachable, cut off from the sentinels) moves it too, and
//!   a reconnect that is waiting out its backoff tries the new primary at
//!   once.
//!
//! Why not redis-rs's `sentinel` feature: its async client asks `SENTINEL
//! MASTERS`, caches its sentinel connections behind `&mut self` and puts no
//! deadline on them (a stalled sentinel would hold a reconnect), and it
//! hands back a client for the primary that the store would still have to
//! check and load its functions into. These few commands keep every call
//! under the store's deadlines.
//!
//! TLS: `rediss://` sentinels are spoken to over TLS, and then the primary
//! too, both with `index.valkey.tls`; the primary's certificate is checked
//! against the address the sentinels announce (an IP unless they run with
//! `announce-hostnames`/`resolve-hostnames`).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::{ConnectionAddr, ConnectionInfo, RedisConnectionInfo};

use super::store::{connect_primary, open, timed, Link, Store, StoreError};
use crate::backoff::Backoff;
use crate::config::index::{is_tls_url, ValkeySentinel};
use crate::shutdown::Shutdown;

/// The pub/sub channel sentinels announce a new primary on: `NAME OLD-IP
/// OLD-PORT NEW-IP NEW-PORT`.
const SWITCH_CHANNEL: &str = "+switch-master";

/// Connects to the primary the sentinels name (see the module docs).
/// Returns the link and the primary's address as `redis://host:port`.
pub(super) async fn connect(
    s: &ValkeySentinel,
    certs: Option<redis::TlsCertificates>,
) -> Result<(Link, String), StoreError> {
    let mut last = StoreError::Down;
    let mut tried = HashSet::new();
    for url in &s.urls {
        let (host, port) = match ask(url, &s.master, certs.clone()).await {
            Ok(Some(addr)) => addr,
            Ok(None) => {
                last = StoreError::Reply(format!(
                    "sentinel {} knows no primary named {:?}",
                    redact(url),
                    s.master
                ));
                continue;
            }
            Err(e) => {
                last = e;
                continue;
            }
        };
        let server = server(s, &host, port);
        if !tried.insert(server.clone()) {
            continue;
        }
        let connected = match open(node(s, host, port), certs.clone()) {
            Ok(client) => connect_primary(client, &server).await,
            Err(e) => Err(e),
        };
        match connected {
            Ok(link) => return Ok((link, server)),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Follows the sentinels' `+switch-master` announcements until shutdown,
/// telling `store` of each switch of its primary (see the module docs).
pub(super) async fn watch(store: Arc<Store>, shutdown: Shutdown) {
    let Some(s) = store.config().sentinel.clone() else {
        return;
    };
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    for url in s.urls.iter().cycle() {
        let subscribed = tokio::select! {
            _ = shutdown.triggered() => return,
            p = subscribe(url, super::store::tls_files(store.config())) => p,
        };
        match subscribed {
            Ok(pubsub) => {
                backoff.reset();
                let mut messages = pubsub.into_on_message();
                loop {
                    let msg = tokio::select! {
                        _ = shutdown.triggered() => return,
                        m = messages.next() => m,
                    };
                    let Some(msg) = msg else { break };
                    let payload: String = msg.get_payload().unwrap_or_default();
                    if let Some((host, port)) = switched_to(&payload, &s.master) {
                        store.primary_moved(&server(&s, host, port));
                    }
                }
                tracing::debug!(sentinel = %redact(url), "valkey: sentinel subscription ended");
            }
            Err(e) => {
                tracing::debug!(sentinel = %redact(url), error = %e, "valkey: cannot follow sentinel");
            }
        }
        tokio::select! {
            _ = shutdown.triggered() => return,
            _ = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}

/// The primary of `master` as sentinel `url` knows it (`None`: it knows no
/// such name).
async fn ask(
    url: &str,
    master: &str,
    certs: Option<redis::TlsCertificates>,
) -> Result<Option<(String, u16)>, StoreError> {
    let client = open(url, certs)?;
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(super::store::CONNECT_TIMEOUT)
        .set_response_timeout(super::store::CONNECT_TIMEOUT);
    let mut conn = timed(client.get_multiplexed_async_connection_with_config(&cfg)).await?;
    let mut cmd = redis::cmd("SENTINEL");
    cmd.arg("GET-MASTER-ADDR-BY-NAME").arg(master);
    timed(cmd.query_async(&mut conn)).await
}

async fn subscribe(
    url: &str,
    certs: Result<Option<redis::TlsCertificates>, StoreError>,
) -> Result<redis::aio::PubSub, StoreError> {
    let client = open(url, certs?)?;
    let mut pubsub = timed(client.get_async_pubsub()).await?;
    timed(pubsub.subscribe(SWITCH_CHANNEL)).await?;
    Ok(pubsub)
}

/// The new primary of a `+switch-master` payload, if it is `master`'s.
fn switched_to<'a>(payload: &'a str, master: &str) -> Option<(&'a str, u16)> {
    let mut f = payload.split_ascii_whitespace();
    if f.next()? != master {
        return None;
    }
    let (_old_ip, _old_port, ip, port) = (f.next()?, f.next()?, f.next()?, f.next()?);
    Some((ip, port.parse().ok()?))
}

/// The primary's connection: the address a sentinel named, the primary's
/// credentials and database, TLS when the sentinels speak it.
fn node(s: &ValkeySentinel, host: String, port: u16) -> ConnectionInfo {
    let addr = match tls(s) {
        true => ConnectionAddr::TcpTls {
            host,
            port,
            insecure: false,
            tls_params: None,
        },
        false => ConnectionAddr::Tcp(host, port),
    };
    ConnectionInfo {
        addr,
        redis: RedisConnectionInfo {
            db: i64::from(s.db),
            username: s.username.clone(),
            password: s.password.clone(),
            ..RedisConnectionInfo::default()
        },
    }
}

/// How `/debug/index` and the logs name the primary (no credentials).
fn server(s: &ValkeySentinel, host: &str, port: u16) -> String {
    let scheme = if tls(s) { "rediss" } else { "redis" };
    format!("{scheme}://{host}:{port}")
}

fn tls(s: &ValkeySentinel) -> bool {
    s.urls.first().is_some_and(|u| is_tls_url(u))
}

/// `url` without its password, for logs and errors.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://…{}", &url[..scheme], &url[at..])
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_is_read_for_its_master_only() {
        let p = "kvmesh 127.0.0.1 6379 127.0.0.1 6380";
        assert_eq!(switched_to(p, "kvmesh"), Some(("127.0.0.1", 6380)));
        assert_eq!(switched_to(p, "other"), None);
        assert_eq!(switched_to("kvmesh 127.0.0.1 6379", "kvmesh"), None);
        assert_eq!(switched_to("kvmesh a 1 b port", "kvmesh"), None);
    }

    #[test]
    fn the_primary_gets_its_own_credentials_and_the_sentinels_scheme() {
        let s = ValkeySentinel {
            urls: vec!["rediss://:pw@sentinel:26379".into()],
            master: "kvmesh".into(),
            password: Some("primary-pw".into()),
            db: 2,
            ..ValkeySentinel::default()
        };
        let n = node(&s, "10.0.0.5".into(), 6380);
        assert!(
            matches!(n.addr, ConnectionAddr::TcpTls { ref host, port: 6380, .. } if host == "10.0.0.5")
        );
        assert_eq!(n.redis.password.as_deref(), Some("primary-pw"));
        assert_eq!(n.redis.db, 2);
        assert_eq!(server(&s, "10.0.0.5", 6380), "rediss://10.0.0.5:6380");
        assert_eq!(redact(&s.urls[0]), "rediss://…@sentinel:26379");
        assert_eq!(redact("redis://sentinel:26379"), "redis://sentinel:26379");
    }
}
