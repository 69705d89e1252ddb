//! `kvmesh inject` / `uninject`: add the kvmesh sidecar to the pod
//! templates of Kubernetes manifests, or take it out again, in the manner of
//! `linkerd inject`: `helm template … | kvmesh inject - | kubectl apply -f -`.
//!
//! Pure functions over `serde_yaml_ng` values; [`command`] reads files and
//! prints. Targets: Deployment, StatefulSet and Pod, and LeaderWorkerSet's
//! leader template only (the leader's sidecar speaks for the group; workers
//! are left alone). An LWS without a `leaderTemplate` runs its leader from
//! `workerTemplate`: inject then adds a `leaderTemplate` copied from the
//! worker template plus the sidecar, and records that it created it, so
//! uninject removes it again. The workers are unchanged either way.
//!
//! Every other kind passes through unchanged, with a note. Beside the
//! workloads, inject emits (before them, so `kubectl apply` creates them
//! first) one ConfigMap per namespace with proxy.yaml and filters.yaml under a
//! content-hashed name, and the Services `kvmesh` and `kvmesh-mesh` (the
//! latter for the mesh backend's DNS discovery only, not with `--index
//! valkey`: [`index`]), all annotated `kvmesh.dev/injected`; such resources in
//! the input are dropped and made again, which keeps inject idempotent.
//! Uninject drops them and removes from each template exactly what inject
//! added.

pub mod command;
pub mod index;
mod sidecar;
mod template;
#[cfg(test)]
mod tests;
pub mod yaml;

use serde_yaml_ng::{Mapping, Value};

pub use sidecar::{InjectOptions, Ports, CONTAINER, CREATED, INJECTED, LABEL};
use template::Injected;

/// Why a manifest could not be injected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InjectError {
    #[error("{what}: {field} is not {expected}")]
    Malformed {
        what: String,
        field: String,
        expected: &'static str,
    },
    #[error("{what}: {reason}")]
    Conflict { what: String, reason: String },
}

/// The documents to print, and notes for stderr.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    pub docs: Vec<Value>,
    pub notes: Vec<String>,
}

/// Injects every pod template in `docs`; see the module docs.
pub fn inject(docs: Vec<Value>, opts: &InjectOptions) -> Result<Outcome, InjectError> {
    let mut out = Outcome::default();
    let mut namespaces: Vec<Option<String>> = Vec::new();
    let mut body = Vec::new();
    for doc in docs {
        if let Some(doc) = visit(doc, &mut |obj| {
            inject_object(obj, opts, &mut out.notes, &mut namespaces)
        })? {
            body.push(doc);
        }
    }
    for ns in &namespaces {
        out.docs.push(opts.config_map(ns.as_deref()));
        out.docs.extend(opts.services(ns.as_deref()));
    }
    out.docs.extend(body);
    Ok(out)
}

/// Removes what [`inject`] added.
pub fn uninject(docs: Vec<Value>) -> Result<Outcome, InjectError> {
    let mut out = Outcome::default();
    for doc in docs {
        if let Some(doc) = visit(doc, &mut |obj| uninject_object(obj, &mut out.notes))? {
            out.docs.push(doc);
        }
    }
    Ok(out)
}

/// What to do with one object: keep it (possibly changed) or drop it.
enum Keep {
    Yes,
    Drop,
}

/// Applies `f` to a document, or to each item of a `kind: List`.
fn visit(
    mut doc: Value,
    f: &mut dyn FnMut(&mut Mapping) -> Result<Keep, InjectError>,
) -> Result<Option<Value>, InjectError> {
    let Some(obj) = doc.as_mapping_mut() else {
        return Ok(Some(doc));
    };
    if kind(obj) == Some("List") {
        if let Some(items) = obj.get_mut("items").and_then(Value::as_sequence_mut) {
            let mut kept = Vec::with_capacity(items.len());
            for mut item in std::mem::take(items) {
                let keep = match item.as_mapping_mut() {
                    Some(o) => f(o)?,
                    None => Keep::Yes,
                };
                if matches!(keep, Keep::Yes) {
                    kept.push(item);
                }
            }
            *items = kept;
        }
        return Ok(Some(doc));
    }
    Ok(match f(obj)? {
        Keep::Yes => Some(doc),
        Keep::Drop => None,
    })
}

fn inject_object(
    obj: &mut Mapping,
    opts: &InjectOptions,
    notes: &mut Vec<String>,
    namespaces: &mut Vec<Option<String>>,
) -> Result<Keep, InjectError> {
    if generated(obj) {
        return Ok(Keep::Drop);
    }
    let what = describe(obj);
    let Some((tpl, copied)) = target(obj, &what, true)? else {
        notes.push(format!("{what}: not a Deployment, StatefulSet, Pod or LeaderWorkerSet; passed through unchanged"));
        return Ok(Keep::Yes);
    };
    let result = template::inject(tpl, opts, &what, copied)?;
    match result {
        Injected::Yes => {
            let ns = namespace(obj);
            if !namespaces.contains(&ns) {
                namespaces.push(ns);
            }
        }
        Injected::OptedOut => {
            if copied {
                remove_leader_template(obj);
            }
            notes.push(format!("{what}: its pods are labelled {LABEL} other than \"true\"; passed through unchanged"));
        }
    }
    Ok(Keep::Yes)
}

fn uninject_object(obj: &mut Mapping, notes: &mut Vec<String>) -> Result<Keep, InjectError> {
    if generated(obj) {
        return Ok(Keep::Drop);
    }
    let what = describe(obj);
    let Some((tpl, _)) = target(obj, &what, false)? else {
        return Ok(Keep::Yes);
    };
    let created_leader = created_leader_template(tpl);
    if !template::uninject(tpl, &what)? {
        notes.push(format!("{what}: not injected; passed through unchanged"));
    } else if created_leader {
        remove_leader_template(obj);
    }
    Ok(Keep::Yes)
}

/// A ConfigMap or Service inject emitted earlier.
fn generated(obj: &Mapping) -> bool {
    matches!(kind(obj), Some("ConfigMap" | "Service"))
        && obj
            .get("metadata")
            .and_then(|m| m.get("annotations"))
            .and_then(|a| a.get(INJECTED))
            .is_some()
}

/// The pod template of an object inject handles (`None` for other kinds).
/// For an LWS without a leader template, `create` copies the worker template
/// (recorded in the template's created list), else there is none.
/// The flag says the template was just copied so.
fn target<'a>(
    obj: &'a mut Mapping,
    what: &str,
    create: bool,
) -> Result<Option<(&'a mut Mapping, bool)>, InjectError> {
    let malformed = |field: &str| InjectError::Malformed {
        what: what.to_owned(),
        field: field.to_owned(),
        expected: "a mapping",
    };
    let Some(kind) = kind(obj).map(str::to_owned) else {
        return Ok(None);
    };
    let api = obj.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    let group = api.rsplit_once('/').map_or("", |(g, _)| g);
    match (kind.as_str(), group) {
        ("Pod", "") => Ok(Some((obj, false))),
        ("Deployment" | "StatefulSet", "apps") => {
            let tpl = obj
                .get_mut("spec")
                .and_then(|s| s.get_mut("template"))
                .ok_or_else(|| malformed("spec.template"))?;
            tpl.as_mapping_mut()
                .map(|t| Some((t, false)))
                .ok_or_else(|| malformed("spec.template"))
        }
        ("LeaderWorkerSet", "leaderworkerset.x-k8s.io") => {
            let lwt = obj
                .get_mut("spec")
                .and_then(|s| s.get_mut("leaderWorkerTemplate"))
                .and_then(Value::as_mapping_mut)
                .ok_or_else(|| malformed("spec.leaderWorkerTemplate"))?;
            // A leader template inject copied earlier is copied afresh: the
            // worker template may have changed since.
            let ours = lwt
                .get("leaderTemplate")
                .and_then(Value::as_mapping)
                .is_some_and(created_leader_template);
            if create && ours {
                lwt.remove("leaderTemplate");
            }
            if !lwt.contains_key("leaderTemplate") {
                if !create {
                    return Ok(None);
                }
                let worker = lwt
                    .get("workerTemplate")
                    .cloned()
                    .ok_or_else(|| malformed("spec.leaderWorkerTemplate.workerTemplate"))?;
                lwt.insert(sidecar::s("leaderTemplate"), worker);
                let leader = lwt
                    .get_mut("leaderTemplate")
                    .and_then(Value::as_mapping_mut)
                    .ok_or_else(|| malformed("spec.leaderWorkerTemplate.workerTemplate"))?;
                return Ok(Some((leader, true)));
            }
            lwt.get_mut("leaderTemplate")
                .and_then(Value::as_mapping_mut)
                .map(|t| Some((t, false)))
                .ok_or_else(|| malformed("spec.leaderWorkerTemplate.leaderTemplate"))
        }
        _ => Ok(None),
    }
}

fn created_leader_template(tpl: &Mapping) -> bool {
    tpl.get("metadata")
        .and_then(|m| m.get("annotations"))
        .and_then(|a| a.get(CREATED))
        .and_then(Value::as_str)
        .is_some_and(|c| c.split(',').any(|p| p == "leaderTemplate"))
}

fn remove_leader_template(obj: &mut Mapping) {
    if let Some(lwt) = obj
        .get_mut("spec")
        .and_then(|s| s.get_mut("leaderWorkerTemplate"))
        .and_then(Value::as_mapping_mut)
    {
        lwt.remove("leaderTemplate");
    }
}

fn kind(obj: &Mapping) -> Option<&str> {
    obj.get("kind").and_then(Value::as_str)
}

fn namespace(obj: &Mapping) -> Option<String> {
    obj.get("metadata")
        .and_then(|m| m.get("namespace"))
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// `Kind/name` for notes and errors.
fn describe(obj: &Mapping) -> String {
    let name = obj
        .get("metadata")
        .and_then(|m| m.get("name"))
        .and_then(Value::as_str)
        .unwrap_or("<unnamed>");
    format!("{}/{name}", kind(obj).unwrap_or("<no kind>"))
}
