use super::*;
use crate::sched::decision::Choice;
use crate::sched::view::{LoadSnapshot, PrefixMatch};

/// A 320-token prompt of 10 blocks.
fn req() -> RequestView {
    RequestView {
        prompt_tokens: 320,
        prompt_blocks: 10,
        ..RequestView::new("r", "m")
    }
}

/// An endpoint with a KV cache of `blocks` 32-token blocks, holding `held` of the prompt's.
fn ep(id: &str, blocks: u32, held: u32) -> EndpointView {
    EndpointView {
        load: LoadSnapshot {
            num_blocks: blocks,
            block_size: 32,
            ..LoadSnapshot::default()
        },
        prefix: PrefixMatch {
            matched_blocks: held,
            block_size: 32,
        },
        ..EndpointView::new(id)
    }
}

fn to(index: usize, eps: &[EndpointView]) -> Route {
    Route::Aggregated {
        target: Choice {
            id: eps[index].id.clone(),
            index,
            fallbacks: vec![],
        },
    }
}

fn scores(s: &EvictionCostScorer, r: &RequestView, eps: &[EndpointView]) -> Vec<f64> {
    let cands: Vec<usize> = (0..eps.len()).collect();
    let mut out = vec![9.0; eps.len()];
    s.score(r, eps, &cands, &mut out);
    out
}

/// Sends `n` cold 320-token requests to `eps[index]` (each computes its whole prompt).
fn fill(s: &EvictionCostScorer, eps: &[EndpointView], index: usize, n: usize) {
    let cold: Vec<EndpointView> = eps
        .iter()
        .map(|e| ep(&e.id, e.load.num_blocks, 0))
        .collect();
    for _ in 0..n {
        s.post_decision(&req(), &cold, &to(index, &cold), 0);
    }
}

/// Sends `n` requests to `eps[index]` that hit 9 of their 10 blocks there.
fn hit(s: &EvictionCostScorer, eps: &[EndpointView], index: usize, n: usize) {
    let warm: Vec<EndpointView> = eps
        .iter()
        .enumerate()
        .map(|(i, e)| ep(&e.id, e.load.num_blocks, if i == index { 9 } else { 0 }))
        .collect();
    for _ in 0..n {
        s.post_decision(&req(), &warm, &to(index, &warm), 0);
    }
}

fn scorer() -> EvictionCostScorer {
    EvictionCostScorer::new(EvictionCostParams::default())
}

/// Three pods of 40 blocks (1280 tokens: four 320-token prompts fill one).
fn three() -> Vec<EndpointView> {
    ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
        .iter()
        .map(|id| ep(id, 40, 0))
        .collect()
}

/// Three full pods, 0 and 2 hitting on what they hold and 1 not: pod 1 is
/// the sink.
fn pod_1_the_sink(s: &EvictionCostScorer) -> Vec<EndpointView> {
    let eps = three();
    for i in 0..3 {
        fill(s, &eps, i, 4);
    }
    hit(s, &eps, 0, 4);
    hit(s, &eps, 2, 4);
    assert_eq!(scores(s, &req(), &eps), vec![0.0, 1.0, 0.0]);
    eps
}

#[test]
fn pods_with_room_all_score_one() {
    let s = scorer();
    let eps = three();
    for i in 0..3 {
        fill(&s, &eps, i, 3);
    }
    assert_eq!(scores(&s, &req(), &eps), vec![1.0; 3]);
    // A pod that does not report its KV never counts as full.
    let unknown: Vec<EndpointView> = eps.iter().map(|e| ep(&e.id, 0, 0)).collect();
    fill(&s, &unknown, 0, 50);
    fill(&s, &unknown, 1, 50);
    assert_eq!(scores(&s, &req(), &unknown), vec![1.0; 3]);
}

#[test]
fn full_pods_that_earn_hits_change_nothing() {
    let s = scorer();
    let eps = three();
    for i in 0..3 {
        fill(&s, &eps, i, 4);
        hit(&s, &eps, i, 4);
    }
    assert_eq!(scores(&s, &req(), &eps), vec![1.0; 3]);
}

#[test]
fn a_cold_request_goes_to_the_pod_that_thrashes_and_not_to_those_that_hit() {
    let s = scorer();
    let eps = three();
    for i in 0..3 {
        fill(&s, &eps, i, 4);
    }
    // Pods 0 and 2 serve hits from their caches; pod 1 only computes.
    hit(&s, &eps, 0, 6);
    hit(&s, &eps, 2, 6);
    fill(&s, &eps, 1, 6);
    assert_eq!(scores(&s, &req(), &eps), vec![0.0, 1.0, 0.0]);
    // In any candidate order.
    let rev: Vec<EndpointView> = eps.iter().rev().cloned().collect();
    assert_eq!(scores(&s, &req(), &rev), vec![0.0, 1.0, 0.0]);
    // A pod the request fits goes first, the sink second.
    let mut more = eps.clone();
    more.push(ep("10.0.0.4:8000", 40, 0));
    assert_eq!(scores(&s, &req(), &more), vec![0.0, 0.5, 0.0, 1.0]);
}

#[test]
fn a_pod_with_room_for_less_than_the_request_is_no_pod_it_fits() {
    // Pods 0 and 2 were sent three 320-token prompts and three that hit 9
    // of 10 blocks: 1056 of 1280 tokens computed, and they earn hits. Pod 1
    // was sent four and earns none.
    let s = scorer();
    let eps = three();
    for i in 0..3 {
        fill(&s, &eps, i, 3);
    }
    fill(&s, &eps, 1, 1);
    hit(&s, &eps, 0, 3);
    hit(&s, &eps, 2, 3);
    // A 320-token prompt fits none (on pods 0 and 2 it would evict a group
    // they hold): pod 1, cheap, is the sink.
    assert_eq!(scores(&s, &req(), &eps), vec![0.0, 1.0, 0.0]);
    // A 192-token prompt still fits pods 0 and 2: they go first.
    let short = RequestView {
        prompt_tokens: 192,
        prompt_blocks: 6,
        ..req()
    };
    assert_eq!(scores(&s, &short, &eps), vec![1.0, 0.5, 1.0]);
}

#[test]
fn a_warm_request_is_left_to_the_prefix_scorers() {
    let s = scorer();
    let eps = three();
    for i in 0..3 {
        fill(&s, &eps, i, 4);
    }
    hit(&s, &eps, 0, 6);
    hit(&s, &eps, 2, 6);
    // Pod 0 holds 5 of the 10 blocks: at coldShare 0.5 the request is warm.
    let mut warm = eps.clone();
    warm[0].prefix.matched_blocks = 5;
    assert_eq!(scores(&s, &req(), &warm), vec![1.0; 3]);
    warm[0].prefix.matched_blocks = 4;
    assert_eq!(scores(&s, &req(), &warm), vec![0.0, 1.0, 0.0]);
    // A prompt that was not keyed says nothing.
    let unkeyed = RequestView {
        prompt_blocks: 0,
        ..req()
    };
    assert_eq!(scores(&s, &unkeyed, &eps), vec![1.0; 3]);
}

#[test]
fn when_every_pod_thrashes_every_sidecar_picks_the_same_sink() {
    // Two sidecars' scorers with different histories, every pod full and
    // earning nothing: both send the overflow to the same pod.
    let eps = three();
    let (one, two) = (scorer(), scorer());
    for i in 0..3 {
        fill(&one, &eps, i, 5);
        fill(&two, &eps, 2 - i, 5 + i);
    }
    let a = scores(&one, &req(), &eps);
    assert_eq!(a, scores(&two, &req(), &eps));
    assert_eq!(a.iter().filter(|&&x| x == 1.0).count(), 1, "{a:?}");
    assert_eq!(a.iter().filter(|&&x| x == 0.0).count(), 2, "{a:?}");
}

#[test]
fn a_loaded_sink_passes_the_overflow_to_the_next_cheap_pod() {
    let s = scorer();
    let mut eps = three();
    for i in 0..3 {
        fill(&s, &eps, i, 5);
    }
    let first = scores(&s, &req(), &eps);
    let sink = first.iter().position(|&x| x == 1.0).unwrap();
    // 6 of 6 requests in flight at the sink: over 1.25 × 7 / 3.
    eps[sink].load.in_flight = 6;
    let next = scores(&s, &req(), &eps);
    assert_eq!(next[sink], 0.0, "{next:?}");
    assert_eq!(next.iter().filter(|&&x| x == 1.0).count(), 1, "{next:?}");
}

#[test]
fn hits_fade_with_the_half_life() {
    let s = EvictionCostScorer::new(EvictionCostParams {
        half_life: 4,
        ..EvictionCostParams::default()
    });
    let eps = pod_1_the_sink(&s);
    // Pod 1 starts to hit and pod 0 to thrash: 40 decisions later the roles
    // have changed.
    hit(&s, &eps, 1, 20);
    fill(&s, &eps, 0, 20);
    assert_eq!(scores(&s, &req(), &eps), vec![1.0, 0.0, 0.0]);
}

#[test]
fn a_pod_sent_nothing_for_long_is_forgotten_and_fits_again() {
    let s = EvictionCostScorer::new(EvictionCostParams {
        forget_after: 20,
        ..EvictionCostParams::default()
    });
    let eps = pod_1_the_sink(&s);
    // Pod 2's groups stop coming (or its engine restarted): 20 decisions
    // later it may take cold requests again, pod 0 still may not.
    hit(&s, &eps, 0, 10);
    fill(&s, &eps, 1, 10);
    assert_eq!(scores(&s, &req(), &eps), vec![0.0, 0.5, 1.0]);
}

#[test]
fn bounded() {
    let s = EvictionCostScorer::new(EvictionCostParams {
        max_endpoints: 2,
        ..EvictionCostParams::default()
    });
    let eps = three();
    for i in 0..3 {
        fill(&s, &eps, i, 1);
    }
    let state = s.state.lock();
    assert_eq!(state.pods.len(), 2);
    assert!(
        !state.pods.contains_key(&eps[0].id),
        "the oldest is forgotten"
    );
}

#[test]
fn parameters_are_checked() {
    let bad = |p: EvictionCostParams| p.validate().map_err(|e| e.path);
    let d = EvictionCostParams::default;
    let cases = [
        (
            EvictionCostParams {
                cold_share: 1.5,
                ..d()
            },
            "coldShare",
        ),
        (
            EvictionCostParams {
                cheap_hit_share: -0.1,
                ..d()
            },
            "cheapHitShare",
        ),
        (
            EvictionCostParams {
                load_factor: f64::NAN,
                ..d()
            },
            "loadFactor",
        ),
        (
            EvictionCostParams {
                half_life: 0,
                ..d()
            },
            "halfLife",
        ),
        (
            EvictionCostParams {
                forget_after: 0,
                ..d()
            },
            "forgetAfter",
        ),
        (
            EvictionCostParams {
                max_endpoints: 0,
                ..d()
            },
            "maxEndpoints",
        ),
    ];
    for (params, path) in cases {
        assert_eq!(bad(params), Err(path.to_owned()));
    }
    assert!(d().validate().is_ok());
}
