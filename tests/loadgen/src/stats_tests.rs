use std::time::Duration;

use super::*;
use crate::record::RequestRecord;

fn rec(
    ttft_ms: u64,
    itl_ms: &[u64],
    e2e_ms: u64,
    prompt: u64,
    cached: Option<u64>,
) -> RequestRecord {
    RequestRecord {
        status: Some(200),
        ttft: Some(Duration::from_millis(ttft_ms)),
        itl: itl_ms.iter().map(|m| Duration::from_millis(*m)).collect(),
        e2e: Duration::from_millis(e2e_ms),
        prompt_tokens: Some(prompt),
        completion_tokens: Some(itl_ms.len() as u64 + 1),
        cached_tokens: cached,
        ..RequestRecord::default()
    }
}

#[test]
fn nearest_rank_percentiles_of_one_to_hundred() {
    let v: Vec<f64> = (1..=100).map(f64::from).collect();
    assert_eq!(percentile(&v, 50.0), Some(50.0));
    assert_eq!(percentile(&v, 90.0), Some(90.0));
    assert_eq!(percentile(&v, 99.0), Some(99.0));
    assert_eq!(percentile(&v, 100.0), Some(100.0));
    assert_eq!(percentile(&v, 0.0), Some(1.0));
    assert_eq!(percentile(&[], 50.0), None);
}

#[test]
fn nearest_rank_on_small_sets_returns_observed_values() {
    // n = 4: p50 -> rank 2, p90 -> rank ceil(3.6) = 4, p99 -> rank 4.
    let d = Dist::of(&[40.0, 10.0, 30.0, 20.0]).unwrap();
    assert_eq!((d.p50, d.p90, d.p99), (20.0, 40.0, 40.0));
    assert_eq!((d.min, d.max, d.mean, d.count), (10.0, 40.0, 25.0, 4));
    // A single sample is every percentile.
    let one = Dist::of(&[7.0]).unwrap();
    assert_eq!((one.p50, one.p99), (7.0, 7.0));
    assert!(Dist::of(&[]).is_none());
    assert!(Dist::of(&[f64::NAN]).is_none());
}

#[test]
fn summary_rates_hit_rate_and_errors() {
    let mut failed = rec(1, &[], 1000, 999, Some(999));
    failed.status = Some(503);
    failed.error = Some("status 503".into());
    let records = vec![
        rec(100, &[10, 20], 300, 1000, Some(500)),
        rec(200, &[30], 400, 1000, Some(0)),
        rec(300, &[40, 50, 60], 500, 2000, None),
        failed,
    ];
    let s = Summary::from_records(&records, Duration::from_secs(2));
    assert_eq!((s.requests, s.ok, s.errors), (4, 3, 1));
    assert!((s.req_per_s - 1.5).abs() < 1e-9);
    // Output tokens 3 + 2 + 4 = 9 over 2 s.
    assert_eq!(s.completion_tokens, 9);
    assert!((s.throughput_tok_s - 4.5).abs() < 1e-9);
    assert_eq!(s.ttft_p50_ms, Some(200.0));
    assert_eq!(s.ttft_p99_ms, Some(300.0));
    assert_eq!(s.ttft_mean_ms, Some(200.0));
    assert_eq!(s.itl_p50_ms, Some(30.0));
    assert_eq!(s.itl_p90_ms, Some(60.0));
    assert_eq!(s.e2e_p50_ms, Some(400.0));
    // Hit rate over requests that reported cached tokens only: 500 / 2000;
    // the failed request's usage is ignored.
    assert_eq!(s.hit_rate, Some(0.25));
    assert_eq!(s.prompt_tokens, 4000);
}

#[test]
fn summary_of_nothing_has_no_latencies_and_zero_rates() {
    let s = Summary::from_records(&[], Duration::ZERO);
    assert_eq!((s.requests, s.req_per_s, s.throughput_tok_s), (0, 0.0, 0.0));
    assert_eq!((s.ttft_p50_ms, s.hit_rate), (None, None));
}
