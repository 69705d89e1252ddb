//! Shared helpers for the simulator's integration tests: a minimal HTTP/1.1
//! client with deadlines, and JSON shape comparison.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;

pub const DEADLINE: Duration = Duration::from_secs(20);

/// One request on a fresh connection; returns status and the whole body.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> (u16, Bytes) {
    try_request(addr, method, path, body, &[])
        .await
        .expect("request failed")
}

pub async fn try_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
    headers: &[(&str, &str)],
) -> anyhow::Result<(u16, Bytes)> {
    tokio::time::timeout(DEADLINE, async {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        let conn = tokio::spawn(conn);
        let bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let mut req = http::Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr.to_string())
            .header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = send.send_request(req.body(Full::new(bytes))?).await?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await?.to_bytes();
        conn.abort();
        Ok((status, body))
    })
    .await?
}

pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (s, b) = request(addr, "POST", path, Some(body)).await;
    (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

pub async fn get_text(addr: SocketAddr, path: &str) -> String {
    let (s, b) = request(addr, "GET", path, None).await;
    assert_eq!(s, 200, "GET {path}");
    String::from_utf8(b.to_vec()).unwrap()
}

/// The JSON of each `data:` event of an SSE body (`[DONE]` as a string).
pub fn sse_events(body: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap_or(Value::String(d.to_string())))
        .collect()
}

/// A completions body.
pub fn completion(prompt: &str, max_tokens: u64) -> Value {
    serde_json::json!({"model": "sim", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

/// `n` distinct words, a prompt of roughly `n + 1` builtin tokens.
pub fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The type of a JSON value, as the shape comparison sees it.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_f64() => "float",
        Value::Number(_) => "int",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Differences in keys and value types between `ours` and `theirs`,
/// recursively (arrays compared element-wise on their first element).
pub fn shape_diff(path: &str, ours: &Value, theirs: &Value, out: &mut Vec<String>) {
    match (ours, theirs) {
        (Value::Object(a), Value::Object(b)) => {
            for k in b.keys().filter(|k| !a.contains_key(*k)) {
                out.push(format!("{path}.{k}: missing"));
            }
            for k in a.keys().filter(|k| !b.contains_key(*k)) {
                out.push(format!("{path}.{k}: extra"));
            }
            for (k, v) in a {
                if let Some(w) = b.get(k) {
                    shape_diff(&format!("{path}.{k}"), v, w, out);
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            if let (Some(x), Some(y)) = (a.first(), b.first()) {
                shape_diff(&format!("{path}[0]"), x, y, out);
            }
        }
        (a, b) if kind(a) != kind(b) => {
            out.push(format!("{path}: {} vs vLLM {}", kind(a), kind(b)))
        }
        _ => {}
    }
}

pub fn assert_same_shape(what: &str, ours: &Value, theirs: &Value) {
    let mut d = Vec::new();
    shape_diff("$", ours, theirs, &mut d);
    assert!(
        d.is_empty(),
        "{what}: shape differs from vLLM's capture:\n{}\nours: {ours}",
        d.join("\n")
    );
}

pub const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures");

/// The body of a raw HTTP capture (after the blank line).
pub fn capture_body(file: &str) -> String {
    let text = std::fs::read_to_string(format!("{FIXTURES}/{file}")).unwrap();
    match text
        .split_once("\r\n\r\n")
        .or_else(|| text.split_once("\n\n"))
    {
        Some((head, body)) if head.starts_with("HTTP/") => body.to_string(),
        _ => text,
    }
}
