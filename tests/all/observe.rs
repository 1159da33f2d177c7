//! Batched observation with leases (0.2.0 `observer`): the host serves an observing
//! policy's client from magazines, tells it what it served, and refuses exactly where
//! the policy asked on every call would have.

use std::ptr::NonNull;
use std::sync::Barrier;

use allocbox::{Handler, HandlerBuilder, Runtime};

use super::support::*;

/// The `quota` fixture capping its client at `max_bytes`, asked on every call (`None`)
/// or observing with the `detail` given (`events`, `totals`, `survivors`).
fn quota_as(max_bytes: u64, detail: Option<&str>) -> Handler {
    let max = max_bytes.to_string();
    let mut config = vec![("max-bytes", max.as_str())];
    if let Some(detail) = detail {
        config.extend([("observe", "true"), ("detail", detail)]);
    }
    HandlerBuilder::new(Runtime::shared())
        .link_with(&load(&allocbox_artifacts::QUOTA), &config)
        .build()
        .unwrap()
}

fn quota(max_bytes: u64, observe: bool) -> Handler {
    quota_as(max_bytes, observe.then_some("events"))
}

fn counter(h: &Handler, name: &str) -> u64 {
    let top = h.link_stats().unwrap().remove(0);
    top.counters.iter().find(|(n, _)| n == name).unwrap().1
}

/// Every block `threads` threads get from `h`, `size` bytes each, until each is
/// refused once.
fn until_refused(h: &Handler, threads: usize, size: usize) -> Vec<NonNull<u8>> {
    let start = Barrier::new(threads);
    let got: Vec<Vec<usize>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    let mut mine = Vec::new();
                    while let Some(p) = h.malloc(size).unwrap() {
                        mine.push(p.as_ptr() as usize);
                    }
                    mine
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    got.into_iter()
        .flatten()
        .map(|p| NonNull::new(p as *mut u8).unwrap())
        .collect()
}

#[test]
fn a_quota_over_leases_refuses_at_the_same_byte_as_asked_on_every_call_from_4_threads() {
    const QUOTA: u64 = 1_000_000;
    for size in [1000, 100_000] {
        let mut totals = Vec::new();
        for form in [None, Some("events"), Some("totals"), Some("survivors")] {
            let h = quota_as(QUOTA, form);
            let blocks = until_refused(&h, 4, size);
            let total = blocks.len() as u64 * size as u64;
            assert_eq!(h.stats().unwrap().live_bytes, total);
            assert_eq!(counter(&h, "lent"), total, "{form:?}");
            // A free gives room back: one more block fits, and no more.
            h.free(Some(blocks[0]), size).unwrap();
            let again = h.malloc(size).unwrap().expect("room after a free");
            assert_eq!(h.malloc(size).unwrap(), None);
            h.free(Some(again), size).unwrap();
            for &p in &blocks[1..] {
                h.free(Some(p), size).unwrap();
            }
            assert_eq!(counter(&h, "lent"), 0);
            h.leak_check().unwrap();
            totals.push(total);
        }
        assert!(
            totals.iter().all(|&t| t == totals[0]),
            "{size}-byte blocks: {totals:?}"
        );
        assert_eq!(totals[0], QUOTA / size as u64 * size as u64);
    }
}

#[test]
fn an_observing_policy_is_told_in_batches_not_asked_on_every_call() {
    let h = quota(u64::MAX, true);
    for _ in 0..1000 {
        let p = h.malloc(64).unwrap().unwrap();
        h.free(Some(p), 64).unwrap();
    }
    let stats = h.stats().unwrap();
    let link = h.link_stats().unwrap().remove(0);
    assert_eq!(stats.mallocs, 1000);
    assert_eq!(link.mallocs, 0, "no malloc asked of the policy");
    // 2000 events in batches of at most 64.
    assert!(
        (32..=40).contains(&link.observed),
        "{} deliveries",
        link.observed
    );
    assert_eq!(counter(&h, "lent"), 0);
}

#[test]
fn a_lease_covers_growth_by_realloc_and_large_blocks_the_policy_serves_itself() {
    let h = quota(200_000, true);
    let small = h.malloc(1000).unwrap().unwrap();
    let grown = h
        .realloc(Some(small), 150_000)
        .unwrap()
        .expect("within the quota");
    assert_eq!(counter(&h, "lent"), 150_000);
    assert_eq!(h.malloc(100_000).unwrap(), None, "past the quota");
    let large = h.malloc(50_000).unwrap().expect("exactly at the quota");
    assert_eq!(h.realloc(Some(large), 50_001).unwrap(), None);
    let shrunk = h.realloc(Some(grown), 100).unwrap().unwrap();
    assert!(h.malloc(100_000).unwrap().is_some_and(|p| {
        h.free(Some(p), 100_000).unwrap();
        true
    }));
    h.free(Some(shrunk), 100).unwrap();
    h.free(Some(large), 50_000).unwrap();
    h.leak_check().unwrap();
}

#[test]
fn a_request_past_the_lease_is_refused_through_renew_and_counted_as_failed() {
    // A quota of 0: every request asks `renew`, which answers 0, so the client is out
    // of memory and the policy goes on.
    let h = quota(0, true);
    assert_eq!(h.malloc(10).unwrap(), None);
    assert_eq!(counter(&h, "refused"), 1);
    assert_eq!(h.stats().unwrap().failed, 1);
    assert!(h.failure().is_none());
}

/// Found by `allocbox check` on the observing `quota` fixture: when a magazine refill
/// got no block, the policy served the request itself and was also told of it as an
/// event, counting it twice.
#[test]
fn a_block_the_policy_serves_itself_when_a_refill_fails_is_counted_once() {
    let adversary = allocbox::Adversary::new(1);
    let h = HandlerBuilder::new(Runtime::shared())
        .link_with(&load(&allocbox_artifacts::QUOTA), &[("observe", "true")])
        .checked(true)
        .adversary(std::sync::Arc::clone(&adversary))
        .build()
        .unwrap();
    adversary.refuse_after(0);
    let block = h
        .calloc(40, 21)
        .unwrap()
        .expect("served by the policy itself");
    assert_eq!(counter(&h, "lent"), 840);
    h.free(Some(block), 840).unwrap();
    assert_eq!(counter(&h, "lent"), 0);
    h.leak_check().unwrap();
}

mod agreement {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Step {
        Malloc(usize),
        Calloc(usize),
        Realloc(usize, usize),
        Free(usize),
    }

    fn size() -> impl Strategy<Value = usize> {
        prop_oneof![1usize..2000, 60_000usize..70_000, Just(100_000usize)]
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            size().prop_map(Step::Malloc),
            size().prop_map(Step::Calloc),
            (any::<usize>(), size()).prop_map(|(i, s)| Step::Realloc(i, s)),
            any::<usize>().prop_map(Step::Free),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// What an observing policy counts from what it is told and from its own calls
        /// is what the host lent, whenever it is told (every `told_every` steps), with
        /// upstream requests refused now and then; its peak is the host's where the
        /// form tells peaks; and a quota is never passed.
        #[test]
        fn an_observing_policy_s_count_matches_the_host_s_whenever_it_is_told(
            steps in proptest::collection::vec(step(), 1..60),
            refuse_every in 2u32..9,
            detail in prop_oneof![Just("events"), Just("totals"), Just("survivors")],
            told_every in 1usize..8,
        ) {
            const QUOTA: u64 = 400_000;
            let adversary = allocbox::Adversary::new(7);
            adversary.refuse_every(refuse_every);
            let h = HandlerBuilder::new(Runtime::shared())
                .link_with(
                    &load(&allocbox_artifacts::QUOTA),
                    &[("max-bytes", "400000"), ("observe", "true"), ("detail", detail)],
                )
                .checked(true)
                .adversary(std::sync::Arc::clone(&adversary))
                .build()
                .unwrap();
            let mut live: Vec<(NonNull<u8>, usize)> = Vec::new();
            for (n, step) in steps.into_iter().enumerate() {
                match step {
                    Step::Malloc(size) => live.extend(h.malloc(size).unwrap().map(|p| (p, size))),
                    Step::Calloc(size) => live.extend(h.calloc(size, 1).unwrap().map(|p| (p, size))),
                    Step::Realloc(i, size) if !live.is_empty() => {
                        let i = i % live.len();
                        if let Some(p) = h.realloc(Some(live[i].0), size).unwrap() {
                            live[i] = (p, size);
                        }
                    }
                    Step::Free(i) if !live.is_empty() => {
                        let (p, size) = live.swap_remove(i % live.len());
                        h.free(Some(p), size).unwrap();
                    }
                    _ => {}
                }
                if n % told_every != 0 {
                    continue;
                }
                let stats = h.stats().unwrap();
                prop_assert_eq!(counter(&h, "lent"), stats.live_bytes);
                prop_assert!(stats.live_bytes <= QUOTA);
                if detail != "totals" {
                    prop_assert_eq!(counter(&h, "peak"), stats.peak_bytes);
                }
            }
            for (p, size) in live {
                h.free(Some(p), size).unwrap();
            }
            prop_assert_eq!(counter(&h, "lent"), 0);
            h.leak_check().unwrap();
        }
    }
}

#[test]
fn an_observing_batch_past_the_batch_limit_stops_the_policy_at_start_naming_it() {
    let err = HandlerBuilder::new(Runtime::shared())
        .link_with(
            &load(&allocbox_artifacts::QUOTA),
            &[("observe", "true"), ("batch", "5000")],
        )
        .build()
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("quota") && text.contains("5000") && text.contains("4096"),
        "{text}"
    );
}
