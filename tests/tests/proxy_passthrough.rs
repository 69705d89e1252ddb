//! The proxy as a transparent OpenAI front: streams chunk by chunk, whole
//! responses, HTTP/2 and TLS clients, request ids, hop-by-hop headers, and
//! paths it does not know.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use bytes::Bytes;
use kvmesh_tests::certs::TestCert;
use kvmesh_tests::client::{self, fetch, next_chunk, post_json, request, send, Alpn};
use kvmesh_tests::fake_upstream::{FakeUpstream, Reply};
use kvmesh_tests::sidecar::{start, start_for, test_config};

const COMPLETION: &str = r#"{"model":"m","prompt":"hello","max_tokens":3,"stream":true}"#;

#[tokio::test]
async fn stream_is_forwarded_chunk_by_chunk() {
    let (tx, reply) = Reply::sse();
    let reply = std::sync::Mutex::new(Some(reply));
    let engine = FakeUpstream::builder()
        .route("/v1/completions", move |_| {
            reply.lock().unwrap().take().unwrap_or(Reply::Hang)
        })
        .start()
        .await;
    let proxy = start_for(engine.addr()).await;
    let resp = send(
        &client::http1(),
        post_json(proxy.addr(), "/v1/completions", COMPLETION),
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    let mut body = resp.into_body();
    // Each chunk must reach the client before the engine produces the next one.
    for i in 0..3 {
        let event = format!("data: {{\"choices\":[{{\"text\":\"t{i}\"}}]}}\n\n");
        assert!(tx.send(event.clone()).await);
        assert_eq!(next_chunk(&mut body).await.unwrap(), Bytes::from(event));
    }
    assert!(tx.send("data: [DONE]\n\n").await);
    assert_eq!(next_chunk(&mut body).await.unwrap(), "data: [DONE]\n\n");
    tx.finish();
    assert_eq!(next_chunk(&mut body).await, None);
    // The engine got the client's bytes, unchanged.
    assert_eq!(engine.calls()[0].body, COMPLETION);
    proxy.shutdown().await;
}

#[tokio::test]
async fn non_streaming_completion_and_models() {
    let engine = kvmesh_tests::fake_vllm::start().await;
    let proxy = start_for(engine.addr()).await;
    let c = client::http1();
    let r = fetch(
        &c,
        post_json(
            proxy.addr(),
            "/v1/completions",
            r#"{"model":"tiny-llama","prompt":"hi","max_tokens":2}"#,
        ),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["choices"][0]["text"], " is is");
    let r = fetch(
        &c,
        request("GET", proxy.addr(), "/v1/models", Bytes::new(), &[]),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["data"][0]["id"], "tiny-llama");
    proxy.shutdown().await;
}

#[tokio::test]
async fn http2_prior_knowledge_client() {
    let engine = kvmesh_tests::fake_vllm::start().await;
    let proxy = start_for(engine.addr()).await;
    let resp = send(
        &client::h2c(),
        post_json(proxy.addr(), "/v1/chat/completions", r#"{"model":"tiny-llama","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":2}"#),
    )
    .await;
    assert_eq!(resp.version(), http::Version::HTTP_2);
    let text = client::whole(resp).await.text();
    assert_eq!(text.matches("\"content\":\" is\"").count(), 2, "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
    // Upstream is HTTP/1.1 by default whatever the client spoke.
    assert_eq!(engine.calls()[0].version, http::Version::HTTP_11);
    proxy.shutdown().await;
}

#[tokio::test]
async fn tls_client_over_http1_and_h2() {
    let engine = kvmesh_tests::fake_vllm::start().await;
    let cert = TestCert::new();
    let mut config = test_config(engine.addr());
    config.listeners.tls = Some(kvmesh_proxy::config::Tls {
        cert: cert.cert_path.clone(),
        key: cert.key_path.clone(),
    });
    let proxy = start(config).await;
    let body = r#"{"model":"tiny-llama","prompt":"hi","max_tokens":1}"#;
    for (alpn, want) in [(Alpn::Http1, &b"http/1.1"[..]), (Alpn::H2, &b"h2"[..])] {
        let req = request(
            "POST",
            proxy.addr(),
            "/v1/completions",
            body.to_owned(),
            &[("content-type", "application/json")],
        );
        let (negotiated, r) = client::tls_fetch(proxy.addr(), cert.der.clone(), alpn, req).await;
        assert_eq!(negotiated.as_deref(), Some(want));
        assert_eq!(r.status, 200);
        assert_eq!(r.json()["choices"][0]["text"], " is");
    }
    proxy.shutdown().await;
}

#[tokio::test]
async fn request_id_is_kept_or_generated() {
    let engine = kvmesh_tests::fake_vllm::start().await;
    let proxy = start_for(engine.addr()).await;
    let c = client::http1();
    let body = r#"{"model":"tiny-llama","prompt":"x","max_tokens":1}"#;
    let r = fetch(
        &c,
        request(
            "POST",
            proxy.addr(),
            "/v1/completions",
            body,
            &[("x-request-id", "client-id-7")],
        ),
    )
    .await;
    assert_eq!(r.headers["x-request-id"], "client-id-7");
    let r2 = fetch(
        &c,
        request("POST", proxy.addr(), "/v1/completions", body, &[]),
    )
    .await;
    let generated = r2.headers["x-request-id"].to_str().unwrap().to_owned();
    assert!(uuid_like(&generated), "{generated}");
    let seen = engine.calls();
    assert_eq!(seen[0].headers["x-request-id"], "client-id-7");
    assert_eq!(seen[1].headers["x-request-id"], generated.as_str());
    proxy.shutdown().await;
}

fn uuid_like(s: &str) -> bool {
    s.len() == 36 && s.chars().filter(|c| *c == '-').count() == 4
}

#[tokio::test]
async fn hop_by_hop_headers_are_stripped_both_ways() {
    let engine = FakeUpstream::builder()
        .route("/v1/models", |_| {
            Reply::json(200, "{}")
                .header("connection", "x-engine-hop")
                .header("x-engine-hop", "1")
                .header("keep-alive", "timeout=5")
                .header("x-engine-end", "kept")
        })
        .start()
        .await;
    let proxy = start_for(engine.addr()).await;
    let req = request(
        "GET",
        proxy.addr(),
        "/v1/models",
        Bytes::new(),
        &[
            ("connection", "x-client-hop"),
            ("x-client-hop", "1"),
            ("proxy-authorization", "Basic Zm9vOmJhcg=="),
            ("te", "trailers"),
            ("authorization", "Bearer end-to-end"),
        ],
    );
    let r = fetch(&client::http1(), req).await;
    assert_eq!(r.status, 200);
    assert!(!r.headers.contains_key("x-engine-hop"));
    assert!(!r.headers.contains_key("keep-alive"));
    assert_eq!(r.headers["x-engine-end"], "kept");
    let seen = &engine.calls()[0];
    for h in ["x-client-hop", "proxy-authorization", "te"] {
        assert!(!seen.headers.contains_key(h), "{h} reached the engine");
    }
    assert_eq!(seen.headers["authorization"], "Bearer end-to-end");
    proxy.shutdown().await;
}

#[tokio::test]
async fn unknown_paths_pass_through_unchanged() {
    let engine = FakeUpstream::builder()
        .route("/tokenize", |s| {
            Reply::json(201, s.body.clone()).header("x-upstream", "yes")
        })
        .start()
        .await;
    let proxy = start_for(engine.addr()).await;
    // Not JSON: the proxy must not parse bodies of paths it does not know.
    let r = fetch(
        &client::http1(),
        request(
            "PUT",
            proxy.addr(),
            "/tokenize?verbose=1",
            "not json at all",
            &[],
        ),
    )
    .await;
    assert_eq!(r.status, 201);
    assert_eq!(r.body, "not json at all");
    assert_eq!(r.headers["x-upstream"], "yes");
    let seen = &engine.calls()[0];
    assert_eq!(seen.method, "PUT");
    assert_eq!(seen.path, "/tokenize?verbose=1");
    proxy.shutdown().await;
}
