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
//! for the chain.

use parking_lot::Mutex;

pub(crate) use crate::link::bindings_v2::exports::allocbox::policy::observer::{Event, Op};

/// One observing handler's undelivered events and lease.
#[derive(Debug)]
pub(crate) struct Observations {
    /// Events delivered per `observe` at most; a full batch is delivered at once.
    batch: usize,
    state: Mutex<State>,
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
    pub(crate) fn new(batch: u32, lease: Option<u64>) -> Self {
        Observations {
            batch: batch.max(1) as usize,
            state: Mutex::new(State {
                lease: lease.map(signed),
                events: Vec::new(),
                undelivered: 0,
            }),
        }
    }

    pub(crate) fn batch(&self) -> usize {
        self.batch
    }

    /// Take `size` bytes from the lease for a request about to be served; false when
    /// the lease does not cover it (the policy must renew it first).
    pub(crate) fn reserve(&self, size: u64) -> bool {
        let size = signed(size);
        let mut s = self.state.lock();
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
        let mut s = self.state.lock();
        if let Some(left) = &mut s.lease {
            *left += size;
        }
        s.undelivered -= size;
    }

    /// A reserved request was served from a magazine with the block at `addr`: the
    /// policy is told later. True when a batch is full and should be delivered now.
    pub(crate) fn lent(&self, op: Op, addr: u64, size: u64) -> bool {
        let mut s = self.state.lock();
        s.events.push(Event { op, addr, size });
        s.events.len() >= self.batch
    }

    /// A reserved request was served by the policy itself: it knows.
    pub(crate) fn served_by_policy(&self, size: u64) {
        self.state.lock().undelivered -= signed(size);
    }

    /// The client gave back `size` bytes: to a magazine (`kept`, the policy is told
    /// later), or to the policy itself. True when a batch is full.
    pub(crate) fn returned(&self, addr: u64, size: u64, kept: bool) -> bool {
        let size_signed = signed(size);
        let mut s = self.state.lock();
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
        if let Some(left) = &mut self.state.lock().lease {
            *left += signed(size);
        }
    }

    pub(crate) fn pending(&self) -> bool {
        !self.state.lock().events.is_empty()
    }

    /// The events to deliver now, oldest first; the policy knows them from here on.
    pub(crate) fn take(&self) -> Vec<Event> {
        let mut s = self.state.lock();
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
        let mut s = self.state.lock();
        s.lease = Some(signed(headroom) - s.undelivered);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_taken_by_lending_and_given_back_by_frees() {
        let obs = Observations::new(8, Some(100));
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
        let obs = Observations::new(8, Some(0));
        // Another thread reserved 30 bytes it has not finished serving.
        obs.state.lock().lease = Some(30);
        assert!(obs.reserve(30));
        // The policy, not knowing of them, says 100 bytes are left under its quota.
        obs.renewed(100);
        assert!(obs.reserve(70));
        assert!(!obs.reserve(1), "exactly at the quota");
        // Once it is told of a free of 20 kept in a magazine, 20 more fit.
        assert!(!obs.returned(0x2000, 20, true));
        assert!(obs.reserve(20));
    }

    #[test]
    fn a_full_batch_asks_for_delivery() {
        let obs = Observations::new(2, None);
        assert!(obs.reserve(u64::MAX));
        assert!(!obs.lent(Op::Malloc, 1, 8));
        assert!(obs.lent(Op::Calloc, 2, 8));
        let taken = obs.take();
        assert_eq!(taken.len(), 2);
        assert!(!obs.pending());
    }
}
