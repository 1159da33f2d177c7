//! loom models of the claim protocol ([`super::slot`]): every interleaving of the owner's
//! fast path against claimers, run on the very code of `slot.rs` (its primitives come
//! from `crate::sync`, loom's under `--cfg allocbox_loom`).
//!
//! loom fails a model when two accesses to a slot's cache overlap (its `UnsafeCell`
//! tracks each `CacheGuard` and fast-path run) or when an assertion below fails. Run:
//!
//! ```text
//! RUSTFLAGS="--cfg allocbox_loom" CARGO_TARGET_DIR=target/loom \
//!     cargo test -p allocbox-ledger --lib --release models
//! ```
//!
//! The threads here are loom's, which all run on one OS thread, so the models build a
//! [`Slot`] and the owner's [`Mine`] directly rather than through [`super::Slots`]
//! (which tells threads apart by their OS thread).

use loom::sync::Arc;
use loom::thread;

use super::magazine::Magazines;
use super::slot::{Mine, Slot};
use super::thread::{Reach, ThreadCache};
use crate::ledger::CacheId;
use crate::platform::barrier;
use crate::sync::Mutex;

const SIZE: u64 = 16;

/// A slot whose magazine of [`SIZE`]-byte blocks holds `blocks`.
fn slot_with(blocks: &[u64]) -> Arc<Slot> {
    let mut magazines = Magazines::new();
    magazines.of_size(SIZE).blocks = blocks.to_vec();
    magazines.cached_bytes = SIZE * blocks.len() as u64;
    let cache = ThreadCache {
        magazines: Some(magazines),
        ..ThreadCache::default()
    };
    Arc::new(Slot::new(CacheId::new(1).unwrap(), cache))
}

/// The owner takes `count` blocks on its fast path (the magazine hit), each on a fast
/// path of its own, and returns them.
fn owner_takes(slot: &Slot, count: usize) -> Vec<u64> {
    let mut mine = Mine::of(slot);
    (0..count)
        .filter_map(|_| mine.with(|cache| cache.take::<{ Reach::FULL }>(SIZE)))
        .collect()
}

/// A thread that claims `slot` and counts a free in it.
fn claimer_counting_a_free(slot: &Arc<Slot>) -> thread::JoinHandle<()> {
    let slot = Arc::clone(slot);
    thread::spawn(move || {
        slot.claim()
            .expect("the owner leaves its fast path")
            .counts
            .frees += 1;
    })
}

/// Every block is in exactly one place at the end: `places` together hold `blocks`.
fn assert_each_block_once(blocks: &[u64], places: &[&[u64]]) {
    let mut found: Vec<u64> = places.iter().flat_map(|p| p.iter().copied()).collect();
    found.sort_unstable();
    assert_eq!(found, blocks, "a block was lost or handed out twice");
}

#[test]
fn models_the_owner_and_one_claimer_never_reach_the_cache_at_once() {
    loom::model(|| {
        let slot = slot_with(&[]);
        let claimer = claimer_counting_a_free(&slot);
        let mut mine = Mine::of(&slot);
        for _ in 0..2 {
            mine.with(|cache| cache.counts.mallocs += 1);
        }
        claimer.join().unwrap();
        let cache = mine.cache();
        assert_eq!((cache.counts.mallocs, cache.counts.frees), (2, 1));
    });
}

#[test]
fn models_the_owner_and_two_claimers_never_reach_the_cache_at_once() {
    let mut model = loom::model::Builder::new();
    // Bounded to keep the run short: three preemptions still interleave each
    // claimer's claim with the owner's entry and exit.
    model.preemption_bound = Some(3);
    model.check(|| {
        let slot = slot_with(&[]);
        let claimers: Vec<_> = (0..2).map(|_| claimer_counting_a_free(&slot)).collect();
        Mine::of(&slot).with(|cache| cache.counts.mallocs += 1);
        for claimer in claimers {
            claimer.join().unwrap();
        }
        let mut mine = Mine::of(&slot);
        let cache = mine.cache();
        assert_eq!((cache.counts.mallocs, cache.counts.frees), (1, 2));
    });
}

#[test]
fn models_a_flush_takes_each_block_the_owner_did_not() {
    loom::model(|| {
        let blocks = [0x1000, 0x2000, 0x3000];
        let slot = slot_with(&blocks);
        let flusher = {
            let slot = Arc::clone(&slot);
            thread::spawn(move || {
                let mut cache = slot.claim().expect("the owner leaves its fast path");
                let drained = cache.magazines.as_mut().unwrap().drain();
                drained.into_iter().flat_map(|(_, b)| b).collect::<Vec<_>>()
            })
        };
        let taken = owner_takes(&slot, 2);
        let flushed = flusher.join().unwrap();
        assert_each_block_once(&blocks, &[&taken, &flushed]);
        let mut mine = Mine::of(&slot);
        let cache = mine.cache();
        assert_eq!(cache.magazines.as_ref().unwrap().cached_bytes, 0);
        assert_eq!(
            cache.lent.iter().count(),
            taken.len(),
            "each taken block is lent"
        );
    });
}

#[test]
fn models_a_free_from_another_thread_reaches_the_owners_lent_block() {
    loom::model(|| {
        let blocks = [0x1000, 0x2000];
        let slot = slot_with(&blocks);
        // Lent before the other thread starts: it got the block from the owner.
        let handed = owner_takes(&slot, 1)[0];
        let freer = {
            let slot = Arc::clone(&slot);
            thread::spawn(move || {
                let mut cache = slot.claim().expect("the owner leaves its fast path");
                let size = cache.lent.remove(handed).expect("the owner lent it");
                assert!(cache.keep(handed, size), "the magazine has room");
            })
        };
        let taken = owner_takes(&slot, 1);
        freer.join().unwrap();
        let mut mine = Mine::of(&slot);
        let cache = mine.cache();
        let cached: Vec<u64> = cache.magazines.as_ref().unwrap().small[SIZE as usize]
            .blocks
            .clone();
        assert_each_block_once(&blocks, &[&taken, &cached]);
        // The owner may have taken the freed block again: what is lent is what it took.
        let lent: Vec<u64> = cache.lent.iter().map(|(addr, _)| addr).collect();
        assert_eq!(lent, taken);
    });
}

#[test]
fn models_a_claim_waits_out_a_refill_under_the_books_lock() {
    loom::model(|| {
        let books = Arc::new(Mutex::new(Vec::from([0x1000u64, 0x2000])));
        let slot = slot_with(&[]);
        let flusher = {
            let (slot, books) = (Arc::clone(&slot), Arc::clone(&books));
            thread::spawn(move || {
                let mut books = books.lock();
                let mut cache = slot.claim().expect("the owner leaves its fast path");
                for (_, blocks) in cache.magazines.as_mut().unwrap().drain() {
                    books.extend(blocks);
                }
            })
        };
        // A miss: the owner refills from the books, holding their lock and its cache
        // (as `Locked::own` does), then takes a block on its fast path.
        {
            let mut books = books.lock();
            let mut mine = Mine::of(&slot);
            let mut cache = mine.cache();
            for block in books.drain(..) {
                assert!(cache.keep(block, SIZE));
            }
        }
        let taken = owner_takes(&slot, 1);
        flusher.join().unwrap();
        let left = books.lock().clone();
        assert_each_block_once(
            &[0x1000, 0x2000],
            &[&taken, &left, &{
                let mut mine = Mine::of(&slot);
                let cache = mine.cache();
                cache.magazines.as_ref().unwrap().small[SIZE as usize]
                    .blocks
                    .clone()
            }],
        );
    });
}

/// The light barrier is what keeps the owner from missing a claim: without it, loom
/// finds an interleaving in which both reach the cache (the store-buffering outcome
/// that the barrier pair exists to forbid).
#[test]
#[should_panic(expected = "Causality violation")]
fn models_without_the_light_barrier_the_owner_and_a_claimer_collide() {
    barrier::turn_light_barrier_off();
    models_the_owner_and_one_claimer_never_reach_the_cache_at_once();
}
