//! The host side of a policy's imports (`upstream` and `bytes`): every address, size,
//! count and length a guest passes is checked here before the host acts on it, every
//! loop is bounded, and every byte the host takes on the guest's behalf counts against
//! its budget.
//!
//! The invariants this layer keeps (ARCHITECTURE.md's map names them in short):
//! Every loop is bounded (`Limits::batch`, read length, time checked at every
//! import and between 16 MiB chunks of every `bytes` import, an overlapping upward
//! copy taken from the end); every byte the host takes for a guest counts against
//! `Limits::overhead` at what it costs the host (`Ledger::cost`); nothing is given
//! back upstream while a block lent from it is live. A `Clearance` (a stretch of
//! upstream memory found inside one held block and clear of every lent block, with
//! both ledgers' generations) lets later accesses, answers and give-backs inside it
//! skip the ledger queries only while both generations are current and nothing is
//! held back. A fresh upstream block is a clearance, and so is a block the client
//! just gave back (it lay inside one held block, and lent blocks are disjoint).

use std::sync::Arc;

use super::bindings;
use super::sandbox::{BYTES_PER_WORK, IMPORT_WORK};
use super::{LinkStart, LinkState, Sandbox, Transit, Upstream};
use crate::clock::Deadline;
use crate::error::{Bound, Call, Error, Rule, Violation};
use crate::gpu::Placement;
use crate::ledger::{Ledger, TakeBack};

/// The largest request a machine could hold (1 PiB, the largest overhead budget too):
/// past it, a size is one no budget covers.
const REAL_REQUEST: u64 = 1 << 50;

impl LinkState {
    pub(crate) fn new(sandbox: Sandbox, start: LinkStart<'_>) -> Self {
        let LinkStart {
            upstream,
            limits,
            checked,
            place,
        } = start;
        LinkState {
            sandbox,
            lent: Ledger::default(),
            upstream,
            transit: Transit::default(),
            unreported: None,
            demand: 0,
            on_allowance: false,
            excused_left: 0,
            batch_limit: limits.batch,
            read_limit: limits.memory,
            overhead_limit: limits.overhead,
            budget_refusals: 0,
            budget_refusals_held: 0,
            clearance: None,
            zeroed: Default::default(),
            checked,
            mapped: super::Mapped::new(limits.grants.memory, limits.grants.gpu.clone()),
            place,
        }
    }

    /// Where the memory the upstream lends lies: the host's own memory, or the blocks
    /// of the link below, which serves the same client as this one.
    pub(super) fn upstream_placement(&self) -> Placement {
        match self.upstream {
            Upstream::System(_) => Placement::Host,
            Upstream::Policy(_) => self.place,
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
    pub(super) fn bounded(
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
    /// Under a counted runtime, each import costs [`IMPORT_WORK`] units.
    #[inline]
    pub(super) fn on_time(&mut self, call: Call) -> wasmtime::Result<()> {
        self.sandbox.charge(IMPORT_WORK);
        if self.out_of_time() {
            return Err(self.timed_out(call));
        }
        Ok(())
    }

    /// [`Self::on_time`] for an import about to move `bytes` for the policy (read,
    /// write, fill, copy, or take them from upstream, which fills or copies them), its
    /// counted work charged first ([`BYTES_PER_WORK`]), so that work past the
    /// limit is refused before it is done. What the client's request covers is not
    /// counted, once a call: the client chose it.
    #[inline]
    pub(super) fn on_time_moving(&mut self, call: Call, bytes: u64) -> wasmtime::Result<()> {
        let excused = bytes.min(self.excused_left);
        self.excused_left -= excused;
        let moved = bytes - excused;
        self.sandbox.charge(moved.div_ceil(BYTES_PER_WORK));
        self.on_time(call)
    }

    #[cold]
    #[inline(never)]
    fn timed_out(&mut self, call: Call) -> wasmtime::Error {
        let policy = self.sandbox.name.clone();
        let limit = self.sandbox.limit_passed();
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
            // A request a machine could hold that fit the budget alone: what the policy
            // held beyond its client's bytes took it past.
            let alone = self.demand.saturating_add(self.overhead_limit);
            if self.demand <= REAL_REQUEST && cost <= alone {
                self.budget_refusals_held += 1;
            }
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
    pub(super) fn check_bytes(
        &mut self,
        call: Call,
        at: u64,
        len: u64,
        read_only: bool,
    ) -> wasmtime::Result<()> {
        if len == 0 {
            return Ok(());
        }
        if (read_only && self.transit.within_block(at, len))
            || self.cleared_in(at, len, Placement::Host)
        {
            return Ok(());
        }
        match self.clear(at, len) {
            Some(Placement::Host) => Ok(()),
            Some(Placement::Device(device)) => {
                Err(self.violate(call, at, len, Rule::DeviceBytes { device }))
            }
            None if !read_only && self.transit.under_block(at, len) => {
                Err(self.violate(call, at, len, Rule::ResizedBlockWritten))
            }
            None => {
                let lent = (self.lent.nearby().overlapping(at, len))
                    .map(|(block, size)| (block, size, at));
                Err(self.violate(call, at, len, Rule::BytesOutOfBounds { lent }))
            }
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

impl bindings::allocbox::policy::allocator::Host for LinkState {
    fn malloc(&mut self, size: u64) -> wasmtime::Result<u64> {
        self.on_time_moving(Call::Malloc, size)?;
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
        let Some(size) = nelem.checked_mul(elsize) else {
            self.on_time(Call::Calloc)?;
            return Ok(0);
        };
        self.on_time_moving(Call::Calloc, size)?;
        if self.upstream_placement() != Placement::Host {
            // Zeroing is host work on the bytes: none for GPU memory.
            return Ok(0);
        }
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
        self.on_time_moving(Call::Realloc, new)?;
        let hold_back = self.check_give_back(Call::Realloc, ptr, old)?;
        if self.upstream_placement() != Placement::Host {
            // Moving a block copies its bytes, which the host never does on a GPU: the
            // old block stays, as after any refused realloc.
            return Ok(0);
        }
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
                unsafe { crate::system::copy_kept(ptr, old, fresh, new) };
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
        let limit = self.batch_limit;
        self.bounded(Call::MallocMany, Bound::Batch, count.into(), limit.into())?;
        let blocks_work = u64::from(count).saturating_mul(IMPORT_WORK);
        self.sandbox.charge(blocks_work);
        self.on_time_moving(Call::MallocMany, size.saturating_mul(count.into()))?;
        if size == 0 {
            return Ok(Vec::new());
        }
        // As many as the budget allows: fewer blocks is a valid answer.
        let per_block = self.upstream.lent().cost_of(size);
        let granted = (self.budget_left() / per_block).min(count.into()) as u32;
        if granted < count {
            self.budget_refusals += 1;
            if per_block <= self.overhead_limit {
                self.budget_refusals_held += 1;
            }
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
        // Each block is a `free`: checked and counted as one.
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
