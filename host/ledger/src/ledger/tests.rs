//! The ledger against a hand-checked list of cases and a proptest model, and what its
//! records cost.

use super::*;

/// What the ledger allocates for `blocks` blocks, ordered, per block.
fn bytes_per_record(blocks: u64) -> f64 {
    let mut ledger = Ledger::default();
    let empty = crate::counting_alloc::live_bytes();
    for i in 0..blocks {
        ledger.insert(0x1000 + i * 64, 1);
    }
    // A range query orders every block: the B-tree holds them all.
    assert!(ledger.ordered().containing(0x1000, 1).is_some());
    (crate::counting_alloc::live_bytes() - empty) as f64 / blocks as f64
}

#[test]
#[cfg_attr(
    miri,
    ignore = "a measurement over 100,000 blocks; the other tests run them"
)]
fn a_block_s_record_costs_at_most_the_ledger_entry_cost() {
    // Just below and just after each doubling of the address index's hash map (which
    // holds all but the newest few), where a record costs least and most, from a few
    // blocks to over a hundred thousand (the cost per record settles from a thousand
    // on).
    let mut worst = 0f64;
    for doubling in 6..=17 {
        let full = (1u64 << doubling) / 8 * 7 + index::RECENT as u64;
        for blocks in [full, full + 1] {
            worst = worst.max(bytes_per_record(blocks));
        }
    }
    assert!(
        worst <= LEDGER_ENTRY_COST as f64,
        "a record costs up to {worst:.1} bytes, more than the {LEDGER_ENTRY_COST} counted"
    );
    assert!(worst > 50.0, "the measurement measures: {worst:.1}");
}

fn ledger(blocks: &[(u64, u64)]) -> Ledger {
    let mut l = Ledger::default();
    for &(a, s) in blocks {
        l.insert(a, s);
    }
    l
}

#[test]
fn overlap_is_found_from_below_inside_and_above() {
    let mut l = ledger(&[(100, 50), (200, 10)]);
    let l = l.ordered();
    assert_eq!(
        l.overlapping(90, 11),
        Some((100, 50)),
        "reaches in from below"
    );
    assert_eq!(l.overlapping(120, 5), Some((100, 50)), "lies inside");
    assert_eq!(
        l.overlapping(149, 40),
        Some((100, 50)),
        "starts in the last byte"
    );
    assert_eq!(l.overlapping(50, 500), Some((200, 10)), "covers both");
    assert_eq!(l.overlapping(150, 50), None, "fits the gap exactly");
    assert_eq!(l.overlapping(90, 10), None, "ends where a block starts");
}

#[test]
fn every_overlapping_block_is_found() {
    let mut l = ledger(&[(100, 10), (110, 10), (130, 10), (200, 10)]);
    let l = l.ordered();
    let found: Vec<_> = l.overlapping_all(105, 30).collect();
    assert_eq!(found, [(130, 10), (110, 10), (100, 10)]);
    assert_eq!(l.overlapping_all(140, 60).count(), 0);
}

#[test]
fn the_gap_around_a_range_reaches_the_neighbouring_blocks() {
    let mut l = ledger(&[(100, 10), (200, 10)]);
    let l = l.ordered();
    assert_eq!(l.gap_around(150, 10), Some((110, 200)));
    assert_eq!(
        l.gap_around(110, 90),
        Some((110, 200)),
        "fills the gap exactly"
    );
    assert_eq!(l.gap_around(10, 5), Some((0, 100)));
    assert_eq!(l.gap_around(300, 5), Some((210, u64::MAX)));
    assert_eq!(l.gap_around(105, 1), None, "inside a block");
    assert_eq!(l.gap_around(150, 51), None, "reaches into the block above");
    assert_eq!(l.gap_around(u64::MAX, 2), None, "overflowing range");
}

#[test]
fn every_change_of_blocks_advances_the_generation() {
    let mut l = ledger(&[(100, 10)]);
    let g = l.generation();
    assert!(l.set_cache(100, None));
    assert_eq!(l.generation(), g, "naming a cache moves no block");
    l.insert(200, 10);
    assert!(l.generation() > g);
    let g = l.generation();
    assert!(l.take_back(200, 9).is_err());
    assert_eq!(l.generation(), g, "a refused take-back changes nothing");
    l.take_back(200, 10).unwrap();
    assert!(l.generation() > g);
    let g = l.generation();
    l.drain();
    assert!(l.generation() > g);
}

#[test]
fn containment_needs_the_whole_range_inside_one_block() {
    // Asked of the blocks waiting outside the order, then of the order.
    let mut l = ledger(&[(100, 50), (150, 50)]);
    let near = l.nearby();
    assert_eq!(near.containing(100, 50), Some((100, 50)));
    assert_eq!(near.containing(120, 10), Some((100, 50)));
    assert_eq!(near.containing(140, 20), None, "spans two adjacent blocks");
    assert_eq!(near.containing(99, 2), None);
    assert_eq!(near.containing(u64::MAX, 2), None, "overflowing range");
    let l = l.ordered();
    assert_eq!(l.containing(100, 50), Some((100, 50)));
    assert_eq!(l.containing(120, 10), Some((100, 50)));
    assert_eq!(l.containing(140, 20), None, "spans two adjacent blocks");
    assert_eq!(l.containing(99, 2), None);
    assert_eq!(l.containing(u64::MAX, 2), None, "overflowing range");
}

#[test]
fn take_back_enforces_the_sized_free_rule_and_tells_double_from_unknown() {
    let mut l = ledger(&[(100, 50)]);
    assert_eq!(
        l.take_back(100, 49),
        Err(TakeBack::WrongSize { recorded: 50 })
    );
    assert_eq!(l.bytes(), 50, "a refused free changes nothing");
    assert!(l.take_back(100, 50).is_ok());
    assert_eq!(l.take_back(100, 50), Err(TakeBack::AlreadyFreed));
    assert_eq!(l.take_back(300, 50), Err(TakeBack::Unknown));
    assert_eq!(l.bytes(), 0);
    assert!(l.is_empty());
}

#[test]
fn remove_unless_keeps_a_block_its_test_holds_for_and_removes_any_other() {
    let mut l = ledger(&[(100, 50), (200, 30)]);
    l.set_cache(200, CacheId::new(7));
    let cached = |e: &Entry| e.cache.is_some();
    let held = Entry {
        size: 30,
        cache: CacheId::new(7),
    };
    assert_eq!(l.remove_unless(200, cached), Err(Some(held)));
    assert_eq!(
        l.get(200).map(|e| e.size),
        Some(30),
        "a kept block stays lent"
    );
    assert_eq!(l.bytes(), 80, "keeping changes nothing");
    assert_eq!(l.remove_unless(100, cached).map(|e| e.size), Ok(50));
    assert_eq!(l.remove_unless(100, cached), Err(None));
    assert_eq!(
        l.why_unknown(100),
        TakeBack::AlreadyFreed,
        "remembered as freed"
    );
    assert_eq!((l.len(), l.bytes()), (1, 30));
    l.check_consistent().unwrap();
}

#[derive(Debug, Clone)]
enum Op {
    Lend {
        slot: u64,
        size: u64,
    },
    TakeBack {
        slot: u64,
    },
    /// `whole`: a query of the whole order; otherwise a nearest-block query.
    Query {
        addr: u64,
        len: u64,
        whole: bool,
    },
}

/// Blocks sit in 64-byte slots, so any mix of lends is disjoint; queries span
/// several slots.
fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (0..96u64, 1..=64u64).prop_map(|(slot, size)| Op::Lend { slot, size }),
        3 => (0..96u64).prop_map(|slot| Op::TakeBack { slot }),
        2 => (0..96 * 64u64, 1..300u64, any::<bool>())
            .prop_map(|(addr, len, whole)| Op::Query { addr, len, whole }),
    ]
}

proptest::proptest! {
    // Under Miri, a few cases (each is thousands of times slower there), and no
    // failure file (Miri keeps the file system out).
    #![proptest_config(proptest::test_runner::Config {
        cases: if cfg!(miri) { 4 } else { 256 },
        failure_persistence: if cfg!(miri) { None } else { proptest::test_runner::Config::default().failure_persistence },
        ..proptest::test_runner::Config::default()
    })]
    /// However lends, take-backs and range queries interleave (blocks lent and
    /// taken back between queries, in any order, addresses lent again, the waiting
    /// list filling up or scanned), every query answers as a plain scan of the live
    /// blocks would.
    #[test]
    fn the_lazy_order_answers_every_query_as_a_full_scan_would(
        // Under Miri, a tenth of the operations: the ledger is safe code, and 400 took
        // most of Miri's twelve minutes in CI; the caches' tests are what Miri is for.
        ops in proptest::collection::vec(op(), 1..if cfg!(miri) { 40 } else { 400 }),
    ) {
        let mut l = Ledger::default();
        let mut live: BTreeMap<u64, u64> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Lend { slot, size } => {
                    let addr = slot * 64;
                    if let std::collections::btree_map::Entry::Vacant(v) = live.entry(addr) {
                        v.insert(size);
                        l.insert(addr, size);
                    }
                }
                Op::TakeBack { slot } => {
                    let addr = slot * 64;
                    match live.remove(&addr) {
                        Some(size) => proptest::prop_assert!(l.take_back(addr, size).is_ok()),
                        None => proptest::prop_assert!(l.take_back(addr, 1).is_err()),
                    }
                }
                Op::Query { addr, len, whole } => {
                    let end = addr + len;
                    let hits: Vec<(u64, u64)> = live
                        .iter()
                        .rev()
                        .map(|(&a, &s)| (a, s))
                        .filter(|&(a, s)| a < end && a + s > addr)
                        .collect();
                    let inside = live
                        .iter()
                        .map(|(&a, &s)| (a, s))
                        .find(|&(a, s)| a <= addr && end <= a + s);
                    let below = live.values().zip(live.keys()).map(|(s, a)| a + s).filter(|&e| e <= addr).max().unwrap_or(0);
                    let above = live.keys().copied().find(|&a| a >= end).unwrap_or(u64::MAX);
                    let gap = hits.is_empty().then_some((below, above));
                    if whole {
                        let order = l.ordered();
                        proptest::prop_assert_eq!(order.overlapping(addr, len).is_some(), !hits.is_empty());
                        proptest::prop_assert_eq!(order.overlapping_all(addr, len).collect::<Vec<_>>(), hits.clone());
                        proptest::prop_assert_eq!(order.containing(addr, len), inside);
                        proptest::prop_assert_eq!(order.gap_around(addr, len), gap);
                    } else {
                        let near = l.nearby();
                        proptest::prop_assert_eq!(near.overlapping(addr, len).is_some(), !hits.is_empty());
                        proptest::prop_assert_eq!(near.containing(addr, len), inside);
                        proptest::prop_assert_eq!(near.gap_around(addr, len), gap);
                        proptest::prop_assert!(l.unordered.len() <= SCAN_LIMIT);
                    }
                }
            }
            proptest::prop_assert_eq!(l.check_consistent(), Ok(()));
            proptest::prop_assert_eq!(l.len(), live.len());
            proptest::prop_assert!(l.unordered.len() <= UNORDERED_LIMIT);
        }
    }
}

#[test]
fn the_cost_of_the_live_blocks_returns_to_nothing_whatever_the_footprint() {
    // Host memory's kind of footprint, a large one, and one smaller than the size.
    for footprint in [
        (|size| size + 40) as fn(u64) -> u64,
        |size| size + 100_000,
        |size| size / 2,
    ] {
        let mut l = Ledger::with_footprint(footprint);
        let blocks: Vec<(u64, u64)> = (1..=20).map(|i| (i * 1_000_000, i * 48)).collect();
        for &(addr, size) in &blocks {
            l.insert(addr, size);
        }
        let expected: u64 = blocks.iter().map(|&(_, size)| footprint(size)).sum();
        assert_eq!(l.cost(), expected + 20 * LEDGER_ENTRY_COST);
        // Newest first, then oldest first: from the end of the waiting list and from
        // inside it, from the newest few and from the hash map.
        let (first, rest) = blocks.split_at(10);
        for &(addr, size) in rest.iter().rev().chain(first) {
            assert_eq!(l.take_back(addr, size).map(|e| e.size), Ok(size));
        }
        assert_eq!(l.cost(), 0, "every block's footprint left with it");
    }
}
