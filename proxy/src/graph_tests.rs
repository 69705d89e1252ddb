//! The sidecar's modules depend one way. Read from the sources: every `.rs`
//! file under `src/` belongs to a top-level module (`foo.rs` or `foo/`), and
//! each `crate::x` it names (a `use` line, grouped or not, or a path used
//! inline; comments and string literals aside) is an arrow to `x`. Any
//! cycle between top-level modules fails here, but through the arrows of
//! [`ALLOWED_BACK_EDGES`], each with its reason; an allowed arrow that is
//! gone, or no longer closes a cycle, fails too, so the list only shrinks.
//!
//! Finer rules the module graph cannot see: no file under `request/`,
//! `routing/`, `pd/` or `mesh/` names the stages (`crate::path`); the
//! request core names none of `routing`, `pd`, `mesh`, `app`, `fleet`,
//! `prefix` or `valkey` (it asks the fleet through `request::Peers`); the stages
//! take narrow handles, so no file under `path/` but `handles.rs` and
//! `mod.rs` (which build them from `App`), and none under `pd/`, names
//! `crate::app`; nor does any file under `path/`, `request/` or `pd/` name
//! the whole `Metrics` (each borrows the group of families it counts in).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Arrows allowed to run back up, `(from, to, why)`. Only ever remove one.
#[rustfmt::skip]
const ALLOWED_BACK_EDGES: &[(&str, &str, &str)] = &[
];

/// An arrow between two top-level modules and where the sources draw it.
type Edges = BTreeMap<(String, String), Vec<String>>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        panic!("cannot read {}", dir.display());
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The sources with comments (doc comments included), string literals and
/// character literals blanked out; line breaks are kept, so line numbers hold.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |out: &mut String, s: &[u8]| {
        for &c in s {
            out.push(if c == b'\n' { '\n' } else { ' ' });
        }
    };
    while i < b.len() {
        let rest = &b[i..];
        let ident_before = i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
        if rest.starts_with(b"//") {
            let end = rest.iter().position(|&c| c == b'\n').unwrap_or(rest.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest.starts_with(b"/*") {
            let (mut depth, mut j) = (0usize, 0);
            while j < rest.len() {
                if rest[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if rest[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank(&mut out, &rest[..j]);
            i += j;
        } else if !ident_before && (rest.starts_with(b"r\"") || rest.starts_with(b"r#")) {
            let hashes = rest[1..].iter().take_while(|&&c| c == b'#').count();
            if rest.get(1 + hashes) != Some(&b'"') {
                out.push('r');
                i += 1;
                continue;
            }
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            let start = 2 + hashes;
            let end = rest[start..]
                .windows(close.len())
                .position(|w| w == close.as_slice())
                .map_or(rest.len(), |p| start + p + close.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest[0] == b'"' {
            let mut j = 1;
            while j < rest.len() && rest[j] != b'"' {
                j += if rest[j] == b'\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(rest.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest[0] == b'\'' {
            // A character literal ('x', '\n', '\u{..}'), else a lifetime.
            let end = if rest.get(1) == Some(&b'\\') {
                rest[2..].iter().position(|&c| c == b'\'').map(|p| p + 3)
            } else {
                let len = text[i + 1..].chars().next().map_or(1, char::len_utf8);
                (rest.get(1 + len) == Some(&b'\'')).then_some(2 + len)
            };
            match end {
                Some(end) => {
                    blank(&mut out, &rest[..end]);
                    i += end;
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            let len = text[i..].chars().next().map_or(1, char::len_utf8);
            out.push_str(&text[i..i + len]);
            i += len;
        }
    }
    out
}

fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The first names of a `use` group's items: `{a, b::c, d::{e, f}}` → a, b, d.
fn group_heads(group: &str) -> Vec<&str> {
    let (mut depth, mut start, mut heads) = (0, 1, Vec::new());
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' | ',' if depth == 1 => {
                heads.push(ident(group[start..].trim_start()));
                start = i + 1;
                if c == '}' {
                    depth -= 1;
                }
            }
            '}' => depth -= 1,
            _ => {}
        }
        if depth == 0 {
            break;
        }
    }
    heads.into_iter().filter(|h| !h.is_empty()).collect()
}

/// Every name a file's code reaches through `crate::`, with its line.
fn crate_names(code: &str) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("crate::") {
        let at = from + at;
        from = at + "crate::".len();
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':' || c == '$') {
            continue;
        }
        let line = code[..at].matches('\n').count() + 1;
        let rest = &code[from..];
        if rest.starts_with('{') {
            let end = rest.find(';').unwrap_or(rest.len());
            for head in group_heads(&rest[..end]) {
                found.push((head.to_owned(), line));
            }
        } else {
            found.push((ident(rest).to_owned(), line));
        }
    }
    found
}

/// The crate root's modules, and the names it re-exports with their module.
fn crate_root(lib: &str) -> (BTreeSet<String>, BTreeMap<String, String>) {
    let code = code_only(lib);
    let mut modules = BTreeSet::new();
    let mut reexports = BTreeMap::new();
    for line in code.lines().map(str::trim) {
        let line = line.strip_prefix("pub ").unwrap_or(line);
        if let Some(m) = line.strip_prefix("mod ") {
            modules.insert(ident(m).to_owned());
        } else if let Some(u) = line.strip_prefix("use ") {
            let module = ident(u).to_owned();
            let items = u[module.len()..].trim_start_matches("::");
            let names = if items.starts_with('{') {
                group_heads(items).into_iter().map(str::to_owned).collect()
            } else {
                vec![ident(items.rsplit("::").next().unwrap_or(items)).to_owned()]
            };
            for n in names {
                reexports.insert(n, module.clone());
            }
        }
    }
    (modules, reexports)
}

/// The top-level module a file under `src/` belongs to; `None` for the
/// crate root and the binary.
fn module_of(rel: &Path) -> Option<String> {
    let first = rel.components().next()?.as_os_str().to_string_lossy();
    let name = first.strip_suffix(".rs").unwrap_or(&first);
    (!matches!(name, "lib" | "main")).then(|| name.to_owned())
}

/// The arrows between top-level modules, from the sources under `src/`.
fn module_graph() -> Edges {
    let root = src();
    let lib = std::fs::read_to_string(root.join("lib.rs")).unwrap_or_default();
    let (modules, reexports) = crate_root(&lib);
    assert!(modules.contains("request"), "lib.rs declares no modules?");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    files.sort();
    let mut edges = Edges::new();
    for f in files {
        let rel = f.strip_prefix(&root).unwrap_or(&f);
        let Some(from) = module_of(rel) else { continue };
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        for (name, line) in crate_names(&code_only(&text)) {
            let to = if modules.contains(&name) {
                name
            } else if let Some(m) = reexports.get(&name) {
                m.clone()
            } else {
                panic!(
                    "{}:{line}: crate::{name} is no module of lib.rs",
                    rel.display()
                );
            };
            if to != from {
                let at = format!("{}:{line}", rel.display());
                edges.entry((from.clone(), to)).or_default().push(at);
            }
        }
    }
    edges
}

/// Strongly connected components of more than one module (Tarjan).
fn cycles(edges: &Edges) -> Vec<Vec<String>> {
    struct Walk<'a> {
        next: BTreeMap<&'a str, Vec<&'a str>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        found: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            for w in self.next.get(v).cloned().unwrap_or_default() {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.entry(v).or_default();
                    *lv = (*lv).min(lw);
                } else if self.stack.contains(&w) {
                    let iw = self.index[w];
                    let lv = self.low.entry(v).or_default();
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let at = self.stack.iter().rposition(|&s| s == v).unwrap_or(0);
                let mut comp: Vec<String> = self.stack.drain(at..).map(str::to_owned).collect();
                if comp.len() > 1 {
                    comp.sort();
                    self.found.push(comp);
                }
            }
        }
    }
    let mut walk = Walk {
        next: BTreeMap::new(),
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        found: Vec::new(),
    };
    for (a, b) in edges.keys() {
        walk.next.entry(a).or_default().push(b);
        walk.next.entry(b).or_default();
    }
    let nodes: Vec<&str> = walk.next.keys().copied().collect();
    for v in nodes {
        if !walk.index.contains_key(v) {
            walk.visit(v);
        }
    }
    walk.found
}

/// Each cycle with the arrows inside it and where the sources draw them.
fn describe(edges: &Edges, found: &[Vec<String>]) -> String {
    let mut out = String::new();
    for comp in found {
        out.push_str(&format!("cycle of {}: {}\n", comp.len(), comp.join(", ")));
        for ((a, b), at) in edges {
            if comp.contains(a) && comp.contains(b) {
                out.push_str(&format!("  {a} -> {b}  ({})\n", at.join(", ")));
            }
        }
    }
    out
}

#[test]
fn modules_depend_one_way() {
    let all = module_graph();
    let mut stale = Vec::new();
    for &(a, b, _) in ALLOWED_BACK_EDGES {
        let key = (a.to_owned(), b.to_owned());
        if !all.contains_key(&key) {
            stale.push(format!("{a} -> {b}: no file draws it any more"));
        } else if !cycles(&all)
            .iter()
            .any(|c| c.iter().any(|m| m == a) && c.iter().any(|m| m == b))
        {
            stale.push(format!("{a} -> {b}: closes no cycle any more"));
        }
    }
    assert!(
        stale.is_empty(),
        "drop these from ALLOWED_BACK_EDGES:\n{}",
        stale.join("\n")
    );
    let mut rest = all.clone();
    for &(a, b, _) in ALLOWED_BACK_EDGES {
        rest.remove(&(a.to_owned(), b.to_owned()));
    }
    let found = cycles(&rest);
    assert!(
        found.is_empty(),
        "modules depend on each other in a circle:\n{}",
        describe(&rest, &found)
    );
}

/// Files under `src/<module>` whose code (comments and strings aside) names
/// one of `needles`.
fn offenders(module: &str, needles: &[&str]) -> Vec<String> {
    lines_where(module, |line| {
        needles.iter().any(|needle| line.contains(needle))
    })
}

/// `file:line: code` of every line of code (comments and strings aside)
/// under `src/<module>` that `bad` picks.
fn lines_where(module: &str, bad: impl Fn(&str) -> bool) -> Vec<String> {
    let root = src().join(module);
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(!files.is_empty(), "no sources under {}", root.display());
    let mut found = Vec::new();
    for f in files {
        let code = code_only(&std::fs::read_to_string(&f).unwrap_or_default());
        for (n, line) in code.lines().enumerate() {
            if bad(line) {
                found.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
            }
        }
    }
    found
}

#[test]
fn the_stages_sit_above_the_request_core() {
    for module in ["request", "routing", "pd", "mesh"] {
        let bad = offenders(module, &["crate::path"]);
        assert!(
            bad.is_empty(),
            "{module} imports the stages:\n{}",
            bad.join("\n")
        );
    }
    let bad = offenders(
        "request",
        &[
            "crate::routing",
            "crate::pd",
            "crate::mesh",
            "crate::app",
            "crate::fleet",
            "crate::prefix",
            "crate::valkey",
        ],
    );
    assert!(
        bad.is_empty(),
        "the request core is no leaf:\n{}",
        bad.join("\n")
    );
    let mut bad = offenders("pd", &["crate::app"]);
    let wiring = ["mod.rs", "handles.rs"].map(|f| Path::new("src").join("path").join(f));
    bad.extend(offenders("path", &["crate::app"]).into_iter().filter(|b| {
        !wiring
            .iter()
            .any(|w| b.contains(&format!("{}:", w.to_string_lossy())))
    }));
    assert!(
        bad.is_empty(),
        "a stage takes the whole App, not a narrow handle:\n{}",
        bad.join("\n")
    );
}

/// Files under `src/<module>` whose code names `word` as a whole identifier
/// (so `Metrics`, not `PdMetrics`).
fn word_offenders(module: &str, word: &str) -> Vec<String> {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    lines_where(module, |line| {
        line.match_indices(word).any(|(at, _)| {
            !line[..at].chars().next_back().is_some_and(is_ident)
                && !line[at + word.len()..].chars().next().is_some_and(is_ident)
        })
    })
}

#[test]
fn the_stages_borrow_their_metric_group() {
    // The request families are grouped by who counts in them; a stage's
    // handle (and the upstream calls' `Upstreams`) borrows its group.
    for module in ["path", "request", "pd"] {
        let bad = word_offenders(module, "Metrics");
        assert!(
            bad.is_empty(),
            "{module} takes the whole Metrics, not its group:\n{}",
            bad.join("\n")
        );
    }
}

#[test]
fn the_reader_sees_what_the_compiler_sees() {
    let text = r##"
//! Names crate::path in a doc comment.
use crate::{body::{Incoming, Reply}, error, fleet::Fleet};
use crate::request::RequestCtx;
/* crate::mesh in a /* nested */ block comment */
fn f<'a>(x: &'a str) -> char {
    let _ = "crate::routing in a string";
    let _ = r#"crate::pd in a raw "string""#;
    let _ = crate::prefix::keys(x);
    let _ = kvmesh_filters::crate::not_ours;
    '"'
}
"##;
    let names: Vec<String> = crate_names(&code_only(text))
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, ["body", "error", "fleet", "request", "prefix"]);
    let (modules, reexports) = crate_root("pub mod a;\nmod b;\npub use b::{B, C};\n");
    assert_eq!(modules, BTreeSet::from(["a".to_owned(), "b".to_owned()]));
    assert_eq!(reexports.get("C").map(String::as_str), Some("b"));
    // A circle is found and shown with the files that draw it; a line is not.
    let mut edges = Edges::new();
    for (a, b) in [("x", "y"), ("y", "z"), ("z", "x"), ("z", "w")] {
        edges.insert((a.to_owned(), b.to_owned()), vec![format!("{a}.rs:1")]);
    }
    let found = cycles(&edges);
    assert_eq!(found, [["x", "y", "z"]]);
    assert!(describe(&edges, &found).contains("z -> x  (z.rs:1)"));
    edges.remove(&("z".to_owned(), "x".to_owned()));
    assert!(cycles(&edges).is_empty());
}

#[test]
fn the_graph_holds_the_known_arrows() {
    let edges = module_graph();
    let has = |a: &str, b: &str| edges.contains_key(&(a.to_owned(), b.to_owned()));
    assert!(has("path", "request"));
    assert!(has("sidecar", "path"));
    assert!(!has("request", "path"));
}
