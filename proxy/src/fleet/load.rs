//! An engine's load, read from its Prometheus `/metrics` text.
//!
//! Only the few series the scheduler uses are read (docs/wire-formats.md §3.3,
//! the same set llm-d's EPP scrapes): queue, running, KV usage, and the cache
//! geometry (block size, number of blocks); and, for the autoscaling hook's
//! SLO model, the engine's cumulative work counters ([`EngineWork`]). Values are summed over label sets
//! (several DP ranks or TP ranks report separately); unknown lines are skipped
//! and a malformed value is ignored, so a newer engine never breaks the scrape.

use serde::Serialize;

use crate::config::EngineKind;

/// What one engine reported about its load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct EngineLoad {
    pub waiting: u32,
    pub running: u32,
    /// KV cache usage, 0..1.
    pub kv_usage: f64,
    /// Tokens per KV block (0: not reported).
    pub block_size: u32,
    /// KV blocks in the engine's cache (0: not reported).
    pub num_blocks: u32,
    /// What the engine has done since it started (`None`: it exports none
    /// of the counters).
    pub work: Option<EngineWork>,
}

/// An engine's cumulative work counters: the autoscaling hook turns their rates into the pool's arrival rate and
/// tokens per request (docs/autoscaling.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct EngineWork {
    /// Requests finished (`vllm:request_success_total`, SGLang's
    /// `sglang:num_requests_total`).
    pub finished: u64,
    /// Prompt tokens prefilled or found cached (`*:prompt_tokens_total`).
    pub prompt_tokens: u64,
    /// Of those, found cached, locally or through a KV connector
    /// (`vllm:prompt_tokens_cached_total`, `sglang:cached_tokens_total`).
    pub cached_tokens: u64,
    /// Tokens generated (`*:generation_tokens_total`).
    pub generation_tokens: u64,
    /// The spread of prompt lengths, from the engine's histogram (`None`:
    /// it exports none).
    pub prompt_spread: Option<PromptSpread>,
}

/// The engine's prompt-length histogram (`vllm:request_prompt_tokens`) read
/// as two counters that only grow: over its buckets, the count times the
/// mean and the mean square of a prompt in that bucket, taking lengths
/// log-uniform within a bucket (the `+Inf` bucket as if it ended at twice
/// its lower bound). The hook turns their deltas into the second moment of
/// the prompts finished in a window, scaled so their mean is the exact
/// counters' (`autoscale::rates`): within ~15% on lognormal prompts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PromptSpread {
    /// Σ of the bucket means (tokens).
    pub tokens: u64,
    /// Σ of the bucket mean squares (tokens²).
    pub tokens_sq: u64,
}

/// The prompt-length histogram's name (its `_bucket` series).
const PROMPT_HISTOGRAM: &str = "vllm:request_prompt_tokens_bucket";

/// Reads an engine's load from its metrics text; `None` when the text holds
/// none of the load series (not an engine of that kind, or not metrics at all).
pub fn parse_engine_metrics(kind: EngineKind, text: &str) -> Option<EngineLoad> {
    let names = Names::of(kind);
    let mut load = EngineLoad::default();
    let (mut waiting, mut running, mut usage_sum, mut usage_n) = (0.0, 0.0, 0.0, 0u32);
    // finished, prompt, cached, generated
    let mut work = [0.0f64; 4];
    let mut work_seen = false;
    // (le, cumulative count) of the prompt histogram, every label set.
    let mut prompt_buckets: Vec<(f64, f64)> = Vec::new();
    let mut seen = false;
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let Some((series, value)) = split_sample(line) else {
            continue;
        };
        let (name, labels) = match series.find('{') {
            Some(i) => (&series[..i], &series[i..]),
            None => (series, ""),
        };
        if name == names.waiting {
            waiting += value;
            seen = true;
        } else if name == names.running {
            running += value;
            seen = true;
        } else if name == names.kv_usage || (kind == EngineKind::Vllm && name == LEGACY_VLLM_USAGE)
        {
            usage_sum += value;
            usage_n += 1;
            seen = true;
        } else if kind == EngineKind::Vllm && name == "vllm:cache_config_info" {
            load.block_size = label_u32(labels, "block_size").unwrap_or(load.block_size);
            load.num_blocks = label_u32(labels, "num_gpu_blocks").unwrap_or(load.num_blocks);
        } else if kind == EngineKind::Sglang && name == "sglang:cache_config_info" {
            load.block_size = label_u32(labels, "page_size").unwrap_or(load.block_size);
            load.num_blocks = label_u32(labels, "num_pages").unwrap_or(load.num_blocks);
        } else if kind == EngineKind::Sglang && name == "sglang:page_size" {
            load.block_size = to_u32(value);
        } else if kind == EngineKind::Sglang && name == "sglang:num_pages" {
            load.num_blocks = to_u32(value);
        } else if let Some(i) = names.work_index(name) {
            work[i] += value;
            work_seen = true;
        } else if kind == EngineKind::Vllm && name == PROMPT_HISTOGRAM {
            if let Some(le) = label(labels, "le").and_then(parse_le) {
                prompt_buckets.push((le, value));
            }
        }
    }
    if !seen {
        return None;
    }
    load.waiting = to_u32(waiting);
    load.running = to_u32(running);
    if usage_n > 0 {
        load.kv_usage = (usage_sum / f64::from(usage_n)).clamp(0.0, 1.0);
    }
    let [finished, prompt_tokens, cached_tokens, generation_tokens] = work.map(to_u64);
    load.work = work_seen.then_some(EngineWork {
        finished,
        prompt_tokens,
        cached_tokens,
        generation_tokens,
        prompt_spread: prompt_spread(prompt_buckets),
    });
    Some(load)
}

fn parse_le(v: &str) -> Option<f64> {
    match v {
        "+Inf" | "Inf" | "inf" => Some(f64::INFINITY),
        _ => v.parse::<f64>().ok().filter(|x| x.is_finite() && *x > 0.0),
    }
}

/// [`PromptSpread`] from a histogram's `(le, cumulative count)` samples,
/// summed over label sets (data-parallel ranks report apart).
fn prompt_spread(mut buckets: Vec<(f64, f64)>) -> Option<PromptSpread> {
    if buckets.is_empty() {
        return None;
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut tokens, mut tokens_sq) = (0.0f64, 0.0f64);
    let (mut lower, mut below) = (0.0f64, 0.0f64);
    let mut i = 0;
    while i < buckets.len() {
        let le = buckets[i].0;
        let mut cumulative = 0.0;
        while i < buckets.len() && buckets[i].0 == le {
            cumulative += buckets[i].1;
            i += 1;
        }
        let n = (cumulative - below).max(0.0);
        below = cumulative.max(below);
        // The first bucket starts at half its bound, `+Inf` ends at twice
        // the last one.
        let lo = if lower > 0.0 { lower } else { le / 2.0 };
        let hi = if le.is_finite() {
            le
        } else {
            2.0 * lower.max(1.0)
        };
        let lo = lo.min(hi);
        let (mean, mean_sq) = log_uniform(lo, hi);
        tokens += n * mean;
        tokens_sq += n * mean_sq;
        if le.is_finite() {
            lower = le;
        }
    }
    Some(PromptSpread {
        tokens: to_u64(tokens),
        tokens_sq: to_u64(tokens_sq),
    })
}

/// The mean and mean square of a length log-uniform on `[lo, hi]`.
fn log_uniform(lo: f64, hi: f64) -> (f64, f64) {
    let l = (hi / lo).ln();
    if !(l.is_finite() && l > 1e-9) {
        return (hi, hi * hi);
    }
    ((hi - lo) / l, (hi * hi - lo * lo) / (2.0 * l))
}

/// What vLLM's `vllm:lora_requests_info` says of the adapters its scheduler
/// holds now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoraInfo {
    /// Adapters of requests in the running batch.
    pub running: Vec<String>,
    /// Adapters of requests waiting for it.
    pub waiting: Vec<String>,
    /// The engine's `--max-loras` (0: not reported).
    pub max_lora: u32,
}

/// Reads `vllm:lora_requests_info` (vLLM's `vllm/v1/metrics/loggers.py`):
/// a gauge whose labels are the state, `running_lora_adapters` and
/// `waiting_lora_adapters` (names joined by commas) and `max_lora`, and
/// whose value is the Unix time the engine last set it. Every combination
/// the engine ever set stays in the text, so the newest (the largest value)
/// is the current one. `None` when the text does not declare the gauge
/// (LoRA off: vLLM declares it with `--enable-lora` only, before any sample;
/// or not vLLM); empty lists when it is declared without a sample.
pub fn parse_lora_info(text: &str) -> Option<LoraInfo> {
    const NAME: &str = "vllm:lora_requests_info";
    let mut declared = false;
    let mut newest: Option<(f64, &str)> = None;
    for line in text.lines() {
        if let Some(comment) = line.strip_prefix("# TYPE ") {
            declared |= comment.split_whitespace().next() == Some(NAME);
            continue;
        }
        if !line.starts_with(NAME) {
            continue;
        }
        declared = true;
        let Some((series, set_at)) = split_sample(line) else {
            continue;
        };
        let Some(labels) = series.strip_prefix(NAME).filter(|l| l.starts_with('{')) else {
            continue;
        };
        if newest.is_none_or(|(t, _)| set_at >= t) {
            newest = Some((set_at, labels));
        }
    }
    if !declared {
        return None;
    }
    let Some((_, labels)) = newest else {
        return Some(LoraInfo::default());
    };
    let names = |key| -> Vec<String> {
        label(labels, key)
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
            .collect()
    };
    Some(LoraInfo {
        running: names("running_lora_adapters"),
        waiting: names("waiting_lora_adapters"),
        max_lora: label_u32(labels, "max_lora").unwrap_or(0),
    })
}

/// Each data-parallel rank's load, from the series labelled `engine="<rank>"`
/// (vLLM labels its per-engine series so), in rank order; empty when no
/// series carries the label.
pub fn parse_rank_loads(kind: EngineKind, text: &str) -> Vec<(u32, EngineLoad)> {
    let mut ranks: Vec<u32> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| label_u32(&l[l.find('{')?..], "engine"))
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
        .into_iter()
        .filter_map(|rank| {
            let label = format!("engine=\"{rank}\"");
            let own: String = text
                .lines()
                .filter(|l| l.contains(&label))
                .flat_map(|l| [l, "\n"])
                .collect();
            Some((rank, parse_engine_metrics(kind, &own)?))
        })
        .collect()
}

/// Before vLLM renamed it (docs/wire-formats.md §3.1); still served by old
/// engines.
const LEGACY_VLLM_USAGE: &str = "vllm:gpu_cache_usage_perc";

struct Names {
    waiting: &'static str,
    running: &'static str,
    kv_usage: &'static str,
    /// The [`EngineWork`] counters, in its field order, without `_total`.
    work: [&'static str; 4],
}

impl Names {
    fn of(kind: EngineKind) -> Self {
        match kind {
            EngineKind::Vllm => Self {
                waiting: "vllm:num_requests_waiting",
                running: "vllm:num_requests_running",
                kv_usage: "vllm:kv_cache_usage_perc",
                work: [
                    "vllm:request_success",
                    "vllm:prompt_tokens",
                    "vllm:prompt_tokens_cached",
                    "vllm:generation_tokens",
                ],
            },
            EngineKind::Sglang => Self {
                waiting: "sglang:num_queue_reqs",
                running: "sglang:num_running_reqs",
                kv_usage: "sglang:token_usage",
                work: [
                    "sglang:num_requests",
                    "sglang:prompt_tokens",
                    "sglang:cached_tokens",
                    "sglang:generation_tokens",
                ],
            },
        }
    }

    /// Which work counter `name` is (with or without the `_total` suffix).
    fn work_index(&self, name: &str) -> Option<usize> {
        let base = name.strip_suffix("_total").unwrap_or(name);
        self.work.iter().position(|w| *w == base)
    }
}

/// `name{labels} value [timestamp]` into the series and its value.
fn split_sample(line: &str) -> Option<(&str, f64)> {
    // Label values may hold spaces, so split after the closing brace if any.
    let end_of_series = match line.rfind('}') {
        Some(i) => i + 1,
        None => line.find(' ')?,
    };
    let (series, rest) = line.split_at(end_of_series);
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    value.is_finite().then_some((series, value))
}

/// The value of `key="..."` inside a `{...}` label block, as a u32.
fn label_u32(labels: &str, key: &str) -> Option<u32> {
    label(labels, key)?.parse().ok()
}

/// The value of `key="..."` inside a `{...}` label block.
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels.trim_start_matches('{');
    while let Some(eq) = rest.find("=\"") {
        let name = rest[..eq].trim_start_matches(',').trim();
        let after = &rest[eq + 2..];
        let close = after.find('"')?;
        if name == key {
            return Some(&after[..close]);
        }
        rest = &after[close + 1..];
    }
    None
}

fn to_u64(v: f64) -> u64 {
    if v <= 0.0 {
        0
    } else if v >= u64::MAX as f64 {
        u64::MAX
    } else {
        // Rounded and in range.
        v.round() as u64
    }
}

fn to_u32(v: f64) -> u32 {
    if v <= 0.0 {
        0
    } else if v >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        // Rounded and in range: the cast is exact.
        v.round() as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = include_str!("../../assets/tests/fixtures/metrics/vllm-0.32.txt");
    const SGLANG: &str = include_str!("../../assets/tests/fixtures/metrics/sglang-0.5.23.txt");
    /// vLLM 0.32 (CPU) with `--enable-lora --max-loras 2`, after requests
    /// for an adapter loaded at run time finished (tests/fixtures/vllm-cpu/lora/).
    const VLLM_LORA: &str =
        include_str!("../../assets/tests/fixtures/vllm-cpu/lora/metrics-after-requests.txt");

    /// The work counters: finished, prompt, cached, generated.
    fn work(load: &EngineLoad) -> (u64, u64, u64, u64) {
        let w = load.work.expect("work counters");
        (
            w.finished,
            w.prompt_tokens,
            w.cached_tokens,
            w.generation_tokens,
        )
    }

    #[test]
    fn reads_a_real_vllm_scrape() {
        let load = parse_engine_metrics(EngineKind::Vllm, VLLM).unwrap();
        assert_eq!(load.block_size, 128);
        assert_eq!(load.num_blocks, 4096);
        assert_eq!((load.waiting, load.running), (0, 0));
        // Summed over finish reasons; `_created` series are not counters.
        assert_eq!(work(&load), (4, 56, 0, 21));
        // Its 4 prompts: 2 of 6-10 tokens, 2 of 11-20 (the sum is 56).
        let spread = load.work.unwrap().prompt_spread.unwrap();
        let (a, a2) = log_uniform(5.0, 10.0);
        let (b, b2) = log_uniform(10.0, 20.0);
        assert_eq!(spread.tokens, (2.0 * a + 2.0 * b).round() as u64);
        assert_eq!(spread.tokens_sq, (2.0 * a2 + 2.0 * b2).round() as u64);
    }

    #[test]
    fn the_prompt_spread_sums_ranks_and_grows_with_the_counts() {
        let hist = |n1: u32, n2: u32| {
            format!(
                "vllm:num_requests_waiting 0\n\
                 vllm:request_success_total {}\n\
                 vllm:request_prompt_tokens_bucket{{engine=\"0\",le=\"1000.0\"}} {n1}\n\
                 vllm:request_prompt_tokens_bucket{{engine=\"0\",le=\"2000.0\"}} {n1}\n\
                 vllm:request_prompt_tokens_bucket{{engine=\"0\",le=\"+Inf\"}} {}\n\
                 vllm:request_prompt_tokens_bucket{{engine=\"1\",le=\"1000.0\"}} 0\n\
                 vllm:request_prompt_tokens_bucket{{engine=\"1\",le=\"2000.0\"}} 0\n\
                 vllm:request_prompt_tokens_bucket{{engine=\"1\",le=\"+Inf\"}} 0\n",
                n1 + n2,
                n1 + n2
            )
        };
        let spread = |n1, n2| {
            parse_engine_metrics(EngineKind::Vllm, &hist(n1, n2))
                .and_then(|l| l.work)
                .and_then(|w| w.prompt_spread)
                .unwrap()
        };
        // One prompt in 500..1000 and one above 2000 (taken as 2000..4000).
        let s = spread(1, 1);
        let (a, a2) = log_uniform(500.0, 1000.0);
        let (b, b2) = log_uniform(2000.0, 4000.0);
        assert_eq!(s.tokens, (a + b).round() as u64);
        assert_eq!(s.tokens_sq, (a2 + b2).round() as u64);
        let more = spread(3, 2);
        assert!(more.tokens > s.tokens && more.tokens_sq > s.tokens_sq);
        // Without the histogram there is no spread, and SGLang has none.
        assert_eq!(
            parse_engine_metrics(EngineKind::Sglang, SGLANG)
                .and_then(|l| l.work)
                .map(|w| w.prompt_spread),
            Some(None)
        );
    }

    #[test]
    fn reads_each_data_parallel_rank() {
        let text = "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2\n\
                    vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 5\n\
                    vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 1\n\
                    vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 3\n\
                    vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5\n";
        let r = parse_rank_loads(EngineKind::Vllm, text);
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].0, r[0].1.waiting, r[0].1.running), (0, 2, 1));
        assert_eq!((r[1].0, r[1].1.waiting, r[1].1.running), (1, 5, 3));
        assert_eq!(r[1].1.kv_usage, 0.5);
        let all = parse_engine_metrics(EngineKind::Vllm, text).unwrap();
        assert_eq!((all.waiting, all.running), (7, 4));
        // A real single-engine scrape: one rank, engine="0".
        assert_eq!(parse_rank_loads(EngineKind::Vllm, VLLM).len(), 1);
    }

    #[test]
    fn reads_a_real_sglang_scrape() {
        let load = parse_engine_metrics(EngineKind::Sglang, SGLANG).unwrap();
        // Summed over streaming and non-streaming series.
        assert_eq!(work(&load), (4, 30, 9, 19));
        assert_eq!(load.block_size, 1);
        assert_eq!(load.num_blocks, 4096);
    }

    #[test]
    fn sums_ranks_and_averages_usage() {
        let text = "vllm:num_requests_waiting{engine=\"0\"} 3\n\
                    vllm:num_requests_waiting{engine=\"1\"} 4.0\n\
                    vllm:num_requests_running{engine=\"0\"} 2\n\
                    vllm:kv_cache_usage_perc{engine=\"0\"} 0.2\n\
                    vllm:kv_cache_usage_perc{engine=\"1\"} 0.4\n";
        let load = parse_engine_metrics(EngineKind::Vllm, text).unwrap();
        assert_eq!((load.waiting, load.running), (7, 2));
        assert!((load.kv_usage - 0.3).abs() < 1e-9);
    }

    #[test]
    fn garbage_and_foreign_text_yield_nothing_and_never_panic() {
        assert_eq!(
            parse_engine_metrics(EngineKind::Vllm, "<html>nope</html>"),
            None
        );
        assert_eq!(parse_engine_metrics(EngineKind::Sglang, VLLM), None);
        let odd = "vllm:num_requests_waiting{a=\"}\"} NaN\nvllm:num_requests_running 1e99\n{\n=\"";
        let load = parse_engine_metrics(EngineKind::Vllm, odd).unwrap();
        assert_eq!(load.running, u32::MAX);
    }

    #[test]
    fn lora_info_is_the_newest_series() {
        // The capture holds the busy series and, set later, the idle one.
        let idle = parse_lora_info(VLLM_LORA).unwrap();
        assert_eq!(
            idle,
            LoraInfo {
                max_lora: 2,
                ..LoraInfo::default()
            }
        );
        let busy = VLLM_LORA.replace("1.7964747352936258e+09", "1.9e+09");
        let busy = parse_lora_info(&busy).unwrap();
        assert_eq!(busy.running, ["sql-lora"]);
        assert_eq!(busy.waiting, ["sql-lora"]);
        // Without LoRA the engine does not declare the gauge; with it, before
        // any request, it declares it without a sample.
        assert_eq!(parse_lora_info(VLLM), None);
        let declared = "# HELP vllm:lora_requests_info Running stats on lora requests.\n\
                        # TYPE vllm:lora_requests_info gauge\n";
        assert_eq!(parse_lora_info(declared), Some(LoraInfo::default()));
        let two = "vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"a,b\",waiting_lora_adapters=\"c\"} 7\n";
        let two = parse_lora_info(two).unwrap();
        assert_eq!(
            (two.running.len(), two.waiting, two.max_lora),
            (2, vec!["c".to_owned()], 4)
        );
    }

    #[test]
    fn label_values_with_spaces_and_commas_parse() {
        let line = "vllm:cache_config_info{a=\"x, y\",block_size=\"32\",num_gpu_blocks=\"40\"} 1.0";
        let text = format!("{line}\nvllm:num_requests_waiting 0\n");
        let load = parse_engine_metrics(EngineKind::Vllm, &text).unwrap();
        assert_eq!((load.block_size, load.num_blocks), (32, 40));
    }
}
