//! Injecting into, and removing from, one pod template (`metadata` + `spec`).
//!
//! Only additions: an init container appended to `spec.initContainers`, a
//! volume appended to `spec.volumes`, the label the Services select, and two
//! annotations: the version ([`INJECTED`]) and what was created that was
//! absent before ([`CREATED`]), so that uninject restores the input exactly
//! (an absent list stays absent, a label the user set stays). Nothing that
//! was there is changed or reordered: the engine container's value is the
//! same before and after.

use serde_yaml_ng::{Mapping, Value};

use super::sidecar::{s, InjectOptions, CONTAINER, CREATED, INJECTED, LABEL, VOLUME};
use super::InjectError;

/// What inject did with one template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Injected {
    Yes,
    /// Labelled `kvmesh.io/inject` with a value other than "true": opted out.
    OptedOut,
}

/// Adds the sidecar (replacing an earlier injection, so injecting twice is
/// injecting once, and a new config replaces the old one). `copied`: the
/// template is an LWS leader template inject just made from the worker
/// template (recorded, so uninject removes it whole).
pub fn inject(
    tpl: &mut Mapping,
    opts: &InjectOptions,
    what: &str,
    copied: bool,
) -> Result<Injected, InjectError> {
    uninject(tpl, what)?;
    let label = tpl
        .get("metadata")
        .and_then(|m| m.get("labels"))
        .and_then(|l| l.get(LABEL))
        .cloned();
    match label {
        Some(Value::String(v)) if v == "true" => {}
        Some(_) => return Ok(Injected::OptedOut),
        None => {}
    }
    check_conflicts(tpl, opts, what)?;
    let mut created = Vec::new();
    if copied {
        created.push("leaderTemplate");
    }
    let metadata = child(tpl, "metadata", "metadata", &mut created, what)?;
    let labels = child(metadata, "labels", "labels", &mut created, what)?;
    if !labels.contains_key(LABEL) {
        labels.insert(s(LABEL), s("true"));
        created.push("label");
    }
    let annotations_absent = !metadata.contains_key("annotations");
    if annotations_absent {
        created.push("annotations");
    }
    let spec = child(tpl, "spec", "spec", &mut created, what)?;
    list(spec, "initContainers", &mut created, what)?.push(opts.container());
    list(spec, "volumes", &mut created, what)?.push(opts.volume());
    let metadata = child(tpl, "metadata", "metadata", &mut Vec::new(), what)?;
    let annotations = child(
        metadata,
        "annotations",
        "annotations",
        &mut Vec::new(),
        what,
    )?;
    annotations.insert(s(INJECTED), s(&opts.version));
    annotations.insert(s(CREATED), s(&created.join(",")));
    Ok(Injected::Yes)
}

/// Removes what [`inject`] added; a template it did not inject is unchanged.
/// Returns whether the template had been injected.
pub fn uninject(tpl: &mut Mapping, what: &str) -> Result<bool, InjectError> {
    let Some(annotations) = tpl
        .get_mut("metadata")
        .and_then(|m| m.get_mut("annotations"))
        .and_then(Value::as_mapping_mut)
    else {
        return Ok(false);
    };
    if annotations.remove(INJECTED).is_none() {
        return Ok(false);
    }
    let created_text = annotations
        .remove(CREATED)
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    let created: Vec<&str> = created_text.split(',').filter(|c| !c.is_empty()).collect();
    let was_created = |name: &str| created.contains(&name);
    if let Some(spec) = tpl.get_mut("spec").and_then(Value::as_mapping_mut) {
        remove_named(
            spec,
            "initContainers",
            CONTAINER,
            was_created("initContainers"),
            what,
        )?;
        remove_named(spec, "volumes", VOLUME, was_created("volumes"), what)?;
        if was_created("spec") && spec.is_empty() {
            tpl.remove("spec");
        }
    }
    if let Some(metadata) = tpl.get_mut("metadata").and_then(Value::as_mapping_mut) {
        if let Some(labels) = metadata.get_mut("labels").and_then(Value::as_mapping_mut) {
            if was_created("label") {
                labels.remove(LABEL);
            }
            if was_created("labels") && labels.is_empty() {
                metadata.remove("labels");
            }
        }
        let empty_annotations = metadata
            .get("annotations")
            .and_then(Value::as_mapping)
            .is_some_and(Mapping::is_empty);
        if was_created("annotations") && empty_annotations {
            metadata.remove("annotations");
        }
        if was_created("metadata") && metadata.is_empty() {
            tpl.remove("metadata");
        }
    }
    Ok(true)
}

/// A container named like ours, a volume named like ours, or one of our
/// ports already declared by another container: injecting would break the pod.
fn check_conflicts(tpl: &Mapping, opts: &InjectOptions, what: &str) -> Result<(), InjectError> {
    let Some(spec) = tpl.get("spec") else {
        return Ok(());
    };
    let ours = [
        Some(opts.ports.client),
        Some(opts.ports.admin),
        opts.ports.mesh,
    ];
    for key in ["containers", "initContainers"] {
        for c in spec
            .get(key)
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
        {
            if c.get("name").and_then(Value::as_str) == Some(CONTAINER) {
                return Err(conflict(
                    what,
                    format!("{key} already has a container named {CONTAINER}"),
                ));
            }
            let ports = c
                .get("ports")
                .and_then(Value::as_sequence)
                .into_iter()
                .flatten();
            for p in ports {
                let n = p.get("containerPort").and_then(Value::as_u64);
                if let Some(n) = n.filter(|n| ours.iter().flatten().any(|o| u64::from(*o) == *n)) {
                    return Err(conflict(
                        what,
                        format!("a container already declares port {n}, which the sidecar's config uses"),
                    ));
                }
            }
        }
    }
    let volumes = spec
        .get("volumes")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten();
    for v in volumes {
        if v.get("name").and_then(Value::as_str) == Some(VOLUME) {
            return Err(conflict(
                what,
                format!("a volume named {VOLUME} already exists"),
            ));
        }
    }
    Ok(())
}

fn conflict(what: &str, reason: String) -> InjectError {
    InjectError::Conflict {
        what: what.to_owned(),
        reason,
    }
}

/// The mapping at `key`, created (and recorded as `record`) when absent.
fn child<'a>(
    m: &'a mut Mapping,
    key: &str,
    record: &'static str,
    created: &mut Vec<&'static str>,
    what: &str,
) -> Result<&'a mut Mapping, InjectError> {
    if !m.contains_key(key) || m.get(key).is_some_and(Value::is_null) {
        m.insert(s(key), Value::Mapping(Mapping::new()));
        created.push(record);
    }
    m.get_mut(key)
        .and_then(Value::as_mapping_mut)
        .ok_or_else(|| InjectError::Malformed {
            what: what.to_owned(),
            field: key.to_owned(),
            expected: "a mapping",
        })
}

/// The sequence at `key`, created (and recorded) when absent.
fn list<'a>(
    m: &'a mut Mapping,
    key: &'static str,
    created: &mut Vec<&'static str>,
    what: &str,
) -> Result<&'a mut Vec<Value>, InjectError> {
    if !m.contains_key(key) || m.get(key).is_some_and(Value::is_null) {
        m.insert(s(key), Value::Sequence(Vec::new()));
        created.push(key);
    }
    m.get_mut(key)
        .and_then(Value::as_sequence_mut)
        .ok_or_else(|| InjectError::Malformed {
            what: what.to_owned(),
            field: format!("spec.{key}"),
            expected: "a list",
        })
}

/// Removes the entry named `name` from the list at `key`, and the list when
/// inject created it and it is empty again.
fn remove_named(
    spec: &mut Mapping,
    key: &str,
    name: &str,
    created: bool,
    what: &str,
) -> Result<(), InjectError> {
    let Some(v) = spec.get_mut(key) else {
        return Ok(());
    };
    let items = v.as_sequence_mut().ok_or_else(|| InjectError::Malformed {
        what: what.to_owned(),
        field: format!("spec.{key}"),
        expected: "a list",
    })?;
    items.retain(|c| c.get("name").and_then(Value::as_str) != Some(name));
    if created && items.is_empty() {
        spec.remove(key);
    }
    Ok(())
}
