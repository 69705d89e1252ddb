//! The HTTP calls the cases make to vLLM and to sidecars, each bounded by a deadline.
//!
//! Bodies are returned as raw bytes so a case can compare exactly what an engine sent with what a
//! sidecar passed on.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// Inference calls on one CPU core: a few seconds; the deadline only guards against a hang.
const REQUEST_DEADLINE: Duration = Duration::from_secs(120);
/// `/metrics` can stall ~2 s while the engine core is busy.
const SCRAPE_DEADLINE: Duration = Duration::from_secs(10);

/// A status and the raw body.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub content_type: Option<String>,
    pub body: Bytes,
}

impl Reply {
    /// The body as JSON, after checking the status is 2xx.
    pub fn json(&self) -> Result<Value> {
        if !self.status.is_success() {
            bail!(
                "HTTP {}: {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            );
        }
        serde_json::from_slice(&self.body).context("response body is not JSON")
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A plain HTTP/1.1 client for loopback servers.
#[derive(Debug, Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for Http {
    fn default() -> Self {
        Http {
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }
}

impl Http {
    pub async fn post_json(&self, url: &str, body: &Value) -> Result<Reply> {
        let bytes = Bytes::from(serde_json::to_vec(body)?);
        self.send(Method::POST, url, Some(bytes), REQUEST_DEADLINE)
            .await
    }

    /// A POST of JSON bytes as they are (a `serde_json::Value` would sort the object keys, and a
    /// chat template prints tool schemas in the order the client sent them).
    pub async fn post_bytes(&self, url: &str, body: Vec<u8>) -> Result<Reply> {
        self.send(Method::POST, url, Some(Bytes::from(body)), REQUEST_DEADLINE)
            .await
    }

    /// A JSON POST with extra request headers.
    pub async fn post_json_with(
        &self,
        url: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> Result<Reply> {
        let bytes = Bytes::from(serde_json::to_vec(body)?);
        self.send_with(Method::POST, url, Some(bytes), headers, REQUEST_DEADLINE)
            .await
    }

    /// A JSON POST whose response body is left to the caller to read frame by frame (a stream);
    /// the deadline covers the response head only.
    pub async fn post_stream(
        &self,
        url: &str,
        body: &Value,
    ) -> Result<(StatusCode, hyper::body::Incoming)> {
        let req = Request::post(url)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(serde_json::to_vec(body)?)))?;
        let resp = tokio::time::timeout(REQUEST_DEADLINE, self.client.request(req))
            .await
            .with_context(|| format!("POST {url}: no response head"))??;
        Ok((resp.status(), resp.into_body()))
    }

    pub async fn post_empty(&self, url: &str) -> Result<Reply> {
        self.send(Method::POST, url, Some(Bytes::new()), REQUEST_DEADLINE)
            .await
    }

    pub async fn get(&self, url: &str) -> Result<Reply> {
        self.send(Method::GET, url, None, SCRAPE_DEADLINE).await
    }

    async fn send(
        &self,
        method: Method,
        url: &str,
        body: Option<Bytes>,
        deadline: Duration,
    ) -> Result<Reply> {
        self.send_with(method, url, body, &[], deadline).await
    }

    async fn send_with(
        &self,
        method: Method,
        url: &str,
        body: Option<Bytes>,
        headers: &[(&str, &str)],
        deadline: Duration,
    ) -> Result<Reply> {
        let mut req = Request::builder().method(method.clone()).uri(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if body.is_some() {
            req = req.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        let req = req.body(Full::new(body.unwrap_or_default()))?;
        let call = async {
            let resp = self.client.request(req).await?;
            let status = resp.status();
            let content_type = resp
                .headers()
                .get(hyper::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let body = resp.into_body().collect().await?.to_bytes();
            anyhow::Ok(Reply {
                status,
                content_type,
                body,
            })
        };
        tokio::time::timeout(deadline, call)
            .await
            .with_context(|| {
                format!(
                    "{method} {url}: no complete answer within {} s",
                    deadline.as_secs()
                )
            })?
            .with_context(|| format!("{method} {url}"))
    }
}
