//! Case 7: faults with real engines, run last in the pair group because it kills both.
//!
//! * Prefill engine down (engine `a` killed): a request split by llm-d's `x-prefiller-host-port`
//!   naming the dead engine is served whole by the decode engine, with the same greedy output as
//!   before, when the decode sidecar is configured `on_prefill_failure: aggregated`; a sidecar
//!   configured `error` answers a clear OpenAI-shaped 502 `prefill_failed` instead. A long prompt
//!   that the scheduler would have split is still answered, with the same output.
//! * Decode engine killed mid-stream (engine `b`): the client's stream ends, promptly, with an SSE
//!   error event and `data: [DONE]`, not a hang or a silent cut; the sidecar keeps serving: its
//!   `/health` answers and the next request gets a prompt OpenAI-shaped error.

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use http_body_util::BodyExt;
use serde_json::{json, Value};

use super::case_pd::sidecar_counter;
use super::engine::Engine;
use super::http::Http;
use super::report::note;
use super::sidecar::SidecarUnderTest;
use super::{long_prompt, MODEL};

/// How long a failed request may take to be answered (retries and back-off included).
const ANSWER_DEADLINE: Duration = Duration::from_secs(30);

fn body(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": true})
}

fn text(reply: &Value) -> Result<String> {
    Ok(reply["choices"][0]["text"]
        .as_str()
        .context("no text in the reply")?
        .to_string())
}

/// The prefill engine goes down. `decode_sidecar` falls back (`aggregated`), `strict_sidecar`
/// errors (`error`); both sit in front of the decode engine.
pub async fn prefill_down(
    http: &Http,
    prefill: &mut Engine,
    decode_sidecar: &SidecarUnderTest,
    strict_sidecar: &SidecarUnderTest,
) -> Result<()> {
    // References from the prefill engine while it lives: the outputs the fallback must equal.
    let header_prompt = long_prompt("fault-prefill-header", 250);
    let sched_prompt = long_prompt("fault-prefill-scheduled", 250);
    let url = format!("{}/v1/completions", prefill.base_url);
    let want_header = text(
        &http
            .post_json(&url, &body(&header_prompt, 8))
            .await?
            .json()?,
    )?;
    let want_sched = text(
        &http
            .post_json(&url, &body(&sched_prompt, 8))
            .await?
            .json()?,
    )?;
    let dead = prefill.base_url.trim_start_matches("http://").to_string();
    prefill.kill();

    let fallback = [("outcome", "fallback_aggregated")];
    let before =
        sidecar_counter(http, decode_sidecar, "kvmesh_pd_requests_total", &fallback).await?;
    let started = Instant::now();
    let reply = http
        .post_json_with(
            &format!("{}/v1/completions", decode_sidecar.url),
            &body(&header_prompt, 8),
            &[("x-prefiller-host-port", &dead)],
        )
        .await?;
    let took = started.elapsed();
    let got = text(&reply.json().context("aggregated fallback")?)?;
    let after =
        sidecar_counter(http, decode_sidecar, "kvmesh_pd_requests_total", &fallback).await?;
    ensure!(
        after - before == 1.0,
        "kvmesh_pd_requests_total{{outcome=\"fallback_aggregated\"}} grew by {}",
        after - before
    );
    ensure!(
        got == want_header,
        "fallback output {got:?} != the output before the fault {want_header:?}"
    );
    note(&format!(
        "pair: case 7: prefill engine down, on_prefill_failure=aggregated: 200 in {:.1} s, same output",
        took.as_secs_f64()
    ));

    let started = Instant::now();
    let reply = http
        .post_json_with(
            &format!("{}/v1/completions", strict_sidecar.url),
            &body(&header_prompt, 8),
            &[("x-prefiller-host-port", &dead)],
        )
        .await?;
    let err: Value = serde_json::from_slice(&reply.body)
        .with_context(|| format!("the error body is not JSON: {}", reply.text()))?;
    note(&format!(
        "pair: case 7: prefill engine down, on_prefill_failure=error: HTTP {} in {:.1} s: {}",
        reply.status,
        started.elapsed().as_secs_f64(),
        reply.text()
    ));
    ensure!(
        reply.status == 502 && err["error"]["code"] == "prefill_failed",
        "want 502 prefill_failed, got HTTP {}: {}",
        reply.status,
        reply.text()
    );

    // The scheduler's own split: whether it still picks the dead prefill pod (then falls back) or
    // already dropped it (then serves aggregated), the client gets the same answer.
    let reply = http
        .post_json(
            &format!("{}/v1/completions", decode_sidecar.url),
            &body(&sched_prompt, 8),
        )
        .await?;
    let got = text(
        &reply
            .json()
            .context("scheduled request with prefill down")?,
    )?;
    ensure!(
        got == want_sched,
        "output with prefill down {got:?} != before {want_sched:?}"
    );
    Ok(())
}

/// The decode engine is killed while `sidecar` streams its response.
pub async fn decode_killed_mid_stream(
    http: &Http,
    decode: &mut Engine,
    sidecar: &SidecarUnderTest,
) -> Result<()> {
    // A short prompt (no split) and a long output: seconds of streaming.
    let req = json!({"model": MODEL, "prompt": "[fault-decode] tell a long story", "max_tokens": 900,
                     "temperature": 0, "ignore_eos": true, "stream": true});
    let (status, mut stream) = http
        .post_stream(&format!("{}/v1/completions", sidecar.url), &req)
        .await?;
    ensure!(status == 200, "stream: HTTP {status}");
    let mut got = Vec::new();
    // The first event, then the kill.
    let first = tokio::time::timeout(ANSWER_DEADLINE, async {
        while let Some(frame) = stream.frame().await {
            if let Ok(data) = frame?.into_data() {
                if !data.is_empty() {
                    got.extend_from_slice(&data);
                    return anyhow::Ok(());
                }
            }
        }
        bail!("the stream ended before its first event")
    })
    .await
    .context("no first event")?;
    first?;
    let killed = Instant::now();
    decode.kill();
    let end = tokio::time::timeout(ANSWER_DEADLINE, async {
        while let Some(frame) = stream.frame().await {
            match frame {
                Ok(f) => {
                    if let Ok(data) = f.into_data() {
                        got.extend_from_slice(&data);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    })
    .await
    .context("the stream hung after the engine was killed")?;
    let text = String::from_utf8_lossy(&got).into_owned();
    let tail: String = text
        .chars()
        .rev()
        .take(400)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    note(&format!(
        "pair: case 7: decode engine killed mid-stream: stream ended {:.1} s later ({}), tail: {tail:?}",
        killed.elapsed().as_secs_f64(),
        if end.is_ok() { "cleanly" } else { "with a transport error" }
    ));
    ensure!(
        end.is_ok(),
        "the stream was cut without a final event: {:?}",
        end.err()
    );
    ensure!(
        !text.contains("\"finish_reason\":\"length\""),
        "the stream finished normally before the kill took effect; nothing was tested"
    );
    ensure!(
        text.contains("data: {\"error\"") && text.trim_end().ends_with("data: [DONE]"),
        "the stream did not end with an error event and [DONE]: {tail:?}"
    );

    // The sidecar keeps serving: health, and a prompt, clear answer to the next request.
    let health = http.get(&format!("{}/health", sidecar.admin_url)).await?;
    ensure!(
        health.status == 200,
        "sidecar /health: HTTP {}",
        health.status
    );
    let started = Instant::now();
    let reply = http
        .post_json(
            &format!("{}/v1/completions", sidecar.url),
            &body("[fault-decode] anyone there?", 4),
        )
        .await?;
    let took = started.elapsed();
    let err: Value = serde_json::from_slice(&reply.body)
        .with_context(|| format!("not an OpenAI error body: {}", reply.text()))?;
    note(&format!(
        "pair: case 7: next request with no engine left: HTTP {} in {:.1} s: {}",
        reply.status,
        took.as_secs_f64(),
        reply.text()
    ));
    ensure!(
        reply.status.is_server_error() && err["error"]["code"].is_string(),
        "want an OpenAI-shaped 5xx, got HTTP {}: {}",
        reply.status,
        reply.text()
    );
    ensure!(took < ANSWER_DEADLINE, "the error took {took:?}");
    Ok(())
}
