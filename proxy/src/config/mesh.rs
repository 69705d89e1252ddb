//! The `mesh` section of `proxy.yaml`: the mesh port, this pod's advertised
//! identity, how peers are discovered, and the stream's timings
//! (docs/mesh.md). Without `listen` the mesh is off and the sidecar routes
//! to its own engine only.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::Duration;

/// See the module docs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Mesh {
    /// Where the mesh port (h2c state stream) listens; absent: no mesh.
    pub listen: Option<SocketAddr>,
    /// This pod's identity, `host:port` of its client port as peers reach it;
    /// default: the client listener's bound address.
    pub advertise: Option<String>,
    /// Peers' mesh addresses, `host:port` (resolved on every refresh).
    pub peers: Vec<String>,
    /// A headless Service whose A/AAAA records are the peers.
    pub dns: Option<DnsDiscovery>,
    /// A file of peer mesh addresses, one per line (`#` comments), polled.
    pub file: Option<PathBuf>,
    /// How often DNS is re-resolved and the file re-read.
    pub refresh_interval: Duration,
    /// A peer whose stream is silent this long leaves the scheduling set.
    pub stale_after: Duration,
    /// How often the local load and in-flight counts are published.
    pub load_interval: Duration,
    /// Frames queued per subscriber; a subscriber that falls this far behind
    /// is dropped (it reconnects and resyncs from a snapshot).
    pub subscriber_queue: usize,
    /// Most subscribers served at once.
    pub max_subscribers: usize,
    /// Deadline of connecting to a peer's mesh port (TCP and HTTP/2).
    pub connect_timeout: Duration,
    /// Longest pause between reconnect attempts (the backoff doubles up to it).
    pub reconnect_max: Duration,
    /// Which discovered peers are followed (docs/mesh.md, "How it shards").
    pub follow: Follow,
    /// Mutual TLS on the state streams; absent: h2c.
    pub tls: Option<MeshTlsFiles>,
}

/// PEM files of the mesh's mutual TLS (docs/mesh.md, "Security").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeshTlsFiles {
    /// The mesh CA: a peer's certificate must chain to one of these.
    pub ca: PathBuf,
    /// This sidecar's certificate chain (leaf first), presented on the mesh
    /// port and to the peers it subscribes to.
    pub cert: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The DNS name (SAN) every mesh certificate carries; a peer is verified
    /// against it, not against its pod IP.
    #[serde(default = "default_server_name")]
    pub server_name: String,
}

fn default_server_name() -> String {
    "kvmesh-mesh".to_owned()
}

/// Which discovered peers a sidecar follows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Follow {
    /// Every peer: requests for any model the mesh serves can be routed here.
    #[default]
    All,
    /// Only peers announcing a model this pod serves (`pod.models`); a peer
    /// announcing no models is followed. Twenty models over 1000 pods make
    /// twenty meshes of 50, but a request for another model finds no pod.
    SameModels,
}

impl Follow {
    /// Whether a peer announcing `theirs` is followed by a pod serving `ours`.
    pub fn follows(self, ours: &[String], theirs: &[String]) -> bool {
        match self {
            Self::All => true,
            Self::SameModels => theirs.is_empty() || theirs.iter().any(|m| ours.contains(m)),
        }
    }
}

/// DNS discovery of a headless Service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DnsDiscovery {
    /// e.g. `kvmesh-mesh.default.svc.cluster.local`.
    pub name: String,
    /// The mesh port of every pod behind it.
    pub port: u16,
}

impl Default for Mesh {
    fn default() -> Self {
        Self {
            listen: None,
            advertise: None,
            peers: Vec::new(),
            dns: None,
            file: None,
            refresh_interval: Duration::from_secs(5),
            stale_after: Duration::from_secs(3),
            load_interval: Duration::from_millis(200),
            subscriber_queue: 1024,
            max_subscribers: 1024,
            connect_timeout: Duration::from_secs(2),
            reconnect_max: Duration::from_secs(5),
            follow: Follow::All,
            tls: None,
        }
    }
}

impl Mesh {
    /// Rules that span fields; `(field, message)` on the first broken one.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let err = |f: &str, m: String| Err((format!("mesh.{f}"), m));
        if let Some(a) = &self.advertise {
            if !is_host_port(a) {
                return err("advertise", format!("{a:?} is not host:port"));
            }
        }
        for p in &self.peers {
            if !is_host_port(p) {
                return err("peers", format!("{p:?} is not host:port"));
            }
        }
        if let Some(d) = &self.dns {
            if d.name.is_empty() || d.port == 0 {
                return err("dns", "needs a name and a non-zero port".to_owned());
            }
        }
        if self.subscriber_queue == 0 || self.max_subscribers == 0 {
            return err("subscriber_queue", "must be at least 1".to_owned());
        }
        if self.load_interval >= self.stale_after {
            return err(
                "load_interval",
                format!(
                    "{} must be shorter than stale_after ({}): the load is the stream's heartbeat",
                    self.load_interval, self.stale_after
                ),
            );
        }
        if self.tls.is_some() && self.listen.is_none() {
            return err("tls", "is set but the mesh port (listen) is not".to_owned());
        }
        let discovers = !self.peers.is_empty() || self.dns.is_some() || self.file.is_some();
        if discovers && self.listen.is_none() {
            return err(
                "listen",
                "peers are configured but the mesh port is not".to_owned(),
            );
        }
        Ok(())
    }
}

/// `host:port` with a non-empty host and a numeric port.
pub fn is_host_port(s: &str) -> bool {
    match s.rsplit_once(':') {
        Some((h, p)) => !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use crate::config::from_yaml_str;

    fn load(yaml: &str) -> Result<crate::config::Config, String> {
        from_yaml_str(yaml, "proxy.yaml").map_err(|e| e.to_string())
    }

    #[test]
    fn a_full_mesh_section_loads() {
        let c = load(
            "mesh:\n  listen: 0.0.0.0:7000\n  advertise: pod-a.ns:8000\n  peers: [10.0.0.2:7000, pod-c.ns:7000]\n  dns: {name: kvmesh.ns.svc, port: 7000}\n  file: /etc/kvmesh/peers\n  stale_after: 2s\n",
        )
        .unwrap();
        assert_eq!(c.mesh.peers.len(), 2);
        assert_eq!(c.mesh.dns.unwrap().port, 7000);
        assert_eq!(c.mesh.advertise.as_deref(), Some("pod-a.ns:8000"));
    }

    #[test]
    fn bad_mesh_sections_name_the_field() {
        for (yaml, field) in [
            (
                "mesh:\n  listen: 0.0.0.0:7000\n  peers: [nope]\n",
                "mesh.peers",
            ),
            ("mesh:\n  peers: [10.0.0.2:7000]\n", "mesh.listen"),
            (
                "mesh:\n  listen: 0.0.0.0:7000\n  load_interval: 5s\n",
                "mesh.load_interval",
            ),
            ("mesh:\n  listen: 0.0.0.0:7000\n  bogus: 1\n", "mesh"),
            (
                "mesh:\n  listen: 0.0.0.0:7000\n  follow: same-models\n",
                "mesh.follow",
            ),
            ("mesh:\n  follow: some\n", "mesh.follow"),
            ("mesh:\n  tls: {ca: a, cert: b, key: c}\n", "mesh.tls"),
            (
                "mesh:\n  listen: 0.0.0.0:7000\n  tls: {ca: a, cert: b}\n",
                "mesh.tls",
            ),
        ] {
            let e = load(yaml).unwrap_err();
            assert!(e.contains(field), "{yaml}: {e}");
        }
    }

    #[test]
    fn same_models_follows_a_peer_sharing_a_model_or_announcing_none() {
        use super::Follow;
        let ours = ["a".to_owned(), "b".to_owned()];
        let (b, c) = (["b".to_owned()], ["c".to_owned()]);
        assert!(Follow::SameModels.follows(&ours, &b));
        assert!(!Follow::SameModels.follows(&ours, &c));
        assert!(Follow::SameModels.follows(&ours, &[]));
        assert!(Follow::All.follows(&ours, &c));
        let c = load("pod:\n  models: [a]\nmesh:\n  listen: 0.0.0.0:7000\n  follow: same-models\n")
            .unwrap();
        assert_eq!(c.mesh.follow, Follow::SameModels);
    }
}
