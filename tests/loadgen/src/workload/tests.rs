#![allow(clippy::unwrap_used)]

use kvmesh_filters::prefix::tokenize::{Builtin, Tokenizer};

use super::*;

fn all_named(seed: u64) -> Vec<Workload> {
    WORKLOAD_NAMES
        .iter()
        .map(|n| Workload::named(n, Size::Small, seed).unwrap().0)
        .collect()
}

#[test]
fn same_seed_same_requests_different_seed_different() {
    let (a, b, c) = (all_named(7), all_named(7), all_named(8));
    for ((a, b), c) in a.iter().zip(&b).zip(&c) {
        assert!(!a.is_empty(), "{} is empty", a.name);
        assert_eq!(a, b, "{} differs under the same seed", a.name);
        assert_ne!(a, c, "{} does not depend on the seed", a.name);
        // Bodies too, byte for byte.
        assert_eq!(
            a.requests[0].body("m").unwrap(),
            b.requests[0].body("m").unwrap()
        );
    }
}

#[test]
fn one_word_is_one_builtin_token() {
    let mut rng = StdRng::seed_from_u64(1);
    let text = text::words(&mut rng, 500);
    assert_eq!(Builtin.encode(&text, false).unwrap().len(), 500);
    assert_eq!(Builtin.encode(&text, true).unwrap().len(), 501);
}

#[test]
fn shared_prefix_groups_share_exactly_the_system_prompt() {
    let p = SharedPrefixParams::small();
    let w = p.build(3);
    assert_eq!(w.len(), p.groups * p.users_per_group);
    let text = |r: &RequestSpec| match &r.prompt {
        Prompt::Text(t) => t.to_string(),
        Prompt::Messages(_) => String::new(),
    };
    let words = |s: &str| s.split(' ').map(str::to_owned).collect::<Vec<_>>();
    let group = |r: &RequestSpec| r.user as usize / p.users_per_group;
    let (a, b) = (
        &w.requests[0],
        w.requests
            .iter()
            .skip(1)
            .find(|r| group(r) == group(&w.requests[0]))
            .unwrap(),
    );
    let other = w.requests.iter().find(|r| group(r) != group(a)).unwrap();
    let (wa, wb, wo) = (words(&text(a)), words(&text(b)), words(&text(other)));
    assert_eq!(wa.len(), p.system_tokens + p.question_tokens);
    let common = wa.iter().zip(&wb).take_while(|(x, y)| x == y).count();
    assert!(common >= p.system_tokens && common < p.system_tokens + p.question_tokens);
    let across = wa.iter().zip(&wo).take_while(|(x, y)| x == y).count();
    assert!(across < 8, "groups share {across} words");
    assert!(w
        .requests
        .iter()
        .all(|r| r.stream && r.max_tokens == p.output_tokens));
}

#[test]
fn multi_turn_prompts_carry_previous_turns() {
    let p = MultiTurnParams::small();
    let w = p.build(5);
    assert!(w.ordered_per_user);
    assert_eq!(w.len(), p.users * p.turns);
    let turns: Vec<&Vec<Message>> = w
        .requests
        .iter()
        .filter(|r| r.user == 1)
        .map(|r| match &r.prompt {
            Prompt::Messages(m) => m,
            Prompt::Text(_) => panic!("chat workload sent text"),
        })
        .collect();
    assert_eq!(turns.len(), p.turns);
    for pair in turns.windows(2) {
        // Turn k+1 = turn k + assistant answer + new user message.
        assert_eq!(&pair[1][..pair[0].len()], &pair[0][..]);
        assert_eq!(pair[1].len(), pair[0].len() + 2);
        assert_eq!(pair[1][pair[0].len()].role, "assistant");
    }
}

#[test]
fn pd_has_the_asked_mix_of_long_and_short() {
    let p = PdParams::small();
    let w = p.build(9);
    let long = w
        .requests
        .iter()
        .filter(|r| r.prompt_words() == p.long_input)
        .count();
    let short = w
        .requests
        .iter()
        .filter(|r| r.prompt_words() == p.short_input)
        .count();
    assert_eq!(
        (long, short),
        (p.long_requests, p.long_requests * p.short_per_long)
    );
}

#[test]
fn long_body_prompts_are_200_kb_and_shared() {
    let p = LongBodyParams::small();
    let w = p.build(2);
    let body = w.requests[0].body("m").unwrap();
    assert!(
        body.len() >= 200_000 && body.len() < 201_000,
        "{}",
        body.len()
    );
    assert_eq!(w.len(), p.requests_per_stage * p.concurrency.len());
    assert_eq!(p.suggested_load().stages.len(), p.concurrency.len());
}

#[test]
fn bodies_ask_for_fixed_lengths_and_usage_when_streaming() {
    let w = tiny(1, 0);
    let v: serde_json::Value = serde_json::from_slice(&w.requests[0].body("m").unwrap()).unwrap();
    assert_eq!(
        (v["max_tokens"].as_u64(), v["ignore_eos"].as_bool()),
        (Some(8), Some(true))
    );
    assert!(v.get("stream_options").is_none());
    let s = &SharedPrefixParams::small().build(0).requests[0];
    let v: serde_json::Value = serde_json::from_slice(&s.body("m").unwrap()).unwrap();
    assert_eq!(v["stream_options"]["include_usage"].as_bool(), Some(true));
    assert!(Workload::named("nope", Size::Small, 0).is_err());
}
