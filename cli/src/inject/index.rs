//! `kvmesh inject --index valkey --valkey-url URL [--valkey-cluster]` (or
//! `--valkey-sentinel URL --valkey-master NAME` behind Sentinel): the
//! index flags written into the proxy.yaml the ConfigMap carries, rather than
//! passed to the sidecar as flags, because backend valkey changes the mesh
//! section too.
//!
//! With `index.backend: valkey` the pods find each other through Valkey, and
//! the sidecar refuses the mesh's peer discovery: `mesh.peers`, `mesh.dns`
//! and `mesh.file` are removed, and `mesh.listen` with them unless
//! `mesh.tls` is set (requests forwarded between sidecars over mutual TLS
//! still use the mesh port). The headless `kvmesh-mesh` Service the DNS
//! discovery needed is not emitted either ([`super::InjectOptions`]'s
//! `mesh_service`). The file is rewritten from its parsed value, so the
//! original's comments are not kept; without index flags it is left as it is.

use kvmesh_proxy::config::index::Backend;
use kvmesh_proxy::config::Config;
use serde_yaml_ng::{Mapping, Value};

use super::sidecar::s;
use super::yaml;

/// The index flags of `kvmesh inject`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexFlags {
    /// `--index`: replaces `index.backend`.
    pub backend: Option<Backend>,
    /// `--valkey-url`: added to `index.valkey.urls`.
    pub urls: Vec<String>,
    /// `--valkey-cluster`: sets `index.valkey.cluster`.
    pub cluster: bool,
    /// `--valkey-sentinel`: added to `index.valkey.sentinel.urls`.
    pub sentinels: Vec<String>,
    /// `--valkey-master`: sets `index.valkey.sentinel.master`.
    pub master: Option<String>,
}

impl IndexFlags {
    /// Whether any flag sets something under `index.valkey`.
    fn sets_valkey(&self) -> bool {
        !self.urls.is_empty() || self.cluster || !self.sentinels.is_empty() || self.master.is_some()
    }
}

/// proxy.yaml with the flags applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rewritten {
    pub text: String,
    /// The `mesh` keys removed (`mesh.dns`, `mesh.listen`, ...), in file order.
    pub dropped: Vec<String>,
}

/// Why the flags could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("--valkey-url, --valkey-cluster, --valkey-sentinel and --valkey-master need --index valkey, or index.backend: valkey in {origin}")]
    NotValkey { origin: String },
    #[error("{origin}: {field} is not a mapping")]
    Malformed { origin: String, field: String },
    #[error("{origin}: {message}")]
    Syntax { origin: String, message: String },
    #[error("writing proxy.yaml: {0}")]
    Emit(#[from] yaml::EmitError),
}

/// Applies `flags` to `text` (whose decoded and validated form is `file`);
/// `None` when they change nothing, so the file goes out as written.
pub fn apply(
    text: &str,
    file: &Config,
    flags: &IndexFlags,
    origin: &str,
) -> Result<Option<Rewritten>, IndexError> {
    let backend = flags.backend.unwrap_or(file.index.backend);
    let valkey_flags = flags.sets_valkey();
    if valkey_flags && backend != Backend::Valkey {
        return Err(IndexError::NotValkey {
            origin: origin.to_owned(),
        });
    }
    if backend == file.index.backend && !valkey_flags {
        return Ok(None);
    }
    let malformed = |field: &str| IndexError::Malformed {
        origin: origin.to_owned(),
        field: field.to_owned(),
    };
    let mut doc: Value = serde_yaml_ng::from_str(text).map_err(|e| IndexError::Syntax {
        origin: origin.to_owned(),
        message: e.to_string(),
    })?;
    if doc.is_null() {
        doc = Value::Mapping(Mapping::new());
    }
    let root = doc
        .as_mapping_mut()
        .ok_or_else(|| malformed("<document>"))?;
    let index = child(root, "index").ok_or_else(|| malformed("index"))?;
    index.insert(s("backend"), s(backend.as_str()));
    if valkey_flags {
        let valkey = child(index, "valkey").ok_or_else(|| malformed("index.valkey"))?;
        if flags.cluster {
            valkey.insert(s("cluster"), Value::Bool(true));
        }
        extend(valkey, "urls", &flags.urls).ok_or_else(|| malformed("index.valkey.urls"))?;
        if !flags.sentinels.is_empty() || flags.master.is_some() {
            let sentinel =
                child(valkey, "sentinel").ok_or_else(|| malformed("index.valkey.sentinel"))?;
            extend(sentinel, "urls", &flags.sentinels)
                .ok_or_else(|| malformed("index.valkey.sentinel.urls"))?;
            if let Some(m) = &flags.master {
                sentinel.insert(s("master"), s(m));
            }
        }
    }
    let mut dropped = Vec::new();
    if backend == Backend::Valkey {
        dropped = drop_discovery(root).ok_or_else(|| malformed("mesh"))?;
    }
    let mut out =
        format!("# {origin}, with kvmesh inject's index flags applied (docs/config.md, `index`)\n");
    yaml::emit(&doc, &mut out)?;
    Ok(Some(Rewritten { text: out, dropped }))
}

/// Removes the mesh's peer discovery, and its port unless mutual TLS needs
/// it; the section goes when nothing is left. `None`: `mesh` is not a mapping.
fn drop_discovery(root: &mut Mapping) -> Option<Vec<String>> {
    let Some(mesh) = root.get_mut("mesh") else {
        return Some(Vec::new());
    };
    if mesh.is_null() {
        root.shift_remove("mesh");
        return Some(Vec::new());
    }
    let mesh = mesh.as_mapping_mut()?;
    let tls = mesh.get("tls").is_some_and(|t| !t.is_null());
    let mut dropped = Vec::new();
    mesh.retain(|k, _| {
        let key = k.as_str().unwrap_or("");
        let drop = matches!(key, "peers" | "dns" | "file") || (key == "listen" && !tls);
        if drop {
            dropped.push(format!("mesh.{key}"));
        }
        !drop
    });
    if mesh.is_empty() {
        root.shift_remove("mesh");
    }
    Some(dropped)
}

/// Appends `items` to the list at `key` (made when absent or null); `None`
/// when it is something else. Nothing to add changes nothing.
fn extend(m: &mut Mapping, key: &str, items: &[String]) -> Option<()> {
    if items.is_empty() {
        return Some(());
    }
    let list = m.entry(s(key)).or_insert(Value::Null);
    if list.is_null() {
        *list = Value::Sequence(Vec::new());
    }
    list.as_sequence_mut()?.extend(items.iter().map(|u| s(u)));
    Some(())
}

/// The mapping at `key`, made when absent or null; `None` when it is
/// something else.
fn child<'a>(m: &'a mut Mapping, key: &str) -> Option<&'a mut Mapping> {
    let v = m.entry(s(key)).or_insert(Value::Null);
    if v.is_null() {
        *v = Value::Mapping(Mapping::new());
    }
    v.as_mapping_mut()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kvmesh_proxy::config::load::from_yaml_str;

    const MESH: &str = "# the default\nlisteners:\n  client: 0.0.0.0:8100\nmesh:\n  listen: 0.0.0.0:7000\n  dns: {name: kvmesh-mesh, port: 7000}\n  stale_after: 3s\n";

    fn valkey(urls: &[&str]) -> IndexFlags {
        IndexFlags {
            backend: Some(Backend::Valkey),
            urls: urls.iter().map(|u| (*u).to_owned()).collect(),
            ..IndexFlags::default()
        }
    }

    fn run(text: &str, flags: &IndexFlags) -> Result<Option<(Rewritten, Config)>, String> {
        let file = from_yaml_str(text, "p.yaml").unwrap();
        match apply(text, &file, flags, "p.yaml") {
            Ok(Some(r)) => {
                let c = from_yaml_str(&r.text, "out").map_err(|e| format!("{e}\n{}", r.text))?;
                Ok(Some((r, c)))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }

    #[test]
    fn valkey_replaces_the_mesh_discovery_with_the_index_section() {
        let (r, c) = run(
            MESH,
            &valkey(&["redis://valkey-0:6379", "redis://valkey-1:6379"]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(c.index.backend, Backend::Valkey);
        assert_eq!(
            c.index.valkey.urls,
            ["redis://valkey-0:6379", "redis://valkey-1:6379"]
        );
        assert_eq!(r.dropped, ["mesh.listen", "mesh.dns"]);
        assert_eq!((c.mesh.listen, c.mesh.dns), (None, None));
        assert_eq!(c.mesh.stale_after.to_string(), "3s", "other mesh keys stay");
        assert_eq!(c.listeners.client.port(), 8100);
        assert!(
            r.text.starts_with("# p.yaml, with kvmesh inject's"),
            "{}",
            r.text
        );
    }

    #[test]
    fn mutual_tls_keeps_the_mesh_port() {
        let text = format!(
            "{MESH}  tls: {{ca: /m/ca.pem, cert: /m/tls.crt, key: /m/tls.key}}\nindex:\n  valkey:\n    urls: [redis://a:6379]\n    stripes: 3\n"
        );
        let mut flags = valkey(&["redis://b:6379"]);
        flags.cluster = true;
        let (r, c) = run(&text, &flags).unwrap().unwrap();
        assert_eq!(r.dropped, ["mesh.dns"]);
        assert_eq!(c.mesh.listen.map(|a| a.port()), Some(7000));
        assert!(c.mesh.tls.is_some());
        assert_eq!(c.index.valkey.urls, ["redis://a:6379", "redis://b:6379"]);
        assert!(c.index.valkey.cluster);
        assert_eq!(c.index.valkey.stripes, 3);
    }

    #[test]
    fn no_flags_or_the_same_backend_change_nothing() {
        assert_eq!(run(MESH, &IndexFlags::default()).unwrap(), None);
        let flags = IndexFlags {
            backend: Some(Backend::Mesh),
            ..IndexFlags::default()
        };
        assert_eq!(run(MESH, &flags).unwrap(), None);
    }

    #[test]
    fn valkey_settings_without_backend_valkey_are_refused() {
        let flags = IndexFlags {
            urls: vec!["redis://a:6379".to_owned()],
            ..IndexFlags::default()
        };
        let e = run(MESH, &flags).unwrap_err();
        assert!(e.contains("need --index valkey"), "{e}");
        // The file's own backend counts.
        let text = "index:\n  backend: valkey\n  valkey: {urls: [redis://a:6379]}\n";
        let (_, c) = run(text, &flags).unwrap().unwrap();
        assert_eq!(c.index.valkey.urls, ["redis://a:6379", "redis://a:6379"]);
    }

    #[test]
    fn sentinel_flags_name_the_sentinels_and_the_master() {
        let flags = IndexFlags {
            backend: Some(Backend::Valkey),
            sentinels: vec![
                "redis://s-0:26379".to_owned(),
                "redis://s-1:26379".to_owned(),
            ],
            master: Some("kvmesh".to_owned()),
            ..IndexFlags::default()
        };
        let (r, c) = run(MESH, &flags).unwrap().unwrap();
        let s = c.index.valkey.sentinel.unwrap();
        assert_eq!(s.urls, ["redis://s-0:26379", "redis://s-1:26379"]);
        assert_eq!(s.master, "kvmesh");
        assert!(c.index.valkey.urls.is_empty());
        assert_eq!(r.dropped, ["mesh.listen", "mesh.dns"]);
        // Without its master name the sidecar's validation refuses it.
        let flags = IndexFlags {
            master: None,
            ..flags
        };
        let e = run(MESH, &flags).unwrap_err();
        assert!(e.contains("sentinel.master"), "{e}");
        // And beside the file's own primary URLs.
        let text = "index:\n  backend: valkey\n  valkey: {urls: [redis://a:6379]}\n";
        let flags = IndexFlags {
            sentinels: vec!["redis://s-0:26379".to_owned()],
            master: Some("kvmesh".to_owned()),
            ..IndexFlags::default()
        };
        let e = run(text, &flags).unwrap_err();
        assert!(e.contains("leave urls empty"), "{e}");
    }

    #[test]
    fn backend_valkey_without_a_url_fails_the_sidecars_validation() {
        let e = run(MESH, &valkey(&[])).unwrap_err();
        assert!(e.contains("index.valkey.urls"), "{e}");
    }
}
