//! A clearance: a stretch of upstream memory found inside one held block and clear of
//! every lent block, with both ledgers' generations, so later accesses, answers and
//! give-backs inside it skip the ledger queries while nothing has changed.

use super::LinkState;
use crate::gpu::Placement;

impl LinkState {
    /// Is `[at, at+len)` (`len` at least 1) inside the current [`Clearance`]: upstream
    /// memory this policy holds, not held back, overlapping no block it lent?
    pub(super) fn cleared(&self, at: u64, len: u64) -> bool {
        self.clearance.is_some_and(|c| {
            c.upstream == self.upstream.lent().generation()
                && c.lent == self.lent.generation()
                && self.transit.holds_back_nothing()
                && at >= c.start
                && at.checked_add(len).is_some_and(|end| end <= c.end)
        })
    }

    /// [`Self::cleared`], and the clearance lies in memory of `place`: an answer inside
    /// it needs no query, a `bytes` access inside it (`Placement::Host`) none either.
    pub(super) fn cleared_in(&self, at: u64, len: u64, place: Placement) -> bool {
        self.clearance.is_some_and(|c| c.memory == place) && self.cleared(at, len)
    }

    /// Make a block upstream just lent, of `size` bytes as its ledger records it, the
    /// clearance: it overlaps no block this policy lent, because every one of those lies
    /// inside an upstream block it still holds, and upstream blocks are disjoint. So the
    /// block the policy answers inside it is admitted without a query.
    pub(super) fn clear_fresh(&mut self, block: u64, size: u64) {
        debug_assert_eq!(self.upstream.lent().get(block).map(|e| e.size), Some(size));
        self.clearance = Some(Clearance {
            start: block,
            end: block + size,
            upstream: self.upstream.lent().generation(),
            lent: self.lent.generation(),
            memory: self.upstream_placement(),
        });
    }

    /// Make a block this policy's client just gave back, of `size` bytes as the link's
    /// ledger recorded it and now off it, the clearance. It lies inside one upstream
    /// block the policy still holds (admission checked that, and no give-back upstream
    /// may take memory from under a lent block), and lent blocks are disjoint, so it
    /// overlaps none of those left. The policy's own give-back of that memory, or the
    /// header it writes there, then needs no query.
    pub(super) fn clear_taken_back(&mut self, block: u64, size: u64) {
        self.clearance = Some(Clearance {
            start: block,
            end: block.saturating_add(size),
            upstream: self.upstream.lent().generation(),
            lent: self.lent.generation(),
            // Admitted as this link's answer: in the memory it lends from.
            memory: self.place,
        });
    }

    /// The full check behind [`Self::cleared`]: does `[at, at+len)` (`len` at least 1)
    /// lie inside one upstream block this policy holds, outside held-back memory and
    /// every block it lent? If so, the clear stretch around it becomes the clearance,
    /// and the answer is where that memory lies.
    pub(super) fn clear(&mut self, at: u64, len: u64) -> Option<Placement> {
        let (block, block_size, memory) = self.owned_containing(at, len)?;
        if self.transit.held_back_overlapping(at, len).is_some() {
            return None;
        }
        let (gap_start, gap_end) = self.lent.nearby().gap_around(at, len)?;
        self.clearance = Some(Clearance {
            start: block.max(gap_start),
            end: (block + block_size).min(gap_end),
            upstream: self.upstream.lent().generation(),
            lent: self.lent.generation(),
            memory,
        });
        Some(memory)
    }
}

/// Upstream memory that the last full check of a `bytes` range found inside one block
/// the policy holds and clear of every block it lent, with both ledgers' generations
/// at that moment. While both generations are current and nothing is held back, any
/// range inside it would pass that check again: so the few header words a policy reads
/// or writes around one block, and the block it then answers there, cost one full
/// check (three ledger queries) rather than two queries each.
#[derive(Debug, Clone, Copy)]
pub(super) struct Clearance {
    start: u64,
    end: u64,
    upstream: u64,
    lent: u64,
    /// Where the memory it lies in is: a GPU's is never read or written by the host.
    memory: Placement,
}
