#![allow(clippy::unwrap_used)]

use super::*;

fn summary(ttft: f64, itl: f64, tok_s: f64, hit: Option<f64>) -> Summary {
    let mut s = Summary::from_records(&[], std::time::Duration::from_secs(1));
    s.requests = 10;
    s.ok = 10;
    s.ttft_p50_ms = Some(ttft);
    s.ttft_p90_ms = Some(ttft * 1.5);
    s.ttft_p99_ms = Some(ttft * 2.0);
    s.itl_p50_ms = Some(itl);
    s.itl_p90_ms = Some(itl * 1.2);
    s.itl_p99_ms = Some(itl * 1.5);
    s.throughput_tok_s = tok_s;
    s.hit_rate = hit;
    s
}

fn stages(ttft: f64) -> Vec<StagePoint> {
    [2.0, 4.0, 8.0]
        .iter()
        .map(|&r| StagePoint {
            label: format!("{r}/s"),
            level: r,
            summary: summary(ttft * r, 20.0 + r, 100.0 * r, None),
        })
        .collect()
}

fn sample() -> Report {
    let mut r = Report::new("round-robin");
    r.add_summary(
        "shared-prefix",
        "kvmesh",
        summary(100.0, 20.0, 300.0, Some(0.8)),
        stages(40.0),
    );
    r.add_summary(
        "shared-prefix",
        "round-robin",
        summary(400.0, 25.0, 150.0, Some(0.1)),
        stages(90.0),
    );
    r.add_summary(
        "long-body",
        "direct",
        summary(5.0, 1.0, 900.0, None),
        vec![],
    );
    r.add_summary(
        "long-body",
        "kvmesh",
        summary(6.0, 1.1, 800.0, None),
        vec![],
    );
    r
}

#[test]
fn table_shows_every_policy_and_ratios_against_the_named_baseline() {
    let t = sample().table();
    assert!(
        t.contains("== shared-prefix (latency ms; ratios vs round-robin)"),
        "{t}"
    );
    let line = |name: &str| t.lines().find(|l| l.starts_with(name)).unwrap().to_string();
    // kvmesh: TTFT 100 vs 400 -> 0.25x; throughput 300 vs 150 -> 2.00x.
    let k = line("kvmesh");
    assert!(
        k.contains("0.25x") && k.contains("2.00x") && k.contains("80%"),
        "{k}"
    );
    assert!(line("round-robin").contains("1.00x"));
    // No policy named round-robin on long-body: the first one is the baseline.
    assert!(
        t.contains("== long-body (latency ms; ratios vs direct)"),
        "{t}"
    );
    // Stage rows for the ladder.
    assert!(t.contains("  @8/s"), "{t}");
}

#[test]
fn json_has_the_demo_shape() {
    let v: serde_json::Value = serde_json::from_str(&sample().to_json().unwrap()).unwrap();
    let p = &v["workloads"][0]["policies"][0];
    assert_eq!(v["workloads"][0]["name"], "shared-prefix");
    assert_eq!(p["policy"], "kvmesh");
    assert_eq!(p["ttft_p50_ms"], 100.0);
    assert_eq!(p["itl_p99_ms"], 30.0);
    assert_eq!(p["hit_rate"], 0.8);
    assert_eq!(p["throughput_tok_s"], 300.0);
    assert_eq!(p["stages"][2]["label"], "8/s");
    // It reads back (serde_json may round the last bit of a float).
    let back: Report = serde_json::from_value(v).unwrap();
    assert_eq!(back.workloads[1].policies[1].policy, "kvmesh");
    assert_eq!(back.workloads[0].policies[0].stages.len(), 3);
}

#[test]
fn png_is_written_and_decodes_as_png() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plot.png");
    sample().write_png(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert!(
        bytes.len() > 5_000,
        "an empty picture is tiny: {}",
        bytes.len()
    );
    if let Ok(dst) = std::env::var("KVMESH_PLOT_SAMPLE") {
        std::fs::copy(&path, dst).unwrap();
    }
}

#[test]
fn png_of_non_streaming_runs_plots_end_to_end_latency() {
    let mut s = summary(0.0, 0.0, 10.0, None);
    (s.ttft_p50_ms, s.ttft_p90_ms, s.ttft_p99_ms) = (None, None, None);
    (s.itl_p50_ms, s.itl_p90_ms, s.itl_p99_ms) = (None, None, None);
    (s.e2e_p50_ms, s.e2e_p90_ms, s.e2e_p99_ms) = (Some(2.0), Some(3.0), Some(8.0));
    let mut r = Report::new("direct");
    r.add_summary("overhead-small", "direct", s.clone(), vec![]);
    r.add_summary("overhead-small", "nginx", s, vec![]);
    // The first policy's darkest colour (its p50 bar) fills a visible area
    // of the left panel; the right panel (ITL) has nothing to show.
    let (rgb, w, _) = plot::render_rgb(&r).unwrap();
    let (cr, cg, cb) = plot::policy_color(0);
    let count = |x0: usize, x1: usize| {
        rgb.chunks(3)
            .enumerate()
            .filter(|(i, px)| (x0..x1).contains(&(i % w as usize)) && px[..] == [cr, cg, cb])
            .count()
    };
    let half = w as usize / 2;
    assert!(count(0, half) > 1_000, "{}", count(0, half));
    assert_eq!(count(half, w as usize), 0);
}
