//! P/D with vLLM's `NixlConnector` between two real engines (case 5 and its harness check).

use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};

use super::engine::Engine;
use super::http::Http;
use super::report::note;
use super::{counter, long_prompt, scrape, MODEL};

/// Two legs as a P/D proxy makes them, checked against vLLM's own counters and an aggregated run.
pub async fn manual_pd(http: &Http, prefill: &Engine, decode: &Engine) -> Result<()> {
    let prompt = long_prompt("pd", 300);
    let max_tokens = 12;
    let url = |e: &Engine| format!("{}/v1/completions", e.base_url);

    // Reference: the decode engine alone, aggregated. Another prompt variant would be cached
    // differently; this one is never seen by the decode engine before the decode leg below, since
    // the reference runs on the prefill engine.
    let reference = http
        .post_json(
            &url(prefill),
            &json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true}),
        )
        .await?
        .json()?;
    let want_text = reference["choices"][0]["text"]
        .as_str()
        .context("reference text")?
        .to_string();
    let prompt_tokens = reference["usage"]["prompt_tokens"]
        .as_f64()
        .context("prompt_tokens")?;

    let before = scrape(http, decode).await?;
    let ext = [("source", "external_kv_transfer")];
    let ext_before = counter(&before, "vllm:prompt_tokens_by_source_total", &ext)?;

    let first = http
        .post_json(
            &url(prefill),
            &json!({
                "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": false,
                "kv_transfer_params": {
                    "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                    "remote_block_ids": null, "remote_host": null, "remote_port": null
                }
            }),
        )
        .await?
        .json()?;
    let params = first
        .get("kv_transfer_params")
        .cloned()
        .unwrap_or(Value::Null);
    ensure!(
        params.get("do_remote_prefill") == Some(&Value::Bool(true)),
        "prefill returned no usable kv_transfer_params: {first}"
    );
    let second = http
        .post_json(
            &url(decode),
            &json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": true, "kv_transfer_params": params}),
        )
        .await?
        .json()?;
    let got_text = second["choices"][0]["text"]
        .as_str()
        .context("decode text")?;

    let after = scrape(http, decode).await?;
    let ext_after = counter(&after, "vllm:prompt_tokens_by_source_total", &ext)?;
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
