//! Reading and writing manifests as Kubernetes reads them.
//!
//! Kubernetes decodes YAML 1.1 (go-yaml v2 under `sigs.k8s.io/yaml`);
//! `serde_yaml_ng` decodes YAML 1.2. The two disagree on a few plain
//! scalars: `0644` is the number 420 in 1.1 and the string "0644" in 1.2;
//! `yes`, `on`, `y`, `off` ... are booleans in 1.1 and strings in 1.2.
//! Reading: a document with such a plain scalar is refused with its line
//! (the meaning cannot be kept through a 1.2 value). Writing: [`emit`] is
//! our own emitter, which quotes every string either version could read as
//! anything else, so the output means the same to kubectl as the input did.

use kvmesh_filters::yaml::strip_comment;
use serde_yaml_ng::{Mapping, Value};

/// Why input could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseError {
    #[error("{origin}: {message}")]
    Syntax { origin: String, message: String },
    #[error(
        "{origin}:{line}: the plain scalar {token:?} means something else to Kubernetes (YAML 1.1: {meaning}) \
         than to YAML 1.2; write it {fix}"
    )]
    Yaml11 {
        origin: String,
        line: usize,
        token: String,
        meaning: &'static str,
        fix: String,
    },
    #[error("{origin}: document {index} is not a mapping (a Kubernetes object)")]
    NotAnObject { origin: String, index: usize },
}

/// Why a value cannot be written as a manifest.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EmitError {
    #[error("a YAML tag ({0}) has no meaning in a Kubernetes manifest")]
    Tagged(String),
    #[error("a mapping key must be a string, a number or a boolean")]
    ComplexKey,
}

/// The documents of one YAML stream; empty documents are dropped.
pub fn parse_stream(text: &str, origin: &str) -> Result<Vec<Value>, ParseError> {
    check_yaml11(text, origin)?;
    let mut docs = Vec::new();
    for (index, de) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let doc: Value = serde::Deserialize::deserialize(de).map_err(|e| ParseError::Syntax {
            origin: origin.to_owned(),
            message: e.to_string(),
        })?;
        match doc {
            Value::Null => {}
            Value::Mapping(_) => docs.push(doc),
            _ => {
                return Err(ParseError::NotAnObject {
                    origin: origin.to_owned(),
                    index: index + 1,
                })
            }
        }
    }
    Ok(docs)
}

/// A multi-document stream: `---` before every document but the first.
pub fn emit_stream(docs: &[Value]) -> Result<String, EmitError> {
    let mut out = String::new();
    for (i, d) in docs.iter().enumerate() {
        if i > 0 {
            out.push_str("---\n");
        }
        emit(d, &mut out)?;
    }
    Ok(out)
}

/// One document in block style.
pub fn emit(doc: &Value, out: &mut String) -> Result<(), EmitError> {
    match doc {
        Value::Mapping(m) if !m.is_empty() => mapping(m, 0, out),
        Value::Sequence(s) if !s.is_empty() => sequence(s, 0, out),
        other => {
            out.push_str(&scalar(other)?);
            out.push('\n');
            Ok(())
        }
    }
}

fn mapping(m: &Mapping, indent: usize, out: &mut String) -> Result<(), EmitError> {
    let mut first = true;
    for (k, v) in m {
        // The first key of a sequence item shares the "- " line.
        if !first || indent == 0 || !out.ends_with("- ") {
            push_indent(out, indent);
        }
        first = false;
        out.push_str(&key(k)?);
        out.push(':');
        value_after_key(v, indent, out)?;
    }
    Ok(())
}

fn sequence(s: &[Value], indent: usize, out: &mut String) -> Result<(), EmitError> {
    for v in s {
        push_indent(out, indent);
        out.push_str("- ");
        match v {
            Value::Mapping(m) if !m.is_empty() => mapping(m, indent + 2, out)?,
            Value::Sequence(inner) if !inner.is_empty() => {
                out.push('\n');
                sequence(inner, indent + 2, out)?;
            }
            Value::String(s) if block_literal(s) => literal(s, indent + 2, out),
            other => {
                out.push_str(&scalar(other)?);
                out.push('\n');
            }
        }
    }
    Ok(())
}

fn value_after_key(v: &Value, indent: usize, out: &mut String) -> Result<(), EmitError> {
    match v {
        Value::Mapping(m) if !m.is_empty() => {
            out.push('\n');
            mapping(m, indent + 2, out)
        }
        // Kubernetes style: a sequence under a key is not indented further.
        Value::Sequence(s) if !s.is_empty() => {
            out.push('\n');
            sequence(s, indent, out)
        }
        Value::String(s) if block_literal(s) => {
            out.push(' ');
            literal(s, indent + 2, out);
            Ok(())
        }
        other => {
            out.push(' ');
            out.push_str(&scalar(other)?);
            out.push('\n');
            Ok(())
        }
    }
}

/// A multi-line string as a literal block, with the chomping indicator that
/// keeps its trailing newlines exactly.
fn literal(s: &str, indent: usize, out: &mut String) {
    let body = s.trim_end_matches('\n');
    let trailing = s.len() - body.len();
    out.push_str(match trailing {
        0 => "|-",
        1 => "|",
        _ => "|+",
    });
    out.push('\n');
    for line in body.split('\n') {
        if !line.is_empty() {
            push_indent(out, indent);
            out.push_str(line);
        }
        out.push('\n');
    }
    for _ in 1..trailing {
        out.push('\n');
    }
}

fn push_indent(out: &mut String, indent: usize) {
    out.extend(std::iter::repeat_n(' ', indent));
}

/// Whether a string reads back exactly from a literal block.
fn block_literal(s: &str) -> bool {
    s.contains('\n')
        && !s.starts_with([' ', '\t', '\n'])
        && !s
            .chars()
            .any(|c| c == '\r' || c == '\t' || (c.is_control() && c != '\n'))
        && s.split('\n').all(|l| !l.ends_with(' '))
}

fn key(k: &Value) -> Result<String, EmitError> {
    match k {
        Value::String(_) | Value::Number(_) | Value::Bool(_) => scalar(k),
        Value::Tagged(t) => Err(EmitError::Tagged(t.tag.to_string())),
        _ => Err(EmitError::ComplexKey),
    }
}

fn scalar(v: &Value) -> Result<String, EmitError> {
    Ok(match v {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) if plain_safe(s) => s.clone(),
        // JSON's string syntax is YAML's double-quoted style.
        Value::String(s) => serde_json::Value::String(s.clone()).to_string(),
        Value::Mapping(_) => "{}".to_owned(),
        Value::Sequence(_) => "[]".to_owned(),
        Value::Tagged(t) => return Err(EmitError::Tagged(t.tag.to_string())),
    })
}

/// Plain only when no YAML version reads the text as anything but this
/// string: a conservative character set, and no word YAML 1.1 or 1.2 treats
/// as null, boolean or number.
fn plain_safe(s: &str) -> bool {
    let Some(first) = s.chars().next() else {
        return false;
    };
    // `:` only inside a word (never `: ` or a trailing `:`, which end a key).
    let colon_ok = !s.ends_with(':') && !s.contains(": ");
    let chars_ok = (first.is_ascii_alphabetic() || first == '/' || first == '_')
        && colon_ok
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/' | ':'));
    chars_ok
        && yaml11_meaning(s).is_none()
        && !matches!(
            s.to_ascii_lowercase().as_str(),
            "null" | "true" | "false" | ".inf" | ".nan"
        )
}

/// What YAML 1.1 (but not 1.2) makes of a plain scalar, if anything.
fn yaml11_meaning(token: &str) -> Option<&'static str> {
    const BOOLS: [&str; 16] = [
        "y", "Y", "yes", "Yes", "YES", "n", "N", "no", "No", "NO", "on", "On", "ON", "off", "Off",
        "OFF",
    ];
    if BOOLS.contains(&token) {
        return Some("a boolean");
    }
    let digits = token.strip_prefix(['-', '+']).unwrap_or(token);
    if digits.len() > 1 && digits.starts_with('0') && digits.bytes().all(|b| b.is_ascii_digit()) {
        return Some("an octal number");
    }
    None
}

/// Refuses plain scalars in value position that YAML 1.1 reads differently
/// (block mappings, block sequences and simple flow collections; block
/// scalars' contents are skipped).
fn check_yaml11(text: &str, origin: &str) -> Result<(), ParseError> {
    // Indentation of the line that opened a block scalar, while inside it.
    let mut block_scalar: Option<usize> = None;
    for (n, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start().len();
        if let Some(open) = block_scalar {
            if line.trim().is_empty() || indent > open {
                continue;
            }
            block_scalar = None;
        }
        let content = strip_comment(line);
        let trimmed = content.trim_end();
        if trimmed.ends_with(['|', '>']) || block_indicator(trimmed) {
            block_scalar = Some(indent);
            continue;
        }
        for token in value_tokens(trimmed) {
            if let Some(meaning) = yaml11_meaning(token) {
                let fix = if meaning == "a boolean" {
                    format!("quoted (\"{token}\") for a string, or true/false for a boolean")
                } else {
                    let octal = u64::from_str_radix(token.trim_start_matches(['-', '+']), 8).ok();
                    match octal {
                        Some(v) => {
                            format!("as {v} (decimal) for the number, or quoted for a string")
                        }
                        None => "quoted".to_owned(),
                    }
                };
                return Err(ParseError::Yaml11 {
                    origin: origin.to_owned(),
                    line: n + 1,
                    token: token.to_owned(),
                    meaning,
                    fix,
                });
            }
        }
    }
    Ok(())
}

/// `key: |2-`, `- >+`: a block scalar header with indicators.
fn block_indicator(line: &str) -> bool {
    let last = line.rsplit([' ', '\t']).next().unwrap_or("");
    last.len() > 1
        && last.starts_with(['|', '>'])
        && last[1..]
            .chars()
            .all(|c| c == '-' || c == '+' || c.is_ascii_digit())
}

/// Candidate plain scalars in value position: after `key: `, after `- `,
/// and the items of flow collections.
fn value_tokens(line: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = line.trim_start();
    while let Some(r) = rest.strip_prefix("- ") {
        rest = r.trim_start();
    }
    if rest == "-" {
        return out;
    }
    let value = match find_key_colon(rest) {
        Some(i) => rest[i + 1..].trim(),
        None => rest.trim(),
    };
    if value.starts_with(['[', '{']) {
        for item in value.split([',', '[', ']', '{', '}']) {
            let item = item.trim();
            let v = match find_key_colon(item) {
                Some(i) => item[i + 1..].trim(),
                None => item,
            };
            if !v.is_empty() {
                out.push(v);
            }
        }
    } else if !value.is_empty() {
        out.push(value);
    }
    out
}

/// The `:` that ends a plain or quoted key (followed by a space or the end).
fn find_key_colon(s: &str) -> Option<usize> {
    let mut quote: Option<char> = None;
    let bytes = s.as_bytes();
    for (i, c) in s.char_indices() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if (c == '"' || c == '\'') && i == 0 => quote = Some(c),
            None if c == ':' && (i + 1 == s.len() || bytes[i + 1] == b' ') => return Some(i),
            None => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(text: &str) -> (Vec<Value>, String) {
        let docs = parse_stream(text, "t").expect("parse");
        let out = emit_stream(&docs).expect("emit");
        let again = parse_stream(&out, "out").expect("reparse");
        assert_eq!(docs, again, "emitted:\n{out}");
        (docs, out)
    }

    #[test]
    fn strings_that_look_like_other_things_are_quoted() {
        let (_, out) = roundtrip(
            "a: \"yes\"\nb: \"0644\"\nc: \"8000\"\nd: \"true\"\ne: \"\"\nf: \"null\"\ng: \"1e3\"\nh: \"a: b\"\ni: \"on\"\nj: \"- x\"\nk: \"#c\"\n",
        );
        for quoted in [
            "\"yes\"", "\"0644\"", "\"8000\"", "\"true\"", "\"\"", "\"null\"", "\"1e3\"",
            "\"a: b\"", "\"on\"",
        ] {
            assert!(out.contains(quoted), "{quoted} in {out}");
        }
    }

    #[test]
    fn nested_structures_and_multiline_strings_round_trip() {
        let (_, out) = roundtrip(
            "apiVersion: v1\nkind: ConfigMap\ndata:\n  a.yaml: |\n    x: 1\n\n    y: [1, 2]\n  b: \"no newline\\nend\"\n  c: \"two\\n\\n\"\n  d: \" lead\\nx\"\nlist:\n- - 1\n  - 2\n- {}\n- []\n- name: x\n  items: [a, b]\n  m: {k: v}\nempty: {}\nnum: 1.5\nneg: -3\nbig: 18446744073709551615\nurl: http://x:80/y\n",
        );
        assert!(
            out.contains("a.yaml: |\n    x: 1\n\n    y: [1, 2]\n"),
            "{out}"
        );
    }

    #[test]
    fn yaml11_scalars_are_refused_with_their_line() {
        let e = parse_stream("a: 1\nmode: 0644\n", "f.yaml").unwrap_err();
        assert!(e.to_string().contains("f.yaml:2"), "{e}");
        assert!(e.to_string().contains("420"), "{e}");
        for bad in [
            "x: on\n",
            "- yes\n",
            "x: [a, off]\n",
            "x: {k: y}\n",
            "x: No # c\n",
        ] {
            assert!(parse_stream(bad, "f").is_err(), "{bad}");
        }
        for ok in [
            "x: \"on\"\n",
            "x: 'yes'\n",
            "x: 420\n",
            "x: |\n  on\n  0644\ny: 1\n",
            "x: >-\n  yes\n",
            "on_call: true\n",
            "x: one\n",
            "x: \"a # b\" # on\n",
            "x: 0\n",
        ] {
            assert!(parse_stream(ok, "f").is_ok(), "{ok}");
        }
    }

    #[test]
    fn multiple_documents_and_empty_ones() {
        let docs = parse_stream("---\n# only a comment\n---\na: 1\n---\nb: 2\n", "t").unwrap();
        assert_eq!(docs.len(), 2);
        assert!(matches!(
            parse_stream("a: 1\n---\n- x\n", "t"),
            Err(ParseError::NotAnObject { index: 2, .. })
        ));
        assert!(parse_stream("a: [1\n", "t").is_err());
    }
}
