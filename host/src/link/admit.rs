//! Admitting what a policy answers: every block it returns is checked in one place
//! (`misplaced`: alignment, use after free, ownership, overlap) before the client sees
//! it, and a moved realloc's block is compared with the client's bytes. Most answers lie
//! in the clearance the call left, and need no query.

use super::Link;
use crate::error::{Bound, Call, Error, Rule, Violation};

impl Link {
    /// Is a block this link returned aligned and inside the clearance (the block the
    /// policy just took, or was given back)? Then it breaks no rule, and no query is
    /// needed: most blocks are, so the callers inline this and keep the queries out of
    /// line.
    #[inline]
    pub(super) fn in_clearance(&self, addr: u64, size: u64) -> bool {
        let state = self.store.data();
        self.info.aligns(addr) && state.cleared_in(addr, size, state.place)
    }

    /// The rule a block this link returned breaks, if any.
    pub(super) fn misplaced(&mut self, addr: u64, size: u64) -> Option<Rule> {
        if self.in_clearance(addr, size) {
            return None;
        }
        self.misplaced_by_query(addr, size)
    }

    /// [`Self::misplaced`] for a block outside the clearance.
    #[inline(never)]
    pub(super) fn misplaced_by_query(&mut self, addr: u64, size: u64) -> Option<Rule> {
        let alignment = self.info.alignment;
        let aligned = self.info.aligns(addr);
        let state = self.store.data_mut();
        if !aligned {
            Some(Rule::Misaligned { alignment })
        } else if let Some((released, released_size)) =
            state.transit.held_back_overlapping(addr, size)
        {
            Some(Rule::UseAfterFree {
                released,
                released_size,
            })
        } else if let Some(found) = state.owned_containing(addr, size).map(|(.., p)| p)
            && found != state.place
        {
            Some(Rule::WrongMemory {
                wanted: state.place,
                found,
            })
        } else if state.owned_containing(addr, size).is_none() {
            Some(Rule::OutsideOwned)
        } else {
            state
                .lent
                .nearby()
                .overlapping(addr, size)
                .map(|(other, other_size)| Rule::Overlap { other, other_size })
        }
    }

    /// Stop the link for breaking `rule` and produce the error that says so.
    pub(super) fn violation(&mut self, call: Call, addr: u64, size: u64, rule: Rule) -> Error {
        let err = Error::Violation(Violation {
            policy: self.info.name.clone(),
            call,
            addr,
            size,
            rule,
        });
        self.poison(err.clone());
        err
    }

    /// End the allowance of the request just answered: a policy that kept what it took
    /// for it past its overhead budget is stopped, and named now rather than when the
    /// run ends.
    pub(super) fn end_allowance(&mut self, call: Call) -> Result<(), Error> {
        let Some((asked, limit)) = self.store.data_mut().end_allowance() else {
            return Ok(());
        };
        let err = Error::WorkLimit {
            policy: self.info.name.clone(),
            call,
            bound: Bound::Overhead,
            asked,
            limit,
        };
        self.poison(err.clone());
        Err(err)
    }

    /// Check and record a block this link returned.
    #[inline(always)]
    pub(super) fn admit(&mut self, call: Call, addr: u64, size: u64) -> Result<u64, Error> {
        if self.in_clearance(addr, size) {
            self.lent_mut().insert(addr, size);
            return Ok(addr);
        }
        self.admit_by_query(call, addr, size)
    }

    /// [`Self::admit`] for a block outside the clearance.
    #[inline(never)]
    pub(super) fn admit_by_query(
        &mut self,
        call: Call,
        addr: u64,
        size: u64,
    ) -> Result<u64, Error> {
        match self.misplaced_by_query(addr, size) {
            None => {
                self.lent_mut().insert(addr, size);
                Ok(addr)
            }
            Some(rule) => Err(self.violation(call, addr, size, rule)),
        }
    }
}

/// The rule a realloc's answer at `new` breaks if it does not hold the first `len` bytes
/// of the client's block at `old`.
pub(super) fn lost_byte(old: u64, new: u64, len: u64) -> Option<Rule> {
    if old == new {
        return None;
    }
    // SAFETY: `old` is the client's live block of at least `len` bytes, unchanged (a lent
    // block is never writable through `bytes`, and the upstream memory under it is held
    // back, not released); `new` was just admitted as a block of at least `len` bytes
    // inside memory the policy holds. Both lie in live host memory and may overlap: they
    // are only read.
    let (kept, answer) = unsafe {
        (
            std::slice::from_raw_parts(old as *const u8, len as usize),
            std::slice::from_raw_parts(new as *const u8, len as usize),
        )
    };
    if kept == answer {
        return None;
    }
    let offset = kept.iter().zip(answer).position(|(a, b)| a != b)?;
    Some(Rule::ReallocLostBytes {
        offset: offset as u64,
    })
}
