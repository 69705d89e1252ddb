#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Mutex;

use serde_json::json;

use super::*;
use crate::body::Whole;

const PEER: &str = "10.0.0.2:8000";

/// A `Reroute` that offers one peer and records what it was sent.
#[derive(Clone, Default)]
struct Fake {
    sent: Arc<Mutex<Vec<(Served, Bytes)>>>,
    /// What the continuation answers (a whole SSE body).
    answer: Bytes,
    /// What the peer's `/tokenize` counts (`None`: it cannot).
    counts: Option<u64>,
    /// The count calls' probes.
    probed: Arc<Mutex<Vec<[Bytes; 2]>>>,
}

impl Reroute for Fake {
    fn pick(
        &self,
        _: Option<&str>,
        avoid: &[Served],
        _: &[Target],
    ) -> Option<(Served, UpstreamName)> {
        let peer = Served::Peer(PEER.parse::<SocketAddr>().unwrap());
        (!avoid.contains(&peer)).then(|| (peer, UpstreamName::Peer(PEER.to_owned())))
    }

    fn send(&self, to: Served, job: Job) -> Continuing {
        self.sent.lock().unwrap().push((to, job.body));
        let answer = self.answer.clone();
        Box::pin(async move {
            let body = crate::body::streamed(Whole::new(answer));
            Ok((body, UpstreamName::Peer(PEER.to_owned())))
        })
    }

    fn count(&self, _: Served, count: Count) -> Counting {
        self.probed.lock().unwrap().push(count.probes);
        let n = self.counts.ok_or("the test's pod does not count");
        Box::pin(async move { n })
    }
}

fn start(route: Route, body: serde_json::Value) -> Start {
    Start {
        route,
        model: Some("m".to_owned()),
        body: Bytes::from(body.to_string()),
        method: Method::POST,
        uri: Uri::from_static("/v1/completions"),
        headers: HeaderMap::new(),
        request_id: HeaderValue::from_static("r1"),
        started: Instant::now(),
        targets: vec![Target::LocalEngine],
        serving: Served::LocalEngine,
        upstream: UpstreamName::Engine("e".to_owned()),
        attempts: 1,
        max_migrations: 3,
        deadline: Duration::from_secs(60),
        kv_resend: None,
    }
}

fn migration(s: Start, fake: &Fake) -> (Migration, Arc<UpstreamMetrics>) {
    let metrics = Arc::new(UpstreamMetrics::new());
    let m = Migration::new(s, Box::new(fake.clone()), Arc::clone(&metrics));
    (m, metrics)
}

fn counted(metrics: &UpstreamMetrics, outcome: &'static str) -> u64 {
    metrics.migration_counts(outcome).0
}

trait Fwd {
    /// `forward`, its failure an `Err` (and what came before it dropped).
    fn _fwd(&mut self, data: Bytes) -> Result<Bytes, ProxyError>;
}

impl Fwd for Migration {
    fn _fwd(&mut self, data: Bytes) -> Result<Bytes, ProxyError> {
        match self.forward(data) {
            (_, Some(e)) => Err(e),
            (b, None) => Ok(b),
        }
    }
}

fn ev(v: serde_json::Value) -> String {
    format!("data: {v}\n\n")
}

fn cmpl(text: &str, ids: Option<&[u64]>, finish: Option<&str>) -> String {
    ev(
        json!({"id": "cmpl-1", "created": 7, "object": "text_completion",
        "choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}]}),
    )
}

fn died() -> ProxyError {
    ProxyError::UpstreamDied {
        upstream: UpstreamName::Engine("e".to_owned()),
        reason: "reset".to_owned(),
    }
}

/// Runs the continuation `m.resume` starts and returns its body's bytes.
async fn resume(m: &mut Migration) -> Bytes {
    use http_body_util::BodyExt;
    let (body, _) = m.resume(&died(), None).expect("migrates").await.unwrap();
    body.collect().await.unwrap().to_bytes()
}

fn sent_json(fake: &Fake) -> serde_json::Value {
    let sent = fake.sent.lock().unwrap();
    serde_json::from_slice(&sent.last().unwrap().1).unwrap()
}

#[test]
fn a_partial_event_waits_for_its_end() {
    let fake = Fake::default();
    let (mut m, _) = migration(start(Route::Completions, json!({"prompt": "p"})), &fake);
    let whole = cmpl(" a", None, None);
    let (head, tail) = whole.split_at(10);
    assert!(m._fwd(Bytes::from(head.to_owned())).unwrap().is_empty());
    let out = m._fwd(Bytes::from(format!("{tail}{head}"))).unwrap();
    assert_eq!(out, whole.as_bytes());
    assert_eq!(m.out.text, " a");
    let b = cmpl(" b", None, None);
    let out = m._fwd(Bytes::from(format!("{}{b}", &whole[10..]))).unwrap();
    assert_eq!(out, format!("{whole}{b}").as_bytes());
    // Whole events in one frame go out as they came.
    let c = cmpl(" c", None, None);
    assert_eq!(m._fwd(Bytes::from(c.clone())).unwrap(), c.as_bytes());
    assert_eq!(m.out.text, " a a b c");
    assert_eq!(m.out.generated, 4);
}

#[test]
fn escaped_text_is_read_as_text() {
    let fake = Fake::default();
    let (mut m, _) = migration(start(Route::Completions, json!({"prompt": "p"})), &fake);
    let e = ev(json!({"id": "x", "object": "text_completion",
        "choices": [{"index": 0, "text": "a \"q\"\n\u{e9}", "finish_reason": null}]}));
    assert_eq!(m._fwd(Bytes::from(e.clone())).unwrap(), e.as_bytes());
    assert_eq!(m.out.text, "a \"q\"\n\u{e9}");
}

#[test]
fn an_event_that_is_no_chunk_goes_out_but_ends_the_chance_to_migrate() {
    let fake = Fake::default();
    let (mut m, metrics) = migration(start(Route::Completions, json!({"prompt": "p"})), &fake);
    for e in ["data: 1\n\n", "data: {\"choices\": 7}\n\n"] {
        assert_eq!(m._fwd(Bytes::from(e)).unwrap(), e.as_bytes());
    }
    assert!(m.resume(&died(), None).is_none());
    assert_eq!(counted(&metrics, "unparsed_event"), 1);
}

#[test]
fn an_error_event_is_a_failure_and_not_forwarded() {
    let fake = Fake::default();
    let (mut m, _) = migration(start(Route::Completions, json!({"prompt": "p"})), &fake);
    m._fwd(Bytes::from(cmpl(" a", None, None))).unwrap();
    let err = ev(json!({"error": {"message": "engine died", "code": 502}}));
    // The events before the error go out; the error event does not.
    let b = cmpl(" b", None, None);
    let (out, failed) = m.forward(Bytes::from(format!("{b}{err}")));
    assert_eq!(out, b.as_bytes());
    assert!(failed.is_some());
    let (out, failed) = m.forward(Bytes::from(format!("{b}{}", &err[..5])));
    assert_eq!(out, b.as_bytes());
    assert!(failed.is_none());
    let (out, failed) = m.forward(Bytes::from(err[5..].to_owned()));
    assert!(out.is_empty() && failed.is_some());
    assert_eq!(m.out.text, " a b b");
    // Not complete: a failure now (or the body's end) is one.
    assert!(m.complete().is_none());
    m._fwd(Bytes::from_static(b"data: [DONE]\n\n")).unwrap();
    assert_eq!(m.complete(), Some(Bytes::new()));
}

#[test]
fn a_finished_stream_cut_before_done_ends_cleanly() {
    let fake = Fake::default();
    let (mut m, metrics) = migration(start(Route::Completions, json!({"prompt": "p"})), &fake);
    m._fwd(Bytes::from(cmpl(" a", None, Some("length"))))
        .unwrap();
    // Its end is all the client misses: `[DONE]`, once, and no migration.
    assert_eq!(m.complete(), Some(Bytes::from_static(b"data: [DONE]\n\n")));
    assert_eq!(m.complete(), Some(Bytes::new()));
    assert_eq!(metrics.migration_counts("migrated"), (0, 0));
    assert!(fake.sent.lock().unwrap().is_empty());
}

#[tokio::test]
async fn an_event_a_peer_cut_is_a_failure_not_output() {
    let fake = Fake::default();
    let (mut m, _) = migration(start(Route::Completions, json!({"prompt": "p"})), &fake);
    // A peer sidecar whose engine died mid-event closes it with its error.
    let a = cmpl(" a", None, None);
    let (out, failed) = m.forward(Bytes::from(format!("{a}data: {{\"choi")));
    assert_eq!(out, a.as_bytes());
    assert!(failed.is_none());
    let tail = "\n\ndata: {\"error\":{\"code\":\"upstream_died\"}}\n\ndata: [DONE]\n\n";
    let (out, failed) = m.forward(Bytes::from(tail));
    assert!(out.is_empty());
    assert!(failed.is_some());
    assert_eq!(m.out.text, " a");
    resume(&mut m).await;
    assert_eq!(sent_json(&fake)["prompt"], "p a");
}

#[tokio::test]
async fn completions_continue_with_text_and_the_rest_of_max_tokens() {
    let fake = Fake {
        answer: Bytes::from(format!(
            "{}{}data: [DONE]\n\n",
            ev(
                json!({"id": "cmpl-2", "created": 9, "choices": [{"index": 0, "text": " c", "finish_reason": null}]})
            ),
            ev(
                json!({"id": "cmpl-2", "created": 9, "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}})
            ),
        )),
        ..Fake::default()
    };
    let body = json!({"prompt": "say", "max_tokens": 5, "min_tokens": 1, "stream": true});
    let (mut m, metrics) = migration(start(Route::Completions, body), &fake);
    m._fwd(Bytes::from(
        cmpl(" a", None, None) + &cmpl(" b", None, None),
    ))
    .unwrap();
    let cont = resume(&mut m).await;
    let sent = sent_json(&fake);
    assert_eq!(sent["prompt"], "say a b");
    assert_eq!(sent["max_tokens"], 3);
    assert_eq!(sent["min_tokens"], 0);
    // The continuation's events read as the first stream's.
    let out = m._fwd(cont).unwrap();
    let text = String::from_utf8(out.to_vec()).unwrap();
    let events: Vec<serde_json::Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(events.len(), 2);
    assert!(events
        .iter()
        .all(|e| e["id"] == "cmpl-1" && e["created"] == 7));
    assert_eq!(events[1]["usage"]["prompt_tokens"], 10);
    assert_eq!(events[1]["usage"]["completion_tokens"], 3);
    assert_eq!(events[1]["usage"]["total_tokens"], 13);
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert_eq!(m.out.text, " a b c");
    assert_eq!(m.complete(), Some(Bytes::new()));
    assert_eq!(metrics.migration_counts("migrated"), (1, 2));
}

#[tokio::test]
async fn completions_continue_with_token_ids_when_the_stream_has_them() {
    let fake = Fake::default();
    let body = json!({"prompt": "say", "max_tokens": 8, "return_token_ids": true});
    let (mut m, _) = migration(start(Route::Completions, body), &fake);
    let first = ev(
        json!({"id": "cmpl-1", "choices": [{"index": 0, "text": " a", "token_ids": [40],
        "prompt_token_ids": [1, 30, 31]}]}),
    );
    m._fwd(Bytes::from(first + &cmpl(" b c", Some(&[41, 42]), None)))
        .unwrap();
    resume(&mut m).await;
    let sent = sent_json(&fake);
    assert_eq!(sent["prompt"], json!([1, 30, 31, 40, 41, 42]));
    assert_eq!(sent["max_tokens"], 5);
}

#[test]
fn a_token_id_prompt_without_output_ids_does_not_migrate() {
    let fake = Fake::default();
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 8});
    let (mut m, metrics) = migration(start(Route::Completions, body), &fake);
    m._fwd(Bytes::from(cmpl(" a", None, None))).unwrap();
    assert!(m.resume(&died(), None).is_none());
    assert_eq!(counted(&metrics, "token_ids_unknown"), 1);
}

#[tokio::test]
async fn chat_continues_the_partial_assistant_message() {
    let role = ev(
        json!({"id": "chatcmpl-2", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    );
    let fake = Fake {
        answer: Bytes::from(format!(
            "{role}{}data: [DONE]\n\n",
            ev(
                json!({"id": "chatcmpl-2", "choices": [{"index": 0, "delta": {"content": " c"}, "finish_reason": "length"}]})
            )
        )),
        ..Fake::default()
    };
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "stream": true});
    let (mut m, _) = migration(start(Route::ChatCompletions, body), &fake);
    let role1 = ev(
        json!({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    );
    let a = ev(json!({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": " a"}}]}));
    m._fwd(Bytes::from(role1 + &a)).unwrap();
    let cont = resume(&mut m).await;
    let sent = sent_json(&fake);
    assert_eq!(
        sent["messages"],
        json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": " a"}])
    );
    assert_eq!(sent["continue_final_message"], true);
    assert_eq!(sent["add_generation_prompt"], false);
    assert_eq!(sent["max_completion_tokens"], 2);
    // The second role chunk is dropped; the content goes on under the first id.
    let out = String::from_utf8(m._fwd(cont).unwrap().to_vec()).unwrap();
    assert!(!out.contains("\"role\""), "{out}");
    assert!(
        out.contains("chatcmpl-1") && !out.contains("chatcmpl-2"),
        "{out}"
    );
    assert_eq!(m.out.text, " a c");
}

#[tokio::test]
async fn chat_extends_a_message_the_client_left_open() {
    let fake = Fake {
        counts: Some(2),
        ..Fake::default()
    };
    let body = json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}],
        "continue_final_message": true, "add_generation_prompt": false});
    let (mut m, _) = migration(start(Route::ChatCompletions, body), &fake);
    m._fwd(Bytes::from(ev(
        json!({"id": "x", "choices": [{"index": 0, "delta": {"content": " yes"}}]}),
    )))
    .unwrap();
    resume(&mut m).await;
    let sent = sent_json(&fake);
    assert_eq!(sent["messages"][1]["content"], "Sure, yes");
    assert_eq!(sent["messages"].as_array().unwrap().len(), 2);
    // The count's probes hold the client's own open text, both of them.
    let probes = fake.probed.lock().unwrap().pop().unwrap();
    let [with, without] = probes.map(|b| serde_json::from_slice::<serde_json::Value>(&b).unwrap());
    assert_eq!(with["messages"][1]["content"], "Sure, yes");
    assert_eq!(without["messages"][1]["content"], "Sure,");
    assert_eq!(without["continue_final_message"], true);
}

/// Chat events that each carry two tokens' text, as vLLM sends when its API
/// server falls behind or runs with `--stream-interval 2`.
fn merged_chat(m: &mut Migration) {
    let role = ev(
        json!({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    );
    let two = |t: &str| {
        ev(json!({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": t}}]}))
    };
    m._fwd(Bytes::from(role + &two(" a b") + &two(" c d")))
        .unwrap();
}

#[tokio::test]
async fn text_output_is_counted_by_the_next_pods_tokenizer() {
    let usage = ev(
        json!({"id": "chatcmpl-2", "choices": [], "usage": {"prompt_tokens": 14, "completion_tokens": 6, "total_tokens": 20}}),
    );
    let fake = Fake {
        answer: Bytes::from(format!("{usage}data: [DONE]\n\n")),
        counts: Some(4),
        ..Fake::default()
    };
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
        "min_tokens": 5, "stream": true, "stream_options": {"include_usage": true}});
    let (mut m, metrics) = migration(start(Route::ChatCompletions, body), &fake);
    merged_chat(&mut m);
    assert_eq!(m.out.generated, 2, "one per event: a lower bound");
    let cont = resume(&mut m).await;
    let sent = sent_json(&fake);
    assert_eq!(sent["max_tokens"], 6, "10 less the 4 counted");
    assert_eq!(sent["min_tokens"], 1);
    // The probes: the answer as an open assistant message, and the same
    // conversation without it, with the generation prompt.
    let probes = fake.probed.lock().unwrap().pop().unwrap();
    let [with, without] = probes.map(|b| serde_json::from_slice::<serde_json::Value>(&b).unwrap());
    assert_eq!(
        with,
        json!({"model": "m", "messages": [{"role": "user", "content": "."},
            {"role": "assistant", "content": " a b c d"}],
            "add_generation_prompt": false, "continue_final_message": true})
    );
    assert_eq!(
        without,
        json!({"model": "m", "messages": [{"role": "user", "content": "."}],
            "add_generation_prompt": true, "continue_final_message": false})
    );
    // `usage` moves the 4 counted tokens from the prompt to the completion.
    let out = String::from_utf8(m._fwd(cont).unwrap().to_vec()).unwrap();
    assert!(out.contains(r#""completion_tokens":10"#), "{out}");
    assert!(out.contains(r#""prompt_tokens":10"#), "{out}");
    assert_eq!(m.carried(), 4);
    assert_eq!(metrics.migration_counts("migrated").0, 1);
}

#[tokio::test]
async fn without_a_count_the_stream_own_count_stands() {
    for counts in [None, Some(1)] {
        let fake = Fake {
            counts,
            ..Fake::default()
        };
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10});
        let (mut m, _) = migration(start(Route::ChatCompletions, body), &fake);
        merged_chat(&mut m);
        resume(&mut m).await;
        // The pod could not count, or counted fewer than the events: the
        // events' count, a lower bound of what was generated, stands.
        assert_eq!(sent_json(&fake)["max_tokens"], 8, "{counts:?}");
        assert_eq!(m.carried(), 2);
    }
}

#[tokio::test]
async fn a_count_that_reaches_the_limit_ends_the_stream() {
    let fake = Fake {
        counts: Some(4),
        ..Fake::default()
    };
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    let mut s = start(Route::ChatCompletions, body);
    s.max_migrations = 1;
    let (mut m, metrics) = migration(s, &fake);
    merged_chat(&mut m);
    let call = m
        .resume(&died(), None)
        .expect("the events' count leaves room");
    let Err(e) = call.await else {
        panic!("no continuation: the output was whole");
    };
    // The error names the pod that failed, not the one that counted.
    assert!(e.to_string().contains("last token"), "{e}");
    assert!(
        matches!(&e, ProxyError::UpstreamDied { upstream: UpstreamName::Engine(n), .. } if n == "e")
    );
    assert!(fake.sent.lock().unwrap().is_empty());
    // The relay asks again: refused at once as finished (before the limit
    // of one migration), and counted once.
    assert!(m.resume(&e, None).is_none());
    assert_eq!(counted(&metrics, "finished"), 1);
    assert_eq!(counted(&metrics, "limit"), 0);
    assert_eq!(fake.probed.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn a_second_migration_that_cannot_count_adds_its_events_to_the_first_count() {
    let fake = Fake {
        answer: Bytes::from(ev(
            json!({"id": "chatcmpl-2", "choices": [{"index": 0, "delta": {"content": " e"}}]}),
        )),
        counts: Some(4),
        ..Fake::default()
    };
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10});
    let (mut m, _) = migration(start(Route::ChatCompletions, body), &fake);
    merged_chat(&mut m);
    let cont = resume(&mut m).await;
    assert_eq!(sent_json(&fake)["max_tokens"], 6);
    m._fwd(cont).unwrap();
    // The second pod (the one peer again, here) cannot count: the 4
    // counted before and the one event since stand, not the 3 events in all.
    m.reroute = Arc::new(Fake {
        counts: None,
        ..fake.clone()
    });
    m.avoid.clear();
    resume(&mut m).await;
    assert_eq!(sent_json(&fake)["max_tokens"], 5);
    assert_eq!(m.carried(), 4 + 5);
}

#[tokio::test]
async fn a_chat_count_renders_with_the_clients_template() {
    let fake = Fake {
        counts: Some(4),
        ..Fake::default()
    };
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
        "chat_template_kwargs": {"enable_thinking": false}, "tools": tools, "chat_template": null});
    let (mut m, _) = migration(start(Route::ChatCompletions, body), &fake);
    merged_chat(&mut m);
    resume(&mut m).await;
    let probes = fake.probed.lock().unwrap().pop().unwrap();
    for p in probes.map(|b| serde_json::from_slice::<serde_json::Value>(&b).unwrap()) {
        assert_eq!(p["chat_template_kwargs"], json!({"enable_thinking": false}));
        assert_eq!(p["tools"], tools);
        assert!(p.get("chat_template").is_none(), "a null is not sent: {p}");
    }
}

#[tokio::test]
async fn what_each_route_counts() {
    // Completions by text: the prompt with the output, and without.
    let fake = Fake {
        counts: Some(3),
        ..Fake::default()
    };
    let (mut m, _) = migration(
        start(Route::Completions, json!({"prompt": "p", "max_tokens": 9})),
        &fake,
    );
    m._fwd(Bytes::from(cmpl(" a b", None, None))).unwrap();
    resume(&mut m).await;
    let probes = fake.probed.lock().unwrap().pop().unwrap();
    let prompts =
        probes.map(|b| serde_json::from_slice::<serde_json::Value>(&b).unwrap()["prompt"].clone());
    assert_eq!(prompts, [json!("p a b"), json!("p")]);
    assert_eq!(sent_json(&fake)["max_tokens"], 6);

    // Completions with the output's ids: exact, nothing asked.
    let fake = Fake {
        counts: Some(99),
        ..Fake::default()
    };
    let body = json!({"prompt": [1, 2], "max_tokens": 9, "return_token_ids": true});
    let (mut m, _) = migration(start(Route::Completions, body), &fake);
    m._fwd(Bytes::from(cmpl(" a b", Some(&[5, 6]), None)))
        .unwrap();
    resume(&mut m).await;
    assert!(fake.probed.lock().unwrap().is_empty());
    assert_eq!(sent_json(&fake)["max_tokens"], 7);
}

#[tokio::test]
async fn the_limit_and_the_pods_left_bound_migrations() {
    let fake = Fake::default();
    let mut s = start(Route::Completions, json!({"prompt": "p"}));
    s.max_migrations = 1;
    let (mut m, metrics) = migration(s, &fake);
    m._fwd(Bytes::from(cmpl(" a", None, None))).unwrap();
    resume(&mut m).await;
    assert!(m.resume(&died(), None).is_none());
    assert_eq!(counted(&metrics, "limit"), 1);

    // With room for more, the one peer (now failed too) is all there was.
    let mut s = start(Route::Completions, json!({"prompt": "p"}));
    s.max_migrations = 3;
    let (mut m, metrics) = migration(s, &fake);
    m._fwd(Bytes::from(cmpl(" a", None, None))).unwrap();
    resume(&mut m).await;
    assert!(m.resume(&died(), None).is_none());
    assert_eq!(counted(&metrics, "no_target"), 1);
}

#[test]
fn what_cannot_migrate_says_why() {
    let fake = Fake::default();
    let cases = [
        (
            Route::Completions,
            json!({"prompt": "p", "n": 2}),
            None,
            "several_choices",
        ),
        (Route::Embeddings, json!({"input": "p"}), None, "route"),
        (
            Route::Completions,
            json!({"prompt": "p", "echo": true}),
            None,
            "echo",
        ),
        (
            Route::ChatCompletions,
            json!({"messages": []}),
            Some(
                json!({"id": "x", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]}),
            ),
            "tool_calls",
        ),
        (
            Route::ChatCompletions,
            json!({"messages": []}),
            Some(
                json!({"id": "x", "choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}),
            ),
            "reasoning",
        ),
    ];
    for (route, body, event, why) in cases {
        let (mut m, metrics) = migration(start(route, body), &fake);
        if let Some(e) = event {
            m._fwd(Bytes::from(ev(e))).unwrap();
        }
        assert!(m.resume(&died(), None).is_none(), "{why}");
        assert_eq!(counted(&metrics, why), 1, "{why}");
    }
    let mut s = start(Route::Completions, json!({"prompt": "p"}));
    s.deadline = Duration::ZERO;
    let (mut m, metrics) = migration(s, &fake);
    assert!(m.resume(&died(), None).is_none());
    assert_eq!(counted(&metrics, "deadline"), 1);
}

/// A Responses stream's typed event, `sequence_number` `seq`.
fn rev(kind: &str, seq: u64, mut v: serde_json::Value) -> String {
    v["type"] = json!(kind);
    v["sequence_number"] = json!(seq);
    format!("event: {kind}\ndata: {v}\n\n")
}

/// The events of a Responses stream `id` (item `item`) up to its deltas.
fn responses_opening(id: &str, created: u64, item: &str, deltas: &[&str]) -> String {
    let r = json!({"id": id, "created_at": created, "status": "in_progress", "output": [], "usage": null});
    let mut out = rev("response.created", 0, json!({"response": r}));
    out += &rev("response.in_progress", 1, json!({"response": r}));
    out += &rev(
        "response.output_item.added",
        2,
        json!({"output_index": 0, "item": {"id": item, "type": "message", "role": "assistant", "content": [], "status": "in_progress"}}),
    );
    out += &rev(
        "response.content_part.added",
        3,
        json!({"output_index": 0, "item_id": item, "content_index": 0, "part": {"type": "output_text", "text": ""}}),
    );
    for (i, d) in deltas.iter().enumerate() {
        out += &rev(
            "response.output_text.delta",
            4 + i as u64,
            json!({"output_index": 0, "item_id": item, "content_index": 0, "delta": d, "logprobs": []}),
        );
    }
    out
}

/// A Responses stream's closing events after `n` deltas of `text`.
fn responses_closing(
    id: &str,
    created: u64,
    item: &str,
    n: u64,
    text: &str,
    usage: serde_json::Value,
) -> String {
    let seq = 4 + n;
    let part = json!({"type": "output_text", "text": text, "annotations": []});
    let message = json!({"id": item, "type": "message", "role": "assistant", "content": [part], "status": "completed"});
    let mut out = rev(
        "response.output_text.done",
        seq,
        json!({"output_index": 0, "content_index": 0, "item_id": item, "text": text}),
    );
    out += &rev(
        "response.content_part.done",
        seq + 1,
        json!({"output_index": 0, "content_index": 0, "item_id": item, "part": part}),
    );
    out += &rev(
        "response.output_item.done",
        seq + 2,
        json!({"output_index": 0, "item": message}),
    );
    out += &rev(
        "response.completed",
        seq + 3,
        json!({"response": {"id": id, "created_at": created, "status": "completed", "max_output_tokens": 3,
                            "output": [message], "usage": usage}}),
    );
    out
}

/// The events of an SSE body: (type, JSON).
fn typed_events(body: &[u8]) -> Vec<(String, serde_json::Value)> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (kind, data) = e.split_once('\n').unwrap();
            let kind = kind.strip_prefix("event: ").unwrap().to_owned();
            (
                kind,
                serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_responses_stream_continues_as_one_numbered_stream_of_one_response() {
    let usage = json!({"input_tokens": 12, "output_tokens": 3, "total_tokens": 15,
                       "input_tokens_details": {"cached_tokens": 0}});
    let fake = Fake {
        answer: Bytes::from(
            responses_opening("resp_2", 9, "msg_2", &[" c", " d", " e"])
                + &responses_closing("resp_2", 9, "msg_2", 3, " c d e", usage),
        ),
        ..Fake::default()
    };
    let body =
        json!({"input": "hi", "instructions": "be brief", "max_output_tokens": 5, "stream": true});
    let (mut m, _) = migration(start(Route::Responses, body), &fake);
    let first = responses_opening("resp_1", 7, "msg_1", &[" a", " b"]);
    assert_eq!(
        m._fwd(Bytes::from(first.clone())).unwrap(),
        first.as_bytes()
    );
    assert!(m.complete().is_none(), "not over before response.completed");
    let cont = resume(&mut m).await;
    // The continuation: the answer so far as the open assistant message vLLM continues.
    let sent = sent_json(&fake);
    assert_eq!(
        sent["input"],
        json!([{"role": "user", "content": "hi"},
               {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress",
                "content": [{"type": "output_text", "text": " a b", "annotations": []}]}])
    );
    assert_eq!(sent["max_output_tokens"], 3);
    assert_eq!(sent["instructions"], "be brief");
    // Its events go on from the client's: the next numbers, the first item and response.
    let out = m._fwd(cont).unwrap();
    let events = typed_events(&out);
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    for (i, (kind, v)) in events.iter().enumerate() {
        assert_eq!(v["type"], kind.as_str());
        assert_eq!(v["sequence_number"], 6 + i as u64, "{v}");
        if let Some(item) = v.get("item_id") {
            assert_eq!(item, "msg_1", "{v}");
        }
    }
    let whole = " a b c d e";
    assert_eq!(events[3].1["text"], whole);
    assert_eq!(events[4].1["part"]["text"], whole);
    assert_eq!(events[5].1["item"]["id"], "msg_1");
    assert_eq!(events[5].1["item"]["content"][0]["text"], whole);
    let r = &events[6].1["response"];
    assert_eq!((&r["id"], &r["created_at"]), (&json!("resp_1"), &json!(7)));
    assert_eq!(r["max_output_tokens"], 5);
    assert_eq!(r["output"][0]["id"], "msg_1");
    assert_eq!(r["output"][0]["content"][0]["text"], whole);
    assert_eq!(r["usage"]["input_tokens"], 10);
    assert_eq!(r["usage"]["output_tokens"], 5);
    assert_eq!(r["usage"]["total_tokens"], 15);
    assert_eq!(m.complete(), Some(Bytes::new()));
}

#[tokio::test]
async fn a_responses_input_the_client_left_open_is_extended() {
    let fake = Fake::default();
    let body = json!({"input": [{"role": "user", "content": "hi"},
        {"type": "message", "id": "m0", "role": "assistant", "status": "incomplete",
         "content": [{"type": "output_text", "text": "Sure,", "annotations": []}]}]});
    let (mut m, _) = migration(start(Route::Responses, body), &fake);
    m._fwd(Bytes::from(responses_opening("r", 1, "msg_1", &[" yes"])))
        .unwrap();
    resume(&mut m).await;
    let sent = sent_json(&fake);
    assert_eq!(sent["input"].as_array().unwrap().len(), 2);
    assert_eq!(sent["input"][1]["content"][0]["text"], "Sure, yes");
}

#[test]
fn what_cannot_migrate_on_responses_says_why() {
    let fake = Fake::default();
    let item = |t: &str| {
        rev(
            "response.output_item.added",
            2,
            json!({"output_index": 0, "item": {"id": "x", "type": t}}),
        )
    };
    let cases = [
        (
            json!({"input": "p", "previous_response_id": "resp_0"}),
            None,
            "previous_response",
        ),
        (
            json!({"input": "p", "background": true}),
            None,
            "background",
        ),
        (
            json!({"input": "p"}),
            Some(item("function_call")),
            "tool_calls",
        ),
        (json!({"input": "p"}), Some(item("reasoning")), "reasoning"),
        (
            json!({"input": "p"}),
            Some(rev("response.output_text.done", 5, json!({"text": "all"}))),
            "finished",
        ),
    ];
    for (body, event, why) in cases {
        let (mut m, metrics) = migration(start(Route::Responses, body), &fake);
        if let Some(e) = event {
            m._fwd(Bytes::from(e)).unwrap();
        }
        assert!(m.resume(&died(), None).is_none(), "{why}");
        assert_eq!(counted(&metrics, why), 1, "{why}");
    }
    // An error event is the upstream failing, and is not forwarded.
    let (mut m, _) = migration(start(Route::Responses, json!({"input": "p"})), &fake);
    let err = rev(
        "error",
        4,
        json!({"code": "InternalServerError", "message": "boom"}),
    );
    let (out, failed) = m.forward(Bytes::from(err));
    assert!(out.is_empty() && failed.is_some());
}

/// Not a test of behaviour: what reading one token's event costs
/// (`cargo test --release -p kvmesh-proxy --lib migrate_cost -- --ignored --nocapture`).
#[test]
#[ignore]
fn migrate_cost() {
    let fake = Fake::default();
    let (mut m, _) = migration(start(Route::Completions, json!({"prompt": "p"})), &fake);
    let one = Bytes::from(cmpl(" token", None, None));
    let n = 200_000;
    let t = std::time::Instant::now();
    for _ in 0..n {
        let (out, failed) = m.forward(one.clone());
        assert!(failed.is_none() && out.len() == one.len());
    }
    let per = t.elapsed() / n;
    println!("forward: {per:?} per event of {} bytes", one.len());
}
