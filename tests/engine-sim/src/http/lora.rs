//! LoRA adapters loaded and unloaded at run time, as vLLM 0.32 serves them
//! with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`
//! (`vllm/entrypoints/serve/lora/api_router.py`, the checks and answers of
//! `vllm/entrypoints/openai/models/serving.py`; observed answers in
//! `tests/fixtures/vllm-cpu/lora/README.md`).
//!
//! * `POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}`:
//!   `200` with the text `Success: LoRA adapter '<name>' added successfully.`;
//!   `400` (`InvalidUserInput`) for an empty name or path, a name that is the
//!   base model's, or one already loaded without `load_inplace`; `404`
//!   (`NotFoundError`) when nothing exists at the path (vLLM reads the
//!   adapter's files there; the simulator asks only that the path exists).
//! * `POST /v1/unload_lora_adapter {"lora_name"}`: `200` with
//!   `Success: LoRA adapter '<name>' removed successfully.`; `400` for an
//!   empty name, `404` for one not loaded.
//! * `GET /v1/models` lists each loaded adapter after the base model, with
//!   `root` its path and `parent` the base model.
//!
//! A request whose `model` is a loaded adapter runs with it: its blocks are
//! hashed and its KV events sent with the adapter's name, and the core
//! counts it in `vllm:lora_requests_info`. The simulator's engine has no
//! `--max-cpu-loras` eviction: an adapter stays until it is unloaded.

use std::collections::BTreeMap;

use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{json, Value};

/// Most adapters one engine holds; a load beyond it is refused (`400`).
const MAX_LOADED: usize = 1024;

/// The adapters one engine has loaded (shared by its data-parallel ranks,
/// as vLLM's API server holds them once for all).
#[derive(Debug, Default)]
pub(crate) struct Adapters {
    /// Name to path, in name order (vLLM lists them in load order).
    loaded: Mutex<BTreeMap<String, String>>,
}

/// What an adapter call answers: the status and, for `200`, vLLM's text, or
/// else its error body.
pub(crate) enum Answer {
    Done(String),
    Error(u16, Value),
}

#[derive(Deserialize)]
struct LoadRequest {
    lora_name: String,
    lora_path: String,
    #[serde(default)]
    load_inplace: bool,
}

#[derive(Deserialize)]
struct UnloadRequest {
    lora_name: String,
}

impl Adapters {
    /// Whether `name` is loaded.
    pub fn has(&self, name: &str) -> bool {
        self.loaded.lock().contains_key(name)
    }

    /// `POST /v1/load_lora_adapter` for an engine serving `base`.
    pub fn load(&self, base: &str, body: &[u8]) -> Answer {
        let req: LoadRequest = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => return invalid_body(&e),
        };
        let name = req.lora_name;
        if name.is_empty() || req.lora_path.is_empty() {
            return user_error("Both 'lora_name' and 'lora_path' must be provided.");
        }
        if name == base {
            return user_error(&format!(
                "The lora adapter '{name}' conflicts with a served base model."
            ));
        }
        let mut loaded = self.loaded.lock();
        if !req.load_inplace && loaded.contains_key(&name) {
            return user_error(&format!(
                "The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
            ));
        }
        if !std::path::Path::new(&req.lora_path).exists() {
            // vLLM 0.32 writes `<path>` in place of the path.
            return not_found(&format!(
                "Loading lora {name} failed: No adapter found for <path>"
            ));
        }
        if loaded.len() >= MAX_LOADED && !loaded.contains_key(&name) {
            return user_error(&format!(
                "the simulator holds at most {MAX_LOADED} adapters"
            ));
        }
        loaded.insert(name.clone(), req.lora_path);
        Answer::Done(format!(
            "Success: LoRA adapter '{name}' added successfully."
        ))
    }

    /// `POST /v1/unload_lora_adapter`.
    pub fn unload(&self, body: &[u8]) -> Answer {
        let req: UnloadRequest = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => return invalid_body(&e),
        };
        let name = req.lora_name;
        if name.is_empty() {
            return user_error("'lora_name' needs to be provided to unload a LoRA adapter.");
        }
        if self.loaded.lock().remove(&name).is_none() {
            return not_found(&format!("The lora adapter '{name}' cannot be found."));
        }
        Answer::Done(format!(
            "Success: LoRA adapter '{name}' removed successfully."
        ))
    }

    /// The model cards of the loaded adapters, for `/v1/models`.
    pub fn cards(&self, base: &str, created: u64, perm_id: &str) -> Vec<Value> {
        self.loaded
            .lock()
            .iter()
            .map(|(name, path)| {
                json!({
                    "id": name, "object": "model", "created": created, "owned_by": "vllm",
                    "root": path, "parent": base, "max_model_len": null,
                    "permission": [super::shapes::permission(perm_id, created)],
                })
            })
            .collect()
    }
}

/// vLLM's `create_error_response` body with the `type` its LoRA checks use.
fn error(code: u16, kind: &str, message: &str) -> Answer {
    Answer::Error(
        code,
        json!({"error": {"message": message, "type": kind, "param": null, "code": code}}),
    )
}

fn user_error(message: &str) -> Answer {
    error(400, "InvalidUserInput", message)
}

fn not_found(message: &str) -> Answer {
    error(404, "NotFoundError", message)
}

/// A body that is not the request's JSON (vLLM answers its validation
/// error as a `400`).
fn invalid_body(e: &serde_json::Error) -> Answer {
    error(
        400,
        "BadRequestError",
        &format!("invalid request body: {e}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(a: &Answer) -> u16 {
        match a {
            Answer::Done(_) => 200,
            Answer::Error(code, _) => *code,
        }
    }

    #[test]
    fn load_and_unload_answer_as_vllm_does() {
        let a = Adapters::default();
        let dir = std::env::temp_dir();
        let path = dir.to_string_lossy();
        let load = format!(r#"{{"lora_name": "sql", "lora_path": "{path}"}}"#);
        assert_eq!(status(&a.load("base", load.as_bytes())), 200);
        assert!(a.has("sql"));
        // Twice: refused unless in place.
        assert_eq!(status(&a.load("base", load.as_bytes())), 400);
        let inplace =
            format!(r#"{{"lora_name": "sql", "lora_path": "{path}", "load_inplace": true}}"#);
        assert_eq!(status(&a.load("base", inplace.as_bytes())), 200);
        let base = format!(r#"{{"lora_name": "base", "lora_path": "{path}"}}"#);
        assert_eq!(status(&a.load("base", base.as_bytes())), 400);
        let missing = br#"{"lora_name": "x", "lora_path": "/nonexistent/kvmesh-sim"}"#;
        assert_eq!(status(&a.load("base", missing)), 404);
        assert_eq!(status(&a.load("base", b"{}")), 400);
        let cards = a.cards("base", 1, "modelperm-1");
        assert_eq!(cards.len(), 1);
        assert_eq!(cards[0]["parent"], "base");
        assert_eq!(status(&a.unload(br#"{"lora_name": "sql"}"#)), 200);
        assert_eq!(status(&a.unload(br#"{"lora_name": "sql"}"#)), 404);
        assert_eq!(status(&a.unload(br#"{"lora_name": ""}"#)), 400);
        assert!(!a.has("sql"));
    }
}
