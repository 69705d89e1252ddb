//! `kvmesh-engine-sim profile`: a profile's costs as a table or JSON.

use serde_json::{json, Value};

use super::LatencyProfile;
use crate::SimError;

/// The JSON of profile `name`: the fields the issue names first, then the
/// profile's other fields, then the derivation (for `gpu:` profiles).
pub fn to_json(name: &str) -> Result<Value, SimError> {
    let (p, derivation) = LatencyProfile::load_explained(name)?;
    let mut out = json!({
        "step_base_ms": p.step_base_ms,
        "prefill_ms_per_token": p.prefill_ms_per_token,
        "decode_ms_per_seq": p.decode_ms_per_seq,
        "decode_ms_per_kctx": p.decode_ms_per_kctx,
        "max_num_batched_tokens": p.max_num_batched_tokens,
        "kv_cache_tokens": p.kv_cache_tokens,
        "kv_bytes_per_token": p.kv_bytes_per_token,
        "kv_transfer_ms_per_token": p.kv_transfer_ms_per_token,
    });
    let rest = serde_json::to_value(&p).map_err(|e| SimError::Config(e.to_string()))?;
    if let (Some(out), Value::Object(rest)) = (out.as_object_mut(), rest) {
        for (k, v) in rest {
            out.entry(k).or_insert(v);
        }
        if let Some(d) = derivation {
            let d = serde_json::to_value(d).map_err(|e| SimError::Config(e.to_string()))?;
            out.insert("derivation".into(), d);
        }
    }
    Ok(out)
}

/// JSON, or one `field  value` line per figure.
pub fn render(name: &str, json: bool) -> Result<String, SimError> {
    let v = to_json(name)?;
    if json {
        return serde_json::to_string_pretty(&v).map_err(|e| SimError::Config(e.to_string()));
    }
    let mut lines = Vec::new();
    let mut push = |prefix: &str, map: &serde_json::Map<String, Value>| {
        for (k, v) in map {
            let shown = match v {
                Value::Number(n) => match n.as_f64() {
                    Some(x) if !n.is_u64() => format!("{x:.6}"),
                    _ => n.to_string(),
                },
                Value::Null => "-".to_string(),
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            lines.push(format!("{:<40} {shown}", format!("{prefix}{k}")));
        }
    };
    if let Some(map) = v.as_object() {
        let (derivation, top): (Vec<_>, Vec<_>) =
            map.iter().partition(|(k, _)| k.as_str() == "derivation");
        push(
            "",
            &top.into_iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        );
        if let Some((_, Value::Object(d))) = derivation.first() {
            push("derivation.", d);
        }
    }
    Ok(lines.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_the_named_fields_and_the_derivation() {
        let v = to_json("gpu:llama-3.1-70b@h100x4").unwrap();
        for k in [
            "step_base_ms",
            "prefill_ms_per_token",
            "decode_ms_per_seq",
            "decode_ms_per_kctx",
            "max_num_batched_tokens",
            "kv_cache_tokens",
            "kv_bytes_per_token",
            "kv_transfer_ms_per_token",
            "prefill_ms_per_token_kctx",
        ] {
            assert!(v[k].is_number(), "{k}: {v}");
        }
        assert_eq!(v["derivation"]["tp"], 4);
        assert!(to_json("vllm-cpu-tiny").unwrap()["kv_cache_tokens"].is_null());
        let table = render("small-gpu", false).unwrap();
        assert!(
            table.contains("name") && table.contains("small-gpu"),
            "{table}"
        );
        assert!(table.contains("derivation.weights_gib_per_gpu"), "{table}");
    }
}
