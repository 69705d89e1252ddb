use super::*;

fn pod(id: &str, addr: Option<&str>, role: Role) -> PodInfo {
    PodInfo {
        id: id.to_owned(),
        sidecar_addr: addr.map(|a| a.parse().unwrap()),
        role,
        models: vec!["m".to_owned()],
        lora_adapters: Vec::new(),
        labels: BTreeMap::new(),
    }
}

fn fleet() -> Fleet {
    let f = Fleet::new(pod("10.0.0.1:8000", None, Role::Both));
    f.upsert_peer(pod("10.0.0.2:8000", Some("10.0.0.2:8000"), Role::Decode))
        .unwrap();
    f
}

#[test]
fn the_local_pod_is_always_there_and_cannot_be_removed_or_spoofed() {
    let f = fleet();
    assert!(!f.remove_peer("10.0.0.1:8000"));
    assert!(f.contains("10.0.0.1:8000"));
    assert_eq!(
        f.upsert_peer(pod("10.0.0.1:8000", Some("10.9.9.9:1"), Role::Both)),
        Err(FleetError::Local("10.0.0.1:8000".to_owned()))
    );
    assert_eq!(f.sidecar_addr("10.0.0.1:8000"), None);
}

#[test]
fn only_known_peers_are_forwarding_targets() {
    let f = fleet();
    assert!(f.is_peer_addr("10.0.0.2:8000".parse().unwrap()));
    assert!(!f.is_peer_addr("10.0.0.3:8000".parse().unwrap()));
    assert!(f.remove_peer("10.0.0.2:8000"));
    // Left discovery: it drains, so a request scheduled to it a moment
    // before may still go, for DEPARTED_GRACE and no longer.
    let addr = "10.0.0.2:8000".parse().unwrap();
    assert!(f.is_peer_addr(addr));
    let later = Instant::now() + super::DEPARTED_GRACE + std::time::Duration::from_secs(1);
    assert!(!f.is_peer_addr_at(addr, later));
    assert!(!f.is_peer_addr(addr), "forgotten once past the grace");
}

#[test]
fn a_peer_cut_off_fails_its_waiting_calls_while_one_that_left_drains() {
    let f = fleet();
    let (id, addr) = ("10.0.0.2:8000", "10.0.0.2:8000".parse().unwrap());
    let lost = f.lost_signal(addr).expect("a peer's signal");
    assert!(f.lost_signal("10.0.0.3:8000".parse().unwrap()).is_none());
    assert!(!lost.is_cancelled());
    assert!(f.cut_off_peer(id));
    assert!(lost.is_cancelled(), "the calls waiting on it fail");
    assert!(!f.contains(id));
    assert!(!f.is_peer_addr(addr), "not forwarded to until it is back");
    assert!(!f.cut_off_peer(id));
    assert!(!f.cut_off_peer("10.0.0.1:8000"), "the local pod stays");
    // Back with its next snapshot, it has a fresh signal.
    f.upsert_peer(pod(id, Some(id), Role::Decode)).unwrap();
    let again = f.lost_signal(addr).expect("back");
    assert!(!again.is_cancelled());
    // One that left drains: its calls go on, and it is still a target.
    assert!(f.remove_peer(id));
    assert!(!again.is_cancelled());
    assert!(f.is_peer_addr(addr));
    assert!(f.lost_signal(addr).is_none());
}

#[test]
fn in_flight_counts_local_guards_and_peer_reports() {
    let f = fleet();
    let g1 = f.begin("10.0.0.2:8000").unwrap();
    let _g2 = f.begin("10.0.0.2:8000").unwrap();
    assert!(f.begin("nowhere:1").is_none());
    assert_eq!(f.local_in_flight().get("10.0.0.2:8000"), Some(&2));
    f.set_remote_in_flight(
        "10.0.0.2:8000",
        HashMap::from([
            ("10.0.0.2:8000".to_owned(), 5),
            ("10.0.0.1:8000".to_owned(), 1),
        ]),
    );
    // An unknown reporter is ignored: only peers publish.
    f.set_remote_in_flight("x:1", HashMap::from([("10.0.0.2:8000".to_owned(), 100)]));
    drop(g1);
    let now = Instant::now();
    let views = f.endpoints(now, 16, |_| 0);
    let peer = views.iter().find(|v| v.id == "10.0.0.2:8000").unwrap();
    assert_eq!(peer.load.in_flight, 1 + 5);
    // The local pod's count is this sidecar's own, exact: a peer's report of
    // requests it forwarded here would count them twice.
    let local = views.iter().find(|v| v.id == "10.0.0.1:8000").unwrap();
    assert_eq!(local.load.in_flight, 0);
}

#[test]
fn requests_forwarded_here_are_counted_locally_but_not_published() {
    let f = fleet();
    let _own = f.begin("10.0.0.1:8000").unwrap();
    let received = f.begin_received().unwrap();
    let _fwd = f.begin("10.0.0.2:8000").unwrap();
    assert_eq!(f.local_in_flight().get("10.0.0.1:8000"), Some(&2));
    let published = f.published_in_flight();
    assert_eq!(published.get("10.0.0.1:8000"), Some(&1));
    assert_eq!(published.get("10.0.0.2:8000"), Some(&1));
    drop(received);
    assert_eq!(f.published_in_flight().get("10.0.0.1:8000"), Some(&1));
    assert_eq!(f.local_in_flight().get("10.0.0.1:8000"), Some(&1));
}

#[test]
fn endpoint_views_carry_load_role_prefix_and_staleness() {
    let f = fleet();
    let now = Instant::now();
    f.set_load(
        "10.0.0.2:8000",
        EngineLoad {
            waiting: 3,
            running: 2,
            kv_usage: 0.5,
            block_size: 32,
            num_blocks: 100,
            ..EngineLoad::default()
        },
        now,
    );
    let later = now + std::time::Duration::from_millis(250);
    let views = f.endpoints(later, 16, |id| if id == "10.0.0.2:8000" { 7 } else { 0 });
    let peer = views.iter().find(|v| v.id == "10.0.0.2:8000").unwrap();
    assert_eq!(peer.role, Role::Decode);
    assert_eq!((peer.load.waiting, peer.load.running), (3, 2));
    assert_eq!(
        peer.prefix,
        PrefixMatch {
            matched_blocks: 7,
            block_size: 32
        }
    );
    assert_eq!(peer.staleness_ms, 250);
    assert_eq!(peer.address, "10.0.0.2:8000");
    let local = views.iter().find(|v| v.id == "10.0.0.1:8000").unwrap();
    // Never reported: as stale as can be, and the request's block size applies.
    assert_eq!(local.staleness_ms, u64::MAX);
    assert_eq!(local.prefix.block_size, 16);
}

#[test]
fn removing_a_peer_drops_what_it_published() {
    let f = fleet();
    f.set_remote_in_flight(
        "10.0.0.2:8000",
        HashMap::from([("10.0.0.1:8000".to_owned(), 9)]),
    );
    f.remove_peer("10.0.0.2:8000");
    let views = f.endpoints(Instant::now(), 16, |_| 0);
    assert_eq!(views.len(), 1);
    assert_eq!(views[0].load.in_flight, 0);
}

#[test]
fn prompt_tokens_to_prefill_count_own_guards_and_every_peer_report() {
    let f = fleet();
    let (local, peer) = ("10.0.0.1:8000", "10.0.0.2:8000");
    let first = f.begin_prefill(peer, 700).unwrap();
    let _second = f.begin_prefill(peer, 300).unwrap();
    assert!(f.begin_prefill(peer, 0).is_none(), "nothing to prefill");
    assert!(f.begin_prefill("nowhere:1", 5).is_none());
    // What the scheduler priced there, and nothing where it priced none.
    let priced = [(local.to_owned(), 40), (peer.to_owned(), 60)];
    let third = f.begin_priced_prefill(peer, &priced).unwrap();
    assert_eq!(f.published_prefill()[peer], 1060);
    drop(third);
    assert!(f.begin_priced_prefill(peer, &priced[..1]).is_none());
    assert_eq!(
        f.published_prefill(),
        HashMap::from([(peer.to_owned(), 1000)])
    );
    // The peer's report counts on every pod it names, the local one too:
    // a request it forwarded here is counted by it alone.
    f.set_remote_prefill(
        peer,
        HashMap::from([(peer.to_owned(), 50), (local.to_owned(), 20)]),
    );
    f.set_remote_prefill("x:1", HashMap::from([(peer.to_owned(), 9999)]));
    drop(first);
    let views = f.endpoints(Instant::now(), 16, |_| 0);
    let tokens = |id: &str| {
        views
            .iter()
            .find(|v| v.id == id)
            .unwrap()
            .load
            .prefill_tokens
    };
    assert_eq!(tokens(peer), 300 + 50);
    assert_eq!(tokens(local), 20);
    // A peer that leaves takes its report along.
    f.remove_peer(peer);
    let views = f.endpoints(Instant::now(), 16, |_| 0);
    assert_eq!(views[0].load.prefill_tokens, 0);
}

#[test]
fn held_requests_are_published_with_in_flight_and_read_back_per_sidecar() {
    let f = fleet();
    let (local, peer) = ("10.0.0.1:8000", "10.0.0.2:8000");
    let held = f.begin_held(Role::Prefill);
    let _also = f.begin_held(Role::Prefill);
    let published = f.published_in_flight();
    assert_eq!(published.get("held:prefill"), Some(&2), "{published:?}");
    // A peer's report: one request in flight to us, three held for the
    // decode pool. The pseudo-target is no pod: nothing routes to it.
    f.set_remote_in_flight(
        peer,
        HashMap::from([(local.to_owned(), 1), ("held:decode".to_owned(), 3)]),
    );
    let views = f.endpoints(Instant::now(), 16, |_| 0);
    assert_eq!(views.len(), 2, "{views:?}");
    let snap = f.snapshot(Instant::now());
    let fleet_wide: HeldCounts = snap.iter().map(|p| p.held).sum();
    assert_eq!((fleet_wide.decode, fleet_wide.prefill), (3, 2));
    let of = |id: &str| snap.iter().find(|p| p.info.id == id).unwrap().held;
    assert_eq!(of(local).prefill, 2);
    assert_eq!(of(peer).decode, 3);
    drop(held);
    assert_eq!(f.local_snapshot(Instant::now()).held.prefill, 1);
}

#[test]
fn endpoints_where_builds_views_of_the_pods_picked_only() {
    let f = fleet();
    f.set_remote_in_flight(
        "10.0.0.2:8000",
        HashMap::from([("10.0.0.1:8000".to_owned(), 1)]),
    );
    let _g = f.begin("10.0.0.2:8000");
    let decode = f.endpoints_where(Instant::now(), |p| p.role == Role::Decode);
    assert_eq!(decode.len(), 1);
    assert_eq!(decode[0].id, "10.0.0.2:8000");
    assert_eq!(
        decode[0].load.in_flight, 1,
        "its loads as endpoints reads them"
    );
    let all = f.endpoints(Instant::now(), 0, |_| 0);
    let same = all.iter().find(|v| v.id == "10.0.0.2:8000").unwrap();
    assert_eq!(same.load, decode[0].load);
    assert!(f.endpoints_where(Instant::now(), |_| false).is_empty());
}
