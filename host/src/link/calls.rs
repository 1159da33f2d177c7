//! A policy's allocator, called: each call entered under the deadline of the client
//! call that caused it, counted, and its answer admitted before it goes up.

use super::admit::lost_byte;
use super::{Exports, Link, Upstream, check_lent};
use crate::clock::Deadline;
use crate::error::{Call, Error, Rule};

impl Link {
    pub(crate) fn malloc(&mut self, deadline: &mut Deadline, size: u64) -> Result<u64, Error> {
        let size = size.max(1);
        self.calls.mallocs += 1;
        let addr = self.enter(Call::Malloc, deadline, size, |g, s| {
            allocator!(g, |a| a.call_malloc(s, size))
        })?;
        if addr == 0 {
            return self.end_allowance(Call::Malloc).map(|()| 0);
        }
        self.admit(Call::Malloc, addr, size)
    }

    /// `calloc`; an overflowing product is "none" without asking the policy (C3).
    pub(crate) fn calloc(
        &mut self,
        deadline: &mut Deadline,
        nelem: u64,
        elsize: u64,
    ) -> Result<u64, Error> {
        let Some(size) = nelem.checked_mul(elsize) else {
            return Ok(0);
        };
        let (nelem, elsize) = if size == 0 { (1, 1) } else { (nelem, elsize) };
        self.calls.callocs += 1;
        let addr = self.enter(Call::Calloc, deadline, size, |g, s| {
            allocator!(g, |a| a.call_calloc(s, nelem, elsize))
        })?;
        if addr == 0 {
            return self.end_allowance(Call::Calloc).map(|()| 0);
        }
        let size = size.max(1);
        self.admit(Call::Calloc, addr, size)?;
        self.make_zero(addr, size)?;
        Ok(addr)
    }

    /// Make sure the `calloc` answer `[addr, addr+size)`, just admitted, holds only
    /// zeros before its client sees it (C3). Memory known zero in this call (a fresh
    /// `calloc` block upstream, a range the policy filled with 0) is left as it is, so a
    /// large zeroed block stays lazily zeroed pages; any other answer is zeroed here,
    /// its time given back to the policy (the client chose the size), or, with deep
    /// checks, a non-zero byte in it is a violation.
    pub(super) fn make_zero(&mut self, addr: u64, size: u64) -> Result<(), Error> {
        let state = self.store.data_mut();
        if state.zeroed.covers(addr, size) {
            return Ok(());
        }
        // SAFETY: `[addr, addr+size)` was just admitted as a block this policy lent: it
        // lies inside live upstream memory the policy holds, and no one else holds it
        // yet (the client has not been given it).
        let block = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, size as usize) };
        if state.checked {
            let Some(offset) = block.iter().position(|&b| b != 0) else {
                return Ok(());
            };
            self.lent_mut().remove(addr);
            let rule = Rule::CallocNotZeroed {
                offset: offset as u64,
            };
            return Err(self.violation(Call::Calloc, addr, size, rule));
        }
        let since = state.sandbox.now();
        block.fill(0);
        state.sandbox.excuse_since(since);
        Ok(())
    }

    /// Resize a block the caller holds with `old` bytes, as this link's ledger records
    /// it (the caller checked); 0 leaves it live and unchanged.
    pub(crate) fn realloc(
        &mut self,
        deadline: &mut Deadline,
        ptr: u64,
        old: u64,
        new: u64,
    ) -> Result<u64, Error> {
        let new = new.max(1);
        if ptr == 0 {
            return self.malloc(deadline, new);
        }
        debug_assert!(
            check_lent(self.lent(), ptr, old).is_ok(),
            "checked by the caller"
        );
        if self.poisoned.is_some() {
            return Ok(0);
        }
        self.calls.reallocs += 1;
        self.store.data_mut().transit.begin(ptr, old);
        let answer = self.enter(Call::Realloc, deadline, new, |g, s| {
            allocator!(g, |a| a.call_realloc(s, ptr, old, new))
        });
        let addr = match answer {
            Ok(0) => {
                // "None" means the old block stays live and unchanged; a policy that gave
                // back its memory on the way broke that. The memory was held back, so the
                // client's block is intact; the policy is stopped.
                let state = self.store.data_mut();
                let held_back = state.transit.end();
                let region = state.mapped.first_held_back();
                state.mapped.end_transit(false);
                if let Some((addr, size)) = held_back.first().copied().or(region) {
                    let rule = Rule::GaveBackLentMemory {
                        block: ptr,
                        block_size: old,
                    };
                    return Err(self.violation(Call::Realloc, addr, size, rule));
                }
                return self.end_allowance(Call::Realloc).map(|()| 0);
            }
            Ok(addr) => addr,
            Err(e) => return Err(e),
        };
        // The answer is checked while the transit still holds back what the policy gave
        // up, so an answer in that memory is refused (`use-after-free`); the old block
        // leaves the books only for the check, so the answer may reuse its place. Once
        // it is placed, it must hold the client's bytes: the old block is intact (no one
        // may write a lent block, and its memory is held back), so the host compares.
        let old_entry = self.lent_mut().remove(ptr).expect("checked above");
        let broken = self.misplaced(addr, new).or_else(|| {
            // The client chose how many bytes this compares: the guest's time is given
            // back (`Sandbox::excuse_since`).
            let sandbox = &mut self.store.data_mut().sandbox;
            let since = sandbox.now();
            let lost = lost_byte(ptr, addr, old.min(new));
            sandbox.excuse_since(since);
            lost
        });
        if let Some(rule) = broken {
            // The client still holds its old block, intact: the upstream block under it
            // was held back. It goes back on the books before the link is stopped, so
            // the stop cannot release that memory while the client holds it.
            self.lent_mut().insert(ptr, old_entry.size);
            return Err(self.violation(Call::Realloc, addr, new, rule));
        }
        self.lent_mut().insert(addr, new);
        self.release_held_back(deadline);
        Ok(addr)
    }

    /// End the transit of an admitted realloc: what the policy gave back during it goes
    /// upstream now, when no block lent here lies inside it.
    pub(super) fn release_held_back(&mut self, deadline: &mut Deadline) {
        let state = self.store.data_mut();
        state.mapped.end_transit(true);
        for (addr, size) in state.transit.end() {
            // Sizes were checked when the policy asked, and each block once; still the
            // embedder's call that resized the block.
            let _ = state.call_upstream(deadline, |u, d| u.free(d, addr, size));
        }
    }

    /// Give back a block the caller holds with `size` bytes, as this link's ledger
    /// records it (the caller checked).
    pub(crate) fn free(
        &mut self,
        deadline: &mut Deadline,
        ptr: u64,
        size: u64,
    ) -> Result<(), Error> {
        let entry = self.lent_mut().remove(ptr);
        debug_assert_eq!(entry.map(|e| e.size), Some(size), "checked by the caller");
        match entry {
            Some(entry) => self.free_taken(deadline, ptr, entry.size),
            None => self.ask_free(deadline, ptr, size),
        }
    }

    /// [`Self::free`] of a block the caller already took off this link's books, where
    /// it was recorded with `size` bytes: the client's free, which found and removed it
    /// in one probe.
    pub(crate) fn free_taken(
        &mut self,
        deadline: &mut Deadline,
        ptr: u64,
        size: u64,
    ) -> Result<(), Error> {
        if self.poisoned.is_none() {
            self.store.data_mut().clear_taken_back(ptr, size);
        }
        self.ask_free(deadline, ptr, size)
    }

    /// Ask the policy to take back a block that is off its books.
    pub(super) fn ask_free(
        &mut self,
        deadline: &mut Deadline,
        ptr: u64,
        size: u64,
    ) -> Result<(), Error> {
        if self.poisoned.is_some() {
            self.release_if_done();
            return Ok(());
        }
        self.calls.frees += 1;
        self.enter(Call::Free, deadline, 0, |g, s| {
            allocator!(g, |a| a.call_free(s, ptr, size))
        })
    }

    pub(crate) fn malloc_many(
        &mut self,
        deadline: &mut Deadline,
        size: u64,
        count: u32,
    ) -> Result<Vec<u64>, Error> {
        let size = size.max(1);
        self.calls.malloc_many += 1;
        let demand = size.saturating_mul(count.into());
        let blocks = self.enter(Call::MallocMany, deadline, demand, |g, s| {
            allocator!(g, |a| a.call_malloc_many(s, size, count))
        })?;
        if blocks.len() > count as usize {
            let rule = Rule::TooManyBlocks {
                asked: count,
                got: blocks.len(),
            };
            return Err(self.violation(Call::MallocMany, 0, size, rule));
        }
        for (i, &addr) in blocks.iter().enumerate() {
            if let Err(e) = self.admit(Call::MallocMany, addr, size) {
                // Blocks admitted before the bad one go back into the books of a dead
                // link, so they are released with it.
                for &ok in &blocks[..i] {
                    self.lent_mut().remove(ok);
                }
                self.release_if_done();
                return Err(e);
            }
        }
        Ok(blocks)
    }

    /// Give back several blocks the caller holds with `size` bytes each, as this link's
    /// ledger records them (the caller checked).
    pub(crate) fn free_many(
        &mut self,
        deadline: &mut Deadline,
        ptrs: Vec<u64>,
        size: u64,
    ) -> Result<(), Error> {
        for &ptr in &ptrs {
            let entry = self.lent_mut().remove(ptr);
            debug_assert_eq!(entry.map(|e| e.size), Some(size), "checked by the caller");
        }
        if self.poisoned.is_some() {
            self.release_if_done();
            return Ok(());
        }
        self.calls.free_many += 1;
        self.enter(Call::FreeMany, deadline, 0, |g, s| {
            allocator!(g, |a| a.call_free_many(s, &ptrs, size))
        })
    }

    /// Ask this link, then every link below it, to give back what it caches.
    /// Every link trims under the one deadline of the embedder's call.
    pub(crate) fn trim(&mut self, deadline: &mut Deadline) -> Result<(), Error> {
        if self.poisoned.is_none() {
            self.start_call(*deadline, 0);
            let trimmed = match &self.bindings {
                Exports::V1(b) => b.allocbox_policy_lifecycle().call_trim(&mut self.store),
                Exports::V2(b) => b.allocbox_policy_lifecycle().call_trim(&mut self.store),
            };
            self.end_call(deadline);
            if let Err(e) = trimmed {
                // The chain stops for this failure, and every link below gives its
                // memory back as it stops: no trim below, under a deadline now passed.
                return Err(self.failed(Call::Trim, e));
            }
        }
        self.store
            .data_mut()
            .call_upstream(deadline, Upstream::trim);
        Ok(())
    }
}
