#![allow(clippy::unwrap_used)]
use super::*;

#[test]
fn completion_view() {
    let v = RequestView::parse(
        br#"{"model":"m","prompt":"hi","stream":true,"max_tokens":5,"cache_salt":"t","temperature":0}"#,
        Shape::Completion,
    )
    .unwrap();
    assert_eq!(v.model.as_deref(), Some("m"));
    assert_eq!(v.prompt, Prompt::Text("hi".into()));
    assert!(v.stream);
    assert_eq!(v.max_tokens, Some(5));
    assert_eq!(v.cache_salt.as_deref(), Some("t"));
    assert_eq!(v.adapter(&["m"]), None);
    assert_eq!(v.adapter(&["base"]), Some("m"));
}

#[test]
fn token_prompts_and_chat_parts() {
    let v = RequestView::parse(br#"{"prompt":[1,2,3]}"#, Shape::Completion).unwrap();
    assert_eq!(v.prompt, Prompt::Tokens(vec![1, 2, 3]));
    let v = RequestView::parse(
        br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{}},{"type":"text","text":"b"}]},{"role":"assistant","content":null}],"max_completion_tokens":3,"max_tokens":9}"#,
        Shape::Chat,
    )
    .unwrap();
    let Prompt::Chat(ms) = v.prompt else {
        panic!("not chat")
    };
    assert_eq!(ms[0].content, "a\nb");
    assert_eq!(ms[1].content, "");
    assert_eq!(v.max_tokens, Some(3));
}

#[test]
fn every_prompt_shape() {
    let parse = |b: &str| RequestView::parse(b.as_bytes(), Shape::Completion).map(|v| v.prompt);
    assert_eq!(
        parse(r#"{"prompt":["a","b\n"]}"#).unwrap(),
        Prompt::Texts(vec!["a".into(), "b\n".into()])
    );
    assert_eq!(
        parse(r#"{"prompt":[[1,2],[],[4294967295]]}"#).unwrap(),
        Prompt::TokenBatches(vec![vec![1, 2], vec![], vec![u32::MAX]])
    );
    assert_eq!(
        parse(r#"{"prompt":[]}"#).unwrap(),
        Prompt::Texts(Vec::new())
    );
    assert_eq!(parse(r#"{"prompt":null}"#).unwrap(), Prompt::None);
    for bad in [
        r#"{"prompt":["a",1]}"#,
        r#"{"prompt":[1,"a"]}"#,
        r#"{"prompt":[[1],2]}"#,
        r#"{"prompt":[4294967296]}"#,
        r#"{"prompt":[-1]}"#,
        r#"{"prompt":[1.5]}"#,
        r#"{"prompt":{"text":"a"}}"#,
        r#"{"prompt":[[1,"a"]]}"#,
    ] {
        assert!(parse(bad).is_err(), "{bad} parsed");
    }
    let chat = |b: &str| RequestView::parse(b.as_bytes(), Shape::Chat);
    assert!(chat(r#"{"messages":[{"role":"user","content":7}]}"#).is_err());
    assert!(chat(r#"{"messages":[{"role":"user","content":"x"}]}"#).is_ok());
}

#[test]
fn shared_text_is_a_slice_of_the_body_and_escapes_are_decoded() {
    let body = Bytes::from_static(br#"{"model":"m","prompt":"plain text \u00e9 no"}"#);
    let v = RequestView::parse_shared(&body, Shape::Completion).unwrap();
    // An escape: decoded into an owned copy.
    assert_eq!(v.prompt, Prompt::Text("plain text \u{e9} no".into()));
    let body = Bytes::from(r#"{"prompt":"héllo wörld","stream":false}"#.to_owned());
    let v = RequestView::parse_shared(&body, Shape::Completion).unwrap();
    let Prompt::Text(t) = &v.prompt else {
        panic!("not text")
    };
    assert_eq!(t.as_str(), "héllo wörld");
    assert!(matches!(t.0, TextRepr::Shared(_)), "borrowed from the body");
    let inside = body.as_ptr_range();
    assert!(inside.contains(&t.as_str().as_ptr()));
    assert_eq!(v, RequestView::parse(&body, Shape::Completion).unwrap());
    assert_eq!(format!("{t:?}"), "\"héllo wörld\"");
}

/// The same body read quickly (no byte below 0x20) and strictly (the
/// same body pretty-printed, so it has newlines between its tokens).
fn both_ways(
    compact: &str,
    shape: Shape,
) -> (Result<RequestView, String>, Result<RequestView, String>) {
    let pretty = compact.replacen('{', "{\n  ", 1);
    assert!(!holds_control_bytes(compact.as_bytes()), "{compact}");
    assert!(holds_control_bytes(pretty.as_bytes()));
    let read = |b: &str| RequestView::parse(b.as_bytes(), shape).map_err(|e| e.to_string());
    (read(compact), read(&pretty))
}

#[test]
fn long_strings_read_quickly_decode_as_serde_json_does() {
    for (body, shape) in [
        (
            r#"{"prompt":"tab\there, \"quoted\", caf\u00e9, \ud83d\ude00, back\\slash\n"}"#,
            Shape::Completion,
        ),
        (
            r#"{"prompt":"plain","model":"m","max_tokens":3}"#,
            Shape::Completion,
        ),
        (r#"{"prompt":""}"#, Shape::Completion),
        (r#"{"prompt":["a\n","b"]}"#, Shape::Completion),
        (r#"{"prompt":[[1,2],[3]]}"#, Shape::Completion),
        (r#"{"prompt":null}"#, Shape::Completion),
        (
            r#"{"messages":[{"role":"system","content":"line one\nline \"two\""},{"role":"user","content":[{"type":"text","text":"a\tb"}]},{"role":"assistant","content":null}]}"#,
            Shape::Chat,
        ),
        (
            r#"{"messages":[{"role":"user","content":"x"}],"stream":true}"#,
            Shape::Chat,
        ),
    ] {
        let (quick, strict) = both_ways(body, shape);
        let quick = quick.unwrap_or_else(|e| panic!("{body}: {e}"));
        assert_eq!(Ok(quick.clone()), strict, "{body}");
        let want: serde_json::Value = serde_json::from_str(body).unwrap();
        match (&quick.prompt, shape) {
            (Prompt::Text(t), _) => assert_eq!(want["prompt"], t.as_str()),
            (Prompt::Chat(ms), _) => assert_eq!(
                want["messages"][0]["content"].as_str().unwrap(),
                ms[0].content
            ),
            _ => {}
        }
    }
}

#[test]
fn long_strings_read_quickly_refuse_what_serde_json_refuses() {
    for (body, shape) in [
        (r#"{"prompt":"lone \ud800 surrogate"}"#, Shape::Completion),
        (r#"{"prompt":"bad \x escape"}"#, Shape::Completion),
        (r#"{"prompt":"unterminated}"#, Shape::Completion),
        (r#"{"prompt":7}"#, Shape::Completion),
        (
            r#"{"messages":[{"role":"user","content":"lone \udc00"}]}"#,
            Shape::Chat,
        ),
        (
            r#"{"messages":[{"role":"user","content":true}]}"#,
            Shape::Chat,
        ),
    ] {
        let (quick, strict) = both_ways(body, shape);
        assert!(quick.is_err(), "{body} read quickly");
        assert!(strict.is_err(), "{body} read strictly");
    }
    // A raw control character inside a string: the body is read strictly.
    let raw = "{\"prompt\":\"a\u{1}b\"}";
    assert!(holds_control_bytes(raw.as_bytes()));
    assert!(RequestView::parse(raw.as_bytes(), Shape::Completion).is_err());
    let raw = "{\"prompt\":\"new\nline\"}";
    assert!(RequestView::parse(raw.as_bytes(), Shape::Completion).is_err());
    // Bytes that are not UTF-8 inside the prompt.
    let mut bytes = br#"{"prompt":"ok "#.to_vec();
    bytes.extend_from_slice(&[0xff, 0xfe]);
    bytes.extend_from_slice(br#""}"#);
    assert!(RequestView::parse(&bytes, Shape::Completion).is_err());
}

#[test]
fn a_control_byte_anywhere_is_found() {
    let mut body = vec![b'a'; 5000];
    assert!(!holds_control_bytes(&body));
    for at in [0, 63, 64, 1023, 1024, 4999] {
        body[at] = 0x1f;
        assert!(holds_control_bytes(&body), "at {at}");
        body[at] = b'a';
    }
    assert!(!holds_control_bytes(b" ~\x7f\xff"));
}

#[test]
fn wrong_types_are_errors() {
    assert!(RequestView::parse(br#"{"stream":"yes"}"#, Shape::Completion).is_err());
    assert!(RequestView::parse(br#"[1]"#, Shape::Chat).is_err());
    assert!(RequestView::parse(br#"{"model":"m""#, Shape::Chat).is_err());
}
