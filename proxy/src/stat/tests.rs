use super::*;

#[test]
fn prefix_counters_from_vllm_text() {
    let text = "# HELP x\n\
        vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 56.0\n\
        vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"m\"} 4.0\n\
        vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 16.0\n\
        vllm:prefix_cache_hits_created{engine=\"0\"} 1.7e9\n";
    assert_eq!(prefix_counters(EngineKind::Vllm, text), Some((60, 16)));
    assert_eq!(prefix_counters(EngineKind::Sglang, text), None);
    assert_eq!(prefix_counters(EngineKind::Vllm, "other 1\n"), None);
}
