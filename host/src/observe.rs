//! Batched observation with leases (0.2.0 `observer`): what the host served an
//! observing policy's client without asking it, kept until it is delivered, and the
//! lease that bounds what the host may lend meanwhile.
//!
//! The lease is exact under threads. The policy answers `renew` from what it has seen;
//! what it has not seen yet is `undelivered`: bytes reserved for requests not yet told
//! to it (served from a magazine and waiting in `events`, or still being served) less
//! bytes given back into a magazine and not yet told. So the true headroom is the
//! policy's answer less `undelivered`, and a request is refused exactly when the
//! policy, seeing every call, would have refused it.
//!
//! Lock order: the chain's lock, then this one; a thread holding this one never waits
//! for the chain. The lock is taken outside the thread caches' protocol, so it takes
//! part in forks of its own ([`fork::Forkable`]): taken before the fork (a thread holds
//! it for a few instructions), let go after it on both sides, so a child never finds it
//! held by a thread it does not have. It is the standard library's lock: letting it go
//! in a child visits no table another thread may have held mid-change, as
//! parking_lot's unlock of a lock with waiters does (a child forked then hung there).

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use allocbox_ledger::platform::fork;

use allocbox_ledger::fasthash::FastMap;

pub(crate) use crate::wit::bindings_v2::exports::allocbox::policy::observer::{
    Detail, Events, Observation, Op, Survivors, Totals,
};

/// One thing served without asking the policy.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Event {
    pub(crate) op: Op,
    pub(crate) addr: u64,
    pub(crate) size: u64,
}

/// `events` as the policy asked to hear of them: in columns of bytes, summed, or only
/// those of blocks that outlive the batch.
pub(crate) fn observation(events: &[Event], detail: Detail) -> Observation {
    match detail {
        Detail::Events => Observation::Events(columns(events.iter())),
        Detail::Survivors => Observation::Survivors(survivors(events)),
        Detail::Totals => {
            let mut totals = Totals {
                lent_blocks: 0,
                lent_bytes: 0,
                freed_blocks: 0,
                freed_bytes: 0,
                lent_by_bits: Vec::new(),
            };
            for e in events {
                if e.op == Op::Free {
                    totals.freed_blocks += 1;
                    totals.freed_bytes += e.size;
                    continue;
                }
                totals.lent_blocks += 1;
                totals.lent_bytes += e.size;
                let bits = (u64::BITS - e.size.leading_zeros()) as usize;
                if totals.lent_by_bits.len() < bits {
                    totals.lent_by_bits.resize(bits, 0);
                }
                totals.lent_by_bits[bits.saturating_sub(1)] += 1;
            }
            Observation::Totals(totals)
        }
    }
}

/// Events in the columns of bytes of `events`.
fn columns<'a>(events: impl Iterator<Item = &'a Event> + Clone) -> Events {
    Events {
        ops: events.clone().map(|e| e.op as u8).collect(),
        addrs: events.clone().flat_map(|e| e.addr.to_le_bytes()).collect(),
        sizes: events.flat_map(|e| e.size.to_le_bytes()).collect(),
    }
}

/// The events of blocks that outlive the batch `events`, the others summed. The ledger
/// lends an address again only after it was given back, so a free pairs with the
/// latest lend of its address in the batch, if any.
fn survivors(events: &[Event]) -> Survivors {
    let mut lent_at: FastMap<u64, usize> = FastMap::default();
    lent_at.reserve(events.len());
    let mut transient = vec![false; events.len()];
    let (mut transient_blocks, mut transient_bytes) = (0u64, 0u64);
    // The level of bytes and blocks lent, from 0 at the batch's start, and its peak.
    let (mut bytes, mut blocks, mut peak_bytes, mut peak_blocks) = (0i128, 0i64, 0i128, 0i64);
    for (i, e) in events.iter().enumerate() {
        if e.op == Op::Free {
            bytes -= i128::from(e.size);
            blocks -= 1;
            if let Some(lent) = lent_at.remove(&e.addr) {
                transient[lent] = true;
                transient[i] = true;
                transient_blocks += 1;
                transient_bytes = u64::saturating_add(transient_bytes, e.size);
            }
        } else {
            bytes += i128::from(e.size);
            blocks += 1;
            peak_bytes = peak_bytes.max(bytes);
            peak_blocks = peak_blocks.max(blocks);
            lent_at.insert(e.addr, i);
        }
    }
    let listed = || {
        events
            .iter()
            .zip(&transient)
            .filter(|&(_, &gone)| !gone)
            .map(|(e, _)| e)
    };
    let places = (0u32..)
        .zip(&transient)
        .filter(|&(_, &gone)| !gone)
        .flat_map(|(place, _)| place.to_le_bytes())
        .collect();
    Survivors {
        events: columns(listed()),
        places,
        count: u32::try_from(events.len()).expect("a batch is at most the batch limit, a u32"),
        transient_blocks,
        transient_bytes,
        // Both at most the batch's lent sum, which fits the u64 sizes lent.
        peak_bytes_rise: u64::try_from(peak_bytes).unwrap_or(u64::MAX),
        peak_blocks_rise: peak_blocks as u64,
    }
}

/// One observing handler's undelivered events and lease.
#[derive(Debug)]
pub(crate) struct Observations {
    /// Events delivered per `observe` at most; a full batch is delivered at once.
    batch: usize,
    detail: Detail,
    state: Mutex<State>,
    /// In a child forked while a thread of its parent kept `state` past the fork's
    /// patience (stopped, say): that lock is the gone thread's forever, and the child
    /// goes on with a state of its own, its lease spent, so its next request asks the
    /// policy. What the gone thread was telling is lost.
    orphaned: OnceLock<Mutex<State>>,
    /// How long a fork waits for a thread to let `state` go.
    fork_patience: Duration,
}

#[derive(Debug)]
struct State {
    /// Bytes the host may still lend without asking; none: no lease. Wider than a
    /// size: frees may return more than a lease of `u64::MAX` left, before the
    /// reservations they balance are cancelled.
    lease: Option<i128>,
    events: Vec<Event>,
    /// Bytes lent (reserved) less bytes given back that the policy has not been told of.
    undelivered: i128,
}

fn signed(size: u64) -> i128 {
    i128::from(size)
}

impl Observations {
    /// Observations whose forks ([`Self::take_part_in_forks`]) wait at most
    /// `fork_patience` for a thread to let their lock go.
    pub(crate) fn new(
        batch: u32,
        lease: Option<u64>,
        detail: Detail,
        fork_patience: Duration,
    ) -> Arc<Self> {
        Arc::new(Observations {
            batch: batch.max(1) as usize,
            detail,
            state: Mutex::new(State {
                lease: lease.map(signed),
                events: Vec::new(),
                undelivered: 0,
            }),
            orphaned: OnceLock::new(),
            fork_patience,
        })
    }

    /// Take part in every fork from now on: registered after the handler's caches, so
    /// that a fork takes the books' lock first, as every thread does.
    pub(crate) fn take_part_in_forks(self: &Arc<Self>) {
        fork::register(Arc::downgrade(self) as std::sync::Weak<dyn fork::Forkable>);
    }

    /// The lock of the state in use: the first one, or the one a forked child took up.
    #[inline]
    fn mutex(&self) -> &Mutex<State> {
        self.orphaned.get().unwrap_or(&self.state)
    }

    /// The state, locked (a thread that panicked while holding it left it whole: each
    /// change is one statement).
    #[inline]
    fn lock(&self) -> MutexGuard<'_, State> {
        self.mutex().lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn batch(&self) -> usize {
        self.batch
    }

    pub(crate) fn detail(&self) -> Detail {
        self.detail
    }

    /// Take `size` bytes from the lease for a request about to be served; false when
    /// the lease does not cover it (the policy must renew it first).
    pub(crate) fn reserve(&self, size: u64) -> bool {
        let size = signed(size);
        let mut s = self.lock();
        match s.lease {
            Some(left) if left < size => return false,
            Some(left) => s.lease = Some(left - size),
            None => {}
        }
        s.undelivered += size;
        true
    }

    /// A reserved request got no block.
    pub(crate) fn cancel(&self, size: u64) {
        let size = signed(size);
        let mut s = self.lock();
        if let Some(left) = &mut s.lease {
            *left += size;
        }
        s.undelivered -= size;
    }

    /// A reserved request was served from a magazine with the block at `addr`: the
    /// policy is told later. True when a batch is full and should be delivered now.
    pub(crate) fn lent(&self, op: Op, addr: u64, size: u64) -> bool {
        let mut s = self.lock();
        s.events.push(Event { op, addr, size });
        s.events.len() >= self.batch
    }

    /// A reserved request was served by the policy itself: it knows.
    pub(crate) fn served_by_policy(&self, size: u64) {
        self.lock().undelivered -= signed(size);
    }

    /// The client gave back `size` bytes: to a magazine (`kept`, the policy is told
    /// later), or to the policy itself. True when a batch is full.
    pub(crate) fn returned(&self, addr: u64, size: u64, kept: bool) -> bool {
        let size_signed = signed(size);
        let mut s = self.lock();
        if let Some(left) = &mut s.lease {
            *left += size_signed;
        }
        if !kept {
            return false;
        }
        s.undelivered -= size_signed;
        s.events.push(Event {
            op: Op::Free,
            addr,
            size,
        });
        s.events.len() >= self.batch
    }

    /// A block the policy resized shrank by `size` bytes: the lease gets them back.
    pub(crate) fn shrunk(&self, size: u64) {
        if let Some(left) = &mut self.lock().lease {
            *left += signed(size);
        }
    }

    pub(crate) fn pending(&self) -> bool {
        !self.lock().events.is_empty()
    }

    /// The events to deliver now, oldest first; the policy knows them from here on.
    pub(crate) fn take(&self) -> Vec<Event> {
        let mut s = self.lock();
        let events = std::mem::take(&mut s.events);
        for e in &events {
            s.undelivered += match e.op {
                Op::Free => signed(e.size),
                Op::Malloc | Op::Calloc => -signed(e.size),
            };
        }
        events
    }

    /// The policy renewed the lease to `headroom` bytes, given what it has seen.
    pub(crate) fn renewed(&self, headroom: u64) {
        let mut s = self.lock();
        s.lease = Some(signed(headroom) - s.undelivered);
    }
}

/// What [`Observations`] holds across a fork: the lock of its state, when a thread let
/// it go within the patience.
struct ForkHeld(fork::HeldLock<Observations, State>);

impl fork::Forkable for Observations {
    fn before_fork(self: Arc<Self>) -> Box<dyn fork::AfterFork> {
        let give_up = Instant::now() + self.fork_patience;
        Box::new(ForkHeld(fork::HeldLock::take(
            self,
            Observations::mutex,
            give_up,
        )))
    }
}

impl fork::AfterFork for ForkHeld {
    fn after_fork(self: Box<Self>, in_child: bool) {
        if in_child && !self.0.taken() {
            // The child's only thread is this one: no call can see the state between
            // the old lock and the new.
            let _ = self.0.owner().orphaned.set(Mutex::new(State {
                lease: Some(0),
                events: Vec::new(),
                undelivered: 0,
            }));
        }
    }
}

#[cfg(test)]
mod tests {
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
            let u64s = |c: &[u8]| -> Vec<u64> {
                words::<8>(c).into_iter().map(u64::from_le_bytes).collect()
            };
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
}
