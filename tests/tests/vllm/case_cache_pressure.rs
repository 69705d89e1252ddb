//! Case 11 (issue 40, item 3): two real vLLM engines whose KV holds less than the prefix groups
//! need, the groups arriving in a cycle that defeats LRU, routed by round-robin, by SMG's
//! cache_aware (when installed), by kvmesh's built-in default and by kvmesh with
//! `eviction-cost-scorer` (`deploy/examples/filters-cache-pressure.yaml`), compared by the engines'
//! own `vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`.
//!
//! Sizes: each engine has 40 KV blocks of 32 tokens (39 usable: vLLM keeps a null block); each
//! group is a system prompt of 11 full blocks plus a few tokens, and each request adds a short
//! question of its own, so a request takes 12 blocks (the last one partial, never cached). One
//! engine holds 3 groups. Three sequences run, of 11, 12 and 13 groups (their shared blocks 1.5x,
//! 1.65x and 1.8x the fleet's 80), each sent one request at a time, group 0, 1, …, G−1, 0, 1, …,
//! four times. An engine given more than 3 of the groups evicts each one just before it comes
//! back; the best a router can do is keep 3 groups on one engine and send the rest to the other (a
//! hit rate near 3/G of the prompt tokens after the first cycle).
//!
//! Every sequence starts from empty caches (`POST /reset_prefix_cache` on both engines) and sends
//! prompts no other sequence sends; kvmesh's sidecars reload their filter config before each, so
//! its scheduler starts afresh too (SMG runs once for all three, as it would be deployed). kvmesh's
//! requests all enter at sidecar a (one client); after each, the test waits until that sidecar's
//! index holds the prompt's blocks, so its next decision sees what the engines hold. The figures
//! are pooled over the three sequences (hit tokens over prompt tokens), over whole sequences and
//! over cycles 2-4 (the first cycle is cold for every router); the assertions are on cycles 2-4.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use kvmesh_filters::prefix::tokenize::HfTokenizer;
use serde_json::json;

use super::engine::Engine;
use super::http::Http;
use super::report::note;
use super::sidecar::SidecarUnderTest;
use super::{counter, long_prompt, repo_root, scrape, BLOCK_SIZE, MODEL};

/// KV blocks of each engine.
pub const KV_BLOCKS: u64 = 40;
/// The group counts of the three sequences, each cycled through in order.
const GROUP_COUNTS: [usize; 3] = [11, 12, 13];
/// Full blocks of a group's system prompt, shared by its requests.
const SHARED_BLOCKS: usize = 11;
const CYCLES: usize = 4;
/// Issue 40's target: kvmesh's hit rate at least this much above round-robin's.
const TARGET_GAP: f64 = 0.15;
/// How long a sidecar's index may take to learn a request's blocks, or to reload its filters.
const SYNC_DEADLINE: Duration = Duration::from_secs(45);

/// The engines' prefix-cache counters summed, in tokens.
#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    hits: f64,
    queries: f64,
}

impl Counters {
    fn since(self, before: Counters) -> Counters {
        Counters {
            hits: self.hits - before.hits,
            queries: self.queries - before.queries,
        }
    }

    fn add(&mut self, other: Counters) {
        self.hits += other.hits;
        self.queries += other.queries;
    }

    fn rate(self) -> f64 {
        if self.queries > 0.0 {
            self.hits / self.queries
        } else {
            0.0
        }
    }
}

/// One router's sequences: hit rates pooled over whole sequences and over cycles 2-4, each
/// sequence's rate over cycles 2-4, and the prompt tokens each engine computed or hit.
#[derive(Debug, Clone, Default)]
pub struct Figures {
    pub router: &'static str,
    all: Counters,
    steady: Counters,
    pub per_sequence: Vec<(usize, f64)>,
    pub queries_per_engine: Vec<f64>,
}

impl Figures {
    /// Hit tokens over prompt tokens, whole sequences.
    pub fn all(&self) -> f64 {
        self.all.rate()
    }

    /// Hit tokens over prompt tokens, cycles 2-4.
    pub fn steady(&self) -> f64 {
        self.steady.rate()
    }

    fn note(&self) {
        note(&format!(
            "pressure: {}: prefix-cache hit rate {:.3} over cycles 2-{CYCLES} ({:.3} with the \
             first); per sequence (groups, cycles 2-{CYCLES}) {:?}; prompt tokens per engine {:?}",
            self.router,
            self.steady(),
            self.all(),
            self.per_sequence
                .iter()
                .map(|(g, r)| format!("{g}: {r:.3}"))
                .collect::<Vec<_>>(),
            self.queries_per_engine
        ));
    }
}

/// Where a run sends its requests.
enum Via<'a> {
    /// Request n to engine n mod 2, as a Kubernetes Service would spread them.
    RoundRobin,
    /// Every request to one URL (SMG).
    Router(&'a str),
    /// Every request to one kvmesh sidecar, waiting for its index after each.
    Sidecar(&'a SidecarUnderTest),
}

/// `proxy.yaml` of a sidecar of this case: the pair sidecar of case 3 with the filter config in
/// `filters` (re-read every 100 ms).
pub fn sidecar_yaml(engine: &Engine, events: &str, peers: &Path, filters: &Path) -> Result<String> {
    Ok(format!(
        "{}scheduling:\n  filters: {}\n  reload_interval: 100ms\n",
        super::case_mesh::pair_sidecar_yaml(engine, events, peers)?,
        filters.display()
    ))
}

/// A shipped filter config, `deploy/examples/NAME`.
pub fn example(name: &str) -> Result<String> {
    let path = repo_root().join("deploy/examples").join(name);
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// The system prompt of group `tag`: the fewest words whose tokens (BOS included) fill
/// [`SHARED_BLOCKS`] blocks and reach a few tokens into the next, so that the question after it
/// never changes a shared block.
fn system_prompt(tokenizer: &HfTokenizer, tag: &str) -> Result<String> {
    let want = SHARED_BLOCKS * BLOCK_SIZE + 4;
    for words in 150..600 {
        let prompt = long_prompt(tag, words);
        if super::case_mesh::tokens(tokenizer, &prompt)?.len() >= want {
            return Ok(prompt);
        }
    }
    bail!("no system prompt of up to 600 words reaches {want} tokens")
}

/// A sequence's prompts in the order they are sent: cycle c, group g is request `c · groups + g`.
fn prompts(tokenizer: &HfTokenizer, run: &str, groups: usize) -> Result<Vec<String>> {
    let systems: Vec<String> = (0..groups)
        .map(|g| system_prompt(tokenizer, &format!("{run}-{groups}-group-{g}")))
        .collect::<Result<_>>()?;
    let mut out = Vec::with_capacity(groups * CYCLES);
    for n in 0..groups * CYCLES {
        let prompt = format!("{}\nQuestion {n}: who answers?", systems[n % groups]);
        let len = super::case_mesh::tokens(tokenizer, &prompt)?.len();
        ensure!(
            len < (SHARED_BLOCKS + 1) * BLOCK_SIZE,
            "request {n} has {len} tokens: its question spills into a 13th block"
        );
        out.push(prompt);
    }
    Ok(out)
}

async fn counters(http: &Http, engines: &[Engine]) -> Result<(Counters, Vec<f64>)> {
    let mut sum = Counters::default();
    let mut per_engine = Vec::new();
    for e in engines {
        let text = scrape(http, e).await?;
        let c = Counters {
            hits: counter(&text, "vllm:prefix_cache_hits_total", &[])?,
            queries: counter(&text, "vllm:prefix_cache_queries_total", &[])?,
        };
        sum.hits += c.hits;
        sum.queries += c.queries;
        per_engine.push(c.queries);
    }
    Ok((sum, per_engine))
}

/// Empties both engines' prefix caches. The sidecars' indexes follow through the engines' KV
/// events; a sequence's prompts share nothing with earlier ones, so nothing stale can match.
async fn reset(http: &Http, engines: &[Engine]) -> Result<()> {
    for e in engines {
        let reply = http
            .post_empty(&format!("{}/reset_prefix_cache", e.base_url))
            .await?;
        ensure!(
            reply.status.is_success(),
            "{}: reset_prefix_cache: HTTP {}",
            e.name,
            reply.status
        );
    }
    Ok(())
}

/// Waits until `sidecar`'s index holds every full block of `prompt` on some pod.
async fn wait_indexed(
    tokenizer: &HfTokenizer,
    sidecar: &SidecarUnderTest,
    prompt: &str,
) -> Result<()> {
    let tokens = super::case_mesh::tokens(tokenizer, prompt)?;
    let index = sidecar.handle().prefix().index();
    let keys = index.request_keys(MODEL, None, &tokens, BLOCK_SIZE);
    let end = Instant::now() + SYNC_DEADLINE;
    loop {
        let best = index
            .match_prefix(&keys)
            .iter()
            .map(|m| m.blocks)
            .max()
            .unwrap_or(0);
        if best >= keys.len() {
            return Ok(());
        }
        if Instant::now() >= end {
            bail!(
                "the sidecar's index holds {best} of the {} blocks of a request it routed",
                keys.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends one sequence of `groups` groups one request at a time through `via`, from empty caches,
/// and adds what the engines counted to `figures`.
async fn sequence(
    http: &Http,
    tokenizer: &HfTokenizer,
    engines: &[Engine],
    groups: usize,
    via: Via<'_>,
    figures: &mut Figures,
) -> Result<()> {
    let prompts = prompts(tokenizer, figures.router, groups)?;
    reset(http, engines).await?;
    let (start, start_per_engine) = counters(http, engines).await?;
    let mut after_first = start;
    // Per request: the engine that served it and the tokens it found cached.
    let mut trace = Vec::with_capacity(prompts.len());
    let mut last_per_engine = start_per_engine.clone();
    for (n, prompt) in prompts.iter().enumerate() {
        if n == groups {
            after_first = counters(http, engines).await?.0;
        }
        let url = match &via {
            Via::RoundRobin => engines[n % engines.len()].base_url.as_str(),
            Via::Router(url) => *url,
            Via::Sidecar(s) => s.url.as_str(),
        };
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0});
        let reply = http
            .post_json(&format!("{url}/v1/completions"), &body)
            .await?;
        ensure!(
            reply.status.is_success(),
            "{}: {groups} groups, request {n}: HTTP {}: {}",
            figures.router,
            reply.status,
            reply.text()
        );
        if let Via::Sidecar(s) = &via {
            wait_indexed(tokenizer, s, prompt).await?;
        }
        let cached = reply.json()?["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        let (_, per_engine) = counters(http, engines).await?;
        let served = per_engine
            .iter()
            .zip(&last_per_engine)
            .position(|(now, before)| now > before)
            .map_or('?', |e| char::from(b'a' + e as u8));
        last_per_engine = per_engine;
        trace.push(format!("{}{served}{cached}", n % groups));
    }
    note(&format!(
        "pressure: {} {groups} groups, group+engine+cached tokens per request: {}",
        figures.router,
        trace.join(" ")
    ));
    let (end, end_per_engine) = counters(http, engines).await?;
    figures.all.add(end.since(start));
    figures.steady.add(end.since(after_first));
    figures
        .per_sequence
        .push((groups, end.since(after_first).rate()));
    figures.queries_per_engine.resize(end_per_engine.len(), 0.0);
    for (sum, (e, s)) in figures
        .queries_per_engine
        .iter_mut()
        .zip(end_per_engine.iter().zip(&start_per_engine))
    {
        *sum += e - s;
    }
    Ok(())
}

/// Round-robin straight to the engines.
pub async fn round_robin(
    http: &Http,
    tokenizer: &HfTokenizer,
    engines: &[Engine],
) -> Result<Figures> {
    let mut figures = Figures {
        router: "round-robin",
        ..Figures::default()
    };
    for groups in GROUP_COUNTS {
        sequence(
            http,
            tokenizer,
            engines,
            groups,
            Via::RoundRobin,
            &mut figures,
        )
        .await?;
    }
    figures.note();
    Ok(figures)
}

/// SMG's cache_aware policy in front of both engines, or why it did not run (not installed, or
/// it would not route to these engines).
pub async fn smg(
    http: &Http,
    tokenizer: &HfTokenizer,
    engines: &[Engine],
) -> Result<std::result::Result<Figures, String>> {
    use kvmesh::demo::peers::smg;
    let bin = match smg::find() {
        Ok(bin) => bin,
        Err(why) => return Ok(Err(why)),
    };
    let workers: Vec<String> = engines.iter().map(|e| e.base_url.clone()).collect();
    let router = match smg::Smg::start(&bin, "cache_aware", &workers, MODEL).await {
        Ok(router) => router,
        Err(why) => return Ok(Err(format!("smg did not start: {why}"))),
    };
    let mut figures = Figures {
        router: "smg-cache-aware",
        ..Figures::default()
    };
    let mut out = Ok(());
    for groups in GROUP_COUNTS {
        let via = Via::Router(&router.url);
        out = sequence(http, tokenizer, engines, groups, via, &mut figures).await;
        if out.is_err() {
            break;
        }
    }
    router.stop().await;
    out?;
    figures.note();
    Ok(Ok(figures))
}

/// kvmesh through sidecar a, the sidecars running the filter config `yaml` (reloaded, so with
/// fresh state, before each sequence).
pub async fn kvmesh(
    http: &Http,
    tokenizer: &HfTokenizer,
    engines: &[Engine],
    sidecars: [&SidecarUnderTest; 2],
    filters: (&Path, &str),
    router: &'static str,
) -> Result<Figures> {
    let fleet = http
        .get(&format!("{}/debug/fleet", sidecars[0].admin_url))
        .await?
        .text();
    note(&format!("pressure: {router}: sidecar a's fleet: {fleet}"));
    let mut figures = Figures {
        router,
        ..Figures::default()
    };
    for groups in GROUP_COUNTS {
        let yaml = format!("{}\n# {router}, {groups} groups\n", filters.1);
        switch_filters(http, sidecars, filters.0, &yaml).await?;
        let via = Via::Sidecar(sidecars[0]);
        sequence(http, tokenizer, engines, groups, via, &mut figures).await?;
    }
    figures.note();
    Ok(figures)
}

/// Writes `yaml` to the sidecars' filter file and waits until both have reloaded it.
async fn switch_filters(
    http: &Http,
    sidecars: [&SidecarUnderTest; 2],
    file: &Path,
    yaml: &str,
) -> Result<()> {
    let mut before = Vec::new();
    for s in sidecars {
        before.push(reloads(http, s).await?);
    }
    std::fs::write(file, yaml)?;
    let end = Instant::now() + SYNC_DEADLINE;
    for (s, before) in sidecars.iter().zip(before) {
        while reloads(http, s).await? <= before {
            if Instant::now() >= end {
                bail!("a sidecar did not reload its filter config");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

async fn reloads(http: &Http, sidecar: &SidecarUnderTest) -> Result<f64> {
    super::case_pd::sidecar_counter(http, sidecar, "kvmesh_filters_reloads_total", &[]).await
}

/// The assertions of issue 40, item 3, on cycles 2-4.
pub fn check(rr: &Figures, smg: Option<&Figures>, kvmesh: &Figures) -> Result<()> {
    ensure!(
        kvmesh.steady() >= rr.steady() + TARGET_GAP,
        "kvmesh's hit rate {:.3} is not {TARGET_GAP} above round-robin's {:.3}",
        kvmesh.steady(),
        rr.steady()
    );
    if let Some(smg) = smg {
        ensure!(
            kvmesh.steady() > smg.steady(),
            "kvmesh's hit rate {:.3} is not above SMG cache_aware's {:.3}",
            kvmesh.steady(),
            smg.steady()
        );
    }
    Ok(())
}
