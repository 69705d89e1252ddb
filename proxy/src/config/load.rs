//! Reading `proxy.yaml`: strict decode with the path and line of the first bad
//! field, then the validation pass for rules that span fields.

use std::path::Path;

pub use kvmesh_filters::yaml::{ConfigError, ConfigErrorKind};

use super::Config;

/// Reads, decodes and validates a config file.
pub fn load_file(path: &Path) -> Result<Config, ConfigError> {
    let origin = path.display().to_string();
    let src = std::fs::read_to_string(path).map_err(|e| ConfigError {
        file: origin.clone(),
        line: None,
        column: None,
        path: String::new(),
        message: format!("cannot read: {e}"),
        kind: ConfigErrorKind::Unreadable,
    })?;
    from_yaml_str(&src, &origin)
}

/// Decodes and validates YAML text; `origin` names it in errors.
pub fn from_yaml_str(src: &str, origin: &str) -> Result<Config, ConfigError> {
    let config = decode(src, origin)?;
    validate(&config).map_err(|(path, message)| {
        let (line, column) = locate(src, &path).unzip();
        ConfigError {
            file: origin.to_owned(),
            line,
            column,
            path,
            message,
            kind: ConfigErrorKind::Invalid,
        }
    })?;
    Ok(config)
}

fn decode(src: &str, origin: &str) -> Result<Config, ConfigError> {
    // An empty file (or one with only comments) means "all defaults".
    if src
        .lines()
        .all(|l| l.trim().is_empty() || l.trim_start().starts_with('#'))
    {
        return Ok(Config::default());
    }
    let de = serde_yaml_ng::Deserializer::from_str(src);
    serde_path_to_error::deserialize::<_, Config>(de).map_err(|err| {
        let field = err.path().to_string();
        let field = if field == "." { String::new() } else { field };
        let inner = err.into_inner();
        let location = inner.location();
        // serde_yaml_ng appends "at line L column C" to its messages; the
        // location is printed by us, in front, so strip the duplicate.
        let mut message = inner.to_string();
        if let Some(pos) = message.find(" at line ") {
            message.truncate(pos);
        }
        let kind = ConfigErrorKind::of_serde_message(&message);
        let message = strip_path_prefix(message, &field);
        ConfigError {
            file: origin.to_owned(),
            line: location.as_ref().map(|l| l.line()),
            column: location.as_ref().map(|l| l.column()),
            path: field,
            message,
            kind,
        }
    })
}

/// serde_yaml_ng starts some messages with the path of the field or of its
/// parent (`engine: unknown field ...`); the path is printed once, by us.
fn strip_path_prefix(message: String, field: &str) -> String {
    let mut prefix = field;
    while !prefix.is_empty() {
        if let Some(rest) = message
            .strip_prefix(prefix)
            .and_then(|r| r.strip_prefix(": "))
        {
            return rest.to_owned();
        }
        prefix = prefix.rfind('.').map_or("", |i| &prefix[..i]);
    }
    message
}

/// [`validate`] for a config that was not read from text (built from flags,
/// or a file with flags applied): its errors name `origin` and no line.
pub fn validate_built(c: &Config, origin: &str) -> Result<(), ConfigError> {
    validate(c).map_err(|(path, message)| ConfigError {
        file: origin.to_owned(),
        line: None,
        column: None,
        path,
        message,
        kind: ConfigErrorKind::Invalid,
    })
}

/// Rules that one field's type cannot express. Returns the dotted field and why.
pub fn validate(c: &Config) -> Result<(), (String, String)> {
    let err = |field: &str, msg: String| Err((field.to_owned(), msg));
    if c.listeners.client.port() != 0 && c.listeners.client == c.listeners.admin {
        return err(
            "listeners.admin",
            format!(
                "the admin listener {} is the same address as the client listener",
                c.listeners.admin
            ),
        );
    }
    for (field, path) in [
        ("engine.health_path", &c.engine.health_path),
        ("engine.metrics_path", &c.engine.metrics_path),
    ] {
        if !path.starts_with('/') || path.parse::<http::uri::PathAndQuery>().is_err() {
            return err(
                field,
                format!("{path:?} must be a URL path starting with '/'"),
            );
        }
    }
    let t = &c.timeouts;
    for (field, d) in [
        ("timeouts.first_byte", t.first_byte),
        ("timeouts.stream_idle", t.stream_idle),
        ("timeouts.connect", t.connect),
    ] {
        if d > t.overall {
            return err(
                field,
                format!(
                    "{d} is longer than timeouts.overall ({}), so it could never fire",
                    t.overall
                ),
            );
        }
    }
    if !(1..=64).contains(&c.engine.data_parallel_size) {
        return err(
            "engine.data_parallel_size",
            format!("{} is not in 1..=64", c.engine.data_parallel_size),
        );
    }
    if c.upstream.max_idle_per_host == 0 {
        // Zero would disable pooling and cost a TCP handshake per request.
        return err(
            "upstream.max_idle_per_host",
            "must be at least 1".to_owned(),
        );
    }
    if c.limits.max_connections == 0 {
        return err("limits.max_connections", "must be at least 1".to_owned());
    }
    if !(1..=1024).contains(&c.runtime.worker_threads) {
        return err(
            "runtime.worker_threads",
            format!("{} is not in 1..=1024", c.runtime.worker_threads),
        );
    }
    super::prefix::validate(c)?;
    super::index::validate(c)?;
    c.mesh.validate()?;
    c.autoscale.validate()?;
    if let Some(t) = &c.tracing {
        t.validate()?;
    }
    if c.mesh.follow == super::mesh::Follow::SameModels && c.pod.models.is_empty() {
        return err(
            "mesh.follow",
            "same-models needs pod.models: this pod's models are what peers are matched against"
                .to_owned(),
        );
    }
    c.pd.validate()?;
    if let Err(e) = tracing_subscriber::EnvFilter::builder().parse(&c.logging.level) {
        return err(
            "logging.level",
            format!("{:?} is not a log filter: {e}", c.logging.level),
        );
    }
    Ok(())
}

/// Finds the line and column of a dotted field in block-style YAML, for errors
/// found after decoding (when the parser's position is gone). Returns `None`
/// when the key is not written in the file (a default was used).
pub fn locate(src: &str, field: &str) -> Option<(usize, usize)> {
    kvmesh_filters::yaml::locate_exact(src, field)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn unknown_field_names_line_and_path() {
        let e = from_yaml_str("timeouts:\n  connect: 1s\n  conect: 2s\n", "p.yaml").unwrap_err();
        assert_eq!(e.path, "timeouts.conect");
        assert_eq!(e.line, Some(3));
        assert_eq!(e.kind, ConfigErrorKind::UnknownField);
        assert!(e.message.starts_with("unknown field `conect`"), "{e}");
    }

    #[test]
    fn unreadable_file_is_its_own_kind() {
        let e = load_file(Path::new("/nonexistent/kvmesh/proxy.yaml")).unwrap_err();
        assert_eq!(e.kind, ConfigErrorKind::Unreadable);
        assert!(
            e.to_string()
                .starts_with("/nonexistent/kvmesh/proxy.yaml: <document>: cannot read: "),
            "{e}"
        );
    }

    #[test]
    fn bad_value_names_line_and_path() {
        let e = from_yaml_str(
            "engine:\n  url: http://127.0.0.1:1\nlimits:\n  max_body_bytes: 0\n",
            "p.yaml",
        )
        .unwrap_err();
        assert_eq!(
            (e.path.as_str(), e.line),
            ("limits.max_body_bytes", Some(4))
        );
        assert_eq!(
            e.to_string(),
            "p.yaml:4:19: limits.max_body_bytes: size must be greater than zero"
        );
    }

    #[test]
    fn wrong_type_is_rejected() {
        let e = from_yaml_str("upstream:\n  http2: maybe\n", "p.yaml").unwrap_err();
        assert_eq!((e.path.as_str(), e.line), ("upstream.http2", Some(2)));
        assert_eq!(e.kind, ConfigErrorKind::WrongType);
    }

    #[test]
    fn cross_field_rule_is_located() {
        let src = "# c\ntimeouts:\n  overall: 10s\n  first_byte: 20s\n";
        let e = from_yaml_str(src, "p.yaml").unwrap_err();
        assert_eq!((e.path.as_str(), e.line), ("timeouts.first_byte", Some(4)));
        assert_eq!(e.kind, ConfigErrorKind::Invalid);
    }

    #[test]
    fn empty_file_is_defaults() {
        assert_eq!(
            from_yaml_str("# nothing\n", "p").unwrap(),
            Config::default()
        );
    }

    #[test]
    fn locate_respects_sections() {
        let src = "a:\n  x: 1\nb:\n  x: 2\n";
        assert_eq!(locate(src, "b.x"), Some((4, 3)));
        assert_eq!(locate(src, "a.y"), None);
    }
}
