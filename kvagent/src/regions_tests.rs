#![allow(clippy::unwrap_used)]
use super::*;
use std::time::Duration;

fn reg() -> Registry {
    Registry::new(RegistryLimits {
        max_regions: 4,
        max_leases: 8,
        max_region_bytes: 1 << 30,
    })
}

fn region(r: &mut Registry, name: &str, blocks: u32) -> u64 {
    let layout = BlockLayout {
        block_bytes: 64,
        layers: 2,
        blocks,
    };
    let len = layout.validate(1 << 30).unwrap();
    let map = Arc::new(Mapping::create(name, len).unwrap());
    r.register(name.into(), layout, map, 1).unwrap().id
}

#[test]
fn reserve_and_release_conserve_blocks() {
    let mut r = reg();
    let id = region(&mut r, "a", 4);
    let later = Instant::now() + Duration::from_secs(60);
    let t1 = TransferId::new("t1").unwrap();
    let b = r.reserve(id, &t1, 3, LeaseState::Reserved, later).unwrap();
    assert_eq!(b, vec![0, 1, 2]);
    let t2 = TransferId::new("t2").unwrap();
    let err = r
        .reserve(id, &t2, 2, LeaseState::Reserved, later)
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::NoRoom, "{err}");
    assert!(r.release(id, &t1));
    assert_eq!(r.free_blocks(id), 4);
    assert!(!r.release(id, &t1), "a second release is a no-op");
}

#[test]
fn landing_prefers_a_reservation_then_a_compatible_region() {
    let mut r = reg();
    let a = region(&mut r, "a", 4);
    let b = region(&mut r, "b", 4);
    let later = Instant::now() + Duration::from_secs(60);
    let t = TransferId::new("t").unwrap();
    let reserved = r.reserve(b, &t, 2, LeaseState::Reserved, later).unwrap();
    let layout = BlockLayout {
        block_bytes: 64,
        layers: 2,
        blocks: 99,
    };
    let (region, blocks) = r.land(&t, &layout, 2, None, Some(a), later).unwrap();
    assert_eq!((region.id, blocks), (b, reserved));
    assert_eq!(r.lease(b, &t).unwrap().state, LeaseState::Receiving);
    let other = BlockLayout {
        block_bytes: 32,
        layers: 2,
        blocks: 4,
    };
    let u = TransferId::new("u").unwrap();
    let err = r.land(&u, &other, 1, None, None, later).unwrap_err();
    assert_eq!(err.code(), ErrorCode::LayoutMismatch);
    let err = r.land(&u, &layout, 5, None, None, later).unwrap_err();
    assert_eq!(err.code(), ErrorCode::NoRoom);
}

#[test]
fn expiry_lists_only_overdue_non_draining_leases() {
    let mut r = reg();
    let a = region(&mut r, "a", 4);
    let now = Instant::now();
    let t = TransferId::new("t").unwrap();
    let d = TransferId::new("d").unwrap();
    r.reserve(a, &t, 1, LeaseState::Reserved, now).unwrap();
    r.reserve(a, &d, 1, LeaseState::Draining, now).unwrap();
    let exp = r.expired(now + Duration::from_millis(1));
    assert_eq!(exp.len(), 1);
    assert_eq!(exp[0].1, t);
    let dropped = r.unregister(a).unwrap();
    assert_eq!(dropped.len(), 2);
    assert_eq!(r.lease_count(), 0);
}
