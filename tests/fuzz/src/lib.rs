//! What every fuzz target shares (filters' and the proxy's, as a
//! dev-dependency of each):
//! the case count (`KVMESH_FUZZ_CASES`, a few thousand by default so the
//! normal `cargo test` stays quick; `scripts/fuzz` runs 100k), a runner that
//! reports cases per second, byte-level mutation of valid seeds, and an
//! allocation counter that shows a decoder never allocates far beyond its
//! input, whatever a length field claims.
//!
//! cargo-fuzz needs a nightly toolchain; this is the stable equivalent:
//! proptest strategies (structure-aware generators) plus mutation of valid
//! encodings, deterministic unless `KVMESH_FUZZ_SEED` is set.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Instant;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

/// Cases per target in the normal test run.
pub const DEFAULT_CASES: u32 = 2000;

/// `KVMESH_FUZZ_CASES`, else [`DEFAULT_CASES`].
pub fn cases() -> u32 {
    std::env::var("KVMESH_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

/// Runs `test` on `cases()` values of `strategy` and prints the rate
/// (`fuzz NAME: N cases in S s (R cases/s)`, which `scripts/fuzz` collects).
/// A failing case panics with proptest's minimal input: this runs inside a
/// `#[test]`, and a panic is how a test fails.
#[allow(clippy::panic)]
pub fn fuzz<S: Strategy>(
    name: &str,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) {
    let cases = cases();
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..Config::default()
    };
    let rng = match std::env::var("KVMESH_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        Some(seed) => {
            let mut bytes = [0u8; 32];
            bytes[..8].copy_from_slice(&seed.to_le_bytes());
            TestRng::from_seed(RngAlgorithm::ChaCha, &bytes)
        }
        None => TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    };
    let mut runner = TestRunner::new_with_rng(config, rng);
    let start = Instant::now();
    let result = runner.run(&strategy, test);
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "fuzz {name}: {cases} cases in {secs:.2} s ({:.0} cases/s)",
        f64::from(cases) / secs.max(1e-9)
    );
    if let Err(e) = result {
        panic!("fuzz {name}: {e}");
    }
}

/// One byte-level edit of a seed. Positions are taken modulo the length.
#[derive(Debug, Clone)]
pub enum Edit {
    FlipBit(usize, u8),
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    /// Inserts the n-th of the target's interesting tokens (huge lengths,
    /// YAML anchors, ...).
    Token(usize, usize),
    Delete(usize, usize),
    Truncate(usize),
    /// Copies `len` bytes from the first position to the second.
    Duplicate(usize, usize, usize),
}

/// 1 to 6 edits.
pub fn edits() -> impl Strategy<Value = Vec<Edit>> {
    let edit = prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(p, b)| Edit::FlipBit(p, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(p, b)| Edit::Set(p, b)),
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(p, v)| Edit::Insert(p, v)),
        (any::<usize>(), any::<usize>()).prop_map(|(p, t)| Edit::Token(p, t)),
        (any::<usize>(), 1usize..16).prop_map(|(p, n)| Edit::Delete(p, n)),
        any::<usize>().prop_map(Edit::Truncate),
        (any::<usize>(), any::<usize>(), 1usize..64).prop_map(|(a, b, n)| Edit::Duplicate(a, b, n)),
    ];
    proptest::collection::vec(edit, 1..6)
}

/// `seed` with `edits` applied; `tokens` are the target's interesting byte
/// strings for [`Edit::Token`].
pub fn mutate(seed: &[u8], edits: &[Edit], tokens: &[&[u8]]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for e in edits {
        let at = |p: usize, len: usize| if len == 0 { 0 } else { p % len };
        match e {
            Edit::FlipBit(p, b) if !v.is_empty() => {
                let i = at(*p, v.len());
                v[i] ^= 1 << b;
            }
            Edit::Set(p, b) if !v.is_empty() => {
                let i = at(*p, v.len());
                v[i] = *b;
            }
            Edit::Insert(p, bytes) => {
                let i = at(*p, v.len() + 1);
                v.splice(i..i, bytes.iter().copied());
            }
            Edit::Token(p, t) if !tokens.is_empty() => {
                let i = at(*p, v.len() + 1);
                v.splice(i..i, tokens[t % tokens.len()].iter().copied());
            }
            Edit::Delete(p, n) if !v.is_empty() => {
                let i = at(*p, v.len());
                let end = (i + n).min(v.len());
                v.drain(i..end);
            }
            Edit::Truncate(p) => {
                let n = at(*p, v.len() + 1);
                v.truncate(n);
            }
            Edit::Duplicate(a, b, n) if !v.is_empty() => {
                let from = at(*a, v.len());
                let chunk: Vec<u8> = v[from..(from + n).min(v.len())].to_vec();
                let to = at(*b, v.len() + 1);
                v.splice(to..to, chunk);
            }
            _ => {}
        }
    }
    v
}

/// Counts the bytes each thread allocates (install it with
/// `#[global_allocator]`); [`allocated_during`] reads it.
pub struct CountingAlloc;

thread_local! {
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

fn count(n: usize) {
    // `try_with`: during thread teardown the slot may be gone; then nothing is counted.
    let _ = ALLOCATED.try_with(|c| c.set(c.get().saturating_add(n)));
}

// SAFETY: every call forwards to the system allocator with the same
// arguments; the counter is a plain thread-local cell that never allocates.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// `f()` and the bytes this thread allocated while it ran (every
/// allocation and reallocation summed: an upper bound on its peak).
pub fn allocated_during<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let before = ALLOCATED.with(Cell::get);
    let r = f();
    (r, ALLOCATED.with(Cell::get) - before)
}
