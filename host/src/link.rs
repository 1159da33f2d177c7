//! One policy instance in a chain, the ledger of what it lent, and its upstream.
//!
//! The chain is nested ownership: a [`Link`]'s store owns its [`Upstream`], which is the
//! host's own memory or the next `Link`. A guest's `upstream.*` import therefore reaches
//! the next link through plain `&mut` access, and every boundary is checked by the same
//! code: a link's answers against its ledgers here, its calls upstream in the `Host`
//! impls of [`imports`].
//!
//! - [`sandbox`]: what every guest store holds and the bounds on it ([`Limits`]);
//! - [`transit`]: the block a policy's own `realloc` is resizing;
//! - [`upstream`]: where a link's memory comes from, the host's or the next link's;
//! - [`imports`]: the host side of a policy's imports, where every value it passes is
//!   checked;
//! - [`observer`]: what the host tells and asks a policy besides its allocator calls:
//!   observation (terms, deliveries, renewals) and its counters.

mod imports;
mod mapped;
mod observer;
mod sandbox;
mod transit;
mod upstream;
mod zeroed;

use imports::check_lent;
pub use mapped::ClientMisuse;
use mapped::Mapped;
pub(crate) use sandbox::Sandbox;
pub use sandbox::{Grants, Limits};
use transit::Transit;
pub(crate) use upstream::Upstream;
use zeroed::Zeroed;

use std::sync::Arc;
use std::time::Duration;

use wasmtime::Store;
use wasmtime_wasi::{WasiCtxView, WasiView};

use crate::clock::{CallTicks, Deadline};
use crate::error::{Bound, Call, Error, Rule, Violation};
use crate::ledger::Ledger;
use crate::mapped::KindGrant;
use crate::observe::Observations;

use crate::wit::{bindings, bindings_v2};

use bindings_v2::exports::allocbox::policy::observer::Guest as Observer;

/// A started policy's exports, in the version of the world it was built against.
pub(crate) enum Exports {
    V1(bindings::Policy),
    V2(bindings_v2::Policy),
}

/// Run `$call` on the allocator export of `$exports`, whichever version it is: the two
/// interfaces have the same functions and types.
macro_rules! allocator {
    ($exports:expr, |$a:ident| $call:expr) => {
        match $exports {
            Exports::V1(b) => {
                let $a = b.allocbox_policy_allocator();
                $call
            }
            Exports::V2(b) => {
                let $a = b.allocbox_policy_allocator();
                $call
            }
        }
    };
}

/// What a policy declared about itself at start-up, checked by the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyInfo {
    pub name: Arc<str>,
    pub version: u8,
    pub alignment: u64,
    pub batch: bool,
    /// It reports its client's misuse (0.2.0): allocation sites are worth recording.
    pub diagnoses: bool,
}

impl PolicyInfo {
    /// Does `addr` meet the alignment the policy declared? A mask, not a division: the
    /// alignment is a power of two, checked when the policy loads.
    #[inline]
    fn aligns(&self, addr: u64) -> bool {
        debug_assert!(self.alignment.is_power_of_two());
        addr & (self.alignment - 1) == 0
    }
}

/// The store data of one policy instance.
pub(crate) struct LinkState {
    pub(crate) sandbox: Sandbox,
    /// What this policy lent to its client and has not had back.
    pub(crate) lent: Ledger,
    pub(crate) upstream: Upstream,
    /// The block this policy's own `realloc` is resizing, and what it gave back meanwhile.
    transit: Transit,
    /// A failure of this link, or of one below it, that the caller of the current call
    /// has not been told of: an upstream failure is "none" to this link's guest, so it
    /// travels up beside the answer ([`Link::take_unreported`]).
    unreported: Option<Arc<Error>>,
    /// Bytes the client is asking for in the current call, on top of what it holds:
    /// the part of the overhead budget that is not overhead.
    demand: u64,
    /// The policy took memory in the current call that only the request's allowance
    /// let it take (`LinkState::end_allowance`).
    on_allowance: bool,
    call_time: Duration,
    batch_limit: u32,
    read_limit: u64,
    overhead_limit: u64,
    budget_refusals: u64,
    /// What the last full `bytes` check cleared; see [`imports::Clearance`].
    clearance: Option<imports::Clearance>,
    /// Upstream memory known to hold only zeros in the current call.
    zeroed: Zeroed,
    /// Deep checks ([`crate::HandlerBuilder::checked`]): a `calloc` answer that is not
    /// zero is a violation rather than zeroed by the host.
    checked: bool,
    /// Regions mapped for this policy through `memory` (0.2.0), and the client misuse it
    /// reported.
    mapped: Mapped,
}

impl std::fmt::Debug for LinkState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkState")
            .field("name", &self.sandbox.name)
            .field("lent", &self.lent.len())
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

impl WasiView for LinkState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        self.sandbox.ctx()
    }
}

impl crate::wasi::GuestView for LinkState {
    fn guest_wasi(&mut self) -> &mut crate::wasi::GuestWasi {
        self.sandbox.guest_wasi()
    }
}

/// Calls the host made into one policy of a chain, and what it has lent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinkStats {
    pub name: String,
    /// Single calls the policy answered (where [`crate::Stats`] counts the client's).
    pub mallocs: u64,
    pub callocs: u64,
    pub reallocs: u64,
    pub frees: u64,
    /// Batch calls the policy answered: magazine refills and flushes, many blocks each.
    pub malloc_many: u64,
    pub free_many: u64,
    /// Deliveries of events to an observing policy, and renewals of its lease.
    pub observed: u64,
    pub renewals: u64,
    /// Blocks the policy lent and has not got back: to the client, to the host's
    /// magazines ([`crate::Stats::cached_blocks`]) or to the policy above it.
    pub live_blocks: u64,
    pub live_bytes: u64,
    pub peak_bytes: u64,
    /// Upstream requests answered "none" because they would have taken the policy past
    /// its overhead budget ([`Limits::overhead`]).
    pub budget_refusals: u64,
    /// Why the policy was stopped, if it was.
    pub failure: Option<String>,
    /// The policy's own counters (`lifecycle.report`, 0.2.0), by name, in its order.
    pub counters: Vec<(String, u64)>,
    /// Regions mapped for the policy ([`crate::mapped`]) and their bytes.
    pub mapped_regions: u64,
    pub mapped_bytes: u64,
    /// Misuse by its client the policy reported (`diagnostics`, 0.2.0): how many, and the
    /// latest ([`ClientMisuse::KEPT`] at most).
    pub client_misuse: u64,
    pub recent_misuse: Vec<ClientMisuse>,
    /// Regions the policy asked for of a kind the embedder did not grant, by kind: the
    /// paths that would have used them did not run.
    pub ungranted: Vec<(KindGrant, u64)>,
}

/// A started, initialised policy instance.
pub(crate) struct Link {
    pub(crate) store: Store<LinkState>,
    bindings: Exports,
    pub(crate) info: PolicyInfo,
    pub(crate) poisoned: Option<Arc<Error>>,
    limits: Limits,
    calls: LinkStats,
    /// What the host served this link's client without asking it, when it observes
    /// (0.2.0 `observer`) as the top of its chain.
    observed: Option<Arc<Observations>>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("info", &self.info)
            .field("poisoned", &self.poisoned)
            .field("state", self.store.data())
            .finish_non_exhaustive()
    }
}

impl Link {
    pub(crate) fn new(
        store: Store<LinkState>,
        bindings: Exports,
        info: PolicyInfo,
        limits: Limits,
    ) -> Self {
        Link {
            store,
            bindings,
            info,
            poisoned: None,
            limits,
            calls: LinkStats::default(),
            observed: None,
        }
    }

    /// This link's counters.
    pub(crate) fn stats(&self) -> LinkStats {
        let lent = self.lent();
        let state = self.store.data();
        LinkStats {
            name: self.info.name.to_string(),
            live_blocks: lent.len() as u64,
            live_bytes: lent.bytes(),
            peak_bytes: lent.peak_bytes(),
            budget_refusals: state.budget_refusals,
            failure: self.poisoned.as_ref().map(|e| e.to_string()),
            mapped_regions: state.mapped.regions() as u64,
            mapped_bytes: state.mapped.bytes(),
            client_misuse: state.mapped.misuse_total(),
            recent_misuse: state.mapped.recent_misuse().to_vec(),
            ungranted: state.mapped.ungranted(),
            ..self.calls.clone()
        }
    }

    /// Regions mapped for this policy that `[addr, addr+size)` lies in, if any.
    pub(crate) fn mapped_containing(&self, addr: u64, size: u64) -> Option<(u64, u64)> {
        self.store.data().mapped.containing(addr, size)
    }

    /// Regions mapped for this policy: `(regions, bytes)`.
    pub(crate) fn mapped_held(&self) -> (usize, u64) {
        let mapped = &self.store.data().mapped;
        (mapped.regions(), mapped.bytes())
    }

    /// Client misuse the policy reported since this was last asked.
    pub(crate) fn take_new_misuse(&mut self) -> Vec<ClientMisuse> {
        self.store.data_mut().mapped.take_new_misuse()
    }

    pub(crate) fn name(&self) -> &Arc<str> {
        &self.info.name
    }

    /// The deadline of a call of the embedder's that reaches this link with no call of
    /// the handler's around it (a thread's end): only such an entry point makes one.
    pub(crate) fn client_call(&self) -> Deadline {
        Deadline::for_client_call(
            self.store.data().sandbox.clock(),
            CallTicks::of(self.limits.call_time),
        )
    }

    pub(crate) fn lent(&self) -> &Ledger {
        &self.store.data().lent
    }

    pub(crate) fn lent_mut(&mut self) -> &mut Ledger {
        &mut self.store.data_mut().lent
    }

    pub(crate) fn upstream(&self) -> &Upstream {
        &self.store.data().upstream
    }

    /// Run one call into the guest under its time limit, turning every failure into a
    /// typed error and poisoning the link. `demand` is the bytes the call asks for, which
    /// the policy may take from upstream beyond its overhead budget.
    fn enter<R>(
        &mut self,
        call: Call,
        deadline: &mut Deadline,
        demand: u64,
        f: impl FnOnce(&Exports, &mut Store<LinkState>) -> wasmtime::Result<R>,
    ) -> Result<R, Error> {
        if let Some(cause) = &self.poisoned {
            return Err(Error::Poisoned {
                policy: self.info.name.clone(),
                cause: cause.clone(),
            });
        }
        // The policy hears of what was served without it before anything it serves.
        if self.observed.as_ref().is_some_and(|o| o.pending()) {
            self.deliver(deadline)?;
        }
        self.start_call(*deadline, demand);
        let answer = f(&self.bindings, &mut self.store);
        self.end_call(deadline);
        answer.map_err(|e| self.failed(call, e))
    }

    /// A call into the guest failed: the typed error that says what happened, the link
    /// stopped for it.
    #[cold]
    #[inline(never)]
    fn failed(&mut self, call: Call, e: wasmtime::Error) -> Error {
        let err = classify(&mut self.store, &self.limits, call, e);
        self.poison(err.clone());
        err
    }

    /// Arm the time limit of a call (the epoch for wasm code, the deadline for imports)
    /// at the deadline of the embedder's call that causes it, and say what the call asks
    /// for.
    #[inline]
    fn start_call(&mut self, deadline: Deadline, demand: u64) {
        let state = self.store.data_mut();
        let armed = state.sandbox.begin_call(deadline);
        state.demand = demand;
        state.on_allowance = false;
        state.zeroed.clear();
        self.store.set_epoch_deadline(armed);
    }

    /// A call into the guest ended: the embedder's call takes on the host work excused
    /// in it, so the next guest call it causes runs under the same, moved, deadline.
    #[inline]
    fn end_call(&mut self, deadline: &mut Deadline) {
        deadline.extend_to(self.store.data().sandbox.deadline());
    }

    /// Stop this link and every link below it because the chain failed at `cause`: no
    /// new request will reach them, so each gives its upstream memory back once its
    /// client holds nothing, rather than keeping caches no one can use. Bottom first, so
    /// that the give-backs of a link above reach a stopped link, not a guest.
    pub(crate) fn retire(&mut self, cause: &Arc<Error>) {
        if let Upstream::Policy(next) = &mut self.store.data_mut().upstream {
            next.retire(cause);
        }
        if self.poisoned.is_none() {
            // The chain knows why: nothing to report.
            self.stop(Arc::new(Error::Poisoned {
                policy: cause.policy().unwrap_or("?").into(),
                cause: cause.clone(),
            }));
        } else {
            // Stopped earlier, over a link that was still running: its give-backs waited
            // for that link to stop too.
            self.release(true);
        }
        self.store.data_mut().unreported = None;
    }

    /// Stop the link for its own failure, which its caller is told of.
    pub(crate) fn poison(&mut self, cause: Error) {
        if self.poisoned.is_some() {
            return;
        }
        log::warn!("{cause}");
        let cause = Arc::new(cause);
        self.store
            .data_mut()
            .unreported
            .get_or_insert(cause.clone());
        self.stop(cause);
    }

    /// Stop the link for good. Its upstream blocks are given back once its client has
    /// given back everything it holds.
    fn stop(&mut self, cause: Arc<Error>) {
        self.poisoned = Some(cause);
        // Held-back memory may lie under the client's old block: it stays on the dead
        // link's books and is released with the rest once the client lets go.
        self.store.data_mut().transit.end();
        self.store.data_mut().mapped.end_transit(false);
        self.release(true);
    }

    /// The failure of this link, or of one below it, that happened since the last time
    /// this was asked: the caller of this link acts on it.
    pub(crate) fn take_unreported(&mut self) -> Option<Arc<Error>> {
        self.store.data_mut().unreported.take()
    }

    /// A dead link whose client holds nothing returns all its upstream memory.
    fn release_if_done(&mut self) {
        self.release(false);
    }

    /// A dead link gives its upstream memory back once the link below is stopped too
    /// (the chain stops every link when one fails): a give-back never calls a guest that
    /// no embedder's call is waiting for, so it needs no deadline, and a running link
    /// below is never timed out for a link above. All of it once its client holds
    /// nothing; with `clear_of_lent`, while its client still holds blocks, every upstream
    /// block none of them lies in (what the policy cached, or kept of a request it
    /// refused), so a stopped policy holds no more than its client's blocks need. That is
    /// a range query per upstream block: made once, when the link stops.
    fn release(&mut self, clear_of_lent: bool) {
        let whole = self.lent().is_empty();
        if self.poisoned.is_none() || !(whole || clear_of_lent) {
            return;
        }
        let state = self.store.data_mut();
        if let Upstream::Policy(next) = &state.upstream
            && next.poisoned.is_none()
        {
            return;
        }
        let held: Vec<(u64, u64)> = state
            .upstream
            .lent()
            .iter()
            .map(|(a, e)| (a, e.size))
            .collect();
        for (addr, size) in held {
            if !whole && state.lent.ordered().overlapping(addr, size).is_some() {
                continue;
            }
            // These are exactly the recorded sizes, so the upstream cannot refuse them;
            // it is the host's memory or a stopped link, so no guest is called.
            let _ = state.call_upstream(&mut Deadline::passed(), |u, d| u.free(d, addr, size));
        }
        if whole {
            state.mapped.unmap_all();
        }
    }

    /// Is a block this link returned aligned and inside the clearance (the block the
    /// policy just took, or was given back)? Then it breaks no rule, and no query is
    /// needed: most blocks are, so the callers inline this and keep the queries out of
    /// line.
    #[inline]
    fn in_clearance(&self, addr: u64, size: u64) -> bool {
        self.info.aligns(addr) && self.store.data().cleared(addr, size)
    }

    /// The rule a block this link returned breaks, if any.
    fn misplaced(&mut self, addr: u64, size: u64) -> Option<Rule> {
        if self.in_clearance(addr, size) {
            return None;
        }
        self.misplaced_by_query(addr, size)
    }

    /// [`Self::misplaced`] for a block outside the clearance.
    #[inline(never)]
    fn misplaced_by_query(&mut self, addr: u64, size: u64) -> Option<Rule> {
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
    fn violation(&mut self, call: Call, addr: u64, size: u64, rule: Rule) -> Error {
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
    fn end_allowance(&mut self, call: Call) -> Result<(), Error> {
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
    fn admit(&mut self, call: Call, addr: u64, size: u64) -> Result<u64, Error> {
        if self.in_clearance(addr, size) {
            self.lent_mut().insert(addr, size);
            return Ok(addr);
        }
        self.admit_by_query(call, addr, size)
    }

    /// [`Self::admit`] for a block outside the clearance.
    #[inline(never)]
    fn admit_by_query(&mut self, call: Call, addr: u64, size: u64) -> Result<u64, Error> {
        match self.misplaced_by_query(addr, size) {
            None => {
                self.lent_mut().insert(addr, size);
                Ok(addr)
            }
            Some(rule) => Err(self.violation(call, addr, size, rule)),
        }
    }

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
    fn make_zero(&mut self, addr: u64, size: u64) -> Result<(), Error> {
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
    fn release_held_back(&mut self, deadline: &mut Deadline) {
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
    fn ask_free(&mut self, deadline: &mut Deadline, ptr: u64, size: u64) -> Result<(), Error> {
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

/// The rule a realloc's answer at `new` breaks if it does not hold the first `len` bytes
/// of the client's block at `old`.
fn lost_byte(old: u64, new: u64, len: u64) -> Option<Rule> {
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

/// Turn a failed call into the error that says what happened.
pub(crate) fn classify(
    store: &mut Store<LinkState>,
    limits: &Limits,
    call: Call,
    err: wasmtime::Error,
) -> Error {
    store.data_mut().sandbox.classify(limits, call, err)
}
