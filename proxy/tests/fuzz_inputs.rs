#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Hostile input at volume for the sidecar's decoders: the request view
//! (every inference body is parsed once into a `RequestView`), the mesh wire
//! decoder (frames from peers) and `proxy.yaml`. Generated inputs
//! (structure-aware) and byte-level mutations of valid seeds; no input may
//! panic, decoding allocates at most a small multiple of the input, and
//! valid mesh frames round-trip. The count of cases per target is
//! `KVMESH_FUZZ_CASES` (`scripts/fuzz` runs 100k).

use bytes::Bytes;
use kvmesh_filters::prefix::kvevents::{BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};
use kvmesh_filters::sched::view::Role;
use kvmesh_fuzz::{allocated_during, edits, fuzz, mutate, CountingAlloc};
use kvmesh_proxy::fleet::{EngineLoad, EngineWork};
use kvmesh_proxy::mesh::wire::{self, Announce, LoadMsg, Msg, HEADER_LEN};
use kvmesh_proxy::path::view::{RequestView, Shape};
use kvmesh_proxy::stat::PodStats;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use serde_json::{json, Value};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Bytes a decode may allocate per input byte, plus a constant (linear in
/// the input; never what a length field claims).
const ALLOC_PER_BYTE: usize = 64;
const ALLOC_BASE: usize = 64 << 10;

fn within_bound(bytes: usize, input: usize) -> Result<(), TestCaseError> {
    prop_assert!(
        bytes <= ALLOC_PER_BYTE * input + ALLOC_BASE,
        "{bytes} bytes allocated for {input} input bytes"
    );
    Ok(())
}

// ---------- the request view ----------

/// Any JSON value, a few levels deep.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|v| json!(v)),
        any::<u64>().prop_map(|v| json!(v)),
        any::<f64>().prop_map(|v| json!(v)),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 5, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            proptest::collection::vec(("[a-z]{1,8}", inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// A prompt in each shape the API allows, or anything.
fn prompt() -> impl Strategy<Value = Value> {
    prop_oneof![
        ".{0,64}".prop_map(Value::String),
        proptest::collection::vec(".{0,16}", 0..4).prop_map(|v| json!(v)),
        proptest::collection::vec(any::<u32>(), 0..16).prop_map(|v| json!(v)),
        proptest::collection::vec(proptest::collection::vec(any::<u32>(), 0..8), 0..3)
            .prop_map(|v| json!(v)),
        any_json(),
    ]
}

/// Chat messages: string or multi-part content, or anything.
fn messages() -> impl Strategy<Value = Value> {
    let content = prop_oneof![
        ".{0,32}".prop_map(Value::String),
        proptest::collection::vec(
            prop_oneof![
                ".{0,16}".prop_map(|t| json!({"type": "text", "text": t})),
                Just(json!({"type": "image_url", "image_url": {"url": "data:x"}})),
                any_json(),
            ],
            0..3
        )
        .prop_map(Value::Array),
        Just(Value::Null),
        any_json(),
    ];
    let message = (
        prop_oneof![
            Just("system"),
            Just("user"),
            Just("assistant"),
            Just("tool")
        ],
        content,
        proptest::option::of(any_json()),
    )
        .prop_map(|(role, content, extra)| {
            let mut m = json!({"role": role, "content": content});
            if let Some(x) = extra {
                m["tool_calls"] = x;
            }
            m
        });
    prop_oneof![
        4 => proptest::collection::vec(message, 0..4).prop_map(Value::Array),
        1 => any_json(),
    ]
}

/// An inference body: the fields the view reads, each sometimes of the
/// wrong type or absent, plus fields it ignores.
fn body() -> impl Strategy<Value = Value> {
    let field =
        |v: BoxedStrategy<Value>| proptest::option::of(prop_oneof![4 => v, 1 => any_json()]);
    (
        field(".{0,16}".prop_map(Value::String).boxed()),
        field(prompt().boxed()),
        field(messages().boxed()),
        field(any::<bool>().prop_map(Value::Bool).boxed()),
        field(any::<u64>().prop_map(|v| json!(v)).boxed()),
        field(any::<u64>().prop_map(|v| json!(v)).boxed()),
        field(".{0,8}".prop_map(Value::String).boxed()),
        proptest::collection::vec(("[a-z_]{1,10}", any_json()), 0..3),
    )
        .prop_map(|(model, prompt, messages, stream, mt, mct, salt, extra)| {
            let mut o = serde_json::Map::new();
            for (k, v) in [
                ("model", model),
                ("prompt", prompt),
                ("messages", messages),
                ("stream", stream),
                ("max_tokens", mt),
                ("max_completion_tokens", mct),
                ("cache_salt", salt),
            ] {
                if let Some(v) = v {
                    o.insert(k.into(), v);
                }
            }
            for (k, v) in extra {
                o.insert(k, v);
            }
            Value::Object(o)
        })
}

/// Parses `bytes` as each shape, copied and shared, and once more after a
/// leading newline: the JSON is the same, but a body holding a byte below
/// 0x20 has its strings read strictly rather than quickly
/// (`request/view.rs`). All must agree, and nothing may panic.
fn parse_view(bytes: &[u8]) -> Result<(), TestCaseError> {
    let shared = Bytes::copy_from_slice(bytes);
    let strict = [b"\n".as_slice(), bytes].concat();
    for shape in [Shape::Completion, Shape::Chat, Shape::Embedding] {
        let (copied, n) = allocated_during(|| RequestView::parse(bytes, shape));
        within_bound(n, bytes.len())?;
        let kept = RequestView::parse_shared(&shared, shape);
        let strictly = RequestView::parse(&strict, shape);
        for (how, other) in [("parse_shared", kept), ("strict", strictly)] {
            match (&copied, other) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, &b, "{}", how),
                (Err(_), Err(_)) => {}
                (a, b) => prop_assert!(false, "parse {a:?} but {how} {b:?}"),
            }
        }
    }
    Ok(())
}

/// Tokens a JSON mutation inserts.
const JSON_TOKENS: &[&[u8]] = &[
    b"[",
    b"]",
    b"{",
    b"}",
    b"\"",
    b",",
    b":",
    b"null",
    b"\\u0000",
    b"\\ud800",
    b"\\",
    b"1e999999",
    b"-0",
    b"18446744073709551616",
    b"\"prompt\":",
    b"\"messages\":",
    b"\"model\":",
    b"\xff",
    b"\xe2\x82",
    b"\"stream\":true",
];

#[test]
fn request_views_of_generated_bodies_never_panic() {
    fuzz("request-view/generated", body(), |v| {
        let text = serde_json::to_vec(&v).unwrap();
        parse_view(&text)
    });
}

#[test]
fn request_views_of_mutated_bodies_never_panic() {
    let mut seeds: Vec<Vec<u8>> = vec![
        br#"{"model":"m","prompt":"Once upon a time","max_tokens":16,"stream":true}"#.to_vec(),
        br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi \u00e9"}]}],"max_completion_tokens":8,"cache_salt":"t1"}"#.to_vec(),
        br#"{"model":"m","prompt":[[1,2,3],[4,5]]}"#.to_vec(),
        br#"{"model":"e","input":"embed me"}"#.to_vec(),
    ];
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    for _ in 0..32 {
        let v = body().new_tree(&mut runner).unwrap().current();
        seeds.push(serde_json::to_vec(&v).unwrap());
    }
    fuzz(
        "request-view/mutated",
        (0..seeds.len(), edits()),
        |(i, e)| parse_view(&mutate(&seeds[i], &e, JSON_TOKENS)),
    );
}

#[test]
fn deeply_nested_bodies_are_errors_not_stack_overflows() {
    for open in ["[", "{\"a\":", "{\"prompt\":"] {
        let body = open.repeat(200_000);
        for shape in [Shape::Completion, Shape::Chat] {
            assert!(RequestView::parse(body.as_bytes(), shape).is_err());
        }
    }
    let messages = format!("{{\"messages\":{}", "[".repeat(200_000));
    assert!(RequestView::parse(messages.as_bytes(), Shape::Chat).is_err());
}

// ---------- the mesh wire ----------

fn short() -> impl Strategy<Value = String> {
    ".{0,12}"
}

fn medium() -> impl Strategy<Value = Medium> {
    prop_oneof![
        Just(Medium::Gpu),
        Just(Medium::Cpu),
        Just(Medium::Storage),
        Just(Medium::External),
        Just(Medium::Other),
    ]
}

/// An event with only the fields the wire carries (so it round-trips).
fn wire_event() -> impl Strategy<Value = KvEvent> {
    let stored = (
        proptest::collection::vec(any::<u64>(), 0..6),
        proptest::option::of(any::<u64>()),
        proptest::collection::vec(any::<u32>(), 0..32),
        any::<u32>(),
        medium(),
        proptest::option::of(short()),
        proptest::option::of(short()),
    )
        .prop_map(
            |(block_hashes, parent, token_ids, block_size, medium, lora_name, salt)| {
                KvEvent::BlockStored(BlockStored {
                    block_hashes,
                    // The salt travels only on root blocks.
                    cache_salt: if parent.is_none() { salt } else { None },
                    parent_block_hash: parent,
                    token_ids,
                    block_size,
                    medium,
                    lora_name,
                    ..BlockStored::default()
                })
            },
        );
    let removed = (proptest::collection::vec(any::<u64>(), 0..6), medium()).prop_map(|(h, m)| {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: h,
            medium: m,
            ..BlockRemoved::default()
        })
    });
    prop_oneof![stored, removed, Just(KvEvent::AllBlocksCleared)]
}

fn msg() -> impl Strategy<Value = Msg> {
    let role = prop_oneof![Just(Role::Prefill), Just(Role::Decode), Just(Role::Both)];
    let strs = || proptest::collection::vec(short(), 0..4);
    let hello = (
        (short(), short(), role, strs(), strs()),
        (
            proptest::collection::vec((short(), short()), 0..3),
            any::<u64>(),
            short(),
        ),
    )
        .prop_map(
            |((id, mesh_addr, role, models, lora_adapters), (labels, instance, kv_agent))| {
                Msg::Hello(Announce {
                    id,
                    mesh_addr,
                    role,
                    models,
                    lora_adapters,
                    labels,
                    instance,
                    kv_agent,
                })
            },
        );
    let load = (
        any::<u32>(),
        any::<u32>(),
        0.0f64..1.0,
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
        any::<bool>(),
        proptest::option::of(any::<[u64; 4]>()),
    )
        .prop_map(
            |(waiting, running, kv_usage, block_size, num_blocks, age_ms, healthy, work)| {
                Msg::Load(LoadMsg {
                    load: EngineLoad {
                        waiting,
                        running,
                        kv_usage,
                        block_size,
                        num_blocks,
                        work: work.map(
                            |[finished, prompt_tokens, cached_tokens, generation_tokens]| {
                                EngineWork {
                                    finished,
                                    prompt_tokens,
                                    cached_tokens,
                                    generation_tokens,
                                    prompt_spread: None,
                                }
                            },
                        ),
                    },
                    age_ms,
                    healthy,
                })
            },
        );
    prop_oneof![
        hello,
        Just(Msg::SnapshotEnd),
        load,
        proptest::collection::vec((short(), any::<u32>()), 0..5).prop_map(Msg::InFlight),
        (short(), proptest::collection::vec(wire_event(), 0..5)).prop_map(|(model, events)| {
            Msg::Kv {
                model,
                batch: EventBatch {
                    ts: 0.0,
                    events,
                    dp_rank: None,
                    unknown_events: 0,
                },
            }
        }),
        (short(), proptest::collection::vec(any::<u64>(), 0..16))
            .prop_map(|(pod, keys)| Msg::Decision { pod, keys }),
        any::<[u64; 5]>().prop_map(|s| Msg::Stats(PodStats {
            requests: s[0],
            pd_splits: s[1],
            pd_failures: s[2],
            prefix_queries: s[3],
            prefix_hits: s[4],
        })),
        proptest::collection::vec(short(), 0..5).prop_map(Msg::Adapters),
        proptest::collection::vec((short(), any::<u64>()), 0..5).prop_map(Msg::Prefill),
    ]
}

/// Reads `frame` as a subscriber does: the header, then the payload it
/// announces; nothing may panic, allocation stays linear.
fn read_frame(frame: &[u8]) -> Result<(), TestCaseError> {
    let (r, n) = allocated_during(|| {
        let Ok(Some(h)) = wire::header(frame) else {
            return;
        };
        let end = (HEADER_LEN + h.len as usize).min(frame.len());
        let _ = wire::decode(h.kind, &frame[HEADER_LEN..end]);
        // And every kind on the same bytes.
        for kind in 0..9 {
            let _ = wire::decode(kind, &frame[HEADER_LEN.min(frame.len())..]);
        }
    });
    within_bound(n, 10 * frame.len())?;
    Ok(r)
}

#[test]
fn mesh_frames_round_trip_and_survive_mutation() {
    fuzz(
        "mesh-wire/generated+mutated",
        (msg(), any::<u64>(), edits()),
        |(m, seq, e)| {
            let frame = wire::encode(seq, &m);
            let h = wire::header(&frame).unwrap().unwrap();
            prop_assert_eq!((h.seq, h.len as usize), (seq, frame.len() - HEADER_LEN));
            prop_assert_eq!(wire::decode(h.kind, &frame[HEADER_LEN..]).unwrap(), m);
            read_frame(&mutate(
                &frame,
                &e,
                &[&[0xff, 0xff, 0xff, 0xff], &[0, 0, 0, 0], &[1]],
            ))
        },
    );
}

#[test]
fn mesh_counts_past_the_payload_are_errors_and_allocate_little() {
    // A count of 2^32-1 at every place a count is read: strings, lists of
    // strings, label pairs, in-flight pairs, events, keys, token ids.
    let huge = [0xffu8; 4];
    let hello_prefix = [&[0, 0, 0, 1][..], b"a", &[0, 0, 0, 1], b"b", &[3]].concat();
    let cases: Vec<(u8, Vec<u8>)> = vec![
        (1, huge.to_vec()),
        (1, [&hello_prefix[..], &huge].concat()),
        (1, [&hello_prefix[..], &[0, 0, 0, 0], &huge].concat()),
        (
            1,
            [&hello_prefix[..], &[0, 0, 0, 0], &[0, 0, 0, 0], &huge].concat(),
        ),
        (4, huge.to_vec()),
        (5, [&[0, 0, 0, 1][..], b"m", &huge].concat()),
        (
            5,
            [&[0, 0, 0, 1][..], b"m", &[0, 0, 0, 1], &[1], &huge].concat(),
        ),
        (6, [&[0, 0, 0, 1][..], b"p", &huge].concat()),
    ];
    for (kind, payload) in cases {
        let (r, n) = allocated_during(|| wire::decode(kind, &payload));
        assert!(r.is_err(), "kind {kind} {payload:02x?} decoded: {r:?}");
        assert!(
            n < 4096,
            "{n} bytes allocated for kind {kind} {payload:02x?}"
        );
    }
    // A header announcing more than the limit is refused before any read.
    let mut h = vec![wire::VERSION, 5];
    h.extend_from_slice(&0u64.to_be_bytes());
    h.extend_from_slice(&u32::MAX.to_be_bytes());
    assert!(wire::header(&h).is_err());
}

// ---------- proxy.yaml ----------

fn example_proxy_configs() -> Vec<String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    let mut out = Vec::new();
    for dir in [root.clone(), root.join("heterogeneous")] {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            let name = p
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("")
                .to_string();
            if name.starts_with("proxy") && name.ends_with(".yaml") {
                out.push(std::fs::read_to_string(&p).unwrap());
            }
        }
    }
    out.sort();
    assert!(out.len() >= 3, "the example proxy configs are the seeds");
    out
}

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
    b"0s",
    b"1ms",
    b"99999999999h",
    b"18446744073709551616",
    b"-1",
    b"0",
    b"NaN",
    b".inf",
    b"'",
    b"\"",
    b"? ",
    b"<<: *a",
    b"|\n",
    b"#",
    b"999999GiB",
    b"0.0.0.0:0",
    b"[::1]:99999",
];

/// A load builds a whole `Config` (defaults included) and an error message
/// that quotes the source, whatever the input: a larger constant, still
/// linear in the text.
fn load_proxy(text: &str) -> Result<(), TestCaseError> {
    let (_, n) = allocated_during(|| kvmesh_proxy::config::load::from_yaml_str(text, "fuzz.yaml"));
    prop_assert!(
        n <= 256 * text.len() + (1 << 20),
        "{n} bytes allocated for a {}-byte config",
        text.len()
    );
    Ok(())
}

#[test]
fn proxy_configs_mutated_never_panic() {
    let seeds = example_proxy_configs();
    let line_ops = proptest::collection::vec((any::<u8>(), any::<usize>(), any::<usize>()), 0..4);
    fuzz(
        "proxy.yaml/mutated",
        (0..seeds.len(), line_ops, edits()),
        |(i, ops, e)| {
            let mut lines: Vec<&str> = seeds[i].lines().collect();
            for (op, a, b) in ops {
                if lines.is_empty() {
                    break;
                }
                let (a, b) = (a % lines.len(), b % lines.len());
                match op % 3 {
                    0 => {
                        lines.remove(a);
                    }
                    1 => lines.insert(b, lines[a]),
                    _ => lines.swap(a, b),
                }
            }
            let text = lines.join("\n");
            load_proxy(&String::from_utf8_lossy(&mutate(
                text.as_bytes(),
                &e,
                YAML_TOKENS,
            )))
        },
    );
}

/// A value of any type the config's fields take, in range or not.
fn config_value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|v| v.to_string()),
        any::<u64>().prop_map(|v| v.to_string()),
        any::<f64>().prop_map(|v| format!("{v:?}")),
        (
            0u64..100_000,
            prop_oneof![
                Just("ms"),
                Just("s"),
                Just("m"),
                Just("h"),
                Just("d"),
                Just("")
            ]
        )
            .prop_map(|(n, u)| format!("{n}{u}")),
        (
            0u64..100_000,
            prop_oneof![Just("B"), Just("KiB"), Just("MiB"), Just("GiB"), Just("TB")]
        )
            .prop_map(|(n, u)| format!("{n}{u}")),
        (any::<[u8; 4]>(), any::<u16>())
            .prop_map(|(ip, p)| format!("{}.{}.{}.{}:{p}", ip[0], ip[1], ip[2], ip[3])),
        Just("true".to_string()),
        Just("null".to_string()),
        Just("[]".to_string()),
        Just("{}".to_string()),
        "[a-z:/.0-9-]{0,16}",
    ]
}

#[test]
fn proxy_configs_with_generated_values_never_panic() {
    // The full example: every key, each value replaced by one of any type.
    let seeds = example_proxy_configs();
    let full = seeds.iter().max_by_key(|s| s.len()).unwrap().clone();
    let lines: Vec<String> = full.lines().map(str::to_string).collect();
    let keyed: Vec<usize> = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| {
            let t = kvmesh_filters::yaml::strip_comment(l).trim_end();
            t.contains(": ") && !t.trim_start().starts_with('#')
        })
        .map(|(i, _)| i)
        .collect();
    assert!(keyed.len() > 20);
    fuzz(
        "proxy.yaml/generated",
        proptest::collection::vec((proptest::sample::select(keyed), config_value()), 1..6),
        |edits| {
            let mut l = lines.clone();
            for (i, v) in edits {
                let key = l[i].split(": ").next().unwrap_or("").to_string();
                l[i] = format!("{key}: {v}");
            }
            load_proxy(&l.join("\n"))
        },
    );
}

#[test]
fn proxy_config_bombs_are_refused() {
    let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
    for w in ["a", "b", "c", "d", "e", "f", "g", "h"].windows(2) {
        let (p, n) = (w[0], w[1]);
        bomb.push_str(&format!(
            "{n}: &{n} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        ));
    }
    for text in [bomb, "[".repeat(20_000), "{a: ".repeat(5_000)] {
        let (r, n) =
            allocated_during(|| kvmesh_proxy::config::load::from_yaml_str(&text, "bomb.yaml"));
        assert!(r.is_err());
        assert!(n < 256 << 20, "{n} bytes allocated");
    }
}
