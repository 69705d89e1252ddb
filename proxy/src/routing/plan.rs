//! A scheduler decision as the execute stage's [`Plan`]: the local pod
//! becomes [`Target::LocalEngine`], another pod [`Target::Peer`] at the
//! sidecar address the fleet holds for it (never an address taken from the
//! request, so the sidecar is no open relay), a prefill/decode pair
//! [`Target::Disaggregated`]. Fallbacks keep the picker's order; a pod that
//! left the fleet since the endpoint snapshot is skipped.

use kvmesh_filters::sched::{EndpointView, RequestView as SchedView, Route};

use crate::fleet::Fleet;
use crate::request::MAX_ATTEMPTS;
use crate::request::{Leg, Plan, Target};

/// The plan for `route`, decided for `req` over `endpoints`; `None` when its
/// chosen pod is no longer known.
pub fn from_route(
    fleet: &Fleet,
    route: &Route,
    req: &SchedView,
    endpoints: &[EndpointView],
) -> Option<Plan> {
    let (target, fallback_ids) = match route {
        Route::Aggregated { target } => (target_of(fleet, &target.id)?, &target.fallbacks),
        Route::Disaggregated { prefill, decode } => {
            let t = Target::Disaggregated {
                prefill: leg_of(fleet, &prefill.id)?,
                decode: leg_of(fleet, &decode.id)?,
            };
            (t, &decode.fallbacks)
        }
    };
    // After a refused P/D attempt the decode pod can still serve it whole.
    let whole_on_decode = match route {
        Route::Disaggregated { decode, .. } => target_of(fleet, &decode.id),
        Route::Aggregated { .. } => None,
    };
    let fallbacks = whole_on_decode
        .into_iter()
        .chain(fallback_ids.iter().filter_map(|id| target_of(fleet, id)))
        .take(MAX_ATTEMPTS - 1)
        .collect();
    let prefill_fallbacks = match route {
        Route::Disaggregated { prefill, .. } => prefill
            .fallbacks
            .iter()
            .filter_map(|id| leg_of(fleet, id))
            .take(MAX_ATTEMPTS - 1)
            .collect(),
        Route::Aggregated { .. } => Vec::new(),
    };
    Some(Plan {
        target,
        fallbacks,
        prefill_fallbacks,
        reason: "scheduled",
        uncached_tokens: uncached_on(req, endpoints, route),
        pool: None,
    })
}

/// The prompt tokens `req` would compute on each pod `route` names (its
/// picks and their fallbacks), from the endpoint views it was decided on.
fn uncached_on(req: &SchedView, endpoints: &[EndpointView], route: &Route) -> Vec<(String, u64)> {
    let choices = match route {
        Route::Aggregated { target } => vec![target],
        Route::Disaggregated { prefill, decode } => vec![prefill, decode],
    };
    choices
        .into_iter()
        .flat_map(|c| std::iter::once(&c.id).chain(&c.fallbacks))
        .filter_map(|id| endpoints.iter().find(|e| e.id == *id))
        .map(|e| (e.id.clone(), req.uncached_tokens(&e.prefix)))
        .collect()
}

/// Where requests for pod `id` go.
pub fn target_of(fleet: &Fleet, id: &str) -> Option<Target> {
    leg_of(fleet, id).map(|leg| leg.whole())
}

fn leg_of(fleet: &Fleet, id: &str) -> Option<Leg> {
    if id == fleet.local_id() {
        return Some(Leg::LocalEngine);
    }
    fleet
        .sidecar_addr(id)
        .map(|sidecar_addr| Leg::Peer { sidecar_addr })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::collections::BTreeMap;
    use std::net::SocketAddr;

    use kvmesh_filters::sched::{Choice, Role};

    use super::*;
    use crate::fleet::PodInfo;

    fn pod(id: &str, addr: Option<SocketAddr>) -> PodInfo {
        PodInfo {
            id: id.to_owned(),
            sidecar_addr: addr,
            role: Role::Both,
            models: vec![],
            lora_adapters: vec![],
            labels: BTreeMap::new(),
        }
    }

    fn choice(id: &str, fallbacks: &[&str]) -> Choice {
        Choice {
            id: id.to_owned(),
            index: 0,
            fallbacks: fallbacks.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    fn fleet() -> (Fleet, SocketAddr, SocketAddr) {
        let b: SocketAddr = "127.0.0.1:7002".parse().unwrap();
        let c: SocketAddr = "127.0.0.1:7003".parse().unwrap();
        let f = Fleet::new(pod("a", None));
        f.upsert_peer(pod("b", Some(b))).unwrap();
        f.upsert_peer(pod("c", Some(c))).unwrap();
        (f, b, c)
    }

    #[test]
    fn local_and_peer_targets_with_fallbacks_in_order() {
        let (f, b, c) = fleet();
        let p = plan(
            &f,
            &Route::Aggregated {
                target: choice("b", &["gone", "a", "c"]),
            },
        )
        .unwrap();
        assert_eq!(p.target, Target::Peer { sidecar_addr: b });
        assert_eq!(
            p.fallbacks,
            vec![Target::LocalEngine, Target::Peer { sidecar_addr: c }]
        );
        assert_eq!(p.decision(), "peer");
    }

    #[test]
    fn disaggregated_falls_back_to_the_decode_pod_whole() {
        let (f, b, _) = fleet();
        let p = plan(
            &f,
            &Route::Disaggregated {
                prefill: choice("b", &[]),
                decode: choice("a", &["c"]),
            },
        )
        .unwrap();
        assert_eq!(
            p.target,
            Target::Disaggregated {
                prefill: Leg::Peer { sidecar_addr: b },
                decode: Leg::LocalEngine
            }
        );
        assert_eq!(p.fallbacks[0], Target::LocalEngine);
        assert_eq!(p.fallbacks.len(), 2);
        assert_eq!(p.decision(), "disaggregated");
    }

    #[test]
    fn a_pod_that_left_yields_no_plan() {
        let (f, _, _) = fleet();
        let r = Route::Aggregated {
            target: choice("zz", &["a"]),
        };
        assert!(plan(&f, &r).is_none());
    }

    /// A plan for a request with no prompt, decided over no endpoints.
    fn plan(f: &Fleet, r: &Route) -> Option<Plan> {
        from_route(f, r, &SchedView::default(), &[])
    }

    #[test]
    fn each_pod_of_the_plan_has_the_prompt_tokens_it_would_compute() {
        let (f, _, _) = fleet();
        // 640 tokens in 40 blocks: b holds 30 of them, c none.
        let req = SchedView {
            prompt_tokens: 640,
            prompt_blocks: 40,
            ..SchedView::default()
        };
        let holding = |id: &str, blocks: u32| EndpointView {
            prefix: kvmesh_filters::sched::PrefixMatch {
                matched_blocks: blocks,
                block_size: 16,
            },
            ..EndpointView::new(id)
        };
        let eps = [holding("a", 0), holding("b", 30), holding("c", 0)];
        let r = Route::Aggregated {
            target: choice("b", &["c", "gone"]),
        };
        let p = from_route(&f, &r, &req, &eps).unwrap();
        assert_eq!(
            p.uncached_tokens,
            vec![("b".to_owned(), 160), ("c".to_owned(), 640)]
        );
    }
}
