#![allow(clippy::unwrap_used)]
//! The prefix stage's fallbacks: a template input the template refuses is
//! keyed on the messages alone and counted.

use prometheus_client::registry::Registry;

use super::*;
use crate::request::view::{RequestView, Shape};

/// A word-level tokenizer and a template that, like Llama 3.1's, takes one
/// tool call per assistant turn and raises on more.
fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,"model":{"type":"WordLevel","vocab":{"[UNK]":0,"user":1,"assistant":2,"hi":3,"tools":4,"call":5},"unk_token":"[UNK]"}}"#;
    std::fs::write(dir.path().join("tokenizer.json"), json).unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), "{}").unwrap();
    let template = "{% if tools %}tools {% endif %}{% for m in messages %}{{ m.role }} \
        {% if m.tool_calls %}{% if m.tool_calls | length != 1 %}{{ raise_exception('one call at a time') }}{% endif %}call \
        {% else %}{{ m.content }} {% endif %}{% endfor %}";
    std::fs::write(dir.path().join("chat_template.jinja"), template).unwrap();
    dir
}

fn state(dir: &std::path::Path) -> (PrefixState, Registry) {
    let yaml = format!(
        "engine:\n  url: http://127.0.0.1:9\nprefix:\n  tokenizer: {}\n",
        dir.display()
    );
    let config = crate::config::from_yaml_str(&yaml, "test").unwrap();
    let mut registry = crate::metrics::registry();
    let state = PrefixState::new(&config, "10.0.0.1:8000", &mut registry).unwrap();
    (state, registry)
}

fn counted(registry: &Registry, reason: &str) -> f64 {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    let series = format!("kvmesh_prefix_inexact_keys_total{{reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .map_or(-1.0, |v| v.trim().parse().unwrap())
}

#[test]
fn a_template_input_the_template_refuses_is_keyed_on_the_messages_and_counted() {
    let dir = model_dir();
    let (state, registry) = state(dir.path());
    let Source::Local(t) = &state.source else {
        panic!("not a local tokenizer")
    };
    let one = br#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","tool_calls":[{"id":"1","function":{"name":"f","arguments":"{}"}}]}],"tools":[{"type":"function","function":{"name":"f"}}]}"#;
    let view = RequestView::parse(one, Shape::Chat).unwrap();
    let ids = state.local_ids(t, &view, 1 << 20, "r1").unwrap().unwrap();
    // tools user hi assistant call
    assert_eq!(ids.ids, [4, 1, 3, 2, 5]);
    assert_eq!(counted(&registry, "template_error"), 0.0);

    let two = br#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","tool_calls":[{"id":"1","function":{"name":"f","arguments":"{}"}},{"id":"2","function":{"name":"f","arguments":"{}"}}]}],"tools":[{"type":"function","function":{"name":"f"}}]}"#;
    let view = RequestView::parse(two, Shape::Chat).unwrap();
    assert!(view.chat.is_some());
    let ids = state.local_ids(t, &view, 1 << 20, "r2").unwrap().unwrap();
    // The messages alone: user hi assistant (empty content).
    assert_eq!(ids.ids, [1, 3, 2]);
    assert_eq!(counted(&registry, "template_error"), 1.0);
    // Every reason is exported from the start.
    for reason in Inexact::ALL {
        assert!(
            counted(&registry, reason.as_str()) >= 0.0,
            "{}",
            reason.as_str()
        );
    }
}
