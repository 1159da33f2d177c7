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
mod tests;
