//! Every metric the Grafana dashboard and the PrometheusRule alerts under
//! `deploy/observability/` query is one that exists: `kvmesh_*` names in a
//! real scrape of a running sidecar's `/metrics`, `vllm:*` names in the vLLM
//! capture (`tests/fixtures/metrics/vllm-0.32.txt`). Names come out of each
//! PromQL expression through a small tokenizer (strings, label matchers, range
//! selectors and label lists skipped; functions and keywords known), so a
//! renamed metric or a typo fails here rather than as an empty panel.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;

use kvmesh_engine_sim::{Engine, SimConfig};
use kvmesh_proxy::config::{Config, EngineUrl};
use kvmesh_proxy::Sidecar;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const DASHBOARD: &str = include_str!("../../deploy/observability/kvmesh-dashboard.json");
const RULES: &str = include_str!("../../deploy/observability/prometheus-rules.yaml");
const VLLM: &str = include_str!("../fixtures/metrics/vllm-0.32.txt");

/// PromQL functions and aggregation operators: a name followed by `(`.
const FUNCTIONS: &[&str] = &[
    "abs",
    "absent",
    "absent_over_time",
    "acos",
    "acosh",
    "asin",
    "asinh",
    "atan",
    "atanh",
    "avg",
    "avg_over_time",
    "bottomk",
    "ceil",
    "changes",
    "clamp",
    "clamp_max",
    "clamp_min",
    "cos",
    "cosh",
    "count",
    "count_over_time",
    "count_values",
    "day_of_month",
    "day_of_week",
    "day_of_year",
    "days_in_month",
    "deg",
    "delta",
    "deriv",
    "exp",
    "floor",
    "group",
    "histogram_avg",
    "histogram_count",
    "histogram_fraction",
    "histogram_quantile",
    "histogram_stddev",
    "histogram_stdvar",
    "histogram_sum",
    "holt_winters",
    "hour",
    "idelta",
    "increase",
    "irate",
    "label_join",
    "label_replace",
    "last_over_time",
    "limitk",
    "limit_ratio",
    "ln",
    "log10",
    "log2",
    "mad_over_time",
    "max",
    "max_over_time",
    "min",
    "min_over_time",
    "minute",
    "month",
    "predict_linear",
    "present_over_time",
    "quantile",
    "quantile_over_time",
    "rad",
    "rate",
    "resets",
    "round",
    "scalar",
    "sgn",
    "sin",
    "sinh",
    "sort",
    "sort_by_label",
    "sort_by_label_desc",
    "sort_desc",
    "sqrt",
    "stddev",
    "stddev_over_time",
    "stdvar",
    "stdvar_over_time",
    "sum",
    "sum_over_time",
    "tan",
    "tanh",
    "time",
    "timestamp",
    "topk",
    "vector",
    "year",
];
/// Keywords followed by a parenthesised list of label names.
const LABEL_LISTS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];
/// Other keywords and literals.
const KEYWORDS: &[&str] = &[
    "and", "or", "unless", "bool", "offset", "atan2", "inf", "nan",
];

/// The metric names one PromQL expression selects.
fn metric_names(expr: &str) -> Result<Vec<String>, String> {
    let b: Vec<char> = expr.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    while i < b.len() {
        let c = b[i];
        if matches!(c, '"' | '\'' | '`') {
            i = skip_string(&b, i)?;
        } else if c == '{' {
            i = skip_group(&b, i, '{', '}')?;
        } else if c == '[' {
            i = skip_group(&b, i, '[', ']')?;
        } else if c == '#' {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '$' {
            // A Grafana variable ($__rate_interval, ${pod}).
            i += 1;
            while i < b.len() && (is_ident(b[i]) || matches!(b[i], '{' | '}')) {
                i += 1;
            }
        } else if c.is_ascii_digit() || (c == '.' && b.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            // Numbers, exponents (1e-9) and durations (5m).
            i += 1;
            while i < b.len()
                && (b[i].is_ascii_alphanumeric()
                    || b[i] == '.'
                    || (matches!(b[i], '+' | '-') && matches!(b[i - 1], 'e' | 'E')))
            {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < b.len() && is_ident(b[i]) {
                i += 1;
            }
            let word: String = b[start..i].iter().collect();
            let mut j = i;
            while j < b.len() && b[j].is_whitespace() {
                j += 1;
            }
            let next = b.get(j).copied();
            // `sum by (pod) (...)`: an aggregation whose grouping comes first.
            let rest: String = b[j..].iter().take(8).collect();
            let grouped = FUNCTIONS.contains(&word.as_str())
                && ["by", "without"].iter().any(|k| {
                    rest.strip_prefix(k)
                        .is_some_and(|r| r.starts_with(|c: char| c.is_whitespace() || c == '('))
                });
            if LABEL_LISTS.contains(&word.as_str()) {
                if next == Some('(') {
                    i = skip_group(&b, j, '(', ')')?;
                }
            } else if KEYWORDS.contains(&word.to_ascii_lowercase().as_str()) {
            } else if next == Some('(') || grouped {
                if !FUNCTIONS.contains(&word.as_str()) {
                    return Err(format!("unknown function {word:?} in {expr}"));
                }
            } else {
                out.push(word);
            }
        } else {
            i += 1;
        }
    }
    Ok(out)
}

/// The index after the string literal starting at `i`.
fn skip_string(b: &[char], i: usize) -> Result<usize, String> {
    let quote = b[i];
    let mut k = i + 1;
    while k < b.len() {
        if b[k] == '\\' && quote != '`' {
            k += 2;
            continue;
        }
        if b[k] == quote {
            return Ok(k + 1);
        }
        k += 1;
    }
    Err("unterminated string".to_owned())
}

/// The index after the group opened at `i`, strings inside respected.
fn skip_group(b: &[char], i: usize, open: char, close: char) -> Result<usize, String> {
    let mut depth = 0;
    let mut k = i;
    while k < b.len() {
        match b[k] {
            '"' | '\'' | '`' => {
                k = skip_string(b, k)?;
                continue;
            }
            c if c == open => depth += 1,
            c if c == close => {
                depth -= 1;
                if depth == 0 {
                    return Ok(k + 1);
                }
            }
            _ => {}
        }
        k += 1;
    }
    Err(format!("unclosed {open}"))
}

/// Names a scrape makes queryable: every sample's name, and from `# TYPE`
/// lines the names of families with no series yet (counters as `_total`,
/// histograms as `_bucket`, `_sum` and `_count`).
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            let base = name.strip_suffix("_total").unwrap_or(name);
            match kind {
                "counter" => {
                    names.insert(format!("{base}_total"));
                }
                "histogram" => {
                    for s in ["_bucket", "_sum", "_count"] {
                        names.insert(format!("{name}{s}"));
                    }
                }
                _ => {
                    names.insert(name.to_owned());
                }
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_owned());
        }
    }
    names
}

/// Every `expr` in the dashboard (panels, nested rows) and the metric inside
/// each templating `label_values(...)` query.
fn dashboard_exprs() -> Vec<String> {
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr", serde_json::Value::String(s)) => out.push(s.clone()),
                        ("definition", serde_json::Value::String(s)) => {
                            let inner = s
                                .strip_prefix("label_values(")
                                .and_then(|s| s.rsplit_once(','))
                                .map(|(m, _)| m.to_owned());
                            out.push(inner.unwrap_or_else(|| panic!("templating query {s}")));
                        }
                        _ => walk(v, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let v: serde_json::Value = serde_json::from_str(DASHBOARD).expect("dashboard is JSON");
    let mut out = Vec::new();
    walk(&v, &mut out);
    out
}

/// Every alert's name and `expr` in the PrometheusRule.
fn rule_exprs() -> Vec<(String, String)> {
    let v: serde_yaml_ng::Value = serde_yaml_ng::from_str(RULES).expect("rules are YAML");
    assert_eq!(v["kind"].as_str(), Some("PrometheusRule"));
    let mut out = Vec::new();
    for g in v["spec"]["groups"].as_sequence().expect("groups") {
        for r in g["rules"].as_sequence().expect("rules") {
            let name = r["alert"]
                .as_str()
                .or(r["record"].as_str())
                .expect("named rule");
            out.push((
                name.to_owned(),
                r["expr"].as_str().expect("expr").to_owned(),
            ));
        }
    }
    out
}

/// A running sidecar's `/metrics`, after one request (so per-route series exist).
async fn scrape_sidecar() -> String {
    let engine = Engine::start_local(SimConfig::new("tiny").with_time_scale(10.0))
        .await
        .unwrap();
    let mut c = Config::default();
    c.engine.url = EngineUrl::parse(&format!("http://{}", engine.addr())).unwrap();
    c.pod.models = vec!["tiny".to_owned()];
    let client = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let s = Sidecar::start(c, client, admin).await.unwrap();
    let body = r#"{"model":"tiny","prompt":"hello there","max_tokens":2,"stream":true}"#;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let reply = http10(s.addr(), &req).await;
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    let metrics = http10(s.admin_addr(), "GET /metrics HTTP/1.0\r\n\r\n").await;
    s.shutdown().await;
    engine.shutdown().await;
    metrics
}

/// Sends `req` and reads until the server closes (bounded by a deadline).
async fn http10(addr: std::net::SocketAddr, req: &str) -> String {
    let exchange = async {
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(req.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        c.read_to_end(&mut out).await.unwrap();
        String::from_utf8_lossy(&out).into_owned()
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), exchange)
        .await
        .expect("answer within 10 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_queried_metric_is_exported() {
    let scrape = scrape_sidecar().await;
    let kvmesh = exported(&scrape);
    let vllm = exported(VLLM);
    assert!(kvmesh.contains("kvmesh_requests_total"), "{kvmesh:?}");
    assert!(vllm.contains("vllm:time_to_first_token_seconds_bucket"));

    let mut exprs: Vec<(String, String)> = dashboard_exprs()
        .into_iter()
        .map(|e| ("dashboard".to_owned(), e))
        .collect();
    let rules = rule_exprs();
    exprs.extend(rules.iter().cloned());
    assert!(exprs.len() > 30, "{} expressions", exprs.len());

    let mut used = BTreeSet::new();
    let mut missing = Vec::new();
    for (origin, e) in &exprs {
        let names = metric_names(e).unwrap_or_else(|err| panic!("{origin}: {err}"));
        assert!(!names.is_empty(), "{origin}: no metric in {e}");
        for n in names {
            let known = if n.starts_with("kvmesh_") {
                kvmesh.contains(&n)
            } else if n.starts_with("vllm:") {
                vllm.contains(&n)
            } else {
                false
            };
            if !known {
                missing.push(format!("{origin}: {n} in {e}"));
            }
            used.insert(n);
        }
    }
    assert!(missing.is_empty(), "not exported:\n{}", missing.join("\n"));

    // What the dashboard must show.
    for n in [
        "kvmesh_routing_decisions_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "kvmesh_pd_requests_total",
        "kvmesh_mesh_peers",
        "kvmesh_autoscale_desired_replicas",
        "kvmesh_autoscale_pods",
    ] {
        assert!(used.contains(n), "{n} is not queried");
    }
    let alerts: BTreeSet<&str> = rules.iter().map(|(n, _)| n.as_str()).collect();
    for a in [
        "KvmeshMeshPeersStale",
        "KvmeshHighFallbackRate",
        "KvmeshPdFailures",
        "KvmeshEngineNotReady",
    ] {
        assert!(alerts.contains(a), "{a} missing: {alerts:?}");
    }
}

#[test]
fn the_tokenizer_finds_metrics_and_skips_the_rest() {
    let names = |e: &str| metric_names(e).unwrap();
    assert_eq!(
        names(
            r#"sum by (pod) (rate(a_total{x=~"b|}c", y!="by(z)"}[5m])) / on (pod) group_left(role) b_info"#
        ),
        ["a_total", "b_info"]
    );
    assert_eq!(
        names("histogram_quantile(0.99, sum by (le) (rate(vllm:ttft_seconds_bucket{pod=~\"$pod\"}[$__rate_interval])))"),
        ["vllm:ttft_seconds_bucket"]
    );
    assert_eq!(
        names("x > bool 1e-9 and y offset 5m unless z[1h:5m]"),
        ["x", "y", "z"]
    );
    assert_eq!(names("sum(a) without (instance) > 0.5"), ["a"]);
    assert_eq!(
        names("clamp_min(sum(rate(a[5m])), 1e-9) # comment with words"),
        ["a"]
    );
    assert!(metric_names("rte(a[5m])").unwrap_err().contains("rte"));
    assert!(metric_names("a{x=\"open").is_err());

    let text = "# TYPE kvmesh_x counter\n# TYPE kvmesh_h_seconds histogram\n# TYPE kvmesh_g gauge\nkvmesh_g 1\n";
    let e = exported(text);
    assert!(
        e.contains("kvmesh_x_total")
            && e.contains("kvmesh_h_seconds_bucket")
            && e.contains("kvmesh_g")
    );
    assert!(!e.contains("kvmesh_h_seconds"));
}
