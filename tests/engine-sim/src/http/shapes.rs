//! JSON bodies exactly as vLLM 0.32 shapes them (field names, order, nulls),
//! copied from the real captures in `fixtures/vllm-cpu/`.

use serde_json::{json, Value};

/// `usage` of a non-streaming response (with `--enable-prompt-tokens-details`).
pub fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached, "created_cache_tokens": null, "multimodal_tokens": null},
        "completion_tokens_details": null,
    })
}

/// `usage` of the final streaming chunk.
pub fn stream_usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// `return_token_ids`: the output's ids in the (first) choice and, when
/// given, the prompt's (in the choice for completions, beside the choices
/// for chat), as vLLM returns them.
pub fn with_token_ids(body: &mut Value, chat: bool, output: &[u32], prompt: Option<&[u32]>) {
    let Some(choice) = body
        .pointer_mut("/choices/0")
        .and_then(Value::as_object_mut)
    else {
        return;
    };
    choice.insert("token_ids".into(), json!(output));
    let Some(prompt) = prompt else {
        return;
    };
    if chat {
        if let Some(o) = body.as_object_mut() {
            o.insert("prompt_token_ids".into(), json!(prompt));
        }
    } else {
        choice.insert("prompt_token_ids".into(), json!(prompt));
    }
}

/// Fields shared by every response of one request.
#[derive(Debug, Clone)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub fingerprint: String,
    pub chat: bool,
}

impl Meta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.chat, chunk) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        }
    }

    /// The non-streaming response.
    pub fn full(&self, text: &str, finish: &str, usage: Value, kv_params: Value) -> Value {
        if self.chat {
            json!({
                "id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "refusal": null, "annotations": null,
                                "audio": null, "function_call": null, "reasoning": null},
                    "logprobs": null, "finish_reason": finish, "stop_reason": null, "token_ids": null,
                    "routed_experts": null,
                }],
                "service_tier": null, "system_fingerprint": self.fingerprint, "usage": usage,
                "prompt_logprobs": null, "prompt_token_ids": null, "prompt_text": null,
                "kv_transfer_params": kv_params, "ec_transfer_params": null, "metrics": null,
            })
        } else {
            json!({
                "id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
                "choices": [{
                    "index": 0, "text": text, "logprobs": null, "finish_reason": finish, "stop_reason": null,
                    "token_ids": null, "prompt_logprobs": null, "prompt_token_ids": null, "routed_experts": null,
                }],
                "service_tier": null, "system_fingerprint": self.fingerprint, "usage": usage,
                "kv_transfer_params": kv_params, "ec_transfer_params": null, "metrics": null,
            })
        }
    }

    /// The chat stream's opening chunk (role, empty content).
    pub fn chat_role_chunk(&self) -> Value {
        json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}],
            "prompt_token_ids": null, "prompt_text": null,
        })
    }

    /// One token's chunk; `finish` on the last one. Without a usage chunk to
    /// follow, the last chunk carries `system_fingerprint` (vLLM does this).
    pub fn token_chunk(&self, text: &str, finish: Option<&str>, fingerprint: bool) -> Value {
        let mut choice = if self.chat {
            json!({"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "stop_reason": null,
                   "prompt_token_ids": null, "token_ids": null})
        };
        if let Some(c) = choice.as_object_mut() {
            if self.chat {
                if finish.is_some() {
                    c.insert("stop_reason".into(), Value::Null);
                }
                c.insert("token_ids".into(), Value::Null);
            }
        }
        let mut chunk = json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "choices": [choice],
        });
        if fingerprint && finish.is_some() {
            if let Some(o) = chunk.as_object_mut() {
                o.insert(
                    "system_fingerprint".into(),
                    Value::String(self.fingerprint.clone()),
                );
            }
        }
        chunk
    }

    /// The `stream_options.include_usage` chunk.
    pub fn usage_chunk(&self, usage: Value) -> Value {
        json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "choices": [], "usage": usage, "system_fingerprint": self.fingerprint,
        })
    }
}

/// vLLM's error body: `{"error": {"message", "type", "param", "code"}}`.
pub fn error(status: u16, message: &str, param: Option<&str>) -> Value {
    let kind = match status {
        400 => "BadRequestError",
        401 => "UnauthorizedError",
        404 => "NotFoundError",
        429 => "TooManyRequestsError",
        501 => "NotImplementedError",
        503 => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    json!({"error": {"message": message, "type": kind, "param": param, "code": status}})
}

/// `GET /v1/models`; `owned_by` is the engine family (`vllm`, `sglang`).
pub fn models(
    model: &str,
    owned_by: &str,
    created: u64,
    max_model_len: usize,
    perm_id: &str,
) -> Value {
    json!({
        "object": "list",
        "data": [{
            "id": model, "object": "model", "created": created, "owned_by": owned_by, "root": model,
            "parent": null, "max_model_len": max_model_len,
            "permission": [permission(perm_id, created)],
        }],
    })
}

/// A model card's `permission` entry.
pub fn permission(perm_id: &str, created: u64) -> Value {
    json!({
        "id": perm_id, "object": "model_permission", "created": created,
        "allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true,
        "allow_search_indices": false, "allow_view": true, "allow_fine_tuning": false,
        "organization": "*", "group": null, "is_blocking": false,
    })
}

/// `POST /tokenize`.
pub fn tokenize(tokens: &[u32], max_model_len: usize) -> Value {
    json!({"count": tokens.len(), "max_model_len": max_model_len, "tokens": tokens, "token_strs": null})
}

/// A NixlConnector prefill's `kv_transfer_params` (vLLM 0.32 keys).
#[allow(clippy::too_many_arguments)]
pub fn nixl_params(
    block_ids: &[u32],
    engine_id: &str,
    request_id: &str,
    host: &str,
    port: u16,
    num_tokens: usize,
    cached: usize,
) -> Value {
    json!({
        "do_remote_prefill": true, "do_remote_decode": false,
        "remote_block_ids": [block_ids], "remote_engine_id": engine_id, "remote_request_id": request_id,
        "remote_host": host, "remote_port": port, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
        "remote_num_tokens": num_tokens, "remote_blocks_expiry_time": null, "transfer_mode": "pull",
        "remote_prefill_cached_tokens": cached,
    })
}
