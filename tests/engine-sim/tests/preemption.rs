//! Recompute preemption as vLLM counts it: when decodes outgrow the KV
//! cache, the newest running request goes back to wait and is recomputed.
//! Its second prefix lookup is counted apart (`preempted_queries`), so
//! `vllm:prefix_cache_queries` holds the prompt tokens of new requests alone,
//! and the recompute shows in the preempted counters instead.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use kvmesh_engine_sim::{Engine, SimConfig};

#[tokio::test]
async fn a_preempted_requests_lookup_is_counted_apart() {
    // 10 blocks of 16 tokens: both 33-token prompts (3 blocks each) are
    // admitted at once, and their 60-token answers need 3 more blocks each.
    let cfg = SimConfig::new("sim")
        .with_time_scale(100.0)
        .with_block_size(16)
        .with_num_blocks(10);
    let e = Engine::start_local(cfg).await.unwrap();
    let (a, b) = (
        completion(&words("a", 32), 60),
        completion(&words("b", 32), 60),
    );
    let ((sa, ra), (sb, rb)) = tokio::join!(
        post(e.addr(), "/v1/completions", &a),
        post(e.addr(), "/v1/completions", &b)
    );
    assert_eq!((sa, sb), (200, 200), "{ra} {rb}");
    let prompt_tokens = ra["usage"]["prompt_tokens"].as_u64().unwrap()
        + rb["usage"]["prompt_tokens"].as_u64().unwrap();

    // Each client gets its whole answer, and usage as it sent the request.
    for r in [&ra, &rb] {
        assert_eq!(r["usage"]["prompt_tokens"], 33, "{r}");
        assert_eq!(r["usage"]["completion_tokens"], 60, "{r}");
        let text = r["choices"][0]["text"].as_str().unwrap();
        assert_eq!(text.split_whitespace().count(), 60, "{r}");
    }

    let s = e.stats();
    assert!(s.preemptions >= 1, "the cache is too small for both: {s:?}");
    assert_eq!(
        s.prefix_queries, prompt_tokens,
        "new requests' lookups only"
    );
    // The victim looks up its prompt and the tokens it had generated again.
    assert!(s.preempted_queries > 0, "{s:?}");
    assert!(s.preempted_hits <= s.preempted_queries);
    let metrics = get_text(e.addr(), "/metrics").await;
    let exported = metrics
        .lines()
        .find(|l| l.starts_with("vllm:prefix_cache_queries_total{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap();
    assert_eq!(exported as u64, prompt_tokens);
    e.shutdown().await;
}
