//! The engine's Prometheus metrics, with vLLM's (or SGLang's) names, types,
//! labels and histogram buckets as in the real captures
//! (`fixtures/vllm-cpu/probe/metrics1.txt`, `fixtures/sglang-cpu/metrics-*.txt`).
//! Every time is in simulated seconds.

use std::fmt::Write;

use crate::config::{Flavor, Role, SimConfig};

/// A cumulative histogram.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    pub bounds: &'static [f64],
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        let v = if v.is_finite() { v.max(0.0) } else { 0.0 };
        for (b, c) in self.bounds.iter().zip(self.counts.iter_mut()) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }
}

const TTFT: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const REQ: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
const TOKENS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0,
];

/// Counters, gauges and histograms of one engine; written by the core.
#[derive(Debug, Clone)]
pub struct EngineMetrics {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub used_blocks: usize,
    pub cached_blocks: usize,
    pub held_transfers: usize,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    /// Prefix lookups of preempted requests resuming: counted apart and not
    /// exported, as vLLM does (`PrefixCacheStats.preempted_queries`).
    pub preempted_queries: u64,
    pub preempted_hits: u64,
    pub external_queries: u64,
    pub external_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub by_source_compute: u64,
    pub by_source_cache: u64,
    pub by_source_external: u64,
    pub preemptions: u64,
    /// Decode side of P/D: fetches of a prefill engine's blocks that failed
    /// (unknown, expired or unreachable), each recomputed instead.
    pub nixl_failed_transfers: u64,
    pub success: [u64; 5],
    pub kv_batches_published: u64,
    pub kv_batches_dropped: u64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub tpot: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
    pub prefill_time: Histogram,
    pub decode_time: Histogram,
    pub inference_time: Histogram,
    pub request_prompt_tokens: Histogram,
    pub request_generation_tokens: Histogram,
    pub request_max_tokens: Histogram,
    pub iteration_tokens: Histogram,
    /// `vllm:lora_requests_info`: every (running, waiting) pair of adapter
    /// lists the core has set, with the Unix time it last did; vLLM keeps
    /// every label set it ever set, the simulator the last [`MAX_LORA_SERIES`].
    pub lora_series: Vec<(String, String, f64)>,
    block_size: usize,
    num_blocks: usize,
}

/// Label sets of `vllm:lora_requests_info` kept.
const MAX_LORA_SERIES: usize = 64;

const REASONS: [&str; 5] = ["stop", "length", "abort", "error", "repetition"];

impl EngineMetrics {
    pub fn new(cfg: &SimConfig) -> Self {
        Self {
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            used_blocks: 0,
            cached_blocks: 0,
            held_transfers: 0,
            prefix_queries: 0,
            prefix_hits: 0,
            preempted_queries: 0,
            preempted_hits: 0,
            external_queries: 0,
            external_hits: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            by_source_compute: 0,
            by_source_cache: 0,
            by_source_external: 0,
            preemptions: 0,
            nixl_failed_transfers: 0,
            success: [0; 5],
            kv_batches_published: 0,
            kv_batches_dropped: 0,
            ttft: Histogram::new(TTFT),
            itl: Histogram::new(ITL),
            tpot: Histogram::new(ITL),
            e2e: Histogram::new(REQ),
            queue_time: Histogram::new(REQ),
            prefill_time: Histogram::new(REQ),
            decode_time: Histogram::new(REQ),
            inference_time: Histogram::new(REQ),
            request_prompt_tokens: Histogram::new(TOKENS),
            request_generation_tokens: Histogram::new(TOKENS),
            request_max_tokens: Histogram::new(TOKENS),
            iteration_tokens: Histogram::new(TOKENS),
            lora_series: Vec::new(),
            block_size: cfg.block_size,
            num_blocks: cfg.num_blocks,
        }
    }

    /// Sets the LoRA gauge's series for these adapter lists (comma-joined)
    /// to `at`, the Unix time, as vLLM's `set_to_current_time` does.
    pub fn set_lora(&mut self, running: String, waiting: String, at: f64) {
        if let Some(s) = self
            .lora_series
            .iter_mut()
            .find(|(r, w, _)| *r == running && *w == waiting)
        {
            s.2 = at;
            return;
        }
        if self.lora_series.len() >= MAX_LORA_SERIES {
            self.lora_series.remove(0);
        }
        self.lora_series.push((running, waiting, at));
    }

    pub fn finished(&mut self, reason: &str) {
        if let Some(i) = REASONS.iter().position(|r| *r == reason) {
            self.success[i] += 1;
        }
    }

    /// The `/metrics` text for `cfg`'s flavor.
    pub fn render(&self, cfg: &SimConfig) -> String {
        match cfg.flavor {
            Flavor::Vllm => self.render_vllm(cfg),
            Flavor::Sglang => self.render_sglang(cfg),
        }
    }

    fn render_vllm(&self, cfg: &SimConfig) -> String {
        let l = format!(
            "engine=\"{}\",model_name=\"{}\"",
            cfg.dp_rank,
            esc(&cfg.model)
        );
        let mut o = String::with_capacity(16 * 1024);
        gauge(
            &mut o,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            &l,
            self.running as f64,
        );
        gauge(
            &mut o,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            &l,
            self.waiting as f64,
        );
        gauge(
            &mut o,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            &l,
            self.kv_usage,
        );
        counter(
            &mut o,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            &[(&l, self.prefix_queries)],
        );
        counter(
            &mut o,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            &[(&l, self.prefix_hits)],
        );
        counter(&mut o, "vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.", &[(&l, self.external_queries)]);
        counter(&mut o, "vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.", &[(&l, self.external_hits)]);
        counter(
            &mut o,
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            &[(&l, self.preemptions)],
        );
        counter(
            &mut o,
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            &[(&l, self.prompt_tokens)],
        );
        let src = |s: &str| format!("{l},source=\"{s}\"");
        counter(
            &mut o,
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            &[
                (&src("local_compute"), self.by_source_compute),
                (&src("local_cache_hit"), self.by_source_cache),
                (&src("external_kv_transfer"), self.by_source_external),
            ],
        );
        counter(
            &mut o,
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            &[(&l, self.by_source_cache + self.by_source_external)],
        );
        if cfg.role != Role::Both {
            // vLLM exports NixlConnector stats only with the connector set up.
            counter(
                &mut o,
                "vllm:nixl_num_failed_transfers",
                "Number of failed NIXL KV Cache transfers.",
                &[(&l, self.nixl_failed_transfers)],
            );
        }
        counter(
            &mut o,
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            &[(&l, self.generation_tokens)],
        );
        let reasons: Vec<String> = REASONS
            .iter()
            .map(|r| {
                format!(
                    "engine=\"{}\",finished_reason=\"{r}\",model_name=\"{}\"",
                    cfg.dp_rank,
                    esc(&cfg.model)
                )
            })
            .collect();
        let pairs: Vec<(&str, u64)> = reasons
            .iter()
            .map(String::as_str)
            .zip(self.success)
            .collect();
        counter(
            &mut o,
            "vllm:request_success",
            "Count of successfully processed requests.",
            &pairs,
        );
        hist(
            &mut o,
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            &l,
            &self.request_prompt_tokens,
        );
        hist(
            &mut o,
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            &l,
            &self.request_generation_tokens,
        );
        hist(
            &mut o,
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            &l,
            &self.iteration_tokens,
        );
        hist(
            &mut o,
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            &l,
            &self.request_max_tokens,
        );
        hist(
            &mut o,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &l,
            &self.ttft,
        );
        hist(
            &mut o,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &l,
            &self.itl,
        );
        hist(
            &mut o,
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            &l,
            &self.tpot,
        );
        hist(
            &mut o,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &l,
            &self.e2e,
        );
        hist(
            &mut o,
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            &l,
            &self.queue_time,
        );
        hist(
            &mut o,
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            &l,
            &self.inference_time,
        );
        hist(
            &mut o,
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            &l,
            &self.prefill_time,
        );
        hist(
            &mut o,
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            &l,
            &self.decode_time,
        );
        if cfg.max_loras > 0 {
            let _ = writeln!(o, "# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge");
            for (running, waiting, at) in &self.lora_series {
                let _ = writeln!(
                    o,
                    "vllm:lora_requests_info{{max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {}",
                    cfg.max_loras,
                    esc(running),
                    esc(waiting),
                    go_float(*at)
                );
            }
        }
        let _ = writeln!(o, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge");
        let _ = writeln!(
            o,
            "vllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",engine=\"{}\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"sim-chained64\"}} 1.0",
            self.block_size, cfg.dp_rank, self.num_blocks
        );
        o
    }

    fn render_sglang(&self, cfg: &SimConfig) -> String {
        let engine_type = match cfg.role {
            Role::Both => "unified",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        };
        let m = esc(&cfg.model);
        let sl = format!("engine_type=\"{engine_type}\",model_name=\"{m}\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"{}\"", cfg.dp_rank);
        let tl = format!("engine_type=\"{engine_type}\",is_streaming=\"false\",model_name=\"{m}\"");
        let mut o = String::with_capacity(8 * 1024);
        let total_tokens = (self.num_blocks * self.block_size) as f64;
        let used_tokens = (self.used_blocks * self.block_size) as f64;
        gauge(
            &mut o,
            "sglang:num_running_reqs",
            "The number of running requests.",
            &sl,
            self.running as f64,
        );
        gauge(
            &mut o,
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            &sl,
            self.waiting as f64,
        );
        gauge(
            &mut o,
            "sglang:token_usage",
            "The token usage.",
            &sl,
            self.kv_usage,
        );
        let hit_rate = if self.prefix_queries == 0 {
            0.0
        } else {
            self.prefix_hits as f64 / self.prefix_queries as f64
        };
        gauge(
            &mut o,
            "sglang:cache_hit_rate",
            "The prefix cache hit rate.",
            &sl,
            hit_rate,
        );
        gauge(
            &mut o,
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            &sl,
            total_tokens,
        );
        gauge(
            &mut o,
            "sglang:page_size",
            "The page size of the KV cache.",
            &sl,
            self.block_size as f64,
        );
        gauge(
            &mut o,
            "sglang:num_pages",
            "The number of pages in the KV cache.",
            &sl,
            self.num_blocks as f64,
        );
        gauge(
            &mut o,
            "sglang:kv_used_tokens",
            "The number of used tokens in the KV cache.",
            &sl,
            used_tokens,
        );
        gauge(
            &mut o,
            "sglang:kv_available_tokens",
            "The number of available tokens in the KV cache.",
            &sl,
            total_tokens - used_tokens,
        );
        gauge(
            &mut o,
            "sglang:num_prefill_bootstrap_queue_reqs",
            "The number of requests in the prefill bootstrap queue.",
            &sl,
            0.0,
        );
        gauge(
            &mut o,
            "sglang:num_decode_transfer_queue_reqs",
            "The number of requests in the decode transfer queue.",
            &sl,
            0.0,
        );
        counter(
            &mut o,
            "sglang:prompt_tokens",
            "Number of prefill tokens processed.",
            &[(&tl, self.prompt_tokens)],
        );
        counter(
            &mut o,
            "sglang:generation_tokens",
            "Number of generation tokens processed.",
            &[(&tl, self.generation_tokens)],
        );
        let cl =
            format!("cache_source=\"device\",engine_type=\"{engine_type}\",model_name=\"{m}\"");
        counter(
            &mut o,
            "sglang:cached_tokens",
            "Number of cached prompt tokens.",
            &[(&cl, self.prefix_hits)],
        );
        counter(
            &mut o,
            "sglang:num_requests",
            "Number of requests processed.",
            &[(&tl, self.success.iter().sum())],
        );
        hist(
            &mut o,
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &tl,
            &self.ttft,
        );
        hist(
            &mut o,
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &tl,
            &self.itl,
        );
        hist(
            &mut o,
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            &tl,
            &self.e2e,
        );
        // SGLang 0.5.23 exposes page_size/num_pages gauges only; the info
        // metric below is the one llm-d's extractor reads
        // (docs/wire-formats.md §3.3).
        let _ = writeln!(o, "# HELP sglang:cache_config_info KV cache configuration\n# TYPE sglang:cache_config_info gauge");
        let _ = writeln!(o, "sglang:cache_config_info{{engine_type=\"{engine_type}\",model_name=\"{m}\",num_pages=\"{}\",page_size=\"{}\"}} 1.0", self.num_blocks, self.block_size);
        o
    }
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A float as Python's prometheus_client writes it (`floatToGoString`): a
/// Unix time is `1.7964747352936258e+09`.
fn go_float(v: f64) -> String {
    let s = format!("{v}");
    match s.find('.') {
        Some(dot) if v > 0.0 && dot > 6 => {
            let digits = format!("{}.{}{}", &s[..1], &s[1..dot], &s[dot + 1..]);
            format!("{}e+0{}", digits.trim_end_matches(['0', '.']), dot - 1)
        }
        _ => num(v),
    }
}

fn num(v: f64) -> String {
    // Python's prometheus_client prints floats ("1.0", "0.25").
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

fn gauge(o: &mut String, name: &str, help: &str, labels: &str, v: f64) {
    let _ = writeln!(
        o,
        "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {}",
        num(v)
    );
}

fn counter(o: &mut String, name: &str, help: &str, series: &[(&str, u64)]) {
    let _ = writeln!(o, "# HELP {name}_total {help}\n# TYPE {name}_total counter");
    for (labels, v) in series {
        let _ = writeln!(o, "{name}_total{{{labels}}} {}", num(*v as f64));
    }
}

fn hist(o: &mut String, name: &str, help: &str, labels: &str, h: &Histogram) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (b, c) in h.bounds.iter().zip(&h.counts) {
        let _ = writeln!(
            o,
            "{name}_bucket{{{labels},le=\"{}\"}} {}",
            num(*b),
            num(*c as f64)
        );
    }
    let _ = writeln!(
        o,
        "{name}_bucket{{{labels},le=\"+Inf\"}} {}",
        num(h.count as f64)
    );
    let _ = writeln!(o, "{name}_count{{{labels}}} {}", num(h.count as f64));
    let _ = writeln!(o, "{name}_sum{{{labels}}} {}", h.sum);
}
