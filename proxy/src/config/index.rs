//! The `index` section of `proxy.yaml`: where the fleet's prefix index and
//! load live (docs/mesh.md, "Past the full mesh: Valkey").
//!
//! * `backend: mesh` (the default): every sidecar follows every peer over
//!   the mesh's state stream and keeps the whole fleet's index in memory.
//!   Right for tens of pods.
//! * `backend: valkey`: each sidecar writes only its own pod's blocks and
//!   record (address, role, models, load, a lease) to Valkey, and asks it,
//!   once per routing decision, which pods hold a request's prefix and how
//!   loaded they and a few others are. Right for hundreds to thousands.
//!
//! ```yaml
//! index:
//!   backend: valkey
//!   valkey:
//!     urls: ["redis://valkey-0.valkey:6379", "redis://valkey-1.valkey:6379"]
//! ```
//!
//! Behind Valkey Sentinel, the sentinels and the name they monitor the
//! primary under, instead of `urls`:
//!
//! ```yaml
//! index:
//!   backend: valkey
//!   valkey:
//!     sentinel:
//!       urls: ["redis://valkey-sentinel:26379"]
//!       master: kvmesh
//! ```

use serde::{Deserialize, Serialize};

use super::Duration;

/// See the module docs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Index {
    pub backend: Backend,
    /// Settings of `backend: valkey` (ignored by the mesh).
    pub valkey: Valkey,
}

/// Where the fleet's prefix index and load live.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// Every sidecar follows every peer (the state stream of docs/mesh.md).
    #[default]
    Mesh,
    /// A shared Valkey (or Redis) deployment.
    Valkey,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Mesh => "mesh",
            Self::Valkey => "valkey",
        }
    }
}

/// `index.valkey`: how the sidecar reaches Valkey and how it uses it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Valkey {
    /// `redis://[user:password@]host:port[/db]` (`rediss://` over TLS; `valkey://`
    /// and `valkeys://` are the same). One URL: a single server.
    /// Several without `cluster`: a primary and its replicas, in any order;
    /// the sidecar uses the one that answers `ROLE` as primary and moves to
    /// another when it fails (after Sentinel, an operator or an operator
    /// pod promoted it). With `cluster`: seed nodes of a Valkey cluster.
    pub urls: Vec<String>,
    /// The URLs are seeds of a Valkey cluster (slots, `MOVED` redirects).
    pub cluster: bool,
    /// Find the primary through Valkey Sentinel instead of `urls` (which
    /// then stay empty): the sentinels are asked for the primary of
    /// `master`, and asked again whenever it fails or they switch it.
    pub sentinel: Option<ValkeySentinel>,
    /// TLS files for `rediss://` URLs. Without them a `rediss://` server is
    /// verified against the system's roots and no client certificate is sent.
    pub tls: Option<ValkeyTls>,
    /// First part of every key, so several fleets can share one Valkey.
    pub key_prefix: String,
    /// Stripes per model: a pod writes to the stripe its id hashes to, and a
    /// lookup asks every stripe at once (one round trip each, in parallel).
    /// One stripe is one cluster slot; more spread a large model's writes
    /// over several primaries (docs/mesh.md has the sizing rule).
    pub stripes: u16,
    /// Longest wait for one lookup; past it the request is routed on what
    /// the sidecar knows (its own pod, recent decisions, recent loads).
    pub lookup_deadline: Duration,
    /// How long a lookup's answer is reused for the same prompt prefix.
    pub cache_ttl: Duration,
    /// How often the pod's record (load, in-flight, lease) is rewritten.
    pub lease_interval: Duration,
    /// A record not rewritten this long expires: the pod leaves every
    /// decision, and its blocks are fenced until their keys expire.
    pub lease_ttl: Duration,
    /// Block keys expire this long after their last write; each sidecar
    /// rewrites its pod's blocks every half of it (jittered).
    pub block_ttl: Duration,
    /// Block changes are gathered this long before they are written.
    pub flush_interval: Duration,
    /// Most pods a lookup returns for holding the prefix (deepest first).
    pub matched: u16,
    /// Pods sampled at random per stripe besides them (power of d choices).
    pub random: u16,
    /// Pods per stripe taken from a hash ring of the prefix, so every sidecar
    /// sees the same homes for a prefix nobody holds yet.
    pub ring: u16,
    /// Upper bound of the random delay before a sidecar rewrites its pod's
    /// state after Valkey lost it (restart, failover), so a fleet does not
    /// rewrite at once.
    pub resync_jitter: Duration,
    /// Most blocks per second one sidecar rewrites in a resync.
    pub resync_rate: u32,
    /// Block changes held while Valkey cannot be written; past it they are
    /// dropped and the pod's state is rewritten whole once Valkey is back.
    pub max_pending: usize,
    /// A pod not seen in any lookup this long is forgotten by this sidecar.
    pub forget_after: Duration,
    /// Approximate mode (`prefix.tokenizer: none`): a routing decision's
    /// guess that its pod holds the prompt's text blocks stays in Valkey
    /// this long after the last decision that sent the prompt there (less
    /// up to a quarter of it: a sidecar rewrites one guess at most every
    /// quarter), then attracts no request any more.
    pub approx_ttl: Duration,
}

/// `index.valkey.sentinel`: where the sentinels are and which primary.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ValkeySentinel {
    /// The sentinels, `redis://[user:password@]host:port` (port 26379 by
    /// convention; `rediss://` over TLS, and then the primary too), asked
    /// in this order. A user and password here are the sentinel's own.
    pub urls: Vec<String>,
    /// The name the sentinels monitor the primary under (`sentinel monitor
    /// NAME ...` in their configuration).
    pub master: String,
    /// The user and password of the primary the sentinels name (ACL or
    /// `requirepass`), when it asks for them.
    pub username: Option<String>,
    pub password: Option<String>,
    /// The database number on the primary.
    pub db: u16,
}

/// `index.valkey.tls`: PEM files for TLS to Valkey (every URL `rediss://`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ValkeyTls {
    /// CA certificates the server's certificate must chain to, instead of the
    /// system's roots (a private CA, as managed Valkey services and
    /// cert-manager issue).
    pub ca: Option<std::path::PathBuf>,
    /// A client certificate chain (leaf first), for servers that require one
    /// (`tls-auth-clients yes`); with `key`.
    pub cert: Option<std::path::PathBuf>,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: Option<std::path::PathBuf>,
}

/// Whether `url` asks for TLS.
pub fn is_tls_url(url: &str) -> bool {
    url.starts_with("rediss://") || url.starts_with("valkeys://")
}

impl Default for Valkey {
    fn default() -> Self {
        Self {
            urls: Vec::new(),
            cluster: false,
            sentinel: None,
            tls: None,
            key_prefix: "kvmesh".to_owned(),
            stripes: 1,
            lookup_deadline: Duration::from_millis(5),
            cache_ttl: Duration::from_millis(50),
            lease_interval: Duration::from_millis(200),
            lease_ttl: Duration::from_secs(3),
            block_ttl: Duration::from_secs(1800),
            flush_interval: Duration::from_millis(10),
            matched: 16,
            random: 4,
            ring: 2,
            resync_jitter: Duration::from_secs(2),
            resync_rate: 20_000,
            max_pending: 1 << 18,
            forget_after: Duration::from_secs(30),
            // Dynamo's router keeps a guess as long without KV events
            // (`--router-ttl-secs`).
            approx_ttl: Duration::from_secs(120),
        }
    }
}

/// Rules that span fields; `(field, message)` on the first broken one.
pub fn validate(c: &super::Config) -> Result<(), (String, String)> {
    let err = |f: &str, m: String| Err((format!("index.{f}"), m));
    let v = &c.index.valkey;
    if c.index.backend != Backend::Valkey {
        return Ok(());
    }
    let (servers, field) = match &v.sentinel {
        Some(s) => {
            sentinel(v, s)?;
            (&s.urls, "valkey.sentinel.urls")
        }
        None if v.urls.is_empty() => {
            return err(
                "valkey.urls",
                "backend valkey needs at least one URL (redis://host:port), or sentinel: {urls, master}"
                    .to_owned(),
            )
        }
        None => (&v.urls, "valkey.urls"),
    };
    for u in servers {
        if !(u.starts_with("redis://") || u.starts_with("valkey://") || is_tls_url(u)) {
            return err(
                field,
                format!("{u:?} must start with redis://, rediss:// (TLS), valkey:// or valkeys://"),
            );
        }
    }
    let tls_urls = servers.iter().filter(|u| is_tls_url(u)).count();
    if tls_urls != 0 && tls_urls != servers.len() {
        return err(
            field,
            "mixes TLS (rediss://) and plain URLs: use one or the other for every server"
                .to_owned(),
        );
    }
    if let Some(t) = &v.tls {
        if tls_urls == 0 {
            return err(
                "valkey.tls",
                "is set but no URL asks for TLS: write them rediss://host:port".to_owned(),
            );
        }
        if t.cert.is_some() != t.key.is_some() {
            return err(
                "valkey.tls",
                "a client certificate needs both cert and key".to_owned(),
            );
        }
        for (field, path) in [("ca", &t.ca), ("cert", &t.cert), ("key", &t.key)] {
            if let Some(path) = path {
                if let Err(e) = std::fs::metadata(path) {
                    return err(
                        &format!("valkey.tls.{field}"),
                        format!("{}: {e}", path.display()),
                    );
                }
            }
        }
    }
    if v.key_prefix.is_empty() || v.key_prefix.contains(['{', '}']) {
        return err(
            "valkey.key_prefix",
            format!("{:?} must be non-empty without braces", v.key_prefix),
        );
    }
    if !(1..=256).contains(&v.stripes) {
        return err("valkey.stripes", format!("{} is not in 1..=256", v.stripes));
    }
    if v.lease_ttl <= v.lease_interval {
        return err(
            "valkey.lease_ttl",
            format!(
                "{} must be longer than lease_interval ({}), or a live pod's lease would lapse",
                v.lease_ttl, v.lease_interval
            ),
        );
    }
    if v.block_ttl.get() < 4 * v.lease_ttl.get() {
        return err(
            "valkey.block_ttl",
            format!("{} must be at least 4x lease_ttl", v.block_ttl),
        );
    }
    if v.matched == 0 || v.matched > 256 || v.random > 64 || v.ring > 64 {
        return err(
            "valkey.matched",
            "matched must be in 1..=256, random and ring at most 64".to_owned(),
        );
    }
    if v.approx_ttl.get() < std::time::Duration::from_millis(100) {
        return err(
            "valkey.approx_ttl",
            format!("{} is shorter than 100ms", v.approx_ttl),
        );
    }
    if v.resync_rate == 0 || v.max_pending == 0 {
        return err(
            "valkey.resync_rate",
            "resync_rate and max_pending must be at least 1".to_owned(),
        );
    }
    let m = &c.mesh;
    let discovery = [
        ("mesh.peers", !m.peers.is_empty()),
        ("mesh.dns", m.dns.is_some()),
        ("mesh.file", m.file.is_some()),
    ];
    if let Some((field, _)) = discovery.iter().find(|(_, set)| *set) {
        return Err((
            (*field).to_owned(),
            "with index.backend valkey, pods find each other through Valkey: \
             mesh.peers, mesh.dns and mesh.file are for backend mesh"
                .to_owned(),
        ));
    }
    Ok(())
}

/// The rules of `index.valkey.sentinel`.
fn sentinel(v: &Valkey, s: &ValkeySentinel) -> Result<(), (String, String)> {
    let err = |f: &str, m: &str| Err((format!("index.valkey.{f}"), m.to_owned()));
    if !v.urls.is_empty() {
        return err(
            "urls",
            "with sentinel the sentinels name the primary: leave urls empty \
             and list the sentinels in sentinel.urls",
        );
    }
    if v.cluster {
        return err(
            "sentinel",
            "Sentinel watches a primary and its replicas, and a Valkey cluster \
             fails over by itself: set sentinel or cluster, not both",
        );
    }
    if s.urls.is_empty() {
        return err(
            "sentinel.urls",
            "needs at least one sentinel (redis://host:26379)",
        );
    }
    if s.master.trim().is_empty() {
        return err(
            "sentinel.master",
            "needs the name the sentinels monitor the primary under \
             (sentinel monitor NAME ... in their configuration)",
        );
    }
    if s.username.is_some() && s.password.is_none() {
        return err("sentinel.username", "a username needs its password");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valkey() -> super::super::Config {
        let mut c = super::super::Config::default();
        c.index.backend = Backend::Valkey;
        c.index.valkey.urls = vec!["redis://127.0.0.1:6379".into()];
        c
    }

    #[test]
    fn the_error_names_the_field_that_is_wrong() {
        assert_eq!(validate(&valkey()), Ok(()));
        let mut c = valkey();
        c.mesh.file = Some("peers.txt".into());
        assert_eq!(validate(&c).unwrap_err().0, "mesh.file");
        let mut c = valkey();
        c.index.valkey.urls.clear();
        assert_eq!(validate(&c).unwrap_err().0, "index.valkey.urls");
        let mut c = valkey();
        c.index.valkey.lease_ttl = c.index.valkey.lease_interval;
        assert_eq!(validate(&c).unwrap_err().0, "index.valkey.lease_ttl");
        let mut c = valkey();
        c.index.valkey.urls = vec!["http://x".into()];
        assert!(validate(&c).unwrap_err().1.contains("redis://"));
        // The mesh backend ignores the valkey section.
        let mut c = super::super::Config::default();
        c.index.valkey.urls.clear();
        assert_eq!(validate(&c), Ok(()));
        let mut c = valkey();
        c.index.valkey.approx_ttl = Duration::from_millis(10);
        assert_eq!(validate(&c).unwrap_err().0, "index.valkey.approx_ttl");
    }

    #[test]
    fn sentinel_needs_sentinels_and_a_master_and_no_primary_or_cluster() {
        let with = |f: &dyn Fn(&mut Valkey, &mut ValkeySentinel)| {
            let mut c = valkey();
            c.index.valkey.urls.clear();
            let mut s = ValkeySentinel {
                urls: vec!["redis://sentinel:26379".into()],
                master: "kvmesh".into(),
                ..ValkeySentinel::default()
            };
            f(&mut c.index.valkey, &mut s);
            c.index.valkey.sentinel = Some(s);
            validate(&c).err().map(|(field, _)| field)
        };
        assert_eq!(with(&|_, _| {}), None);
        let field = |f: &dyn Fn(&mut Valkey, &mut ValkeySentinel)| with(f).unwrap_or_default();
        assert_eq!(field(&|_, s| s.urls.clear()), "index.valkey.sentinel.urls");
        assert_eq!(
            field(&|_, s| s.master.clear()),
            "index.valkey.sentinel.master"
        );
        assert_eq!(
            field(&|v, _| v.urls = vec!["redis://a:6379".into()]),
            "index.valkey.urls"
        );
        assert_eq!(field(&|v, _| v.cluster = true), "index.valkey.sentinel");
        assert_eq!(
            field(&|_, s| s.urls = vec!["http://sentinel:26379".into()]),
            "index.valkey.sentinel.urls"
        );
        assert_eq!(
            field(&|_, s| s.urls.push("rediss://tls-sentinel:26379".into())),
            "index.valkey.sentinel.urls"
        );
        assert_eq!(
            field(&|_, s| s.username = Some("kvmesh".into())),
            "index.valkey.sentinel.username"
        );
        // TLS files go with rediss:// sentinels (and then the primary).
        assert_eq!(
            field(&|v, _| v.tls = Some(ValkeyTls::default())),
            "index.valkey.tls"
        );
        assert_eq!(
            with(&|v, s| {
                s.urls = vec!["rediss://sentinel:26379".into()];
                v.tls = Some(ValkeyTls::default());
            }),
            None
        );
    }
}
