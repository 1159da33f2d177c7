//! A pooled runtime: instances reuse warm slots, yet each starts clean, and a full pool
//! refuses a start with a typed error.

use allocbox::{HandlerBuilder, LoadError, Runtime};

use super::support::*;

#[test]
fn a_pooled_instance_starts_clean_after_its_slot_held_cached_blocks() {
    let pool = Runtime::pooled(2, 64 << 20).unwrap();
    let policy = pool
        .adopt(&load(&allocbox_artifacts::SIZE_CLASSES))
        .unwrap();
    for round in 0..4 {
        // Without magazines the freed block stays in the guest's own cache. Were the
        // slot's memory not reset, the next instance would lend that stale address,
        // which its ledger never handed over: an `outside-owned` violation.
        let h = HandlerBuilder::new(&pool)
            .link(&policy)
            .magazines(false)
            .build()
            .unwrap();
        let p = h.malloc(64).unwrap().unwrap();
        fill(p, 64, round);
        assert!(holds(p, 64, round));
        h.free(Some(p), 64).unwrap();
        assert_eq!(h.link_stats().unwrap()[0].live_blocks, 0, "round {round}");
    }
}

#[test]
fn a_full_pool_refuses_a_start_until_a_handler_ends() {
    let pool = Runtime::pooled(1, 64 << 20).unwrap();
    let policy = pool.adopt(&load(&allocbox_artifacts::SYSTEM)).unwrap();
    let start = || HandlerBuilder::new(&pool).link(&policy).build();
    let first = start().unwrap();
    assert!(
        matches!(start(), Err(LoadError::PoolFull { .. })),
        "a second instance does not fit a pool of one"
    );
    let p = first.malloc(32).unwrap().unwrap();
    first.free(Some(p), 32).unwrap();
    drop(first);
    start().expect("the slot is free again");
}

/// The limiter, not the pool, stops a guest that grows: with the slot exactly as big
/// as the limit, the error is still the typed memory limit.
#[test]
fn a_pooled_guest_still_meets_its_memory_limit() {
    let limit = allocbox::Limits::default().memory;
    let pool = Runtime::pooled(1, limit).unwrap();
    let policy = pool.adopt(&load(&allocbox_artifacts::BROKEN)).unwrap();
    let h = HandlerBuilder::new(&pool)
        .link_with(&policy, &[("fault", "grow-memory")])
        .build()
        .unwrap();
    let err = h.malloc(16).unwrap_err();
    assert!(
        matches!(err, allocbox::Error::MemoryLimit { limit: l, .. } if l == limit),
        "got {err}"
    );
}

/// A componentize-py policy is 14 core instances (CPython and its runtime): every slot
/// of the pool has room for one, not only for a Rust policy's few.
#[test]
fn every_pool_slot_holds_a_policy_with_an_interpreter_inside() {
    let pool = Runtime::pooled(2, 64 << 20).unwrap();
    let policy = pool.adopt(&load(&allocbox_artifacts::LIMIT)).unwrap();
    let start = || HandlerBuilder::new(&pool).link(&policy).build().unwrap();
    let (first, second) = (start(), start());
    for h in [&first, &second] {
        let p = h.malloc(100).unwrap().unwrap();
        fill(p, 100, 7);
        assert!(holds(p, 100, 7));
        h.free(Some(p), 100).unwrap();
    }
}
