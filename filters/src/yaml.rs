//! Positions in YAML text, for errors found after parsing (serde's values
//! carry no positions): the line and column of a field path
//! (`plugins[2].parameters.threshold`, `timeouts.first_byte`), and the line
//! without its comment. It understands block-style YAML, which is how configs
//! and manifests are written; inside flow collections (`{a: 1}`) or block
//! scalars [`locate`] stops at the deepest key it could find, which is still
//! the right neighbourhood. Both config loaders (`filters.yaml` here,
//! `proxy.yaml` in the sidecar) and the manifest reader of `kvmesh inject` use
//! this one implementation.
//!
//! [`ConfigError`] is the one error both loaders return: the file, the line
//! and column, the field path, what is wrong and a [`ConfigErrorKind`] that
//! tests and callers match on.

use std::fmt;

/// What kind of config mistake it was; tests and metrics match on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigErrorKind {
    /// The file could not be read.
    Unreadable,
    /// Not YAML, or not the expected shape at that point.
    Syntax,
    /// A key the schema does not have.
    UnknownField,
    /// A value of the wrong type.
    WrongType,
    /// A required key is missing.
    MissingField,
    /// A value outside its allowed set (enum variant, apiVersion, kind).
    UnknownValue,
    /// A plugin `type` the registry does not know.
    UnknownPluginType,
    /// A `pluginRef` (or a handler's profile / decider) naming nothing.
    DanglingRef,
    /// Two plugins or two profiles with the same name.
    Duplicate,
    /// A value out of range, a rule spanning fields broken, or a plugin in the wrong place.
    Invalid,
}

impl ConfigErrorKind {
    /// The kind of a serde decoding message (serde exposes no structured kind).
    pub fn of_serde_message(message: &str) -> Self {
        if message.contains("unknown field") {
            ConfigErrorKind::UnknownField
        } else if message.contains("invalid type") || message.contains("invalid value") {
            ConfigErrorKind::WrongType
        } else if message.contains("missing field") {
            ConfigErrorKind::MissingField
        } else if message.contains("unknown variant") {
            ConfigErrorKind::UnknownValue
        } else {
            ConfigErrorKind::Syntax
        }
    }
}

/// A config file that cannot be used. Displays as `file:line:col: path: message`
/// (`<document>` for the path when the whole file is at fault).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// The file name given to the loader (`<flags>`, `<inline>` and the like
    /// for configs that did not come from a file).
    pub file: String,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// 1-based column, when known.
    pub column: Option<usize>,
    /// Field path, e.g. `schedulingProfiles[0].plugins[1].pluginRef` or
    /// `timeouts.connect`; empty for the whole document.
    pub path: String,
    /// What is wrong.
    pub message: String,
    /// The category.
    pub kind: ConfigErrorKind,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file)?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(col) = self.column {
                write!(f, ":{col}")?;
            }
        }
        let path = if self.path.is_empty() {
            "<document>"
        } else {
            &self.path
        };
        write!(f, ": {path}: {}", self.message)
    }
}

/// One structural token of a line: a mapping key or a sequence dash.
#[derive(Debug)]
struct Entry {
    line: usize,
    col: usize,
    key: Option<String>,
}

/// One step of a field path.
#[derive(Debug, PartialEq, Eq)]
enum Seg<'a> {
    Key(&'a str),
    Index(usize),
}

/// 1-based (line, column) of the deepest part of `path` found in `text`.
pub fn locate(text: &str, path: &str) -> Option<(usize, usize)> {
    find(text, path).0
}

/// 1-based (line, column) of `path` when the whole of it is written in
/// `text`; `None` when some part is not (a default was used).
pub fn locate_exact(text: &str, path: &str) -> Option<(usize, usize)> {
    match find(text, path) {
        (pos, true) => pos,
        (_, false) => None,
    }
}

/// The deepest position found, and whether every segment was.
fn find(text: &str, path: &str) -> (Option<(usize, usize)>, bool) {
    let entries = entries(text);
    let mut lo = 0;
    let mut hi = entries.len();
    let mut best = None;
    for seg in segments(path) {
        let Some(scope) = entries.get(lo..hi) else {
            return (best, false);
        };
        let Some(min_col) = scope.iter().map(|e| e.col).min() else {
            return (best, false);
        };
        let mut dashes = 0;
        let mut found = None;
        for (off, e) in scope.iter().enumerate() {
            if e.col != min_col {
                continue;
            }
            let hit = match seg {
                Seg::Key(k) => e.key.as_deref() == Some(k),
                Seg::Index(i) => {
                    let is_dash = e.key.is_none();
                    let hit = is_dash && dashes == i;
                    dashes += usize::from(is_dash);
                    hit
                }
            };
            if hit {
                found = Some(lo + off);
                break;
            }
        }
        let Some(j) = found else {
            return (best, false);
        };
        best = Some((entries[j].line + 1, entries[j].col + 1));
        lo = j + 1;
        hi = children_end(&entries, j);
    }
    (best, best.is_some())
}

/// End (exclusive) of the entries nested under `entries[j]`.
fn children_end(entries: &[Entry], j: usize) -> usize {
    let c = entries[j].col;
    // `key:` followed by `- item` at the same indentation (Kubernetes style).
    let same_col_seq = entries[j].key.is_some()
        && entries
            .get(j + 1)
            .is_some_and(|n| n.col == c && n.key.is_none());
    let mut k = j + 1;
    while let Some(e) = entries.get(k) {
        let nested = e.col > c || (same_col_seq && e.col == c && e.key.is_none());
        if !nested {
            break;
        }
        k += 1;
    }
    k
}

fn segments(path: &str) -> Vec<Seg<'_>> {
    let mut out = Vec::new();
    for part in path.split('.').filter(|p| !p.is_empty()) {
        let (name, mut rest) = match part.find('[') {
            Some(p) => (&part[..p], &part[p..]),
            None => (part, ""),
        };
        if !name.is_empty() {
            out.push(Seg::Key(name));
        }
        while let Some(end) = rest.find(']') {
            if let Ok(i) = rest[1..end].parse() {
                out.push(Seg::Index(i));
            }
            rest = &rest[end + 1..];
        }
    }
    out
}

fn entries(text: &str) -> Vec<Entry> {
    let mut out = Vec::new();
    for (line, raw) in text.lines().enumerate() {
        let body = strip_comment(raw);
        let trimmed = body.trim_start();
        if trimmed.is_empty() || trimmed.starts_with("---") || trimmed.starts_with("...") {
            continue;
        }
        let mut col = body.len() - trimmed.len();
        let mut rest = trimmed;
        while rest == "-" || rest.starts_with("- ") {
            out.push(Entry {
                line,
                col,
                key: None,
            });
            let after = rest[1..].trim_start();
            col += rest.len() - after.len();
            rest = after;
        }
        if let Some(key) = key_of(rest) {
            out.push(Entry {
                line,
                col,
                key: Some(key),
            });
        }
    }
    out
}

/// The key of `key: value` / `key:` / `"key": value`, if `rest` is one.
fn key_of(rest: &str) -> Option<String> {
    let first = rest.chars().next()?;
    if first == '{' || first == '[' {
        return None;
    }
    if first == '"' || first == '\'' {
        let end = rest[1..].find(first)? + 1;
        let after = &rest[end + 1..];
        let after = after.trim_start();
        return (after == ":" || after.starts_with(": ")).then(|| rest[1..end].to_owned());
    }
    let pos = rest
        .find(": ")
        .or_else(|| rest.ends_with(':').then(|| rest.len() - 1))?;
    Some(rest[..pos].trim_end().to_owned())
}

/// The line without a trailing `# comment` (a `#` after whitespace, outside quotes).
pub fn strip_comment(line: &str) -> &str {
    let mut quote = None;
    let mut prev = ' ';
    for (i, c) in line.char_indices() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if c == '"' || c == '\'' => quote = Some(c),
            None if c == '#' && prev.is_whitespace() => return &line[..i],
            None => {}
        }
        prev = c;
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "\
apiVersion: kvmesh.dev/v1alpha1   # a comment
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- name: lat
  type: load-aware-scorer
  parameters:
    threshold: 0
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: lat
        weight: 2
      - pluginRef: foo
";

    #[test]
    fn finds_nested_fields() {
        assert_eq!(locate(DOC, "kind"), Some((2, 1)));
        assert_eq!(locate(DOC, "plugins[1].parameters.threshold"), Some((8, 5)));
        assert_eq!(locate(DOC, "plugins[0].type"), Some((4, 3)));
        assert_eq!(
            locate(DOC, "schedulingProfiles[0].plugins[1].pluginRef"),
            Some((14, 9))
        );
        assert_eq!(
            locate(DOC, "schedulingProfiles[0].plugins[0].weight"),
            Some((13, 9))
        );
    }

    #[test]
    fn falls_back_to_deepest_found() {
        assert_eq!(locate(DOC, "plugins[1].parameters.nope"), Some((7, 3)));
        assert_eq!(locate(DOC, "nope"), None);
    }

    #[test]
    fn exact_needs_every_segment() {
        assert_eq!(
            locate_exact(DOC, "plugins[1].parameters.threshold"),
            Some((8, 5))
        );
        assert_eq!(locate_exact(DOC, "plugins[1].parameters.nope"), None);
        let sections = "a:\n  x: 1\nb:\n  x: 2\n";
        assert_eq!(locate_exact(sections, "b.x"), Some((4, 3)));
        assert_eq!(locate_exact(sections, "a.y"), None);
    }

    #[test]
    fn comments_are_stripped_outside_quotes() {
        assert_eq!(strip_comment("a: 1 # c"), "a: 1 ");
        assert_eq!(strip_comment("a: \"x # y\""), "a: \"x # y\"");
        assert_eq!(strip_comment("a: b#c"), "a: b#c");
    }
}
