use super::*;

fn observations(batch: u32, lease: Option<u64>) -> Arc<Observations> {
    Observations::new(batch, lease, Detail::Events, Duration::from_millis(100))
}

#[test]
fn a_lease_is_taken_by_lending_and_given_back_by_frees() {
    let obs = observations(8, Some(100));
    assert!(obs.reserve(60));
    assert!(!obs.reserve(60), "40 left");
    assert!(!obs.lent(Op::Malloc, 0x1000, 60));
    assert!(!obs.returned(0x1000, 60, true));
    assert!(obs.reserve(100));
    obs.cancel(100);
    assert_eq!(obs.take().len(), 2);
}

#[test]
fn a_renewal_counts_what_the_policy_has_not_seen() {
    let obs = observations(8, Some(0));
    // Another thread reserved 30 bytes it has not finished serving.
    obs.lock().lease = Some(30);
    assert!(obs.reserve(30));
    // The policy, not knowing of them, says 100 bytes are left under its quota.
    obs.renewed(100);
    assert!(obs.reserve(70));
    assert!(!obs.reserve(1), "exactly at the quota");
    // Once it is told of a free of 20 kept in a magazine, 20 more fit.
    assert!(!obs.returned(0x2000, 20, true));
    assert!(obs.reserve(20));
}

/// A fork whose patience ran out while another thread kept the lock: the child
/// goes on with a state of its own (the lease spent, so the policy is asked), and
/// never waits for the lock of the thread it does not have.
#[test]
fn a_child_forked_while_a_thread_kept_the_lock_past_the_patience_goes_on_without_it() {
    use fork::Forkable;
    let obs = observations(8, Some(100));
    // As if another thread were stopped inside `reserve` when the process forked.
    std::mem::forget(obs.lock());
    let held = Arc::clone(&obs).before_fork();
    held.after_fork(true);
    assert_eq!(obs.lock().lease, Some(0));
    assert!(!obs.reserve(1), "the policy is asked first");
    obs.renewed(100);
    assert!(obs.reserve(1));
}

/// The lock held by another thread at the moment of the fork is waited for, taken
/// across the fork and let go on both sides.
#[test]
fn a_fork_waits_for_the_thread_holding_the_lock_and_lets_it_go_after() {
    use fork::Forkable;
    let obs = observations(8, Some(100));
    let (locked, release) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
    std::thread::scope(|s| {
        s.spawn(|| {
            let guard = obs.lock();
            locked.wait();
            release.wait();
            drop(guard);
        });
        locked.wait();
        s.spawn(|| release.wait());
        let held = Arc::clone(&obs).before_fork();
        assert!(obs.mutex().try_lock().is_err(), "held across the fork");
        held.after_fork(true);
    });
    assert!(obs.orphaned.get().is_none());
    assert!(obs.reserve(100));
}

#[test]
fn a_full_batch_asks_for_delivery() {
    let obs = observations(2, None);
    assert!(obs.reserve(u64::MAX));
    assert!(!obs.lent(Op::Malloc, 1, 8));
    assert!(obs.lent(Op::Calloc, 2, 8));
    let taken = obs.take();
    assert_eq!(taken.len(), 2);
    assert!(!obs.pending());
}

fn event(op: Op, addr: u64, size: u64) -> Event {
    Event { op, addr, size }
}

fn words<const N: usize>(column: &[u8]) -> Vec<[u8; N]> {
    column.as_chunks::<N>().0.to_vec()
}

#[test]
fn survivors_list_only_blocks_that_cross_the_batch_and_keep_their_places() {
    let events = [
        // Lent before the batch, given back in it: listed.
        event(Op::Free, 0x10, 5),
        // Lent and given back within it: counted, and its peak kept.
        event(Op::Malloc, 0x20, 100),
        event(Op::Calloc, 0x30, 7),
        event(Op::Free, 0x20, 100),
        // The same address lent again, and kept past the batch: listed.
        event(Op::Malloc, 0x20, 8),
        event(Op::Free, 0x30, 7),
    ];
    let Observation::Survivors(s) = observation(&events, Detail::Survivors) else {
        panic!("survivors asked for");
    };
    assert_eq!(s.events.ops, [2, 0]);
    let addrs: Vec<u64> = words(&s.events.addrs)
        .into_iter()
        .map(u64::from_le_bytes)
        .collect();
    assert_eq!(addrs, [0x10, 0x20]);
    let places: Vec<u32> = words(&s.places)
        .into_iter()
        .map(u32::from_le_bytes)
        .collect();
    assert_eq!(places, [0, 4]);
    assert_eq!(s.count, 6);
    assert_eq!((s.transient_blocks, s.transient_bytes), (2, 107));
    // From -5 bytes and -1 block after the first free: up to 102 bytes, 1 block.
    assert_eq!((s.peak_bytes_rise, s.peak_blocks_rise), (102, 1));
}

#[test]
fn a_batch_of_frees_only_rises_to_no_peak() {
    let events = [event(Op::Free, 0x10, 5), event(Op::Free, 0x20, 5)];
    let Observation::Survivors(s) = observation(&events, Detail::Survivors) else {
        panic!("survivors asked for");
    };
    assert_eq!((s.peak_bytes_rise, s.peak_blocks_rise), (0, 0));
    assert_eq!(s.events.ops, [2, 2]);
}

mod survivors_model {
    use std::collections::BTreeMap;

    use super::*;
    use proptest::prelude::*;

    /// A batch the ledger could have made: blocks live before it, then lends of
    /// addresses not lent and gives-back of lent ones, an address lent again only
    /// after it was given back.
    fn batch() -> impl Strategy<Value = (BTreeMap<u64, u64>, Vec<Event>)> {
        let before = proptest::collection::btree_map(0u64..16, 1u64..100, 0..8);
        let steps = proptest::collection::vec((any::<bool>(), 0u64..16, 1u64..100), 0..64);
        (before, steps).prop_map(|(before, steps)| {
            let mut live = before.clone();
            let mut events = Vec::new();
            for (lend, addr, size) in steps {
                match (lend, live.get(&addr).copied()) {
                    (true, None) => {
                        live.insert(addr, size);
                        let op = if size % 2 == 0 {
                            Op::Malloc
                        } else {
                            Op::Calloc
                        };
                        events.push(Event { op, addr, size });
                    }
                    (false, Some(size)) => {
                        live.remove(&addr);
                        events.push(Event {
                            op: Op::Free,
                            addr,
                            size,
                        });
                    }
                    _ => {}
                }
            }
            (before, events)
        })
    }

    fn unpacked(s: &Survivors) -> Vec<(u32, Event)> {
        let ops = s.events.ops.iter().map(|&op| match op {
            0 => Op::Malloc,
            1 => Op::Calloc,
            _ => Op::Free,
        });
        let u64s =
            |c: &[u8]| -> Vec<u64> { words::<8>(c).into_iter().map(u64::from_le_bytes).collect() };
        let places = words::<4>(&s.places).into_iter().map(u32::from_le_bytes);
        let events = ops
            .zip(u64s(&s.events.addrs))
            .zip(u64s(&s.events.sizes))
            .map(|((op, addr), size)| Event { op, addr, size });
        places.zip(events).collect()
    }

    proptest! {
        /// A policy that applies only the survivors to what it knew before the
        /// batch knows what one told every event knows: the same live blocks, the
        /// same lends, each survivor at its own place, and the same peaks.
        #[test]
        fn survivors_tell_what_every_event_tells((before, events) in batch()) {
            let Observation::Survivors(s) = observation(&events, Detail::Survivors) else {
                panic!("survivors asked for");
            };
            let listed = unpacked(&s);
            prop_assert_eq!(s.count as usize, events.len());
            let mut last = None;
            for &(place, e) in &listed {
                let at = events[place as usize];
                prop_assert_eq!((at.op, at.addr, at.size), (e.op, e.addr, e.size));
                prop_assert!(last < Some(place), "places in order");
                last = Some(place);
            }
            let apply = |live: &mut BTreeMap<u64, u64>, e: &Event| match e.op {
                Op::Free => {
                    live.remove(&e.addr);
                }
                _ => {
                    live.insert(e.addr, e.size);
                }
            };
            let (mut told_all, mut told_survivors) = (before.clone(), before.clone());
            let (mut bytes, mut blocks, mut peak_bytes, mut peak_blocks) = (0i64, 0i64, 0, 0);
            for e in &events {
                apply(&mut told_all, e);
                let sign = if e.op == Op::Free { -1 } else { 1 };
                bytes += sign * e.size as i64;
                blocks += sign;
                peak_bytes = peak_bytes.max(bytes);
                peak_blocks = peak_blocks.max(blocks);
            }
            for (_, e) in &listed {
                apply(&mut told_survivors, e);
            }
            prop_assert_eq!(told_survivors, told_all);
            let lends = |es: &mut dyn Iterator<Item = &Event>| {
                es.filter(|e| e.op != Op::Free).count() as u64
            };
            let listed_lends = lends(&mut listed.iter().map(|(_, e)| e));
            prop_assert_eq!(listed_lends + s.transient_blocks, lends(&mut events.iter()));
            prop_assert_eq!((s.peak_bytes_rise, s.peak_blocks_rise), (peak_bytes as u64, peak_blocks as u64));
        }
    }
}

#[test]
fn totals_sum_the_events_and_count_sizes_by_bits() {
    let events = [
        Event {
            op: Op::Malloc,
            addr: 1,
            size: 1,
        },
        Event {
            op: Op::Calloc,
            addr: 2,
            size: 1000,
        },
        Event {
            op: Op::Free,
            addr: 1,
            size: 1,
        },
    ];
    let Observation::Totals(t) = observation(&events, Detail::Totals) else {
        panic!("totals asked for");
    };
    assert_eq!(
        (t.lent_blocks, t.lent_bytes, t.freed_blocks, t.freed_bytes),
        (2, 1001, 1, 1)
    );
    assert_eq!(t.lent_by_bits.len(), 10);
    assert_eq!((t.lent_by_bits[0], t.lent_by_bits[9]), (1, 1));
    let Observation::Events(e) = observation(&events, Detail::Events) else {
        panic!("events asked for");
    };
    assert_eq!(e.ops, [0, 1, 2]);
    assert_eq!(e.sizes.len(), 24);
}
