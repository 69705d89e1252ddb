//! Cases 2 and 3: sidecars fed by real vLLM's KV events, alone and joined by the mesh.
//!
//! Each engine of the pair publishes its KV events to the SUB socket its sidecar binds (vLLM
//! connects to `tcp://127.0.0.1:PORT`); the sidecar replays from the engine's ROUTER on first join
//! and on gaps. The sidecars tokenize with tiny-llama's own tokenizer (`prefix.tokenizer: DIR`) and
//! follow a peers file each, empty until case 3 joins them.
//!
//! * Case 2 compares a sidecar's prefix index with what vLLM itself reported, read back from the
//!   engine's replay socket (every batch since sequence 0): every block vLLM reports as held is in the
//!   index for that pod (its key recomputed from the tokens vLLM sent, parent chain included), and the
//!   index holds no other entry. After `POST /reset_prefix_cache` and one request, the earlier blocks
//!   are gone from the index and only the new request's remain.
//! * Case 3 sends prompt families sharing a long system prompt alternately to the two sidecars, then
//!   other families alternately straight to the two engines (round robin), and compares the
//!   prefix-cache hits vLLM itself counts (`vllm:prefix_cache_hits_total`).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use kvmesh_filters::prefix::kvevents::{decode_batch, KvEvent};
use kvmesh_filters::prefix::tokenize::{HfTokenizer, Tokenizer};
use serde_json::json;

use super::engine::Engine;
use super::http::Http;
use super::report::note;
use super::sidecar::SidecarUnderTest;
use super::{counter, kv_events_report, long_prompt, model_dir, scrape, BLOCK_SIZE, MODEL};

/// How long the index may take to reflect what the engine published (loaded machine).
const SYNC_DEADLINE: Duration = Duration::from_secs(45);

/// `proxy.yaml` of a pair sidecar: KV events from `engine` on `events` (the sidecar binds it), the
/// model's tokenizer, the mesh on a port-0 listener following `peers_file`.
pub fn pair_sidecar_yaml(engine: &Engine, events: &str, peers_file: &Path) -> Result<String> {
    let replay = engine
        .replay_endpoint
        .as_deref()
        .context("the engine publishes no KV events")?;
    Ok(format!(
        "engine:\n  url: {url}\n  kind: vllm\n  health_interval: 200ms\n  kv_events:\n    endpoint: {events}\n    \
         replay_endpoint: {replay}\n    topic: \"{topic}\"\n    socket: bind\n    replay_timeout: 5s\n\
         pod:\n  models: [{MODEL}]\n\
         prefix:\n  tokenizer: {dir}\n  block_size: {BLOCK_SIZE}\n\
         mesh:\n  listen: 127.0.0.1:0\n  file: {peers}\n  refresh_interval: 100ms\n  stale_after: 5s\n\
         logging:\n  level: warn\n",
        url = engine.base_url,
        topic = engine.topic,
        dir = model_dir().display(),
        peers = peers_file.display(),
    ))
}

/// The sidecar's own tokens for a completion prompt (BOS included, as vLLM).
pub fn tokens(tokenizer: &HfTokenizer, prompt: &str) -> Result<Vec<u32>> {
    Ok(tokenizer.encode(prompt, true)?)
}

/// The index keys of a token sequence, as `sidecar` stores them.
fn keys(sidecar: &SidecarUnderTest, tokens: &[u32]) -> Vec<u64> {
    sidecar
        .handle()
        .prefix()
        .index()
        .request_keys(MODEL, None, tokens, BLOCK_SIZE)
}

/// Leading blocks of `keys` that `sidecar`'s index says `pod` holds.
fn held(sidecar: &SidecarUnderTest, pod: &str, keys: &[u64]) -> usize {
    let prefix = sidecar.handle().prefix();
    let Some(id) = prefix.pod_id(pod) else {
        return 0;
    };
    prefix
        .index()
        .match_prefix(keys)
        .iter()
        .find(|m| m.pod == id)
        .map_or(0, |m| m.blocks)
}

/// The most leading blocks of `keys` any pod holds, per `sidecar`'s index.
fn best_held(sidecar: &SidecarUnderTest, keys: &[u64]) -> usize {
    let index = sidecar.handle().prefix().index();
    index
        .match_prefix(keys)
        .iter()
        .map(|m| m.blocks)
        .max()
        .unwrap_or(0)
}

/// What vLLM reported, replayed from its ROUTER: the blocks it holds now (engine hash -> the full
/// token chain from the root to that block), and whether a cache reset was among the batches.
#[derive(Debug, Default)]
pub struct Reported {
    pub live: HashMap<u64, Vec<u32>>,
    pub cleared: usize,
    pub batches: usize,
}

/// Replays every batch `engine` still buffers, from sequence 0, and folds them in order.
pub async fn reported(engine: &Engine) -> Result<Reported> {
    let replay = engine
        .replay_endpoint
        .as_deref()
        .context("the engine publishes no KV events")?;
    let msgs = kvmesh_engine_sim::replay(replay, 0, Duration::from_secs(10))
        .await
        .with_context(|| format!("replaying {}'s KV events from {replay}", engine.name))?;
    // Engine hash -> (parent, this block's tokens), for every block ever stored.
    let mut blocks: HashMap<u64, (Option<u64>, Vec<u32>)> = HashMap::new();
    let mut live: HashSet<u64> = HashSet::new();
    let mut out = Reported {
        batches: msgs.len(),
        ..Reported::default()
    };
    for m in &msgs {
        let batch = decode_batch(&m.payload)
            .with_context(|| format!("decoding replayed batch {}", m.seq))?;
        for ev in batch.events {
            match ev {
                KvEvent::BlockStored(s) if s.is_main_group() => {
                    let size = s.block_size.max(1) as usize;
                    let mut parent = s.parent_block_hash;
                    for (i, h) in s.block_hashes.iter().enumerate() {
                        let toks = s
                            .token_ids
                            .get(i * size..(i + 1) * size)
                            .context("BlockStored with fewer tokens than blocks")?;
                        blocks.insert(*h, (parent, toks.to_vec()));
                        live.insert(*h);
                        parent = Some(*h);
                    }
                }
                KvEvent::BlockRemoved(r) => {
                    for h in &r.block_hashes {
                        live.remove(h);
                    }
                }
                KvEvent::AllBlocksCleared => {
                    live.clear();
                    out.cleared += 1;
                }
                _ => {}
            }
        }
    }
    for h in live {
        // Walk up to the root (bounded by the model length in blocks).
        let mut chain = Vec::new();
        let mut at = Some(h);
        for _ in 0..64 {
            let Some(cur) = at else { break };
            let (parent, toks) = blocks
                .get(&cur)
                .with_context(|| format!("block {cur:#x} has a parent vLLM never reported"))?;
            chain.push(toks.clone());
            at = *parent;
        }
        ensure!(at.is_none(), "block {h:#x}: parent chain longer than 64");
        let tokens: Vec<u32> = chain.into_iter().rev().flatten().collect();
        out.live.insert(h, tokens);
    }
    Ok(out)
}

/// How `sidecar`'s index compares with what `engine` reported: `Ok(n)` when they agree exactly
/// (`n` blocks), else a description of the difference.
fn compare(sidecar: &SidecarUnderTest, rep: &Reported) -> std::result::Result<usize, String> {
    let (_, pod) = sidecar.handle().prefix().local_pod();
    let pod = pod.to_string();
    let mut missing = 0;
    for tokens in rep.live.values() {
        let k = keys(sidecar, tokens);
        if held(sidecar, &pod, &k) < k.len() {
            missing += 1;
        }
    }
    let entries = sidecar.handle().prefix().index().stats().entries;
    if missing == 0 && entries == rep.live.len() {
        Ok(entries)
    } else {
        Err(format!(
            "vLLM reports {} blocks held; the index lacks {missing} of them and holds {entries} entries",
            rep.live.len()
        ))
    }
}

/// Waits until `sidecar`'s index equals what `engine` reported (re-read on every try).
async fn wait_index_equals(sidecar: &SidecarUnderTest, engine: &Engine) -> Result<Reported> {
    let end = Instant::now() + SYNC_DEADLINE;
    loop {
        let rep = reported(engine).await?;
        match compare(sidecar, &rep) {
            Ok(_) => return Ok(rep),
            Err(diff) if Instant::now() >= end => {
                bail!("after {} s: {diff}", SYNC_DEADLINE.as_secs())
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

async fn complete(http: &Http, url: &str, prompt: &str) -> Result<serde_json::Value> {
    http.post_json(
        &format!("{url}/v1/completions"),
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}),
    )
    .await?
    .json()
}

fn cached_tokens(reply: &serde_json::Value) -> u64 {
    reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// Waits until the sidecar has applied at least one batch of its engine's events: vLLM's PUB
/// connects to the sidecar's SUB some time after both exist, and a batch published before that is
/// only recovered on the next gap. Sends a small warm-up request per try.
///
/// On failure the error carries [`kv_events_report`].
pub async fn wait_events_flow(
    http: &Http,
    engine: &Engine,
    sidecar: &SidecarUnderTest,
) -> Result<()> {
    for attempt in 0..10 {
        let prompt = long_prompt(&format!("{}-warmup-{attempt}", engine.name), 40);
        complete(http, &sidecar.url, &prompt).await?;
        let end = Instant::now() + Duration::from_secs(5);
        while Instant::now() < end {
            let text = http
                .get(&format!("{}/metrics", sidecar.admin_url))
                .await?
                .text();
            if super::metrics::sum(&text, "kvmesh_kv_event_batches_total", &[]).unwrap_or(0.0)
                >= 1.0
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    bail!(
        "engine {}'s sidecar applied no KV-event batch after 10 warm-up requests\n{}",
        engine.name,
        kv_events_report(http, engine, sidecar).await?
    )
}

/// Case 2 on one engine and its sidecar (before the mesh joins the pair, so the index holds this pod
/// only).
pub async fn ingest(
    http: &Http,
    tokenizer: &HfTokenizer,
    engine: &Engine,
    sidecar: &SidecarUnderTest,
) -> Result<()> {
    let prompts: Vec<String> = (0..2)
        .map(|i| long_prompt(&format!("ingest-{i}"), 150))
        .collect();
    for p in &prompts {
        complete(http, &sidecar.url, p).await?;
    }
    let before = wait_index_equals(sidecar, engine).await?;
    let me = sidecar.handle().prefix().local_pod().1.to_string();
    for p in &prompts {
        let k = keys(sidecar, &tokens(tokenizer, p)?);
        ensure!(
            held(sidecar, &me, &k) == k.len(),
            "the index lacks blocks of a prompt the engine served"
        );
    }
    note(&format!(
        "pair: case 2: index = vLLM's report: {} blocks ({} batches)",
        before.live.len(),
        before.batches
    ));

    let reset = http
        .post_empty(&format!("{}/reset_prefix_cache", engine.base_url))
        .await?;
    ensure!(
        reset.status.is_success(),
        "reset_prefix_cache: HTTP {}",
        reset.status
    );
    let after_prompt = long_prompt("ingest-after-reset", 100);
    complete(http, &sidecar.url, &after_prompt).await?;
    let after = wait_index_equals(sidecar, engine).await?;
    ensure!(
        after.cleared > before.cleared,
        "vLLM reported no AllBlocksCleared after the reset"
    );
    for p in &prompts {
        let k = keys(sidecar, &tokens(tokenizer, p)?);
        ensure!(
            held(sidecar, &me, &k) == 0,
            "a block from before the reset is still indexed for the pod"
        );
    }
    let k = keys(sidecar, &tokens(tokenizer, &after_prompt)?);
    ensure!(
        held(sidecar, &me, &k) == k.len(),
        "the request after the reset is not indexed"
    );
    note(&format!(
        "pair: case 2: after reset_prefix_cache + 1 request the index holds {} blocks, all the new request's",
        after.live.len()
    ));
    Ok(())
}

/// Writes the peers files so each sidecar follows the other, and waits until both fleets hold the
/// other pod.
pub async fn join(sidecars: [&SidecarUnderTest; 2], peers_files: [&PathBuf; 2]) -> Result<()> {
    for (i, file) in peers_files.iter().enumerate() {
        let other = sidecars[1 - i].handle().mesh_addr().context("mesh is on")?;
        std::fs::write(file, format!("{other}\n"))?;
    }
    let end = Instant::now() + SYNC_DEADLINE;
    loop {
        let joined = sidecars[0].handle().fleet().contains(&sidecars[1].pod_id())
            && sidecars[1].handle().fleet().contains(&sidecars[0].pod_id());
        if joined {
            return Ok(());
        }
        if Instant::now() >= end {
            bail!("the two sidecars did not see each other through the mesh");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A family's prompts: one long system prompt, a different short question per request.
fn family(tag: &str, requests: usize) -> Vec<String> {
    let system = long_prompt(tag, 200);
    (0..requests)
        .map(|q| format!("{system}\nQuestion {q}: which engine answers request {tag}-{q}?"))
        .collect()
}

const FAMILIES: usize = 2;
const PER_FAMILY: usize = 4;

async fn hits(http: &Http, engines: &[Engine]) -> Result<f64> {
    let mut total = 0.0;
    for e in engines {
        total += counter(&scrape(http, e).await?, "vllm:prefix_cache_hits_total", &[])?;
    }
    Ok(total)
}

/// Case 3 on the joined pair.
pub async fn precise_routing(
    http: &Http,
    tokenizer: &HfTokenizer,
    engines: &[Engine],
    sidecars: [&SidecarUnderTest; 2],
) -> Result<()> {
    // Routed: family f's request k goes to sidecar (f + k) % 2.
    let before = hits(http, engines).await?;
    let mut routed_cached = Vec::new();
    for f in 0..FAMILIES {
        let prompts = family(&format!("routed-{f}"), PER_FAMILY);
        // Full blocks of the system prompt alone; its last token may merge with what follows.
        let system_blocks = tokens(tokenizer, &long_prompt(&format!("routed-{f}"), 200))?
            .len()
            .saturating_sub(1)
            / BLOCK_SIZE;
        for (k, p) in prompts.iter().enumerate() {
            let via = sidecars[(f + k) % 2];
            let reply = complete(http, &via.url, p).await?;
            let cached = cached_tokens(&reply);
            routed_cached.push(cached);
            if k > 0 {
                ensure!(
                    cached >= (system_blocks * BLOCK_SIZE) as u64,
                    "routed request {f}-{k} (sent to sidecar {}) found {cached} cached tokens; the \
                     holder of the {system_blocks}-block system prompt would have had them",
                    (f + k) % 2
                );
            }
            // Sync on the events: both sidecars know where the prompt's blocks are before the
            // next request is sent to either.
            let k_all = keys(via, &tokens(tokenizer, p)?);
            let end = Instant::now() + SYNC_DEADLINE;
            while sidecars.iter().any(|s| best_held(s, &k_all) < k_all.len()) {
                if Instant::now() >= end {
                    bail!("the sidecars' indexes did not learn routed request {f}-{k}");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    let routed = hits(http, engines).await? - before;

    // Baseline: round robin straight to the engines, other families of the same shape.
    let before = hits(http, engines).await?;
    let mut rr_cached = Vec::new();
    for f in 0..FAMILIES {
        for (k, p) in family(&format!("round-robin-{f}"), PER_FAMILY)
            .iter()
            .enumerate()
        {
            let reply = complete(http, &engines[(f + k) % 2].base_url, p).await?;
            rr_cached.push(cached_tokens(&reply));
        }
    }
    let rr = hits(http, engines).await? - before;
    note(&format!(
        "pair: case 3: vllm:prefix_cache_hits_total over both engines: precise routing {routed} \
         tokens, round robin {rr} tokens\n  cached tokens per request, routed: {routed_cached:?}\n  \
         cached tokens per request, round robin: {rr_cached:?}"
    ));
    ensure!(
        routed > rr,
        "precise routing hit {routed} tokens, round robin {rr}: routing gained nothing"
    );
    Ok(())
}
