#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Hostile input at volume for filters' two decoders: the KV-event decoder
//! (msgpack batches as vLLM and SGLang publish them) and `filters.yaml`.
//! Each target takes generated inputs (structure-aware: valid shapes with
//! fields of the wrong type, extra fields, odd widths) and byte-level
//! mutations of valid seeds (the captured vLLM frames, the shipped example
//! configs). No input may panic, and decoding allocates at most a small
//! multiple of the input, whatever a length field claims.
//! `KVMESH_FUZZ_CASES=100000 cargo test --release -p kvmesh-filters --test
//! fuzz_inputs` is the long run (`scripts/fuzz`).

use kvmesh_filters::prefix::kvevents::{decode_batch, decode_message, decode_replay_reply};
use kvmesh_filters::sched::{FilterConfig, PluginRegistry};
use kvmesh_fuzz::{allocated_during, edits, fuzz, mutate, CountingAlloc};
use proptest::prelude::*;
use proptest::strategy::ValueTree;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Most bytes a decode may allocate per input byte, plus a constant: an event
/// struct is ~100x its shortest encoding and the events vector reserves up to
/// 256 at once. What matters is that it is linear in the input, not in what
/// a length field says (see `huge_lengths_*`).
const ALLOC_PER_BYTE: usize = 512;
const ALLOC_BASE: usize = 128 << 10;

// ---------- KV events ----------

/// A msgpack value, encoded by [`enc`] in its shortest form or, `wide`, in
/// the 32-bit forms engines also use.
#[derive(Debug, Clone)]
enum Mp {
    Nil,
    Bool(bool),
    U(u64),
    I(i64),
    F(f64),
    S(String),
    B(Vec<u8>),
    A(Vec<Mp>),
    M(Vec<(Mp, Mp)>),
}

fn s(v: &str) -> Mp {
    Mp::S(v.to_string())
}

fn enc(v: &Mp, wide: bool, out: &mut Vec<u8>) {
    let len32 = |out: &mut Vec<u8>, tag: u8, n: usize| {
        out.push(tag);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    };
    match v {
        Mp::Nil => out.push(0xc0),
        Mp::Bool(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
        Mp::U(u) if *u < 128 && !wide => out.push(*u as u8),
        Mp::U(u) => {
            out.push(0xcf);
            out.extend_from_slice(&u.to_be_bytes());
        }
        Mp::I(i) if (-32..0).contains(i) && !wide => out.push(*i as i8 as u8),
        Mp::I(i) => {
            out.push(0xd3);
            out.extend_from_slice(&i.to_be_bytes());
        }
        Mp::F(f) => {
            out.push(0xcb);
            out.extend_from_slice(&f.to_be_bytes());
        }
        Mp::S(t) => {
            if t.len() < 32 && !wide {
                out.push(0xa0 | t.len() as u8);
            } else {
                len32(out, 0xdb, t.len());
            }
            out.extend_from_slice(t.as_bytes());
        }
        Mp::B(b) => {
            len32(out, 0xc6, b.len());
            out.extend_from_slice(b);
        }
        Mp::A(items) => {
            if items.len() < 16 && !wide {
                out.push(0x90 | items.len() as u8);
            } else {
                len32(out, 0xdd, items.len());
            }
            for i in items {
                enc(i, wide, out);
            }
        }
        Mp::M(pairs) => {
            if pairs.len() < 16 && !wide {
                out.push(0x80 | pairs.len() as u8);
            } else {
                len32(out, 0xdf, pairs.len());
            }
            for (k, v) in pairs {
                enc(k, wide, out);
                enc(v, wide, out);
            }
        }
    }
}

/// Any msgpack value, nested a few levels.
fn any_mp() -> impl Strategy<Value = Mp> {
    let leaf = prop_oneof![
        Just(Mp::Nil),
        any::<bool>().prop_map(Mp::Bool),
        any::<u64>().prop_map(Mp::U),
        any::<i64>().prop_map(Mp::I),
        any::<f64>().prop_map(Mp::F),
        "[a-zA-Z_]{0,12}".prop_map(Mp::S),
        proptest::collection::vec(any::<u8>(), 0..12).prop_map(Mp::B),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Mp::A),
            proptest::collection::vec((inner.clone(), inner), 0..4).prop_map(Mp::M),
        ]
    })
}

/// A block hash in any of the forms engines send.
fn hash() -> impl Strategy<Value = Mp> {
    prop_oneof![
        any::<u64>().prop_map(Mp::U),
        any::<i64>().prop_map(Mp::I),
        proptest::collection::vec(any::<u8>(), 0..12).prop_map(Mp::B),
    ]
}

fn opt(v: impl Strategy<Value = Mp>) -> impl Strategy<Value = Mp> {
    prop_oneof![Just(Mp::Nil), v]
}

fn medium() -> impl Strategy<Value = Mp> {
    opt(prop_oneof![
        Just(s("GPU")),
        Just(s("CPU")),
        Just(s("CPU_PINNED")),
        Just(s("DISK")),
        "[A-Z]{0,6}".prop_map(Mp::S)
    ])
}

/// One event's fields in vLLM's positional order, with its tag.
fn event_fields() -> impl Strategy<Value = (&'static str, Vec<(&'static str, Mp)>)> {
    let hashes = || proptest::collection::vec(hash(), 0..6).prop_map(Mp::A);
    let stored = (
        hashes(),
        opt(hash()),
        proptest::collection::vec((0u64..200_000).prop_map(Mp::U), 0..40).prop_map(Mp::A),
        (0u64..512).prop_map(Mp::U),
        opt(any::<u64>().prop_map(Mp::U)),
        medium(),
        opt("[a-z]{0,8}".prop_map(Mp::S)),
        opt(any_mp()),
    )
        .prop_map(|(h, p, t, bs, lora, m, ln, extra)| {
            (
                "BlockStored",
                vec![
                    ("block_hashes", h),
                    ("parent_block_hash", p),
                    ("token_ids", t),
                    ("block_size", bs),
                    ("lora_id", lora),
                    ("medium", m),
                    ("lora_name", ln),
                    ("extra_keys", extra),
                ],
            )
        });
    let removed = (hashes(), medium())
        .prop_map(|(h, m)| ("BlockRemoved", vec![("block_hashes", h), ("medium", m)]));
    prop_oneof![
        4 => stored,
        2 => removed,
        1 => Just(("AllBlocksCleared", vec![])),
        1 => Just(("SomethingNew", vec![("x", Mp::U(1))])),
    ]
}

/// An event as a tagged array or a map, sometimes with one field replaced
/// by a value of any type, some fields dropped, or extra fields after.
fn event() -> impl Strategy<Value = Mp> {
    (
        event_fields(),
        any::<bool>(),
        proptest::option::of((any::<usize>(), any_mp())),
        0usize..3,
        proptest::collection::vec(any_mp(), 0..2),
    )
        .prop_map(|((tag, mut fields), as_map, replace, drop_last, extra)| {
            if let Some((i, v)) = replace {
                if !fields.is_empty() {
                    let n = fields.len();
                    fields[i % n].1 = v;
                }
            }
            let keep = fields.len().saturating_sub(drop_last);
            fields.truncate(keep);
            if as_map {
                let mut pairs = vec![(s("type"), s(tag))];
                pairs.extend(fields.into_iter().map(|(k, v)| (s(k), v)));
                pairs.extend(extra.into_iter().map(|v| (s("unknown_key"), v)));
                Mp::M(pairs)
            } else {
                let mut items = vec![s(tag)];
                items.extend(fields.into_iter().map(|(_, v)| v));
                items.extend(extra);
                Mp::A(items)
            }
        })
}

/// A batch `[ts, events, dp_rank?]` or its map form, encoded.
fn batch() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![
            any::<f64>().prop_map(Mp::F),
            any::<u64>().prop_map(Mp::U),
            Just(Mp::Nil)
        ],
        proptest::collection::vec(event(), 0..8),
        proptest::option::of(opt(any::<i64>().prop_map(Mp::I))),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(ts, events, dp, as_map, wide)| {
            let v = if as_map {
                let mut pairs = vec![(s("ts"), ts), (s("events"), Mp::A(events))];
                if let Some(dp) = dp {
                    pairs.push((s("data_parallel_rank"), dp));
                }
                Mp::M(pairs)
            } else {
                let mut items = vec![ts, Mp::A(events)];
                items.extend(dp);
                Mp::A(items)
            };
            let mut out = Vec::new();
            enc(&v, wide, &mut out);
            out
        })
}

/// Decodes `payload` as a batch, a live message and a replay reply; fails
/// the case when the allocation bound is broken.
fn decode_all(payload: &[u8]) -> Result<(), TestCaseError> {
    let seq = 7u64.to_be_bytes();
    let ((), bytes) = allocated_during(|| {
        let _ = decode_batch(payload);
        let _ = decode_message(&[&b"kv@pod@model"[..], &seq[..], payload]);
        let _ = decode_replay_reply(&[&b""[..], &seq[..], payload]);
    });
    // Three decodes of the same payload.
    let bound = 3 * (ALLOC_PER_BYTE * payload.len() + ALLOC_BASE);
    prop_assert!(
        bytes <= bound,
        "{bytes} bytes allocated for a {}-byte payload",
        payload.len()
    );
    Ok(())
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// The payloads of every frame a real vLLM 0.32 sent (tests/fixtures).
fn captured_payloads() -> Vec<Vec<u8>> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/vllm-cpu/capture-1/events.jsonl");
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            unhex(v["frames_hex"][2].as_str().unwrap())
        })
        .collect()
}

/// Heads that claim huge lengths: array32, map32, str32, bin32, ext32.
const HUGE_HEADS: &[&[u8]] = &[
    &[0xdd, 0xff, 0xff, 0xff, 0xff],
    &[0xdf, 0xff, 0xff, 0xff, 0xff],
    &[0xdb, 0xff, 0xff, 0xff, 0xff],
    &[0xc6, 0xff, 0xff, 0xff, 0xff],
    &[0xc9, 0xff, 0xff, 0xff, 0xff, 0x01],
    &[0xdc, 0xff, 0xff],
    &[0x9f],
    &[0xc0],
];

#[test]
fn kv_events_generated_batches_never_panic() {
    fuzz("kvevents/generated", batch(), |payload| {
        decode_all(&payload)?;
        // A batch of events with known tags and well-typed fields decodes.
        Ok(())
    });
}

#[test]
fn kv_events_mutated_batches_never_panic() {
    let mut seeds = captured_payloads();
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    for _ in 0..32 {
        seeds.push(batch().new_tree(&mut runner).unwrap().current());
    }
    fuzz("kvevents/mutated", (0..seeds.len(), edits()), |(i, e)| {
        decode_all(&mutate(&seeds[i], &e, HUGE_HEADS))
    });
}

#[test]
fn every_captured_payload_still_decodes() {
    // The seeds are valid: a mutation that decodes is then a real variant.
    for p in captured_payloads() {
        decode_batch(&p).unwrap();
    }
}

#[test]
fn huge_lengths_are_errors_and_allocate_little() {
    for head in HUGE_HEADS.iter().take(6) {
        // In every position a length may sit: the batch, the events, an
        // event, a field.
        let payloads: Vec<Vec<u8>> = vec![
            head.to_vec(),
            [&[0x92, 0xcb][..], &[0; 8], head].concat(),
            [&[0x92, 0xcb][..], &[0; 8], &[0x91], head].concat(),
            [
                &[0x92, 0xcb][..],
                &[0; 8],
                &[0x91, 0x92, 0xab],
                b"BlockStored",
                head,
            ]
            .concat(),
        ];
        for p in payloads {
            let (r, bytes) = allocated_during(|| decode_batch(&p));
            assert!(r.is_err(), "{p:02x?} decoded");
            assert!(bytes < 64 << 10, "{bytes} bytes allocated for {p:02x?}");
        }
    }
}

// ---------- filters.yaml ----------

fn example_filter_configs() -> Vec<String> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    let mut out: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("filters") && n.ends_with(".yaml"))
        })
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    out.sort();
    assert!(out.len() >= 5, "the example filter configs are the seeds");
    out
}

/// Tokens a YAML mutation inserts: anchors and aliases, flow collections,
/// tags, odd scalars, indentation.
const YAML_TOKENS: &[&[u8]] = &[
    b"&a ",
    b"*a",
    b"[",
    b"]",
    b"{",
    b"}",
    b": ",
    b"- ",
    b"\n  ",
    b"\n",
    b"!!binary ",
    b"~",
    b"1e999",
    b"-1",
    b"0x7fffffffffffffff",
    b"99999999999999999999",
    b"NaN",
    b".inf",
    b"'",
    b"\"",
    b"? ",
    b"<<: *a",
    b"|\n",
    b"#",
];

/// Parses, validates and, when valid, builds the plugins: none may panic.
fn load_filters(text: &str) -> Result<(), TestCaseError> {
    if let Ok(cfg) = FilterConfig::from_yaml(text, "fuzz.yaml") {
        let _ = cfg.build(&PluginRegistry::builtin());
    }
    Ok(())
}

/// Line-level edits too: YAML's structure is its lines.
fn mutate_lines(text: &str, ops: &[(u8, usize, usize)]) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    for &(op, a, b) in ops {
        if lines.is_empty() {
            break;
        }
        let (i, j) = (a % lines.len(), b % lines.len());
        match op % 5 {
            0 => {
                lines.remove(i);
            }
            1 => {
                let l = lines[i].clone();
                lines.insert(j, l);
            }
            2 => lines.swap(i, j),
            3 => lines[i] = format!("  {}", lines[i]),
            _ => lines[i] = lines[i].trim_start().to_string(),
        }
    }
    lines.join("\n")
}

#[test]
fn filter_configs_mutated_never_panic() {
    let seeds = example_filter_configs();
    for s in &seeds {
        FilterConfig::from_yaml(s, "seed.yaml").unwrap();
    }
    let line_ops = proptest::collection::vec((any::<u8>(), any::<usize>(), any::<usize>()), 0..4);
    fuzz(
        "filters.yaml/mutated",
        (0..seeds.len(), line_ops, edits()),
        |(i, ops, e)| {
            let text = mutate_lines(&seeds[i], &ops);
            let bytes = mutate(text.as_bytes(), &e, YAML_TOKENS);
            load_filters(&String::from_utf8_lossy(&bytes))
        },
    );
}

/// A parameter value of any YAML type.
fn yaml_value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|v| v.to_string()),
        any::<f64>().prop_map(|v| format!("{v:?}")),
        (0u32..100).prop_map(|v| v.to_string()),
        Just("true".to_string()),
        Just("null".to_string()),
        "[a-z-]{0,12}",
        Just("[1, 2, 3]".to_string()),
        Just("{a: 1}".to_string()),
        Just("''".to_string()),
    ]
}

/// A config of registered plugin types with parameters named as in the
/// examples, values of any type, and profiles referring to known and
/// unknown plugins with any weight.
fn generated_filter_config(
    types: Vec<&'static str>,
    keys: Vec<String>,
) -> impl Strategy<Value = String> {
    let plugin = (
        proptest::sample::select(types),
        proptest::option::of("[a-z]{1,6}"),
        proptest::collection::vec((proptest::sample::select(keys), yaml_value()), 0..4),
    );
    let plugins = proptest::collection::vec(plugin, 0..6);
    let profile_entries =
        proptest::collection::vec((any::<usize>(), proptest::option::of(yaml_value())), 0..6);
    (
        prop_oneof![
            Just("kvmesh.dev/v1alpha1"),
            Just("llm-d.ai/v1alpha1"),
            Just("v9")
        ],
        plugins,
        proptest::collection::vec(("[a-z]{1,6}", profile_entries), 0..3),
    )
        .prop_map(|(api, plugins, profiles)| {
            let mut y = format!("apiVersion: {api}\nkind: EndpointPickerConfig\nplugins:\n");
            let mut names = Vec::new();
            for (ty, name, params) in &plugins {
                y.push_str(&format!("  - type: {ty}\n"));
                if let Some(n) = name {
                    y.push_str(&format!("    name: {n}\n"));
                }
                names.push(name.clone().unwrap_or_else(|| ty.to_string()));
                if !params.is_empty() {
                    y.push_str("    parameters:\n");
                    for (k, v) in params {
                        y.push_str(&format!("      {k}: {v}\n"));
                    }
                }
            }
            y.push_str("schedulingProfiles:\n");
            for (name, entries) in &profiles {
                y.push_str(&format!("  - name: {name}\n    plugins:\n"));
                for (r, w) in entries {
                    let target = names
                        .get(r % (names.len() + 1))
                        .map_or("nope", String::as_str);
                    y.push_str(&format!("      - pluginRef: {target}\n"));
                    if let Some(w) = w {
                        y.push_str(&format!("        weight: {w}\n"));
                    }
                }
            }
            y
        })
}

#[test]
fn filter_configs_generated_never_panic() {
    let types: Vec<&'static str> = PluginRegistry::builtin().type_names().collect();
    // Parameter names as the examples spell them.
    let mut keys: Vec<String> = Vec::new();
    for text in example_filter_configs() {
        let mut in_params = false;
        for l in text.lines() {
            let t = l.trim_start();
            if t.starts_with("parameters:") {
                in_params = true;
            } else if t.starts_with("- ") || !l.starts_with("      ") {
                in_params = false;
            } else if in_params {
                if let Some((k, _)) = t.split_once(':') {
                    keys.push(k.to_string());
                }
            }
        }
    }
    keys.sort();
    keys.dedup();
    keys.push("unknownParameter".into());
    fuzz(
        "filters.yaml/generated",
        generated_filter_config(types, keys),
        |text| load_filters(&text),
    );
}

#[test]
fn yaml_bombs_are_refused_with_bounded_memory() {
    // Billion laughs: each alias level multiplies by ten.
    let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
    for (prev, next) in ["a", "b", "c", "d", "e", "f", "g", "h"]
        .windows(2)
        .map(|w| (w[0], w[1]))
    {
        bomb.push_str(&format!("{next}: &{next} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"));
    }
    // Deep flow nesting. (The YAML scanner's time grows with the square of
    // the depth of `{a: ` nesting: 40k levels take seconds; see
    // docs/robustness.md.)
    let deep = "[".repeat(20_000);
    let deep_maps = "{a: ".repeat(5_000);
    for text in [bomb, deep, deep_maps] {
        let (r, bytes) = allocated_during(|| FilterConfig::from_yaml(&text, "bomb.yaml"));
        assert!(r.is_err());
        assert!(bytes < 256 << 20, "{bytes} bytes allocated");
    }
}
