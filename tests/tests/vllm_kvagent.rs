//! The kvmesh KV connector (`kvagent/connector/kvmesh_connector.py`) inside real, unmodified vLLM
//! (CPU build, tiny-llama), with two `kvmesh-kvagent` processes on loopback moving the blocks.
//!
//! Two engines load the connector through `kv_connector_module_path`; each has its own node agent.
//! A request is prefilled on one engine, whose connector posts the prompt's KV blocks to the other
//! engine's agent at the end of prefill; the decode engine's connector waits for them and loads them
//! into its KV cache. Cases:
//!
//! 1. legs made by hand: vLLM's own `prompt_tokens_by_source_total{source="external_kv_transfer"}`
//!    grows by the whole prompt (the decode engine computed none of it), and the decode agent
//!    received every prompt block;
//! 2. the prompt's first blocks already cached on the decode engine: local hits plus transferred
//!    tokens make the prompt, and only the rest is loaded, after the cached blocks;
//! 3. through a kvmesh sidecar with the `kvagent` P/D connector (llm-d's `x-prefiller-host-port`
//!    names the prefill engine; the sidecar adds the transfer id and the decode node's agent);
//! 4. a decode leg whose transfer never comes: the connector's wait runs out, vLLM recomputes.
//!
//! Every case's greedy output and every generated token's log-probability equal the prefill
//! engine's aggregated answer.
//!
//! Starts vLLM (like `vllm_e2e`): run under `flock /tmp/kvmesh-vllm.lock` on a shared machine.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "vllm/mod.rs"]
mod vllm;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

use vllm::engine::{Engine, EngineSpec};
use vllm::http::Http;
use vllm::report::{note, Timings};
use vllm::sidecar::SidecarUnderTest;
use vllm::{counter, engines_lock, long_prompt, repo_root, scrape, MODEL};

/// Staging blocks each engine's connector registers with its agent (prompts here need ≤ 12).
const STAGING_BLOCKS: u32 = 32;
const MAX_TOKENS: u64 = 12;
/// The connectors' deadline for agent calls (a decode waits this long for a transfer).
const WAIT_DEADLINE_S: u64 = 15;
const EXT: [(&str, &str); 1] = [("source", "external_kv_transfer")];

/// A `kvmesh-kvagent run` process; killed when dropped.
struct AgentProc {
    child: Child,
    socket: PathBuf,
    /// `127.0.0.1:PORT` of the agent-to-agent listener.
    peer: String,
    /// `http://127.0.0.1:PORT` of the admin listener.
    admin: String,
}

impl AgentProc {
    fn start(bin: &Path, dir: &Path, id: &str) -> Result<AgentProc> {
        let socket = dir.join(format!("{id}.sock"));
        let log = std::fs::File::create(dir.join(format!("agent-{id}.log")))?;
        let mut child = Command::new(bin)
            .args(["run", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
            .args(["--ready-json", "--agent-id", id, "--socket"])
            .arg(&socket)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let stdout = child.stdout.take().context("agent stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("agent {id} printed no ready line within 30 s");
            }
        };
        let ready: Value = serde_json::from_str(line.trim())
            .with_context(|| format!("agent {id} ready line {line:?}"))?;
        let peer = ready["peer"].as_str().context("peer")?.to_string();
        let admin = format!("http://{}", ready["admin"].as_str().context("admin")?);
        Ok(AgentProc {
            child,
            socket,
            peer,
            admin,
        })
    }

    async fn counter(&self, http: &Http, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
        let text = http.get(&format!("{}/metrics", self.admin)).await?.text();
        Ok(vllm::metrics::sum(&text, name, labels).unwrap_or(0.0))
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The agent binary beside this test's own (`target/debug`), built first when it is missing (a run of
/// this test alone builds only `kvmesh-tests`).
fn agent_bin() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .context("test binary has no target dir")?;
    let bin = dir.join("kvmesh-kvagent");
    if !bin.is_file() {
        note("building kvmesh-kvagent (not built by this test run)");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = Command::new(cargo)
            .args(["build", "-p", "kvmesh-kvagent", "--bin", "kvmesh-kvagent"])
            .current_dir(repo_root())
            .spawn()?;
        // Bounded: should the running `cargo test` hold the build directory's lock, say so
        // instead of waiting forever.
        let deadline = std::time::Instant::now() + Duration::from_secs(900);
        let status = loop {
            if let Some(status) = build.try_wait()? {
                break status;
            }
            if std::time::Instant::now() >= deadline {
                let _ = build.kill();
                let _ = build.wait();
                bail!(
                    "building kvmesh-kvagent took over 900 s; build it first \
                     (cargo build -p kvmesh-kvagent) and rerun"
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        };
        ensure!(status.success(), "cargo build -p kvmesh-kvagent failed");
    }
    ensure!(bin.is_file(), "{} missing", bin.display());
    Ok(bin)
}

fn spec(name: &'static str, cpu: u32, agent: &AgentProc) -> EngineSpec {
    let config = json!({
        "kv_connector": "KvmeshConnector",
        "kv_connector_module_path": "kvmesh_connector",
        "kv_role": "kv_both",
        // vLLM 0.32 fails a request whose KV load failed unless told to recompute it.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "socket": agent.socket, "staging_blocks": STAGING_BLOCKS, "deadline_s": WAIT_DEADLINE_S,
            "region_name": name,
        },
    });
    let connector_dir = repo_root().join("kvagent/connector");
    let env = vec![(
        "PYTHONPATH".to_string(),
        connector_dir.display().to_string(),
    )];
    EngineSpec {
        kv_transfer: Some((config, env)),
        ..EngineSpec::new(name, cpu)
    }
}

fn completions(e: &Engine) -> String {
    format!("{}/v1/completions", e.base_url)
}

/// What a completion answered: the text, each generated token's log-probability, the prompt size.
#[derive(Debug)]
struct Answer {
    text: String,
    logprobs: Vec<f64>,
    prompt_tokens: f64,
}

impl Answer {
    fn from_reply(reply: &Value) -> Result<Answer> {
        let choice = &reply["choices"][0];
        let text = choice["text"]
            .as_str()
            .with_context(|| format!("no text in {reply}"))?;
        let logprobs = choice["logprobs"]["token_logprobs"]
            .as_array()
            .with_context(|| format!("no logprobs in {reply}"))?
            .iter()
            .map(|v| v.as_f64().context("a logprob"))
            .collect::<Result<Vec<f64>>>()?;
        let prompt_tokens = reply["usage"]["prompt_tokens"]
            .as_f64()
            .context("prompt_tokens")?;
        Ok(Answer {
            text: text.to_string(),
            logprobs,
            prompt_tokens,
        })
    }

    /// Same text, and every token's log-probability within 1e-3: the KV the decode engine
    /// attended to was the prompt's (wrong or missing KV moves the log-probabilities even where a
    /// random-weight model repeats the same token).
    fn ensure_same(&self, want: &Answer, what: &str) -> Result<()> {
        ensure!(
            self.text == want.text,
            "{what}: output {:?} != aggregated {:?}",
            self.text,
            want.text
        );
        ensure!(
            self.logprobs.len() == want.logprobs.len()
                && self
                    .logprobs
                    .iter()
                    .zip(&want.logprobs)
                    .all(|(a, b)| (a - b).abs() < 1e-3),
            "{what}: logprobs {:?} != aggregated {:?}",
            self.logprobs,
            want.logprobs
        );
        Ok(())
    }
}

/// A completion request body for `prompt` (greedy, with log-probabilities).
fn body(prompt: &str, max_tokens: u64) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": true, "logprobs": 1})
}

/// The aggregated answer on `engine`.
async fn reference(http: &Http, engine: &Engine, prompt: &str) -> Result<Answer> {
    let reply = http
        .post_json(&completions(engine), &body(prompt, MAX_TOKENS))
        .await?
        .json()?;
    Answer::from_reply(&reply)
}

/// The decode engine's prompt-token counters: (external_kv_transfer, local_cache_hit).
async fn sources(http: &Http, decode: &Engine) -> Result<(f64, f64)> {
    let text = scrape(http, decode).await?;
    let name = "vllm:prompt_tokens_by_source_total";
    Ok((
        counter(&text, name, &EXT)?,
        counter(&text, name, &[("source", "local_cache_hit")])?,
    ))
}

/// Prefill on `prefill` with the kvagent parameters, then decode on `decode` with what prefill
/// returned, as the sidecar does.
async fn two_legs(
    http: &Http,
    prefill: &Engine,
    decode: &Engine,
    dest_agent: &AgentProc,
    prompt: &str,
    transfer: &str,
) -> Result<Answer> {
    let mut first = body(prompt, 1);
    first["kv_transfer_params"] = json!({
        "do_remote_decode": true, "do_remote_prefill": false,
        "kvmesh_transfer_id": transfer, "kvmesh_dest_agent": dest_agent.peer,
    });
    let (first, params) = vllm::prefill_leg(http, &completions(prefill), &first).await?;
    let n = Answer::from_reply(&first)?.prompt_tokens;
    ensure!(
        params["kvmesh_transfer_id"] == transfer && params["kvmesh_num_tokens"].as_f64() == Some(n),
        "prefill returned no kvmesh transfer parameters: {first}"
    );
    let mut second = body(prompt, MAX_TOKENS);
    second["kv_transfer_params"] = params;
    let second = http
        .post_json(&completions(decode), &second)
        .await?
        .json()?;
    Answer::from_reply(&second)
}

/// Case 1: the two legs by hand, as the sidecar's `kvagent` connector makes them.
async fn by_hand(
    http: &Http,
    prefill: &Engine,
    decode: &Engine,
    dest_agent: &AgentProc,
) -> Result<()> {
    let prompt = long_prompt("kvagent-hand", 300);
    let want = reference(http, prefill, &prompt).await?;
    let (ext_before, _) = sources(http, decode).await?;
    let moved_before = dest_agent
        .counter(http, "kvagent_transfer_bytes_total", &[])
        .await?;
    let got = two_legs(http, prefill, decode, dest_agent, &prompt, "hand-1").await?;
    let (ext_after, _) = sources(http, decode).await?;
    let moved = dest_agent
        .counter(http, "kvagent_transfer_bytes_total", &[])
        .await?
        - moved_before;
    let prompt_tokens = want.prompt_tokens;
    note(&format!(
        "by hand: prompt {prompt_tokens} tokens, decode external_kv_transfer +{}, decode agent +{moved} bytes, output {:?}",
        ext_after - ext_before,
        got.text
    ));
    ensure!(
        ext_after - ext_before == prompt_tokens,
        "decode engine's external_kv_transfer grew by {} tokens, want the prompt's {prompt_tokens}",
        ext_after - ext_before
    );
    // tiny-llama: 2 layers x 32 KiB per 32-token block; every prompt block crossed the agents.
    let blocks = (prompt_tokens as u64).div_ceil(32);
    ensure!(
        moved >= (blocks * 2 * 32 * 1024) as f64,
        "the decode agent received {moved} bytes, want at least {blocks} blocks' worth"
    );
    got.ensure_same(&want, "P/D")
}

/// Case 2: the decode engine already holds the prompt's first blocks (a shared prefix): only the
/// rest comes from the transfer, and the connector places it after the locally cached blocks.
async fn partly_cached_on_decode(
    http: &Http,
    prefill: &Engine,
    decode: &Engine,
    dest_agent: &AgentProc,
) -> Result<()> {
    let shared = long_prompt("kvagent-shared", 200);
    reference(http, decode, &shared).await?;
    let prompt = format!("{shared} {}", long_prompt("tail", 120));
    let want = reference(http, prefill, &prompt).await?;
    let (ext_before, local_before) = sources(http, decode).await?;
    let got = two_legs(http, prefill, decode, dest_agent, &prompt, "hand-2").await?;
    let (ext_after, local_after) = sources(http, decode).await?;
    let (ext, local) = (ext_after - ext_before, local_after - local_before);
    note(&format!(
        "partly cached: prompt {} tokens, decode local_cache_hit +{local}, external_kv_transfer +{ext}, output {:?}",
        want.prompt_tokens, got.text
    ));
    ensure!(
        local > 0.0 && ext > 0.0 && local + ext == want.prompt_tokens,
        "want the prompt ({}) split between local hits (+{local}) and the transfer (+{ext})",
        want.prompt_tokens
    );
    got.ensure_same(&want, "P/D with a local prefix")
}

/// Case 4: the decode leg names a transfer that never comes (its prefill node died). The decode
/// connector's wait runs out, it reports the load failed, vLLM recomputes the prompt, and the
/// answer is still the aggregated one.
async fn transfer_never_arrives(
    http: &Http,
    prefill: &Engine,
    decode: &Engine,
    dest_agent: &AgentProc,
) -> Result<()> {
    let prompt = long_prompt("kvagent-lost", 260);
    let want = reference(http, prefill, &prompt).await?;
    let timeouts = [("cause", "timeout")];
    let before = dest_agent
        .counter(http, "kvagent_failures_total", &timeouts)
        .await?;
    let started = std::time::Instant::now();
    let mut lost = body(&prompt, MAX_TOKENS);
    lost["kv_transfer_params"] =
        json!({"kvmesh_transfer_id": "never-sent", "kvmesh_num_tokens": want.prompt_tokens});
    let reply = http.post_json(&completions(decode), &lost).await?.json()?;
    let took = started.elapsed();
    let got = Answer::from_reply(&reply)?;
    let after = dest_agent
        .counter(http, "kvagent_failures_total", &timeouts)
        .await?;
    note(&format!(
        "lost transfer: answered in {:.1} s after the {WAIT_DEADLINE_S} s wait, agent timeouts +{}, output {:?}",
        took.as_secs_f64(),
        after - before,
        got.text
    ));
    ensure!(
        after - before >= 1.0,
        "the decode agent counted no timed-out wait"
    );
    ensure!(
        took.as_secs() >= WAIT_DEADLINE_S,
        "answered in {took:?}, before the connector's wait could have run out"
    );
    got.ensure_same(&want, "recomputed")
}

/// POST with one extra header (the harness's client sends none).
async fn post_with_header(url: &str, body: &Value, header: (&str, &str)) -> Result<Value> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .header(header.0, header.1)
        .body(Full::new(Bytes::from(serde_json::to_vec(body)?)))?;
    let call = async {
        let resp = client.request(req).await?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        ensure!(
            status.is_success(),
            "POST {url}: {status}: {}",
            String::from_utf8_lossy(&bytes)
        );
        Ok(serde_json::from_slice(&bytes)?)
    };
    tokio::time::timeout(Duration::from_secs(120), call)
        .await
        .with_context(|| format!("POST {url}: no answer within 120 s"))?
}

/// Case 3: a kvmesh sidecar in front of the decode engine runs P/D with `--pd-connector kvagent`.
async fn through_sidecar(
    http: &Http,
    prefill: &Engine,
    decode: &Engine,
    dest_agent: &AgentProc,
) -> Result<()> {
    let prompt = long_prompt("kvagent-sidecar", 280);
    let want = reference(http, prefill, &prompt).await?;
    let prompt_tokens = want.prompt_tokens;
    let port = dest_agent
        .peer
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .context("agent port")?;
    // The prefill engine is outside the sidecar's mesh: llm-d's header may name
    // it only because it is allow-listed (no open relay).
    let sidecar = SidecarUnderTest::start(
        &decode.base_url,
        &format!(
            "pd:\n  connector: kvagent\n  kvagent_port: {port}\n  allowed_prefillers: [\"127.0.0.1:{}\"]\n",
            prefill.port
        ),
    )
    .await?;
    let ext_before = counter(
        &scrape(http, decode).await?,
        "vllm:prompt_tokens_by_source_total",
        &EXT,
    )?;
    let reply = post_with_header(
        &format!("{}/v1/completions", sidecar.url),
        &body(&prompt, MAX_TOKENS),
        (
            "x-prefiller-host-port",
            &format!("127.0.0.1:{}", prefill.port),
        ),
    )
    .await;
    let pd_metrics = http
        .get(&format!("{}/metrics", sidecar.admin_url))
        .await?
        .text();
    sidecar.shutdown().await;
    let reply = reply?;
    let got = Answer::from_reply(&reply)?;
    let ext_after = counter(
        &scrape(http, decode).await?,
        "vllm:prompt_tokens_by_source_total",
        &EXT,
    )?;
    note(&format!(
        "sidecar: prompt {prompt_tokens} tokens, decode external_kv_transfer +{}, output {:?}",
        ext_after - ext_before,
        got.text
    ));
    let pd_lines: Vec<&str> = pd_metrics
        .lines()
        .filter(|l| l.contains("pd") && l.contains("kvagent"))
        .collect();
    ensure!(
        ext_after - ext_before == prompt_tokens,
        "through the sidecar the decode engine's external_kv_transfer grew by {}, want {prompt_tokens}; sidecar P/D metrics: {pd_lines:?}",
        ext_after - ext_before
    );
    got.ensure_same(&want, "sidecar P/D")
}

#[test]
fn vllm_kvagent_pd() -> Result<()> {
    let _one_group_at_a_time = engines_lock();
    let mut t = Timings::new("kvagent");
    let venv = t.step("set-up: vLLM venv", vllm::setup::venv)?;
    let bin = t.step("kvmesh-kvagent binary", agent_bin)?;
    let work = tempfile::Builder::new()
        .prefix("kvmesh-vllm-kvagent-")
        .tempdir()?;
    let agents = t.step("start two agents", || {
        Ok((
            AgentProc::start(&bin, work.path(), "p-node")?,
            AgentProc::start(&bin, work.path(), "d-node")?,
        ))
    })?;
    let (p_agent, d_agent) = &agents;
    let specs = [spec("prefill", 0, p_agent), spec("decode", 1, d_agent)];
    let engines = t.step("start vLLM x2 (KvmeshConnector)", || {
        Engine::start_all(&venv, work.path(), &specs)
    })?;
    let (prefill, decode) = (&engines[0], &engines[1]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let http = Http::default();
    let res = t
        .step("case: P/D legs by hand", || {
            rt.block_on(by_hand(&http, prefill, decode, d_agent))
        })
        .and_then(|()| {
            t.step(
                "case: P/D with the prompt's first blocks cached on decode",
                || rt.block_on(partly_cached_on_decode(&http, prefill, decode, d_agent)),
            )
        })
        .and_then(|()| {
            t.step(
                "case: P/D through a sidecar (--pd-connector kvagent)",
                || rt.block_on(through_sidecar(&http, prefill, decode, d_agent)),
            )
        })
        .and_then(|()| {
            t.step("case: a transfer that never arrives is recomputed", || {
                rt.block_on(transfer_never_arrives(&http, prefill, decode, d_agent))
            })
        });
    if let Err(e) = &res {
        let logs: Vec<String> = engines
            .iter()
            .map(|e| format!("--- {} ---\n{}", e.name, e.log_tail(40)))
            .collect();
        let agent_logs = ["p-node", "d-node"]
            .iter()
            .map(|id| {
                let text = std::fs::read_to_string(work.path().join(format!("agent-{id}.log")))
                    .unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                format!(
                    "--- agent {id} ---\n{}",
                    lines[lines.len().saturating_sub(20)..].join("\n")
                )
            })
            .collect::<Vec<_>>();
        bail!("{e:#}\n{}\n{}", logs.join("\n"), agent_logs.join("\n"));
    }
    Ok(())
}
