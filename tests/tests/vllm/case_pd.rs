//! P/D with vLLM's `NixlConnector` between two real engines (case 5 and its harness check).

use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};

use super::engine::Engine;
use super::http::Http;
use super::report::note;
use super::{counter, long_prompt, prefill_leg, scrape, MODEL};

/// How long the by-hand decode leg may take before it counts as a stalled NIXL pull (it answers
/// in seconds when the transfer works).
const DECODE_STALL: std::time::Duration = std::time::Duration::from_secs(60);

/// Two legs as a P/D proxy makes them, checked against vLLM's own counters and an aggregated run.
pub async fn manual_pd(http: &Http, prefill: &Engine, decode: &Engine) -> Result<()> {
    let prompt = long_prompt("pd", 300);
    let max_tokens = 12;
    let url = |e: &Engine| format!("{}/v1/completions", e.base_url);

    // Reference: the decode engine alone, aggregated. Another prompt variant would be cached
    // differently; this one is never seen by the decode engine before the decode leg below, since
    // the reference runs on the prefill engine.
    let (want_text, prompt_tokens) = reference(
        http,
        &url(prefill),
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true}),
    )
    .await?;

    let ext = [("source", "external_kv_transfer")];
    // NIXL over UCX TCP on loopback once stalled a decode's KV pull past the whole request
    // deadline (CI, 29 Nov; the engines were otherwise healthy). A first stall is reported and
    // retried once with a fresh prefill; a second one fails the case.
    let mut stalls = 0;
    let (got_text, ext_before, ext_after) = loop {
        let before = scrape(http, decode).await?;
        let ext_before = counter(&before, "vllm:prompt_tokens_by_source_total", &ext)?;
        let prefill_body = json!({
            "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": false,
            "kv_transfer_params": {
                "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                "remote_block_ids": null, "remote_host": null, "remote_port": null
            }
        });
        let (first, params) = prefill_leg(http, &url(prefill), &prefill_body).await?;
        ensure!(
            params.get("do_remote_prefill") == Some(&Value::Bool(true)),
            "prefill returned no usable kv_transfer_params: {first}"
        );
        let decode_body = json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": true, "kv_transfer_params": params});
        let decode_url = url(decode);
        let decode_leg = http.post_json(&decode_url, &decode_body);
        let second = match tokio::time::timeout(DECODE_STALL, decode_leg).await {
            Ok(answer) => answer?.json()?,
            Err(_) if stalls == 0 => {
                stalls += 1;
                note(&format!(
                    "pair: the decode leg stalled for {DECODE_STALL:?} on its NIXL pull; retrying once with a fresh prefill"
                ));
                continue;
            }
            Err(_) => {
                anyhow::bail!("the decode leg stalled twice for {DECODE_STALL:?} on its NIXL pull")
            }
        };
        let got_text = second["choices"][0]["text"]
            .as_str()
            .context("decode text")?
            .to_owned();
        let after = scrape(http, decode).await?;
        let ext_after = counter(&after, "vllm:prompt_tokens_by_source_total", &ext)?;
        break (got_text, ext_before, ext_after);
    };
    note(&format!(
        "pair: P/D prompt {prompt_tokens} tokens, decode external_kv_transfer +{}, output {got_text:?}",
        ext_after - ext_before
    ));
    ensure!(
        ext_after - ext_before == prompt_tokens,
        "decode engine's external_kv_transfer grew by {} tokens, want the prompt's {prompt_tokens}",
        ext_after - ext_before
    );
    ensure!(
        got_text == want_text,
        "P/D output {got_text:?} != aggregated output {want_text:?}"
    );
    Ok(())
}

/// The filter config of the P/D sidecar: the shipped `filters-pd-disaggregated.yaml` with both
/// thresholds lowered to fit tiny-llama's 1024-token context.
pub const PD_FILTERS: &str = "apiVersion: kvmesh.dev/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: healthy-fresh-filter
  - type: model-filter
  - type: prefill-filter
  - type: decode-filter
  - type: prefix-cache-scorer
  - type: active-request-scorer
  - type: kv-cache-utilization-scorer
  - type: max-score-picker
  - type: prefix-based-pd-decider
    parameters:
      nonCachedTokens: 128
      promptTokens: 128
  - type: disagg-profile-handler
    parameters:
      profiles:
        decode: decode
        prefill: prefill
      deciders:
        prefill: prefix-based-pd-decider
schedulingProfiles:
  - name: decode
    plugins:
      - pluginRef: healthy-fresh-filter
      - pluginRef: model-filter
      - pluginRef: decode-filter
      - pluginRef: prefix-cache-scorer
        weight: 3
      - pluginRef: active-request-scorer
        weight: 2
      - pluginRef: kv-cache-utilization-scorer
        weight: 2
      - pluginRef: max-score-picker
  - name: prefill
    plugins:
      - pluginRef: healthy-fresh-filter
      - pluginRef: model-filter
      - pluginRef: prefill-filter
      - pluginRef: active-request-scorer
        weight: 2
      - pluginRef: max-score-picker
";

/// `proxy.yaml` of the prefill pod's sidecar (engine `a`): role `prefill`, the mesh on.
pub fn prefill_sidecar_yaml(engine: &Engine) -> String {
    format!(
        "engine:\n  url: {}\n  kind: vllm\n  health_interval: 200ms\n\
         pod:\n  role: prefill\n  models: [{MODEL}]\n\
         mesh:\n  listen: 127.0.0.1:0\n\
         logging:\n  level: warn\n",
        engine.base_url
    )
}

/// `proxy.yaml` of a decode pod's sidecar (engine `b`): role `decode`, `pd.connector: nixl`, the
/// lowered thresholds in `filters`, the prefill sidecar's mesh port in `peers`, and what to do when
/// prefill fails.
pub fn decode_sidecar_yaml(
    engine: &Engine,
    filters: &std::path::Path,
    peers: &std::path::Path,
    on_prefill_failure: &str,
) -> String {
    format!(
        "engine:\n  url: {url}\n  kind: vllm\n  health_interval: 200ms\n\
         pod:\n  role: decode\n  models: [{MODEL}]\n\
         prefix:\n  tokenizer: {dir}\n  block_size: {block}\n\
         scheduling:\n  filters: {filters}\n\
         pd:\n  connector: nixl\n  min_uncached_tokens: 128\n  prefill_retries: 1\n  retry_backoff: 50ms\n  \
         on_prefill_failure: {on_prefill_failure}\n\
         mesh:\n  listen: 127.0.0.1:0\n  file: {peers}\n  refresh_interval: 100ms\n  stale_after: 5s\n\
         logging:\n  level: warn\n",
        url = engine.base_url,
        dir = super::model_dir().display(),
        block = super::BLOCK_SIZE,
        filters = filters.display(),
        peers = peers.display(),
    )
}

/// A sidecar's counter from its admin `/metrics` (0 when not exported yet).
pub async fn sidecar_counter(
    http: &Http,
    sidecar: &super::sidecar::SidecarUnderTest,
    name: &str,
    labels: &[(&str, &str)],
) -> Result<f64> {
    let text = http
        .get(&format!("{}/metrics", sidecar.admin_url))
        .await?
        .text();
    Ok(super::metrics::sum(&text, name, labels).unwrap_or(0.0))
}

/// Case 5: a long prompt sent to the decode pod's sidecar is split by its scheduler: prefill on the
/// peer (engine `a`, through its sidecar), KV over NIXL, decode on engine `b`. Checked with vLLM's
/// own counters and against engine `a` serving the request alone.
pub async fn through_sidecar(
    http: &Http,
    prefill: &Engine,
    decode: &Engine,
    decode_sidecar: &super::sidecar::SidecarUnderTest,
) -> Result<()> {
    let want = Expected::of(http, "pd-through-sidecar", prefill, decode).await?;
    let split = [("outcome", "disaggregated")];
    let split_before =
        sidecar_counter(http, decode_sidecar, "kvmesh_pd_requests_total", &split).await?;
    let got = want.ask(http, decode_sidecar).await?;
    let external = want.external_tokens(http, decode).await?;
    let split_after =
        sidecar_counter(http, decode_sidecar, "kvmesh_pd_requests_total", &split).await?;
    note(&format!(
        "pair: case 5: prompt {} tokens; decode engine external_kv_transfer +{external}; \
         sidecar disaggregated +{}; output {got:?}",
        want.prompt_tokens,
        split_after - split_before
    ));
    ensure!(
        split_after - split_before == 1.0,
        "the decode sidecar did not split the request (kvmesh_pd_requests_total{{outcome=\"disaggregated\"}} +{})",
        split_after - split_before
    );
    want.check(external, &got)
}

/// What a P/D completion must give: engine `a`'s own answer to the same greedy request, and the
/// prompt tokens engine `b` had received over KV transfer before it.
struct Expected {
    body: Value,
    text: String,
    prompt_tokens: f64,
    external_before: f64,
}

impl Expected {
    /// A 300-word prompt tagged `tag`, 12 greedy tokens, answered by `prefill` alone.
    async fn of(http: &Http, tag: &str, prefill: &Engine, decode: &Engine) -> Result<Expected> {
        let body = json!({"model": MODEL, "prompt": long_prompt(tag, 300), "max_tokens": 12,
                          "temperature": 0, "ignore_eos": true});
        let (text, prompt_tokens) =
            reference(http, &format!("{}/v1/completions", prefill.base_url), &body).await?;
        let external_before = external_kv_tokens(http, decode).await?;
        Ok(Expected {
            body,
            text,
            prompt_tokens,
            external_before,
        })
    }

    /// The request sent to `sidecar`: the text it answered.
    async fn ask(&self, http: &Http, sidecar: &super::sidecar::SidecarUnderTest) -> Result<String> {
        let got = http
            .post_json(&format!("{}/v1/completions", sidecar.url), &self.body)
            .await?
            .json()?;
        let text = got["choices"][0]["text"]
            .as_str()
            .with_context(|| format!("P/D text in {got}"))?;
        Ok(text.to_owned())
    }

    /// The prompt tokens `decode` received over KV transfer since.
    async fn external_tokens(&self, http: &Http, decode: &Engine) -> Result<f64> {
        Ok(external_kv_tokens(http, decode).await? - self.external_before)
    }

    /// The decode engine got the whole prompt's KV over the transfer (it recomputed none), and the
    /// answer is engine `a`'s.
    fn check(&self, external: f64, got: &str) -> Result<()> {
        ensure!(
            external == self.prompt_tokens,
            "the decode engine's external_kv_transfer grew by {external} tokens, want the prompt's {}",
            self.prompt_tokens
        );
        ensure!(
            got == self.text,
            "P/D output {got:?} != engine a alone {:?}",
            self.text
        );
        Ok(())
    }
}

/// vLLM's `prompt_tokens_by_source_total{source="external_kv_transfer"}` on `engine`.
async fn external_kv_tokens(http: &Http, engine: &Engine) -> Result<f64> {
    counter(
        &scrape(http, engine).await?,
        "vllm:prompt_tokens_by_source_total",
        &[("source", "external_kv_transfer")],
    )
}

/// The aggregated answer to `body` at `url`: its text and the prompt's length in tokens.
async fn reference(http: &Http, url: &str, body: &Value) -> Result<(String, f64)> {
    let reply = http.post_json(url, body).await?.json()?;
    let text = reply["choices"][0]["text"]
        .as_str()
        .context("reference text")?
        .to_string();
    let prompt_tokens = reply["usage"]["prompt_tokens"]
        .as_f64()
        .context("prompt_tokens")?;
    Ok((text, prompt_tokens))
}

/// Case 5b: the same through `/v1/responses` (issue 40, item 4): vLLM 0.32 takes
/// `kv_transfer_params` on a Responses request and returns them on its response, so the decode
/// sidecar splits it as it splits a completion (the prefill leg capped by `max_output_tokens`).
pub async fn responses_through_sidecar(
    http: &Http,
    prefill: &Engine,
    decode: &Engine,
    decode_sidecar: &super::sidecar::SidecarUnderTest,
) -> Result<()> {
    let body = json!({"model": MODEL, "instructions": "Continue the text.",
                      "input": long_prompt("pd-responses", 300), "max_output_tokens": 12,
                      "temperature": 0, "ignore_eos": true});
    let text = |reply: &Value| -> Result<String> {
        reply["output"]
            .as_array()
            .and_then(|items| items.iter().find(|i| i["type"] == "message"))
            .and_then(|m| m["content"][0]["text"].as_str())
            .map(str::to_owned)
            .with_context(|| format!("no output text in {reply}"))
    };
    let alone = http
        .post_json(&format!("{}/v1/responses", prefill.base_url), &body)
        .await?
        .json()?;
    let want_text = text(&alone)?;
    let prompt_tokens = alone["usage"]["input_tokens"]
        .as_f64()
        .context("usage.input_tokens")?;
    let ext = [("source", "external_kv_transfer")];
    let ext_before = counter(
        &scrape(http, decode).await?,
        "vllm:prompt_tokens_by_source_total",
        &ext,
    )?;
    let split = [("outcome", "disaggregated")];
    let split_before =
        sidecar_counter(http, decode_sidecar, "kvmesh_pd_requests_total", &split).await?;
    let got = http
        .post_json(&format!("{}/v1/responses", decode_sidecar.url), &body)
        .await?
        .json()?;
    let got_text = text(&got)?;
    let ext_after = counter(
        &scrape(http, decode).await?,
        "vllm:prompt_tokens_by_source_total",
        &ext,
    )?;
    let split_after =
        sidecar_counter(http, decode_sidecar, "kvmesh_pd_requests_total", &split).await?;
    note(&format!(
        "pair: case 5b: /v1/responses, prompt {prompt_tokens} tokens; decode engine external_kv_transfer +{}; \
         sidecar disaggregated +{}; output {got_text:?}",
        ext_after - ext_before,
        split_after - split_before
    ));
    ensure!(
        split_after - split_before == 1.0,
        "the decode sidecar did not split the /v1/responses request (+{})",
        split_after - split_before
    );
    ensure!(
        ext_after - ext_before == prompt_tokens,
        "decode engine's external_kv_transfer grew by {} tokens, want the prompt's {prompt_tokens}",
        ext_after - ext_before
    );
    ensure!(
        got_text == want_text,
        "P/D output {got_text:?} != engine a alone {want_text:?}"
    );
    Ok(())
}

/// `proxy.yaml` of a prefill pod's sidecar (engine `a`) that splits the requests it takes itself:
/// role `prefill`, `pd.connector: nixl`, the lowered thresholds in `filters`, no mesh (case 5c
/// writes its fleet by hand).
pub fn splitting_prefill_sidecar_yaml(engine: &Engine, filters: &std::path::Path) -> String {
    format!(
        "engine:\n  url: {url}\n  kind: vllm\n  health_interval: 200ms\n\
         pod:\n  role: prefill\n  models: [{MODEL}]\n\
         prefix:\n  tokenizer: {dir}\n  block_size: {block}\n\
         scheduling:\n  filters: {filters}\n\
         pd:\n  connector: nixl\n  min_uncached_tokens: 128\n\
         logging:\n  level: warn\n",
        url = engine.base_url,
        dir = super::model_dir().display(),
        block = super::BLOCK_SIZE,
        filters = filters.display(),
    )
}

/// Case 5c (issue 42): a decode pod that fails before its first token. A prefill pod's sidecar
/// (engine `a`) splits a long prompt. The decode pod its scheduler picks first refuses connections
/// (its sidecar just died: idle by its last load, so the KV-usage scorer ranks it first); the
/// sidecar sends the decode leg again, with the same `kv_transfer_params`, to the next decode pod,
/// engine `b`'s sidecar. Engine `b` must pull the prompt's KV from engine `a` over NIXL
/// (`external_kv_transfer` grows by the prompt, nothing is recomputed), and the answer must equal
/// engine `a` serving the request alone: the prefill pod kept the blocks for a decode that came
/// from another pod than the one first named.
pub async fn decode_leg_resent(
    http: &Http,
    prefill: &Engine,
    decode: &Engine,
    decode_sidecar: &super::sidecar::SidecarUnderTest,
    splitter: &super::sidecar::SidecarUnderTest,
) -> Result<()> {
    use kvmesh_filters::sched::Role;
    use kvmesh_proxy::fleet::{EngineLoad, PodInfo};

    let want = Expected::of(http, "pd-decode-resent", prefill, decode).await?;
    // The decode pods, written just before the request: their loads are fresh for 5 s
    // (`healthy-fresh-filter`), and no mesh refreshes them.
    let gone = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?
    };
    let fleet = splitter.handle().fleet();
    let now = tokio::time::Instant::now();
    let busier = EngineLoad {
        waiting: 2,
        running: 6,
        kv_usage: 0.4,
        ..EngineLoad::default()
    };
    for (addr, load) in [
        (gone, EngineLoad::default()),
        (decode_sidecar.handle().addr(), busier),
    ] {
        let id = addr.to_string();
        fleet
            .upsert_peer(PodInfo {
                id: id.clone(),
                sidecar_addr: Some(addr),
                role: Role::Decode,
                models: vec![MODEL.to_owned()],
                lora_adapters: vec![],
                labels: Default::default(),
            })
            .map_err(|e| anyhow::anyhow!("adding decode pod {id}: {e}"))?;
        fleet.set_load(&id, load, now);
    }
    let got = want.ask(http, splitter).await?;
    let external = want.external_tokens(http, decode).await?;
    let resent = [("outcome", "decode_resent")];
    let resent_n = sidecar_counter(http, splitter, "kvmesh_pd_requests_total", &resent).await?;
    note(&format!(
        "pair: case 5c: prompt {} tokens; decode pod refused, leg re-sent {resent_n}x; \
         engine b external_kv_transfer +{external}; output {got:?}",
        want.prompt_tokens
    ));
    ensure!(
        resent_n == 1.0,
        "the splitting sidecar did not re-send the decode leg (kvmesh_pd_requests_total{{outcome=\"decode_resent\"}} = {resent_n})"
    );
    want.check(external, &got)
}
