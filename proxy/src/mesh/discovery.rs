//! Membership: which mesh addresses to follow, and one owned subscriber task
//! per address.
//!
//! Sources, unioned: `mesh.peers` (static `host:port`, names re-resolved),
//! `mesh.dns` (a headless Service's A/AAAA records with tokio's resolver),
//! `mesh.file` (one `host:port` per line, `#` comments, re-read). All are
//! refreshed every `refresh_interval`. A source that fails to resolve keeps
//! its last good set, so a DNS hiccup does not empty the mesh. An address
//! that leaves every source has its task stopped, and its pod leaves the
//! fleet. On shutdown the tasks are aborted instead: the fleet keeps every
//! peer for the requests the draining sidecar still schedules. The loop
//! also publishes the peer gauges (known, fresh, lag).

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::subscriber::{self, PeerStatus};
use super::Tasks;
use crate::config::Mesh as MeshConfig;
use crate::fleet::MAX_PODS;
use crate::shutdown::Shutdown;

/// How often the peer gauges are refreshed.
const GAUGE_EVERY: Duration = Duration::from_millis(250);
/// Deadline of one name resolution.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest peers file read.
const MAX_FILE_BYTES: u64 = 1 << 20;

struct Follow {
    stop: CancellationToken,
    status: watch::Receiver<PeerStatus>,
}

/// Last good address sets, per source.
#[derive(Default)]
struct Sources {
    fixed: BTreeSet<SocketAddr>,
    dns: BTreeSet<SocketAddr>,
    file: BTreeSet<SocketAddr>,
}

/// The discovery loop (see the module docs). Returns on shutdown, after
/// every subscriber task stopped.
pub async fn run(shared: Tasks, shutdown: Shutdown) {
    let cfg = shared.config.mesh.clone();
    let own: Option<SocketAddr> = shared.mesh.mesh_addr();
    let mut follows: HashMap<SocketAddr, Follow> = HashMap::new();
    let mut tasks = JoinSet::new();
    let mut sources = Sources::default();
    let mut next_refresh = Instant::now();
    loop {
        while tasks.try_join_next().is_some() {}
        if Instant::now() >= next_refresh {
            refresh(&cfg, &mut sources).await;
            next_refresh = Instant::now() + cfg.refresh_interval.get();
            let want: BTreeSet<SocketAddr> = sources
                .fixed
                .iter()
                .chain(&sources.dns)
                .chain(&sources.file)
                .copied()
                .filter(|a| Some(*a) != own)
                .take(MAX_PODS)
                .collect();
            follows.retain(|addr, f| {
                let keep = want.contains(addr);
                if !keep {
                    tracing::info!(%addr, "mesh: peer left discovery");
                    f.stop.cancel();
                }
                keep
            });
            for addr in want {
                if follows.contains_key(&addr) {
                    continue;
                }
                let stop = CancellationToken::new();
                let (tx, rx) = watch::channel(PeerStatus::default());
                tasks.spawn(subscriber::run(shared.clone(), addr, stop.clone(), tx));
                follows.insert(addr, Follow { stop, status: rx });
            }
        }
        gauges(&shared, &follows, cfg.stale_after.get());
        tokio::select! {
            _ = shutdown.triggered() => break,
            _ = tokio::time::sleep(GAUGE_EVERY) => {}
        }
    }
    // Aborted, not stopped: a stopped subscriber forgets its peer, and a
    // draining sidecar still schedules the requests it took just before
    // (a prefill pod that forgot every peer would find no decode pod and
    // answer 503). The fleet keeps the peers as last seen.
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
}

fn gauges(shared: &Tasks, follows: &HashMap<SocketAddr, Follow>, stale: Duration) {
    let now = Instant::now();
    let (mut known, mut fresh, mut other_models, mut lag) = (0, 0, 0, 0u64);
    let mut entries = Vec::with_capacity(follows.len());
    for (addr, f) in follows {
        let s = f.status.borrow();
        entries.extend(peer_entry(*addr, &s, now, stale));
        if s.is_self {
            continue;
        }
        if s.other_models {
            other_models += 1;
            continue;
        }
        known += 1;
        if let (true, Some(at)) = (s.synced, s.last_frame) {
            let age = now.saturating_duration_since(at);
            if age < stale {
                fresh += 1;
                lag = lag.max(u64::try_from(age.as_millis()).unwrap_or(u64::MAX));
            }
        }
    }
    shared.mesh.metrics.peers(known, fresh, other_models);
    shared.mesh.metrics.lag_ms(lag);
    entries.sort_by(|a, b| a.mesh_addr.cmp(&b.mesh_addr));
    shared.mesh.set_peers(entries);
}

async fn refresh(cfg: &MeshConfig, s: &mut Sources) {
    if let Some(v) = resolve_all(&cfg.peers).await {
        s.fixed = v;
    }
    if let Some(d) = &cfg.dns {
        match tokio::time::timeout(
            RESOLVE_TIMEOUT,
            tokio::net::lookup_host((d.name.as_str(), d.port)),
        )
        .await
        {
            Ok(Ok(addrs)) => s.dns = addrs.collect(),
            Ok(Err(e)) => {
                tracing::warn!(name = %d.name, error = %e, "mesh: DNS discovery failed; keeping the last peers")
            }
            Err(_) => {
                tracing::warn!(name = %d.name, "mesh: DNS discovery timed out; keeping the last peers")
            }
        }
    }
    if let Some(path) = &cfg.file {
        match read_peers_file(path).await {
            Ok(lines) => {
                if let Some(v) = resolve_all(&lines).await {
                    s.file = v;
                }
            }
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "mesh: peers file unreadable; keeping the last peers")
            }
        }
    }
}

/// Every `host:port` resolved; `None` if any failed (the caller keeps the
/// last good set rather than losing the peers that did resolve).
async fn resolve_all(names: &[String]) -> Option<BTreeSet<SocketAddr>> {
    let mut out = BTreeSet::new();
    let mut ok = true;
    for n in names {
        if let Ok(a) = n.parse::<SocketAddr>() {
            out.insert(a);
            continue;
        }
        match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host(n.as_str())).await {
            Ok(Ok(addrs)) => out.extend(addrs),
            _ => {
                tracing::warn!(peer = %n, "mesh: cannot resolve peer");
                ok = false;
            }
        }
    }
    ok.then_some(out)
}

/// The lines of a peers file that name a peer.
pub async fn read_peers_file(path: &std::path::Path) -> std::io::Result<Vec<String>> {
    let meta = tokio::fs::metadata(path).await?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(std::io::Error::other("peers file larger than 1 MiB"));
    }
    let text = tokio::fs::read_to_string(path).await?;
    Ok(parse_peers(&text))
}

/// `host:port` entries of a peers file: one per line, `#` starts a comment.
pub fn parse_peers(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| crate::config::mesh::is_host_port(l))
        .map(str::to_owned)
        .collect()
}

/// A followed address as `/debug/stat` shows it (`None`: the address is
/// this sidecar).
fn peer_entry(
    addr: SocketAddr,
    s: &PeerStatus,
    now: Instant,
    stale: Duration,
) -> Option<crate::stat::PeerEntry> {
    if s.is_self {
        return None;
    }
    let age = s.last_frame.map(|at| now.saturating_duration_since(at));
    let state = if s.other_models {
        "other_models"
    } else if !s.synced {
        "connecting"
    } else if age.is_some_and(|a| a < stale) {
        "connected"
    } else {
        "stale"
    };
    Some(crate::stat::PeerEntry {
        mesh_addr: addr.to_string(),
        id: s.id.clone(),
        state: state.to_owned(),
        last_frame_ms: age.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn peer_states() {
        let now = tokio::time::Instant::now();
        let addr: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let stale = Duration::from_secs(1);
        let mut s = PeerStatus::default();
        let state = |s: &PeerStatus| peer_entry(addr, s, now, stale).map(|e| e.state);
        assert_eq!(state(&s).as_deref(), Some("connecting"));
        s.synced = true;
        s.last_frame = Some(now);
        assert_eq!(state(&s).as_deref(), Some("connected"));
        s.last_frame = now.checked_sub(Duration::from_secs(2));
        assert_eq!(state(&s).as_deref(), Some("stale"));
        s.other_models = true;
        assert_eq!(state(&s).as_deref(), Some("other_models"));
        s.is_self = true;
        assert_eq!(state(&s), None);
    }

    #[test]
    fn peers_file_lines() {
        let text = "# peers\n10.0.0.1:7000\n  pod-b.svc:7000 # b\nnot-an-addr\n\n:7000\n";
        assert_eq!(parse_peers(text), vec!["10.0.0.1:7000", "pod-b.svc:7000"]);
    }
}
