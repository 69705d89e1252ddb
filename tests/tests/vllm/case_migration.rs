//! Case 10: a stream whose engine is SIGKILLed mid-way goes on on the other engine, and with
//! greedy decoding the client reads what an uninterrupted run reads (issue 42, docs/migration.md).
//!
//! Two engines, each behind its sidecar, the sidecars meshed. Sidecar `a` takes the client's
//! requests and its filter config keeps them on engine `a` (a `label-selector-filter` on its own
//! pod's label), so the test knows which engine serves them; a migrating stream goes on wherever
//! the fleet allows, here sidecar `b` and engine `b`.
//!
//! * First, two uninterrupted runs of each request, one straight to each engine: vLLM's CPU build
//!   at temperature 0 must give both the same text (and token ids): if it did not, no migration
//!   could be held to equality, and the case says so.
//! * Then a completion (`return_token_ids`, `include_usage`), a chat and a `/v1/responses` stream
//!   run at once through sidecar `a`; once each has given the client `KILL_AFTER` events, engine
//!   `a` is SIGKILLed. Every stream must finish with the text (and, for the completion, the token
//!   ids) of the uninterrupted run on engine `b`, every event with one `id` (the response's, for
//!   Responses, whose `sequence_number`s run from 0 without a gap), and a `usage` that counts the
//!   whole; sidecar `a` counts three migrations.
//! * Engine `a` runs with `--stream-interval 3`, so each of its events carries three tokens, as
//!   vLLM's events do whenever its API server falls behind the engine (it merges the outputs it
//!   has not sent yet): the chat and Responses streams go by text, and their continuations'
//!   limits and `usage` hold only if sidecar `a` counts that text (engine `b`'s `/tokenize`), not
//!   its events.

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use http_body_util::BodyExt;
use serde_json::{json, Value};

use super::case_pd::sidecar_counter;
use super::engine::Engine;
use super::http::Http;
use super::report::note;
use super::sidecar::SidecarUnderTest;
use super::MODEL;

/// Events the client reads from each stream before the engine serving them is killed.
const KILL_AFTER: usize = 8;
/// Output tokens of each stream: seconds of generation on one core, so the kill lands mid-way.
const MAX_TOKENS: u64 = 700;
/// How long a stream may take, migration included.
const STREAM_DEADLINE: Duration = Duration::from_secs(120);

/// Sidecar `a`'s filter config: only pods labelled `engine: a` (its own) are scheduled.
pub const FILTERS_A: &str = "apiVersion: kvmesh.dev/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: model-filter
  - name: engine-a
    type: label-selector-filter
    parameters:
      matchLabels: {engine: a}
  - type: round-robin-picker
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: model-filter
      - pluginRef: engine-a
      - pluginRef: round-robin-picker
";

/// The sidecar of engine `label`, meshed through `peers_file`, labelled `engine: <label>`; with
/// `filters`, that filter config.
pub fn sidecar_yaml(
    engine: &Engine,
    label: &str,
    peers_file: &std::path::Path,
    filters: Option<&std::path::Path>,
) -> String {
    let scheduling = filters.map_or(String::new(), |f| {
        format!("scheduling:\n  filters: {}\n", f.display())
    });
    format!(
        "engine:\n  url: {url}\n  kind: vllm\n  health_interval: 200ms\n  metrics_interval: 200ms\n\
         pod:\n  models: [{MODEL}]\n  labels: {{engine: {label}}}\n\
         mesh:\n  listen: 127.0.0.1:0\n  file: {peers}\n  refresh_interval: 100ms\n  stale_after: 5s\n\
         {scheduling}logging:\n  level: warn\n",
        url = engine.base_url,
        peers = peers_file.display(),
    )
}

/// Waits until sidecar `a`'s fleet holds `b`'s pod as healthy (a stream can migrate there).
pub async fn wait_peer_healthy(a: &SidecarUnderTest, b: &SidecarUnderTest) -> Result<()> {
    let end = Instant::now() + Duration::from_secs(30);
    let id = b.pod_id();
    loop {
        let now = tokio::time::Instant::now();
        let healthy = a
            .handle()
            .fleet()
            .snapshot(now)
            .iter()
            .any(|p| p.info.id == id && p.healthy);
        if healthy {
            return Ok(());
        }
        if Instant::now() >= end {
            bail!("sidecar a never saw b's pod healthy");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn completion() -> Value {
    json!({"model": MODEL, "prompt": "[migration] the sidecar beside every engine", "max_tokens": MAX_TOKENS,
           "temperature": 0, "ignore_eos": true, "stream": true, "return_token_ids": true,
           "stream_options": {"include_usage": true}})
}

fn chat() -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": "[migration] tell a long story"}],
           "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": true, "stream": true,
           "stream_options": {"include_usage": true}})
}

fn responses() -> Value {
    json!({"model": MODEL, "input": "[migration] tell another long story", "instructions": "be long",
           "max_output_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": true, "stream": true})
}

/// The three streams: completions, chat, responses.
fn requests() -> [(&'static str, Value); 3] {
    [
        ("/v1/completions", completion()),
        ("/v1/chat/completions", chat()),
        ("/v1/responses", responses()),
    ]
}

/// What a client read from one stream.
#[derive(Debug, Default)]
struct Read {
    text: String,
    token_ids: Vec<u64>,
    /// Every event carried `token_ids`.
    all_ids: bool,
    /// The most token ids one event carried.
    most_ids: usize,
    ids: Vec<String>,
    usage: Option<Value>,
    events: usize,
    done: bool,
    errors: Vec<String>,
    /// Responses: each event's `sequence_number`.
    seqs: Vec<u64>,
}

impl Read {
    fn new() -> Self {
        Read {
            all_ids: true,
            ..Read::default()
        }
    }

    /// Reads the SSE events of `buf` that are whole, leaving the rest in it.
    fn take(&mut self, buf: &mut String) -> Result<()> {
        while let Some(end) = buf.find("\n\n") {
            let ev: String = buf.drain(..end + 2).collect();
            for line in ev.lines() {
                let Some(data) = line.strip_prefix("data: ") else {
                    continue;
                };
                if data.trim() == "[DONE]" {
                    self.done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(data)
                    .with_context(|| format!("an event that is not JSON: {data}"))?;
                if v.get("error").is_some() {
                    self.errors.push(data.to_string());
                    continue;
                }
                self.events += 1;
                if let Some(kind) = v["type"].as_str() {
                    self.typed(kind, &v);
                    continue;
                }
                if let Some(id) = v["id"].as_str() {
                    if !self.ids.iter().any(|i| i == id) {
                        self.ids.push(id.to_string());
                    }
                }
                if !v["usage"].is_null() {
                    self.usage = Some(v["usage"].clone());
                }
                let Some(c) = v["choices"].as_array().and_then(|c| c.first()) else {
                    continue;
                };
                let text = c["text"]
                    .as_str()
                    .or_else(|| c["delta"]["content"].as_str());
                self.text.push_str(text.unwrap_or_default());
                match c["token_ids"].as_array() {
                    Some(ids) => {
                        self.most_ids = self.most_ids.max(ids.len());
                        self.token_ids.extend(ids.iter().filter_map(Value::as_u64));
                    }
                    None => self.all_ids = false,
                }
            }
        }
        Ok(())
    }

    /// A `/v1/responses` event: its text, its response's id, and the final
    /// `usage` (as chat's counts, to compare alike).
    fn typed(&mut self, kind: &str, v: &Value) {
        if let Some(n) = v["sequence_number"].as_u64() {
            self.seqs.push(n);
        }
        self.all_ids = false;
        match kind {
            "response.output_text.delta" => {
                self.text.push_str(v["delta"].as_str().unwrap_or_default());
            }
            "response.created" | "response.completed" => {
                let r = &v["response"];
                if let Some(id) = r["id"].as_str() {
                    if !self.ids.iter().any(|i| i == id) {
                        self.ids.push(id.to_string());
                    }
                }
                if kind == "response.completed" {
                    self.done = true;
                    let u = &r["usage"];
                    self.usage = Some(json!({"prompt_tokens": u["input_tokens"],
                        "completion_tokens": u["output_tokens"], "total_tokens": u["total_tokens"]}));
                    let text = r["output"][0]["content"][0]["text"].as_str();
                    if text != Some(self.text.as_str()) {
                        self.errors.push(format!(
                            "response.completed's text {text:?} is not the deltas'"
                        ));
                    }
                }
            }
            _ => {}
        }
    }
}

/// Streams `body` from `url` to its end.
async fn run(http: &Http, url: &str, body: &Value) -> Result<Read> {
    let (status, mut stream) = http.post_stream(url, body).await?;
    ensure!(status == 200, "{url}: HTTP {status}");
    let mut read = Read::new();
    let mut buf = String::new();
    tokio::time::timeout(STREAM_DEADLINE, async {
        while let Some(frame) = stream.frame().await {
            if let Ok(data) = frame?.into_data() {
                buf.push_str(&String::from_utf8_lossy(&data));
                read.take(&mut buf)?;
            }
        }
        anyhow::Ok(())
    })
    .await
    .with_context(|| format!("{url}: the stream did not end"))??;
    Ok(read)
}

/// Streams `body` from `url`, signalling `started` once `KILL_AFTER` events came, and reads on to
/// the end.
async fn run_until_killed(
    http: Http,
    url: String,
    body: Value,
    started: tokio::sync::mpsc::Sender<()>,
) -> Result<Read> {
    let (status, mut stream) = http.post_stream(&url, &body).await?;
    ensure!(status == 200, "{url}: HTTP {status}");
    let mut read = Read::new();
    let mut buf = String::new();
    let mut signalled = false;
    tokio::time::timeout(STREAM_DEADLINE, async {
        while let Some(frame) = stream.frame().await {
            if let Ok(data) = frame?.into_data() {
                buf.push_str(&String::from_utf8_lossy(&data));
                read.take(&mut buf)?;
                if !signalled && read.events >= KILL_AFTER {
                    signalled = true;
                    let _ = started.send(()).await;
                }
            }
        }
        anyhow::Ok(())
    })
    .await
    .with_context(|| format!("{url}: the stream did not end"))??;
    Ok(read)
}

/// Where two reads first differ, for the error.
fn first_difference(a: &str, b: &str) -> String {
    let at = a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count();
    let around = |s: &str| {
        s.chars()
            .skip(at.saturating_sub(20))
            .take(60)
            .collect::<String>()
    };
    format!(
        "first difference at char {at} (of {} and {}): {:?} vs {:?}",
        a.chars().count(),
        b.chars().count(),
        around(a),
        around(b)
    )
}

/// The case (see the module docs). `engines` are `a` and `b`; `a` is killed.
pub async fn killed_mid_stream(
    http: &Http,
    engines: &mut [Engine],
    a: &SidecarUnderTest,
) -> Result<()> {
    let [engine_a, engine_b] = engines else {
        bail!("two engines");
    };
    // Two uninterrupted runs of each request, one on each engine.
    let mut want = Vec::new();
    for (route, body) in requests() {
        let on_a = run(http, &format!("{}{route}", engine_a.base_url), &body).await?;
        let on_b = run(http, &format!("{}{route}", engine_b.base_url), &body).await?;
        ensure!(
            on_a.text == on_b.text && on_a.token_ids == on_b.token_ids,
            "{route}: vLLM's CPU build at temperature 0 gave two engines different outputs, so \
             no migration can be held to equality: {}",
            first_difference(&on_a.text, &on_b.text)
        );
        ensure!(
            on_b.usage
                .as_ref()
                .and_then(|u| u["completion_tokens"].as_u64())
                == Some(MAX_TOKENS),
            "{route}: the uninterrupted run's usage: {:?}",
            on_b.usage
        );
        want.push(on_b);
    }
    note(&format!(
        "migration: case 10: uninterrupted runs on a and b agree ({}, {} and {} chars; {} token ids)",
        want[0].text.len(),
        want[1].text.len(),
        want[2].text.len(),
        want[0].token_ids.len()
    ));

    let migrated = [("outcome", "migrated")];
    let before = sidecar_counter(http, a, "kvmesh_migrations_total", &migrated).await?;
    let (tx, mut rx) = tokio::sync::mpsc::channel(3);
    let streams: Vec<_> = requests()
        .into_iter()
        .map(|(route, body)| {
            let http = http.clone();
            let url = format!("{}{route}", a.url);
            tokio::spawn(run_until_killed(http, url, body, tx.clone()))
        })
        .collect();
    drop(tx);
    for _ in 0..3 {
        tokio::time::timeout(STREAM_DEADLINE, rx.recv())
            .await
            .context("a stream gave no events")?
            .context("a stream ended before its events")?;
    }
    let killed = Instant::now();
    engine_a.kill();
    let mut got = Vec::new();
    for s in streams {
        got.push(s.await.context("stream task")??);
    }
    let after = sidecar_counter(http, a, "kvmesh_migrations_total", &migrated).await?;
    note(&format!(
        "migration: case 10: engine a killed after {KILL_AFTER} events of each stream; all ended {:.1} s later; \
         kvmesh_migrations_total{{outcome=\"migrated\"}} +{}",
        killed.elapsed().as_secs_f64(),
        after - before
    ));
    // Engine a runs with `--stream-interval 3`: the streams' events before
    // the kill carried several tokens each, which only a count of the text
    // (not of the events) carries over right.
    ensure!(
        got[0].most_ids > 1,
        "engine a's events carried one token each: --stream-interval did not take"
    );
    for ((route, got), want) in ["completions", "chat", "responses"]
        .iter()
        .zip(&got)
        .zip(&want)
    {
        ensure!(
            got.errors.is_empty(),
            "{route}: the client got error events: {:?}",
            got.errors
        );
        ensure!(
            got.done,
            "{route}: no end (data: [DONE], or response.completed)"
        );
        ensure!(
            got.seqs.iter().copied().eq(0..got.seqs.len() as u64),
            "{route}: sequence numbers {:?}",
            got.seqs
        );
        ensure!(
            got.ids.len() == 1,
            "{route}: the stream's events carried {} ids: {:?}",
            got.ids.len(),
            got.ids
        );
        ensure!(
            got.text == want.text,
            "{route}: the migrated stream's text is not the uninterrupted run's: {}",
            first_difference(&got.text, &want.text)
        );
        if *route == "completions" {
            ensure!(
                got.all_ids && got.token_ids == want.token_ids,
                "{route}: the migrated stream's token ids are not the uninterrupted run's"
            );
        }
        // The counts; `prompt_tokens_details.cached_tokens` differs with what each engine cached.
        let counts = |u: &Option<Value>| {
            ["prompt_tokens", "completion_tokens", "total_tokens"]
                .map(|k| u.as_ref().and_then(|u| u[k].as_u64()))
        };
        ensure!(
            counts(&got.usage) == counts(&want.usage),
            "{route}: usage {:?}, an uninterrupted run's {:?}",
            got.usage,
            want.usage
        );
    }
    ensure!(
        after - before == 3.0,
        "sidecar a counted {} migrations, not 3: the streams ended before the kill took effect?",
        after - before
    );
    Ok(())
}
