//! The LoRA adapters a pod's engine has loaded now, from what its sidecar
//! reads of it (docs/filters.md, "LoRA adapters loaded at run time").
//!
//! vLLM loads and unloads adapters while it runs (`POST /v1/load_lora_adapter`,
//! `/v1/unload_lora_adapter`, with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`). Its
//! `/v1/models` lists each loaded adapter as a model card whose `parent` is
//! the base model (`vllm/entrypoints/openai/models/serving.py`,
//! `show_available_models`; base models' `parent` is null), and
//! `vllm:lora_requests_info` names the adapters of the requests its scheduler
//! holds ([`super::parse_lora_info`]). The live set is the union of
//! `pod.lora_adapters` (always there), the adapters `/v1/models` listed at
//! its last answer and those the newest metric series names: an adapter
//! unloaded leaves at the next `/v1/models` answer, unless requests for it
//! still run. Pure: the scrape reads the engine and hands the texts here.

use serde::Deserialize;

use super::LoraInfo;

/// Most adapters one pod is known to hold; further names are dropped (vLLM's
/// `--max-cpu-loras` is far below it in practice).
pub const MAX_ADAPTERS: usize = 256;
/// Longest adapter name kept; a longer one is dropped.
pub const MAX_NAME_LEN: usize = 256;

/// The adapters a `/v1/models` answer lists: the cards with a `parent`.
/// `None` when the body is not a model list.
pub fn parse_models(body: &[u8]) -> Option<Vec<String>> {
    #[derive(Deserialize)]
    struct List {
        data: Vec<Card>,
    }
    #[derive(Deserialize)]
    struct Card {
        id: String,
        #[serde(default)]
        parent: Option<String>,
    }
    let list: List = serde_json::from_slice(body).ok()?;
    Some(
        list.data
            .into_iter()
            .filter(|c| c.parent.is_some())
            .map(|c| c.id)
            .collect(),
    )
}

/// The live set: `configured` in its order, then every other adapter
/// `listed` by `/v1/models` or named by the metric, sorted, once each; at
/// most [`MAX_ADAPTERS`], none longer than [`MAX_NAME_LEN`].
pub fn live_set(configured: &[String], listed: &[String], info: Option<&LoraInfo>) -> Vec<String> {
    let mut found: Vec<&String> = listed
        .iter()
        .chain(
            info.into_iter()
                .flat_map(|i| i.running.iter().chain(&i.waiting)),
        )
        .filter(|n| !n.is_empty() && n.len() <= MAX_NAME_LEN && !configured.contains(n))
        .collect();
    found.sort_unstable();
    found.dedup();
    configured
        .iter()
        .chain(found)
        .take(MAX_ADAPTERS)
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOADED: &[u8] =
        include_bytes!("../../assets/tests/fixtures/vllm-cpu/lora/models-loaded.json");
    const BASE: &[u8] =
        include_bytes!("../../assets/tests/fixtures/vllm-cpu/lora/models-base.json");

    #[test]
    fn models_lists_the_adapters_of_a_real_vllm() {
        assert_eq!(parse_models(LOADED).unwrap(), ["sql-lora"]);
        assert_eq!(parse_models(BASE).unwrap(), Vec::<String>::new());
        assert_eq!(parse_models(b"<html>"), None);
        assert_eq!(parse_models(br#"{"data": [{"object": "model"}]}"#), None);
    }

    #[test]
    fn the_live_set_is_the_union_in_a_stable_order() {
        let configured = vec!["static".to_owned()];
        let listed = vec!["zeta".to_owned(), "alpha".to_owned(), "static".to_owned()];
        let info = LoraInfo {
            running: vec!["running".into()],
            waiting: vec!["alpha".into(), String::new()],
            max_lora: 2,
        };
        assert_eq!(
            live_set(&configured, &listed, Some(&info)),
            ["static", "alpha", "running", "zeta"]
        );
        // Unloaded: /v1/models no longer lists it and nothing runs for it.
        assert_eq!(live_set(&configured, &[], None), ["static"]);
        let many: Vec<String> = (0..MAX_ADAPTERS + 9).map(|i| format!("a{i:04}")).collect();
        assert_eq!(live_set(&[], &many, None).len(), MAX_ADAPTERS);
        let long = vec!["x".repeat(MAX_NAME_LEN + 1)];
        assert!(live_set(&[], &long, None).is_empty());
    }
}
