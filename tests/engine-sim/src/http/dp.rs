//! Data parallelism as vLLM serves it: one API server, N engine ranks behind
//! its one HTTP port (`--data-parallel-size N`).
//!
//! * A request carrying `X-data-parallel-rank: r` runs on rank `r` (vLLM
//!   0.32 honours the header: `_get_data_parallel_rank` in
//!   `vllm/entrypoints/...serving.py`); a rank outside `0..N` is a 400.
//!   Without it, the least loaded rank takes it, by vLLM's DP load-balancing
//!   score `waiting * 4 + running` (lowest rank on a tie).
//! * `GET /metrics` is every rank's series, grouped per metric family, each
//!   labelled `engine="r"` as vLLM labels its per-engine series.
//! * Rank `r` publishes its KV events with `dp_rank` = `r`, on the
//!   configured endpoint's port + `r` (vLLM offsets the port by the rank;
//!   port 0 stays 0, a port of the OS's own per rank).
//!
//! Everything else (`/sim/stats`, `/sim/faults`, the P/D side channels) is
//! the chosen rank's: rank 0 unless the header names another.

use std::sync::Arc;

use http::{HeaderMap, StatusCode};

use super::Shared;

/// The header that names the rank.
pub const RANK_HEADER: &str = "x-data-parallel-rank";

/// The engine's ranks, rank order.
pub(crate) struct Ranks(Vec<Arc<Shared>>);

impl Ranks {
    pub(crate) fn new(ranks: Vec<Arc<Shared>>) -> Self {
        Self(ranks)
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    pub(crate) fn first(&self) -> &Arc<Shared> {
        &self.0[0]
    }

    /// The rank a request runs on (see the module docs); `Err` with the
    /// message of a 400 when the header names no rank of this engine.
    pub(crate) fn pick(
        &self,
        headers: &HeaderMap,
        inference: bool,
    ) -> Result<&Arc<Shared>, String> {
        if let Some(v) = headers.get(RANK_HEADER) {
            let rank = v.to_str().ok().and_then(|s| s.trim().parse::<usize>().ok());
            return match rank.and_then(|r| self.0.get(r)) {
                Some(s) => Ok(s),
                None => Err(format!(
                    "{RANK_HEADER}: {:?} is not a rank of this engine (0..{})",
                    String::from_utf8_lossy(v.as_bytes()),
                    self.0.len()
                )),
            };
        }
        if !inference {
            return Ok(self.first());
        }
        let score = |s: &Arc<Shared>| {
            let m = s.metrics.lock();
            m.waiting * 4 + m.running
        };
        Ok(self
            .0
            .iter()
            .min_by_key(|s| score(s))
            .unwrap_or_else(|| self.first()))
    }

    /// `GET /metrics` of every rank, one family after another.
    pub(crate) fn metrics(&self) -> String {
        let texts: Vec<String> = self
            .0
            .iter()
            .map(|s| s.metrics.lock().render(&s.cfg))
            .collect();
        merge_families(&texts)
    }
}

/// 400 for a bad rank header, in vLLM's error shape.
pub(crate) fn bad_rank(msg: &str) -> super::Reply {
    let none = crate::faults::Verdict::default();
    super::json_response(
        StatusCode::BAD_REQUEST.as_u16(),
        &super::shapes::error(400, msg, None),
        &none,
    )
}

/// `endpoint` with its port raised by `rank` (`tcp://*:5557` → `:5558` for
/// rank 1); endpoints without a numeric port, and port 0, are unchanged.
pub fn offset_port(endpoint: &str, rank: usize) -> String {
    let Some((head, port)) = endpoint.rsplit_once(':') else {
        return endpoint.to_owned();
    };
    match port.parse::<usize>() {
        Ok(0) | Err(_) => endpoint.to_owned(),
        Ok(p) => format!("{head}:{}", p + rank),
    }
}

/// Prometheus texts merged by metric family: each family's `# HELP`/`# TYPE`
/// once (from the first text that has it), then its samples from every text
/// in order.
fn merge_families(texts: &[String]) -> String {
    let mut order: Vec<String> = Vec::new();
    let mut families: std::collections::HashMap<String, (Vec<&str>, Vec<&str>)> =
        std::collections::HashMap::new();
    for (i, text) in texts.iter().enumerate() {
        let mut current = String::new();
        for line in text.lines() {
            let name = family_of(line);
            if name != current {
                current = name.to_owned();
                if !families.contains_key(&current) {
                    order.push(current.clone());
                }
            }
            let entry = families.entry(current.clone()).or_default();
            if line.starts_with('#') {
                if i == 0 || entry.1.is_empty() {
                    entry.0.push(line);
                }
            } else if !line.is_empty() {
                entry.1.push(line);
            }
        }
    }
    let mut out = String::new();
    for name in &order {
        if let Some((meta, samples)) = families.get(name) {
            for l in meta.iter().chain(samples) {
                out.push_str(l);
                out.push('\n');
            }
        }
    }
    out
}

/// The metric family a line belongs to: the name in `# HELP|TYPE name`, or
/// a sample's name without the `_total`/`_bucket`/`_sum`/`_count`/`_created`
/// suffix.
fn family_of(line: &str) -> &str {
    if let Some(rest) = line
        .strip_prefix("# HELP ")
        .or_else(|| line.strip_prefix("# TYPE "))
    {
        return rest.split_whitespace().next().unwrap_or("");
    }
    let name = line
        .split(|c: char| c == '{' || c.is_whitespace())
        .next()
        .unwrap_or("");
    for suffix in ["_total", "_bucket", "_sum", "_count", "_created"] {
        if let Some(base) = name.strip_suffix(suffix) {
            return base;
        }
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_offset_by_rank() {
        assert_eq!(offset_port("tcp://*:5557", 0), "tcp://*:5557");
        assert_eq!(offset_port("tcp://*:5557", 2), "tcp://*:5559");
        assert_eq!(offset_port("tcp://127.0.0.1:0", 3), "tcp://127.0.0.1:0");
        assert_eq!(offset_port("ipc:///tmp/kv", 1), "ipc:///tmp/kv");
    }

    #[test]
    fn families_are_merged_with_one_header() {
        let r0 = "# HELP vllm:num_requests_waiting w\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\"} 1\n# HELP vllm:prompt_tokens p\n# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{engine=\"0\"} 5\n";
        let r1 = r0.replace("engine=\"0\"", "engine=\"1\"");
        let m = merge_families(&[r0.to_owned(), r1]);
        assert_eq!(m.matches("# TYPE vllm:num_requests_waiting").count(), 1);
        let lines: Vec<&str> = m.lines().collect();
        assert_eq!(lines[2], "vllm:num_requests_waiting{engine=\"0\"} 1");
        assert_eq!(lines[3], "vllm:num_requests_waiting{engine=\"1\"} 1");
        assert_eq!(lines[6], "vllm:prompt_tokens_total{engine=\"0\"} 5");
        assert_eq!(lines[7], "vllm:prompt_tokens_total{engine=\"1\"} 5");
    }
}
