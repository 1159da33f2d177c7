//! The host side of a policy's imports (`upstream` and `bytes`): every address, size,
//! count and length a guest passes is checked here before the host acts on it, every
//! loop is bounded, and every byte the host takes on the guest's behalf counts against
//! its budget.

use std::sync::Arc;

use super::bindings;
use super::{Limits, LinkState, Sandbox, Transit, Upstream};
use crate::clock::Deadline;
use crate::error::{Bound, Call, Error, Rule, Violation};
use crate::ledger::{Ledger, TakeBack};

impl LinkState {
    pub(crate) fn new(
        sandbox: Sandbox,
        upstream: Upstream,
        limits: &Limits,
        checked: bool,
    ) -> Self {
        LinkState {
            sandbox,
            lent: Ledger::default(),
            upstream,
            transit: Transit::default(),
            unreported: None,
            demand: 0,
            on_allowance: false,
            call_time: limits.call_time,
            batch_limit: limits.batch,
            read_limit: limits.memory,
            overhead_limit: limits.overhead,
            budget_refusals: 0,
            clearance: None,
            zeroed: Default::default(),
            checked,
            mapped: super::Mapped::new(limits.grants.memory),
        }
    }

    /// Call the upstream from inside this link's current call. An upstream link runs
    /// under this call's deadline: an embedder's call has one deadline, not one per link.
    /// An upstream policy that fails answers this link's guest "none", and its failure
    /// is kept here, to travel up when this link's call ends; but when the chain's time
    /// ran out meanwhile, this guest can do nothing more either, and is stopped with
    /// that failure (so the link that was running when time ran out is the one named).
    #[inline]
    pub(super) fn upstream_call<R>(
        &mut self,
        f: impl FnOnce(&mut Upstream, &mut Deadline) -> R,
    ) -> wasmtime::Result<R> {
        if let Upstream::System(_) = &self.upstream {
            // The host's own memory runs no guest: no deadline to pass or take back.
            return Ok(f(&mut self.upstream, &mut Deadline::passed()));
        }
        self.upstream_policy_call(f)
    }

    /// [`Self::upstream_call`] of a policy upstream.
    fn upstream_policy_call<R>(
        &mut self,
        f: impl FnOnce(&mut Upstream, &mut Deadline) -> R,
    ) -> wasmtime::Result<R> {
        let mut deadline = self.sandbox.deadline();
        let (answer, failed) = self.call_upstream(&mut deadline, f);
        self.sandbox.extend_to(deadline);
        match failed {
            // A link below that ran out of time ran out of this call's time.
            Some(cause) if matches!(*cause, Error::Timeout { .. }) || self.out_of_time() => {
                Err(self.fail((*cause).clone()))
            }
            _ => Ok(answer),
        }
    }

    /// Call the upstream, its links under `deadline`, and return the answer with the
    /// failure of an upstream link meanwhile, which is also kept to travel up.
    pub(super) fn call_upstream<R>(
        &mut self,
        deadline: &mut Deadline,
        f: impl FnOnce(&mut Upstream, &mut Deadline) -> R,
    ) -> (R, Option<Arc<Error>>) {
        let answer = f(&mut self.upstream, deadline);
        let Upstream::Policy(l) = &mut self.upstream else {
            return (answer, None);
        };
        let failed = l.take_unreported();
        if let Some(cause) = &failed {
            self.unreported.get_or_insert(cause.clone());
        }
        (answer, failed)
    }

    /// Record that this policy did `fault` inside an import and produce the error that
    /// traps it.
    #[cold]
    fn fail(&mut self, fault: Error) -> wasmtime::Error {
        let err = wasmtime::Error::new(fault.clone());
        self.sandbox.fault = Some(fault);
        err
    }

    /// Record that this policy broke `rule` and produce the error that traps it.
    pub(super) fn violate(
        &mut self,
        call: Call,
        addr: u64,
        size: u64,
        rule: Rule,
    ) -> wasmtime::Error {
        self.fail(Error::Violation(Violation {
            policy: self.sandbox.name.clone(),
            call,
            addr,
            size,
            rule,
        }))
    }

    /// Refuse work past a bound of [`Limits`].
    fn bounded(
        &mut self,
        call: Call,
        bound: Bound,
        asked: u64,
        limit: u64,
    ) -> wasmtime::Result<()> {
        if asked <= limit {
            return Ok(());
        }
        let policy = self.sandbox.name.clone();
        Err(self.fail(Error::WorkLimit {
            policy,
            call,
            bound,
            asked,
            limit,
        }))
    }

    /// Stop an import of a call that has run past its time: wasm code is interrupted by
    /// the epoch, host code checks here, at every import and between chunks of long ones.
    #[inline]
    pub(super) fn on_time(&mut self, call: Call) -> wasmtime::Result<()> {
        if self.out_of_time() {
            return Err(self.timed_out(call));
        }
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn timed_out(&mut self, call: Call) -> wasmtime::Error {
        let policy = self.sandbox.name.clone();
        let limit = self.call_time;
        self.fail(Error::Timeout {
            policy,
            call,
            limit,
        })
    }

    fn out_of_time(&self) -> bool {
        self.sandbox.out_of_time()
    }

    /// Host memory the policy may still take from upstream within its overhead budget,
    /// upstream blocks counted at what they cost the host ([`Ledger::cost`]).
    fn budget_left(&self) -> u64 {
        let allowed = self
            .lent
            .bytes()
            .saturating_add(self.demand)
            .saturating_add(self.overhead_limit);
        allowed.saturating_sub(self.held())
    }

    /// Host memory the policy holds: its upstream blocks and mapped regions, each at
    /// what it costs the host.
    #[inline]
    pub(super) fn held(&self) -> u64 {
        self.upstream
            .lent()
            .cost()
            .saturating_add(self.mapped.cost())
    }

    /// The current request's allowance ends with its answer. A policy that took memory
    /// in the call that only the allowance let it take, and still holds more than its
    /// client's bytes and its overhead budget, took it for the request and kept it: the
    /// bound it passed, or `None`. (One that was over its budget before the call, by a
    /// cache it kept as its client gave blocks back, and took nothing, is not.)
    pub(super) fn end_allowance(&mut self) -> Option<(u64, u64)> {
        self.demand = 0;
        if !std::mem::take(&mut self.on_allowance) {
            return None;
        }
        let beyond = self.held().saturating_sub(self.lent.bytes());
        (beyond > self.overhead_limit).then_some((beyond, self.overhead_limit))
    }

    /// May the policy take one more upstream block of `size` bytes?
    fn may_take(&mut self, size: u64) -> bool {
        let cost = self.upstream.lent().cost_of(size);
        self.within_budget(cost)
    }

    /// May the policy take `cost` more bytes of host memory from upstream? A refusal is
    /// counted.
    pub(super) fn within_budget(&mut self, cost: u64) -> bool {
        let left = self.budget_left();
        let ok = cost <= left;
        if !ok {
            self.budget_refusals += 1;
        }
        // Past what the budget allows without the request, the request's allowance
        // pays: see `end_allowance`.
        self.on_allowance |= ok && cost > left.saturating_sub(self.demand);
        ok
    }

    #[cold]
    pub(super) fn caller_fault(
        &mut self,
        call: Call,
        addr: u64,
        size: u64,
        f: TakeBack,
    ) -> wasmtime::Error {
        let rule = match f {
            TakeBack::Unknown => Rule::UnknownFree,
            TakeBack::AlreadyFreed => Rule::DoubleFree,
            TakeBack::WrongSize { recorded } => Rule::WrongSizeFree { recorded },
        };
        self.violate(call, addr, size, rule)
    }

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

    /// Make a block upstream just lent, of `size` bytes as its ledger records it, the
    /// clearance: it overlaps no block this policy lent, because every one of those lies
    /// inside an upstream block it still holds, and upstream blocks are disjoint. So the
    /// block the policy answers inside it is admitted without a query.
    fn clear_fresh(&mut self, block: u64, size: u64) {
        debug_assert_eq!(self.upstream.lent().get(block).map(|e| e.size), Some(size));
        self.clearance = Some(Clearance {
            start: block,
            end: block + size,
            upstream: self.upstream.lent().generation(),
            lent: self.lent.generation(),
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
        });
    }

    /// The full check behind [`Self::cleared`]: does `[at, at+len)` (`len` at least 1)
    /// lie inside one upstream block this policy holds, outside held-back memory and
    /// every block it lent? If so, the clear stretch around it becomes the clearance.
    fn clear(&mut self, at: u64, len: u64) -> bool {
        let Some((block, block_size)) = self.owned_containing(at, len) else {
            return false;
        };
        if self.transit.held_back_overlapping(at, len).is_some() {
            return false;
        }
        let Some((gap_start, gap_end)) = self.lent.nearby().gap_around(at, len) else {
            return false;
        };
        self.clearance = Some(Clearance {
            start: block.max(gap_start),
            end: (block + block_size).min(gap_end),
            upstream: self.upstream.lent().generation(),
            lent: self.lent.generation(),
        });
        true
    }

    /// Is `ptr` an upstream block this policy holds with exactly `size` bytes? A block
    /// it already gave back during the current realloc is a double free.
    // Always: like its one caller, `check_give_back`.
    #[inline(always)]
    fn check_held(&mut self, call: Call, ptr: u64, size: u64) -> wasmtime::Result<()> {
        let fault = if self.transit.is_held_back(ptr) {
            Err(TakeBack::AlreadyFreed)
        } else {
            check_lent(self.upstream.lent(), ptr, size)
        };
        fault.map_err(|f| self.caller_fault(call, ptr, size, f))
    }

    /// Is `[at, at+len)` inside memory this policy owns and has not lent out? The block
    /// in transit may also be read.
    fn check_bytes(
        &mut self,
        call: Call,
        at: u64,
        len: u64,
        read_only: bool,
    ) -> wasmtime::Result<()> {
        if len == 0 {
            return Ok(());
        }
        let allowed = (read_only && self.transit.within_block(at, len))
            || self.cleared(at, len)
            || self.clear(at, len);
        if allowed {
            Ok(())
        } else {
            Err(self.violate(call, at, len, Rule::BytesOutOfBounds))
        }
    }

    /// Refuse to give back (or move) upstream memory that holds a block this policy has
    /// lent, other than the block in transit during its own realloc (whose upstream memory
    /// is held back instead): the client would lose its data, and the host would free
    /// memory a client still writes to.
    #[inline]
    pub(super) fn check_nothing_lent_inside(
        &mut self,
        call: Call,
        ptr: u64,
        size: u64,
    ) -> wasmtime::Result<()> {
        if size > 0 && self.cleared(ptr, size) {
            return Ok(());
        }
        self.check_nothing_lent_inside_by_query(call, ptr, size)
    }

    /// [`Self::check_nothing_lent_inside`] outside the clearance: a range query.
    #[inline(never)]
    fn check_nothing_lent_inside_by_query(
        &mut self,
        call: Call,
        ptr: u64,
        size: u64,
    ) -> wasmtime::Result<()> {
        let in_transit = self.transit.block_addr();
        let inside = self
            .lent
            .ordered()
            .overlapping_all(ptr, size)
            .find(|&(block, _)| Some(block) != in_transit);
        match inside {
            None => Ok(()),
            Some((block, block_size)) => Err(self.violate(
                call,
                ptr,
                size,
                Rule::GaveBackLentMemory { block, block_size },
            )),
        }
    }

    /// The checks every give-back upstream (free, or the old block of a realloc) passes
    /// before the host acts on it. Returns whether the memory must be held back.
    // Always: on every give-back's path, and left a call (with its own frame) when
    // merely marked inline.
    #[inline(always)]
    fn check_give_back(&mut self, call: Call, ptr: u64, size: u64) -> wasmtime::Result<bool> {
        self.check_held(call, ptr, size)?;
        self.check_nothing_lent_inside(call, ptr, size)?;
        self.zeroed.forget(ptr, size);
        Ok(self.transit.under_block(ptr, size))
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
}

impl bindings::allocbox::policy::allocator::Host for LinkState {
    fn malloc(&mut self, size: u64) -> wasmtime::Result<u64> {
        self.on_time(Call::Malloc)?;
        if size == 0 || !self.may_take(size) {
            return Ok(0);
        }
        let block = self.upstream_call(|u, d| u.malloc(d, size))?;
        if block != 0 {
            self.zeroed.forget(block, size);
            self.clear_fresh(block, size);
        }
        Ok(block)
    }

    fn calloc(&mut self, nelem: u64, elsize: u64) -> wasmtime::Result<u64> {
        self.on_time(Call::Calloc)?;
        let Some(size) = nelem.checked_mul(elsize) else {
            return Ok(0);
        };
        if !self.may_take(size.max(1)) {
            return Ok(0);
        }
        let block = self.upstream_call(|u, d| u.calloc(d, nelem, elsize))?;
        if block != 0 {
            // The host's memory and a lower link's `calloc` answer are zero.
            self.zeroed.add(block, size.max(1));
        }
        Ok(block)
    }

    fn realloc(&mut self, ptr: u64, old: u64, new: u64) -> wasmtime::Result<u64> {
        if ptr == 0 {
            return self.malloc(new);
        }
        self.on_time(Call::Realloc)?;
        let hold_back = self.check_give_back(Call::Realloc, ptr, old)?;
        if new == 0 {
            // Like malloc(0) upstream: none, and the old block stays.
            return Ok(0);
        }
        if hold_back {
            // Resizing the block that holds the client's data in transit: move it by
            // copy so the original stays intact until this policy's answer is checked.
            if !self.may_take(new) {
                return Ok(0);
            }
            let fresh = self.upstream_call(|u, d| u.malloc(d, new))?;
            if fresh != 0 {
                self.zeroed.forget(fresh, new);
                // Once a call (the old block is held back from here on), and as long as
                // the upstream block under the client's: the client chose the size, so
                // the guest's time is given back (`Sandbox::excuse_since`).
                let since = self.sandbox.now();
                // SAFETY: `ptr` is a live upstream block of `old` bytes (check_held found
                // it in the upstream ledger with that size, not given back) and `fresh` a
                // new one of `new` bytes; both lie in host memory lent by the upstream,
                // and a new block cannot overlap a live one.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        ptr as *const u8,
                        fresh as *mut u8,
                        old.min(new) as usize,
                    )
                };
                self.sandbox.excuse_since(since);
                self.transit.hold_back(ptr, old);
            }
            return Ok(fresh);
        }
        let upstream = self.upstream.lent();
        let growth = upstream.cost_of(new).saturating_sub(upstream.cost_of(old));
        if !self.within_budget(growth) {
            return Ok(0);
        }
        match self.upstream_call(|u, d| u.realloc(d, ptr, old, new))? {
            Ok(addr) => {
                self.zeroed.forget(addr, new);
                Ok(addr)
            }
            Err(f) => Err(self.caller_fault(Call::Realloc, ptr, old, f)),
        }
    }

    fn free(&mut self, ptr: u64, size: u64) -> wasmtime::Result<()> {
        self.on_time(Call::Free)?;
        if self.check_give_back(Call::Free, ptr, size)? {
            self.transit.hold_back(ptr, size);
            return Ok(());
        }
        self.upstream_call(|u, d| u.free(d, ptr, size))?
            .map_err(|f| self.caller_fault(Call::Free, ptr, size, f))
    }

    fn malloc_many(&mut self, size: u64, count: u32) -> wasmtime::Result<Vec<u64>> {
        self.on_time(Call::MallocMany)?;
        let limit = self.batch_limit;
        self.bounded(Call::MallocMany, Bound::Batch, count.into(), limit.into())?;
        if size == 0 {
            return Ok(Vec::new());
        }
        // As many as the budget allows: fewer blocks is a valid answer.
        let per_block = self.upstream.lent().cost_of(size);
        let granted = (self.budget_left() / per_block).min(count.into()) as u32;
        if granted < count {
            self.budget_refusals += 1;
        }
        let blocks = self.upstream_call(|u, d| u.malloc_many(d, size, granted))?;
        if !blocks.is_empty() {
            // Fresh blocks hold whatever their memory held.
            self.zeroed.clear();
        }
        Ok(blocks)
    }

    fn free_many(&mut self, ptrs: Vec<u64>, size: u64) -> wasmtime::Result<()> {
        let limit = self.batch_limit;
        self.bounded(
            Call::FreeMany,
            Bound::Batch,
            ptrs.len() as u64,
            limit.into(),
        )?;
        for ptr in ptrs {
            self.free(ptr, size)?;
        }
        Ok(())
    }
}

/// Is `ptr` lent with exactly `size` bytes?
#[inline]
pub(super) fn check_lent(ledger: &Ledger, ptr: u64, size: u64) -> Result<(), TakeBack> {
    match ledger.get(ptr) {
        Some(e) if e.size == size => Ok(()),
        Some(e) => Err(TakeBack::WrongSize { recorded: e.size }),
        None => Err(ledger.why_unknown(ptr)),
    }
}

/// Bytes one step of a long `bytes` access touches before the call's time is checked
/// again: a few milliseconds of memory bandwidth.
const BYTES_CHUNK: u64 = 16 << 20;

/// Which end of a range a chunked loop starts from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Order {
    Ascending,
    /// For a copy whose destination lies above its overlapping source: a chunk copied
    /// from the end never overwrites source bytes still to be copied.
    Descending,
}

impl LinkState {
    /// Run `step(offset, len)` over `[0, total)` in chunks of at most [`BYTES_CHUNK`],
    /// checking the call's time before each, so that no host loop whose length a guest
    /// chose outlives the call's deadline by more than one chunk.
    fn in_chunks(
        &mut self,
        call: Call,
        total: u64,
        order: Order,
        mut step: impl FnMut(u64, u64),
    ) -> wasmtime::Result<()> {
        let mut done = 0;
        while done < total {
            self.on_time(call)?;
            let len = (total - done).min(BYTES_CHUNK);
            let offset = match order {
                Order::Ascending => done,
                Order::Descending => total - done - len,
            };
            step(offset, len);
            done += len;
        }
        Ok(())
    }
}

impl bindings::allocbox::policy::bytes::Host for LinkState {
    fn read(&mut self, at: u64, len: u32) -> wasmtime::Result<Vec<u8>> {
        self.on_time(Call::BytesRead)?;
        let limit = self.read_limit;
        self.bounded(Call::BytesRead, Bound::ReadLength, len.into(), limit)?;
        self.check_bytes(Call::BytesRead, at, len.into(), true)?;
        let mut out = vec![0; len as usize];
        let into = out.as_mut_ptr() as u64;
        self.in_chunks(
            Call::BytesRead,
            len.into(),
            Order::Ascending,
            |offset, n| {
                // SAFETY: check_bytes proved `[at, at+len)` lies inside one live upstream
                // block (or the block in transit, which lies inside one), and every block in
                // a ledger lies inside host memory allocated by SystemMemory and not yet
                // released; `out` has `len` bytes; this chunk lies inside both.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (at + offset) as *const u8,
                        (into + offset) as *mut u8,
                        n as usize,
                    )
                };
            },
        )?;
        Ok(out)
    }

    fn write(&mut self, at: u64, data: Vec<u8>) -> wasmtime::Result<()> {
        self.on_time(Call::BytesWrite)?;
        self.check_bytes(Call::BytesWrite, at, data.len() as u64, false)?;
        self.zeroed.forget(at, data.len() as u64);
        let source = data.as_ptr() as u64;
        self.in_chunks(
            Call::BytesWrite,
            data.len() as u64,
            Order::Ascending,
            |offset, n| {
                // SAFETY: as in `read`; the range is also not lent out, so no client holds
                // it; `data` has the range's length.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (source + offset) as *const u8,
                        (at + offset) as *mut u8,
                        n as usize,
                    )
                };
            },
        )?;
        Ok(())
    }

    fn fill(&mut self, at: u64, len: u64, byte: u8) -> wasmtime::Result<()> {
        self.check_bytes(Call::BytesFill, at, len, false)?;
        self.zeroed.forget(at, len);
        self.in_chunks(Call::BytesFill, len, Order::Ascending, |offset, n| {
            // SAFETY: as in `write`; the chunk lies inside the checked range.
            unsafe { std::ptr::write_bytes((at + offset) as *mut u8, byte, n as usize) };
        })?;
        if byte == 0 {
            self.zeroed.add(at, len);
        }
        Ok(())
    }

    fn copy(&mut self, dst: u64, src: u64, len: u64) -> wasmtime::Result<()> {
        self.check_bytes(Call::BytesCopy, src, len, true)?;
        self.check_bytes(Call::BytesCopy, dst, len, false)?;
        self.zeroed.forget(dst, len);
        let order = match dst > src && dst < src + len {
            true => Order::Descending,
            false => Order::Ascending,
        };
        self.in_chunks(Call::BytesCopy, len, order, |offset, n| {
            // SAFETY: both ranges were checked as in `read`/`write` and the chunk lies
            // inside both; `copy` allows overlap inside one chunk, and chunks are taken
            // from the end exactly when the destination lies above an overlapping source,
            // so no chunk overwrites source bytes a later chunk still reads.
            unsafe {
                std::ptr::copy(
                    (src + offset) as *const u8,
                    (dst + offset) as *mut u8,
                    n as usize,
                )
            };
        })?;
        Ok(())
    }

    fn read_u64(&mut self, at: u64) -> wasmtime::Result<u64> {
        self.on_time(Call::BytesRead)?;
        self.check_bytes(Call::BytesRead, at, 8, true)?;
        // SAFETY: as in `read`; an unaligned read is used because headers may sit anywhere.
        Ok(u64::from_le(unsafe {
            std::ptr::read_unaligned(at as *const u64)
        }))
    }

    fn write_u64(&mut self, at: u64, value: u64) -> wasmtime::Result<()> {
        self.on_time(Call::BytesWrite)?;
        self.check_bytes(Call::BytesWrite, at, 8, false)?;
        self.zeroed.forget(at, 8);
        // SAFETY: as in `write`.
        unsafe { std::ptr::write_unaligned(at as *mut u64, value.to_le()) };
        Ok(())
    }
}
