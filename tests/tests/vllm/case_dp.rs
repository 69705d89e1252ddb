//! Case 8: vLLM data parallelism behind one sidecar.
//!
//! One engine with `--data-parallel-size 2` (rank r's threads on core r) publishes each rank's KV
//! events on the endpoints' port + rank; the sidecar (`engine.data_parallel_size: 2`) binds both SUB
//! sockets, reads each rank's load from the `engine="<rank>"` series of vLLM's metrics, and names the
//! rank of every request in `X-data-parallel-rank`. What vLLM did is read back from vLLM itself: the
//! `dp_rank` of the batches each rank's replay socket returns, and its per-rank counters
//! (`vllm:request_success_total`, `vllm:prefix_cache_hits_total`, `vllm:prompt_tokens_total`).

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use kvmesh_filters::prefix::kvevents::decode_batch;
use serde_json::{json, Value};

use super::engine::Engine;
use super::http::Http;
use super::report::note;
use super::sidecar::SidecarUnderTest;
use super::{counter, kv_events_report, long_prompt, model_dir, scrape, BLOCK_SIZE, MODEL};

/// Words of each rank's shared prefix (~330 tokens: 10 full blocks).
const PREFIX_WORDS: usize = 150;
/// Tokens a repeat of a rank's prefix must find in that rank's cache: 9 full blocks at least.
const PREFIX_HIT_TOKENS: f64 = 9.0 * BLOCK_SIZE as f64;

/// `proxy.yaml` of the sidecar: both ranks' KV events from `events` (rank r on its port + r, the
/// sidecar binds them), the model's tokenizer, load scraped every 100 ms.
pub fn sidecar_yaml(engine: &Engine, events: &str) -> Result<String> {
    let replay = engine
        .replay_endpoint
        .as_deref()
        .context("the engine publishes no KV events")?;
    Ok(format!(
        "engine:\n  url: {url}\n  kind: vllm\n  health_interval: 200ms\n  metrics_interval: 100ms\n  \
         data_parallel_size: 2\n  kv_events:\n    endpoint: {events}\n    replay_endpoint: {replay}\n    \
         topic: \"{topic}\"\n    socket: bind\n    replay_timeout: 5s\n\
         pod:\n  models: [{MODEL}]\n\
         prefix:\n  tokenizer: {dir}\n  block_size: {BLOCK_SIZE}\n\
         logging:\n  level: warn\n",
        url = engine.base_url,
        topic = engine.topic,
        dir = model_dir().display(),
    ))
}

/// The case (see the module docs), in four steps: each rank's blocks reach the sidecar under that
/// rank; every batch a rank published carries its `dp_rank`; through the sidecar each rank's prefix
/// goes back to it (its own hit counter grows, both ranks serve); with rank 0 busy, a fresh prompt
/// goes to idle rank 1 while rank 0's prefix still follows rank 0.
pub async fn check(http: &Http, engine: &Engine, sidecar: &SidecarUnderTest) -> Result<()> {
    let prefixes = [0, 1].map(|r| long_prompt(&format!("dp-rank{r}"), PREFIX_WORDS));
    for (rank, prefix) in prefixes.iter().enumerate() {
        learn(http, engine, sidecar, rank, prefix).await?;
    }
    for rank in 0..2 {
        let batches = dp_ranks_published(engine, rank).await?;
        note(&format!(
            "dp: rank {rank}'s replay socket: {batches} batches, all dp_rank {rank}"
        ));
    }

    for (rank, prefix) in prefixes.iter().enumerate() {
        let (before, after) = through(http, engine, sidecar, &format!("{prefix} again")).await?;
        let hits = delta(&before, &after, "vllm:prefix_cache_hits_total")?;
        let served = delta(&before, &after, "vllm:request_success_total")?;
        ensure!(
            served[rank] == 1.0 && served[1 - rank] == 0.0,
            "rank {rank}'s prefix through the sidecar: requests served per rank {served:?}"
        );
        ensure!(
            hits[rank] >= PREFIX_HIT_TOKENS,
            "rank {rank}'s prefix through the sidecar hit only {hits:?} tokens per rank"
        );
        note(&format!(
            "dp: rank {rank}'s prefix through the sidecar: served by rank {rank}, {} tokens from its cache",
            hits[rank]
        ));
    }

    // Rank 0 busy with long requests straight to it; the sidecar sees that in vLLM's metrics.
    let long: Vec<_> = (0..3)
        .map(|i| {
            let (http, url) = (http.clone(), engine.base_url.clone());
            let body = json!({"model": MODEL, "prompt": format!("busy {i}"), "max_tokens": 1000,
                              "ignore_eos": true, "temperature": 0});
            tokio::spawn(async move {
                http.post_json_with(
                    &format!("{url}/v1/completions"),
                    &body,
                    &[("x-data-parallel-rank", "0")],
                )
                .await
            })
        })
        .collect();
    let fresh = long_prompt("dp-fresh", 60);
    let view = route_until(
        http,
        sidecar,
        &fresh,
        "rank 0's load in the sidecar",
        |dp| dp["ranks"][0]["running"].as_u64().unwrap_or(0) >= 1,
    )
    .await?;
    ensure!(
        view["ranks"][1]["running"] == 0 && view["rank"] == 1,
        "with rank 0 busy a fresh prompt should go to idle rank 1: {view}"
    );
    let (before, after) = through(http, engine, sidecar, &fresh).await?;
    let tokens = delta(&before, &after, "vllm:prompt_tokens_total")?;
    ensure!(
        tokens[1] > 0.0,
        "the fresh prompt through the sidecar ran on rank 1: prompt tokens per rank {tokens:?}"
    );
    let (before, after) = through(http, engine, sidecar, &format!("{} busy", prefixes[0])).await?;
    let hits = delta(&before, &after, "vllm:prefix_cache_hits_total")?;
    ensure!(
        hits[0] > 0.0 && hits[1] == 0.0,
        "rank 0's prefix follows busy rank 0: hits per rank {hits:?}"
    );
    let still_busy = long.iter().filter(|t| !t.is_finished()).count();
    ensure!(
        still_busy > 0,
        "the long requests on rank 0 ended before the checks ran, so rank 0 was not busy"
    );
    note(&format!(
        "dp: rank 0 busy ({} running): fresh prompt on rank 1 ({} prompt tokens), rank 0's prefix on rank 0 ({} tokens from cache)",
        view["ranks"][0]["running"], tokens[1], hits[0]
    ));
    for t in long {
        let reply = t.await??;
        ensure!(
            reply.status.is_success(),
            "a long request: {}",
            reply.text()
        );
    }
    Ok(())
}

/// Sends `prefix` straight to `rank` (a new suffix per try) until the sidecar's `/debug/route` shows
/// its blocks held by that rank alone: the rank's KV events reached the sidecar under its rank.
async fn learn(
    http: &Http,
    engine: &Engine,
    sidecar: &SidecarUnderTest,
    rank: usize,
    prefix: &str,
) -> Result<()> {
    let url = format!("{}/v1/completions", engine.base_url);
    let header = rank.to_string();
    let probe = format!("{prefix} probe");
    let mut last = Value::Null;
    for attempt in 0..10 {
        let body =
            json!({"model": MODEL, "prompt": format!("{prefix} warm {attempt}"), "max_tokens": 1});
        http.post_json_with(&url, &body, &[("x-data-parallel-rank", &header)])
            .await?
            .json()?;
        // Under uvicorn's 5 s keep-alive, so the next try's pooled connection is still open.
        let end = Instant::now() + Duration::from_secs(3);
        while Instant::now() < end {
            last = debug_route(http, sidecar, &probe).await?;
            if last["ranks"][rank]["matched_blocks"].as_u64().unwrap_or(0) > 0 {
                ensure!(
                    last["ranks"][1 - rank]["matched_blocks"] == 0 && last["rank"] == rank,
                    "rank {rank}'s prefix: {last}"
                );
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    bail!(
        "rank {rank}'s blocks never reached the sidecar; last /debug/route data_parallel: {last}\n{}",
        kv_events_report(http, engine, sidecar).await?
    )
}

/// Every batch `rank`'s replay socket still holds decodes with `dp_rank` = `rank`; returns how many.
async fn dp_ranks_published(engine: &Engine, rank: usize) -> Result<usize> {
    let base = engine
        .replay_endpoint
        .as_deref()
        .context("the engine publishes no KV events")?;
    let (head, port) = base.rsplit_once(':').context("replay endpoint port")?;
    let endpoint = format!("{head}:{}", port.parse::<usize>()? + rank);
    let msgs = kvmesh_engine_sim::replay(&endpoint, 0, Duration::from_secs(10))
        .await
        .with_context(|| format!("replaying rank {rank}'s KV events from {endpoint}"))?;
    ensure!(!msgs.is_empty(), "rank {rank} published no KV events");
    for m in &msgs {
        let batch =
            decode_batch(&m.payload).with_context(|| format!("decoding batch {}", m.seq))?;
        ensure!(
            batch.dp_rank == Some(rank as i64),
            "rank {rank}'s batch {} carries dp_rank {:?}",
            m.seq,
            batch.dp_rank
        );
    }
    Ok(msgs.len())
}

/// One completion through the sidecar, with vLLM's metrics before and after.
async fn through(
    http: &Http,
    engine: &Engine,
    sidecar: &SidecarUnderTest,
    prompt: &str,
) -> Result<(String, String)> {
    let before = scrape(http, engine).await?;
    http.post_json(
        &format!("{}/v1/completions", sidecar.url),
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}),
    )
    .await?
    .json()?;
    Ok((before, scrape(http, engine).await?))
}

/// How much counter `name` grew on each rank between two scrapes.
fn delta(before: &str, after: &str, name: &str) -> Result<[f64; 2]> {
    let of = |text: &str, rank: &str| counter(text, name, &[("engine", rank)]);
    Ok([
        of(after, "0")? - of(before, "0")?,
        of(after, "1")? - of(before, "1")?,
    ])
}

/// The `data_parallel` view of the sidecar's `POST /debug/route` for `prompt` (sends nothing upstream).
async fn debug_route(http: &Http, sidecar: &SidecarUnderTest, prompt: &str) -> Result<Value> {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
    let v = http
        .post_json(&format!("{}/debug/route", sidecar.admin_url), &body)
        .await?
        .json()?;
    Ok(v["data_parallel"].clone())
}

/// Polls `/debug/route` for `prompt` until `ok` holds of its `data_parallel` view (bounded: 30 s).
async fn route_until(
    http: &Http,
    sidecar: &SidecarUnderTest,
    prompt: &str,
    what: &str,
    ok: impl Fn(&Value) -> bool,
) -> Result<Value> {
    let end = Instant::now() + Duration::from_secs(30);
    let mut last = Value::Null;
    while Instant::now() < end {
        last = debug_route(http, sidecar, prompt).await?;
        if ok(&last) {
            return Ok(last);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("{what}: not within 30 s; last /debug/route data_parallel: {last}")
}
