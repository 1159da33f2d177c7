//! Where a link gets its memory from: the host's own memory, or the next link of the
//! chain. A failing upstream policy is absorbed into "none" here, so the healthy guest
//! that called it is never trapped for its upstream's fault.

use super::Link;
use crate::clock::Deadline;
use crate::ledger::{Ledger, TakeBack};
use crate::system::SystemMemory;

/// Where a link gets its memory from.
#[derive(Debug)]
pub(crate) enum Upstream {
    /// Boxed: a link's state holds its upstream inline, and most links' is a policy.
    System(Box<SystemMemory>),
    Policy(Box<Link>),
}

impl Upstream {
    /// The blocks this upstream lent: what the link above it owns.
    pub(crate) fn lent(&self) -> &Ledger {
        match self {
            Upstream::System(s) => &s.lent,
            Upstream::Policy(l) => &l.store.data().lent,
        }
    }

    pub(crate) fn lent_mut(&mut self) -> &mut Ledger {
        match self {
            Upstream::System(s) => &mut s.lent,
            Upstream::Policy(l) => l.lent_mut(),
        }
    }

    // The methods below absorb a failing upstream policy into "none": the caller is a
    // healthy guest that must not be trapped for its upstream's fault. The failure is
    // kept as the failing link's unreported failure and travels up as the calls return
    // (`LinkState::upstream_call`) to the handler, which stops the chain.
    // A give-back (free, realloc) is checked by the caller before it reaches a policy.
    // A policy upstream runs under the deadline of the embedder's call that caused the
    // call, which its own calls move on as host work is excused in them.

    pub(super) fn malloc(&mut self, deadline: &mut Deadline, size: u64) -> u64 {
        match self {
            Upstream::System(s) => s.malloc(size, false),
            Upstream::Policy(l) => l.malloc(deadline, size).unwrap_or(0),
        }
    }

    pub(super) fn calloc(&mut self, deadline: &mut Deadline, nelem: u64, elsize: u64) -> u64 {
        match self {
            Upstream::System(s) => match nelem.checked_mul(elsize) {
                Some(size) => s.malloc(size.max(1), true),
                None => 0,
            },
            Upstream::Policy(l) => l.calloc(deadline, nelem, elsize).unwrap_or(0),
        }
    }

    pub(super) fn realloc(
        &mut self,
        deadline: &mut Deadline,
        ptr: u64,
        old: u64,
        new: u64,
    ) -> Result<u64, TakeBack> {
        match self {
            Upstream::System(s) => s.realloc(ptr, old, new),
            Upstream::Policy(l) => Ok(l.realloc(deadline, ptr, old, new).unwrap_or(0)),
        }
    }

    #[inline]
    pub(crate) fn free(
        &mut self,
        deadline: &mut Deadline,
        ptr: u64,
        size: u64,
    ) -> Result<(), TakeBack> {
        match self {
            Upstream::System(s) => s.free(ptr, size),
            Upstream::Policy(l) => {
                let _ = l.free(deadline, ptr, size);
                Ok(())
            }
        }
    }

    pub(super) fn malloc_many(
        &mut self,
        deadline: &mut Deadline,
        size: u64,
        count: u32,
    ) -> Vec<u64> {
        match self {
            Upstream::System(s) => (0..count)
                .map_while(|_| Some(s.malloc(size, false)).filter(|&a| a != 0))
                .collect(),
            Upstream::Policy(l) => l.malloc_many(deadline, size, count).unwrap_or_default(),
        }
    }

    pub(super) fn trim(&mut self, deadline: &mut Deadline) {
        if let Upstream::Policy(l) = self {
            // A failing trim poisons that link; its blocks are released host-side.
            let _ = l.trim(deadline);
        }
    }
}
