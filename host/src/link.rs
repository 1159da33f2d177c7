//! One policy instance in a chain, the ledger of what it lent, and its upstream.
//!
//! The chain is nested ownership: a [`Link`]'s store owns its [`Upstream`], which is the
//! host's own memory or the next `Link`. A guest's `upstream.*` import therefore reaches
//! the next link through plain `&mut` access, and every boundary is checked by the same
//! code: a link's answers against its ledgers here, its calls upstream in the `Host`
//! impls below.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use wasmtime::component::ResourceTable;
use wasmtime::{Store, Trap};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::error::{Bound, Call, Error, Rule, Violation};
use crate::ledger::{Ledger, TakeBack};
use crate::system::SystemMemory;

pub(crate) mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "policy",
        imports: { default: trappable },
    });
}

use bindings::exports::allocbox::policy::allocator::Guest as Allocator;

/// What a policy declared about itself at start-up, checked by the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyInfo {
    pub name: Arc<str>,
    pub version: u8,
    pub alignment: u64,
    pub batch: bool,
}

/// Where a link gets its memory from.
#[derive(Debug)]
pub(crate) enum Upstream {
    System(SystemMemory),
    Policy(Box<Link>),
}

/// The link's client broke the sized-free rule or freed what it does not own.
pub(crate) type CallerFault = TakeBack;

impl Upstream {
    /// The blocks this upstream lent: what the link above it owns.
    pub(crate) fn lent(&self) -> &Ledger {
        match self {
            Upstream::System(s) => &s.lent,
            Upstream::Policy(l) => &l.store.data().lent,
        }
    }

    // The methods below absorb a failing upstream policy into "none": the caller is a
    // healthy guest that must not be trapped for its upstream's fault. The failure is
    // kept in the failing link and in the chain's poison log, where the handler finds it.

    fn malloc(&mut self, size: u64) -> u64 {
        match self {
            Upstream::System(s) => s.malloc(size, false),
            Upstream::Policy(l) => l.malloc(size).unwrap_or(0),
        }
    }

    fn calloc(&mut self, nelem: u64, elsize: u64) -> u64 {
        match self {
            Upstream::System(s) => match nelem.checked_mul(elsize) {
                Some(size) => s.malloc(size.max(1), true),
                None => 0,
            },
            Upstream::Policy(l) => l.calloc(nelem, elsize).unwrap_or(0),
        }
    }

    fn realloc(&mut self, ptr: u64, old: u64, new: u64) -> Result<u64, CallerFault> {
        match self {
            Upstream::System(s) => s.realloc(ptr, old, new),
            Upstream::Policy(l) => match l.realloc(ptr, old, new) {
                Ok(addr) => Ok(addr),
                Err(LinkFault::Caller(fault)) => Err(fault),
                Err(LinkFault::Link(_)) => Ok(0),
            },
        }
    }

    pub(crate) fn free(&mut self, ptr: u64, size: u64) -> Result<(), CallerFault> {
        match self {
            Upstream::System(s) => s.free(ptr, size),
            Upstream::Policy(l) => match l.free(ptr, size) {
                Ok(()) | Err(LinkFault::Link(_)) => Ok(()),
                Err(LinkFault::Caller(fault)) => Err(fault),
            },
        }
    }

    fn malloc_many(&mut self, size: u64, count: u32) -> Vec<u64> {
        match self {
            Upstream::System(s) => (0..count)
                .map_while(|_| Some(s.malloc(size, false)).filter(|&a| a != 0))
                .collect(),
            Upstream::Policy(l) => l.malloc_many(size, count).unwrap_or_default(),
        }
    }

    fn trim(&mut self) {
        if let Upstream::Policy(l) = self {
            // A failing trim poisons that link; its blocks are released host-side.
            let _ = l.trim();
        }
    }

    /// Every poisoned link from here down, with its cause.
    pub(crate) fn failures(&self, out: &mut Vec<Arc<Error>>) {
        if let Upstream::Policy(l) = self {
            if let Some(cause) = &l.poisoned {
                out.push(cause.clone());
            }
            l.store.data().upstream.failures(out);
        }
    }
}

/// Bounds on one policy instance: every unit of host work and host memory a policy can
/// cause is bounded by one of these. See SECURITY.md for what each one covers.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Most bytes of linear memory (and tables) the guest may grow to; also the longest
    /// `bytes.read` (an answer that could never fit in the guest). Default 64 MiB.
    pub memory: u64,
    /// Longest a single call into the guest may run, time spent in its imports
    /// included. A chain's call is bounded by the sum of its links' limits. Passing it
    /// stops the policy with [`Error::Timeout`]. Default 1 s.
    pub call_time: Duration,
    /// Most blocks one `malloc-many` or `free-many` may ask of the host. Passing it stops
    /// the policy with [`Error::WorkLimit`]. Default 4096.
    pub batch: u32,
    /// Most bytes a policy may hold from its upstream beyond what its client holds and
    /// is asking for in the current call (its overhead: caches, headers, free lists),
    /// each upstream block counting [`LEDGER_ENTRY_COST`] bytes more for the host's own
    /// record of it. An upstream request past it is answered "none", as out of memory,
    /// and counted in [`LinkStats::budget_refusals`]. It bounds overhead, not size: a
    /// client may still get a single block of many GiB. Default 256 MiB.
    pub overhead: u64,
    /// Guest stdout/stderr kept for error messages and the log. Default 16 KiB.
    pub output: usize,
    /// What WASI grants the guest beyond nothing. Default: nothing.
    pub grants: Grants,
}

/// Host memory one upstream block costs beyond its bytes (the ledger's entry for it),
/// counted against [`Limits::overhead`] so that a policy cannot grow the host's books
/// without bound by taking many tiny blocks.
pub const LEDGER_ENTRY_COST: u64 = 64;

/// What the sandbox grants a guest. WASI is deny-by-default: no files, no network, no
/// environment, and clocks that always read zero (a policy cannot time anything or leak
/// timing into its placements) — unless granted here. Files and sockets are never
/// granted: a placement policy has no use for them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grants {
    /// Real wall and monotonic clocks.
    pub clocks: bool,
    /// Environment variables the guest may read.
    pub env: Vec<(String, String)>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory: 64 << 20,
            call_time: Duration::from_secs(1),
            batch: 4096,
            overhead: 256 << 20,
            output: 16 << 10,
            grants: Grants::default(),
        }
    }
}

/// What every guest store holds, policy or hook: the deny-by-default WASI context, the
/// memory cap, the bounded output, and a rule the guest broke inside an import.
pub(crate) struct Sandbox {
    pub(crate) name: Arc<str>,
    /// What the guest did wrong inside one of its imports (a broken rule, a passed
    /// bound); the trap it causes is reported as this error.
    fault: Option<Error>,
    limiter: MemoryLimiter,
    output: MemoryOutputPipe,
    wasi: WasiCtx,
    table: ResourceTable,
}

impl Sandbox {
    pub(crate) fn new(
        name: Arc<str>,
        limits: &Limits,
        wasi: WasiCtx,
        output: MemoryOutputPipe,
    ) -> Self {
        Sandbox {
            name,
            fault: None,
            limiter: MemoryLimiter {
                limit: limits.memory,
                hit: false,
            },
            output,
            wasi,
            table: ResourceTable::new(),
        }
    }

    pub(crate) fn limiter(&mut self) -> &mut dyn wasmtime::ResourceLimiter {
        &mut self.limiter
    }

    /// Turn a failed call into the error that says what happened.
    pub(crate) fn classify(&mut self, limits: &Limits, call: Call, err: wasmtime::Error) -> Error {
        let policy = self.name.clone();
        if let Some(fault) = self.fault.take() {
            return fault;
        }
        if std::mem::take(&mut self.limiter.hit) {
            return Error::MemoryLimit {
                policy,
                call,
                limit: limits.memory,
            };
        }
        if err.downcast_ref::<Trap>() == Some(&Trap::Interrupt) {
            return Error::Timeout {
                policy,
                call,
                limit: limits.call_time,
            };
        }
        let mut message = match err.downcast_ref::<Trap>() {
            Some(trap) => trap.to_string(),
            None => format!("{err:#}"),
        };
        let said = self.output.contents();
        if !said.is_empty() {
            let said = String::from_utf8_lossy(&said);
            let tail: Vec<&str> = said.trim_end().lines().rev().take(3).collect();
            message.push_str(&format!(" (guest output: {})", tail.join(" | ")));
        }
        Error::Trap {
            policy,
            call,
            message,
        }
    }
}

impl WasiView for Sandbox {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl Drop for Sandbox {
    /// What the guest printed goes to the host's log.
    fn drop(&mut self) {
        let said = self.output.contents();
        if !said.is_empty() {
            log::info!(
                "guest `{}` said: {}",
                self.name,
                String::from_utf8_lossy(&said).trim_end()
            );
        }
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
    /// Counts poisonings anywhere in the chain, so the handler notices a failure deep
    /// down with one atomic load per call.
    poison_count: Arc<AtomicUsize>,
    /// The runtime's tick count, advanced with the engine's epoch.
    clock: Arc<AtomicU64>,
    /// The tick past which the current call has run too long, its imports included.
    deadline: u64,
    /// Bytes the client is asking for in the current call, on top of what it holds:
    /// the part of the overhead budget that is not overhead.
    demand: u64,
    call_time: Duration,
    batch_limit: u32,
    read_limit: u64,
    overhead_limit: u64,
    budget_refusals: u64,
}

/// The block a policy's own `realloc` is resizing, and the upstream memory the policy
/// gave back during that call.
///
/// The invariant it keeps: while a block is in transit the client's bytes stay where
/// they are — upstream memory under the block is held back, not released — and no
/// answer may lie in memory the policy gave back. Once the answer is admitted the
/// held-back memory is released; if the call fails, the policy is stopped and the
/// memory stays on its books until its client lets go of the old block.
#[derive(Debug, Default)]
struct Transit {
    block: Option<(u64, u64)>,
    held_back: Vec<(u64, u64)>,
}

impl Transit {
    fn begin(&mut self, ptr: u64, size: u64) {
        debug_assert!(self.block.is_none() && self.held_back.is_empty());
        self.block = Some((ptr, size));
    }

    /// End the transit, returning what was held back.
    fn end(&mut self) -> Vec<(u64, u64)> {
        self.block = None;
        std::mem::take(&mut self.held_back)
    }

    /// Does `[at, at+len)` lie wholly inside the block in transit?
    fn within_block(&self, at: u64, len: u64) -> bool {
        self.block
            .is_some_and(|(p, s)| at >= p && at.checked_add(len).is_some_and(|e| e <= p + s))
    }

    /// Does the upstream block `[ptr, ptr+size)` hold (part of) the block in transit?
    fn under_block(&self, ptr: u64, size: u64) -> bool {
        self.block
            .is_some_and(|(p, s)| p < ptr.saturating_add(size) && ptr < p + s)
    }

    /// A held-back upstream block that `[at, at+len)` overlaps.
    fn held_back_overlapping(&self, at: u64, len: u64) -> Option<(u64, u64)> {
        let end = at.saturating_add(len);
        self.held_back
            .iter()
            .copied()
            .find(|&(p, s)| p < end && at < p + s)
    }
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

/// Caps the guest's own memory; remembers that it tried to pass the cap so that the
/// resulting trap is reported as a memory-limit error, not a generic trap.
#[derive(Debug)]
struct MemoryLimiter {
    limit: u64,
    hit: bool,
}

impl wasmtime::ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired as u64 > self.limit {
            self.hit = true;
            wasmtime::bail!("guest memory limit of {} bytes reached", self.limit);
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 1 << 20)
    }
}

impl LinkState {
    pub(crate) fn new(
        sandbox: Sandbox,
        upstream: Upstream,
        limits: &Limits,
        poison_count: Arc<AtomicUsize>,
        clock: Arc<AtomicU64>,
    ) -> Self {
        LinkState {
            sandbox,
            lent: Ledger::default(),
            upstream,
            transit: Transit::default(),
            poison_count,
            clock,
            deadline: u64::MAX,
            demand: 0,
            call_time: limits.call_time,
            batch_limit: limits.batch,
            read_limit: limits.memory,
            overhead_limit: limits.overhead,
            budget_refusals: 0,
        }
    }

    /// Record that this policy did `fault` inside an import and produce the error that
    /// traps it.
    fn fail(&mut self, fault: Error) -> wasmtime::Error {
        let err = wasmtime::Error::new(fault.clone());
        self.sandbox.fault = Some(fault);
        err
    }

    /// Record that this policy broke `rule` and produce the error that traps it.
    fn violate(&mut self, call: Call, addr: u64, size: u64, rule: Rule) -> wasmtime::Error {
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
    fn on_time(&mut self, call: Call) -> wasmtime::Result<()> {
        if self.clock.load(Ordering::Relaxed) <= self.deadline {
            return Ok(());
        }
        let policy = self.sandbox.name.clone();
        let limit = self.call_time;
        Err(self.fail(Error::Timeout {
            policy,
            call,
            limit,
        }))
    }

    /// Bytes (and ledger entries, at [`LEDGER_ENTRY_COST`] each) the policy may still
    /// take from upstream within its overhead budget.
    fn budget_left(&self) -> u64 {
        let allowed = self
            .lent
            .bytes()
            .saturating_add(self.demand)
            .saturating_add(self.overhead_limit);
        allowed.saturating_sub(holding(self.upstream.lent()))
    }

    /// May the policy take `bytes` more in `blocks` more blocks from upstream? A
    /// refusal is counted.
    fn within_budget(&mut self, bytes: u64, blocks: u64) -> bool {
        let cost = bytes.saturating_add(blocks.saturating_mul(LEDGER_ENTRY_COST));
        let ok = cost <= self.budget_left();
        if !ok {
            self.budget_refusals += 1;
        }
        ok
    }

    fn caller_fault(
        &mut self,
        call: Call,
        addr: u64,
        size: u64,
        f: CallerFault,
    ) -> wasmtime::Error {
        let rule = match f {
            TakeBack::Unknown => Rule::UnknownFree,
            TakeBack::AlreadyFreed => Rule::DoubleFree,
            TakeBack::WrongSize { recorded } => Rule::WrongSizeFree { recorded },
        };
        self.violate(call, addr, size, rule)
    }

    /// Does `[at, at+len)` lie inside memory this policy holds from upstream and has not
    /// given back (held-back memory is on its way out)?
    fn owns(&self, at: u64, len: u64) -> bool {
        self.upstream.lent().containing(at, len).is_some()
            && self.transit.held_back_overlapping(at, len).is_none()
    }

    /// Is `ptr` an upstream block this policy holds with exactly `size` bytes? A block
    /// it already gave back during the current realloc is a double free.
    fn check_held(&mut self, call: Call, ptr: u64, size: u64) -> wasmtime::Result<()> {
        let fault = if self.transit.held_back.iter().any(|&(p, _)| p == ptr) {
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
            || (self.owns(at, len) && self.lent.overlapping(at, len).is_none());
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
    fn check_nothing_lent_inside(
        &mut self,
        call: Call,
        ptr: u64,
        size: u64,
    ) -> wasmtime::Result<()> {
        let in_transit = self.transit.block.map(|(p, _)| p);
        let inside = self
            .lent
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
    fn check_give_back(&mut self, call: Call, ptr: u64, size: u64) -> wasmtime::Result<bool> {
        self.check_held(call, ptr, size)?;
        self.check_nothing_lent_inside(call, ptr, size)?;
        Ok(self.transit.under_block(ptr, size))
    }
}

/// Host memory an upstream ledger stands for: its bytes and the cost of its entries.
fn holding(ledger: &Ledger) -> u64 {
    ledger
        .bytes()
        .saturating_add(ledger.len() as u64 * LEDGER_ENTRY_COST)
}

impl bindings::allocbox::policy::allocator::Host for LinkState {
    fn malloc(&mut self, size: u64) -> wasmtime::Result<u64> {
        self.on_time(Call::Malloc)?;
        if size == 0 || !self.within_budget(size, 1) {
            return Ok(0);
        }
        Ok(self.upstream.malloc(size))
    }

    fn calloc(&mut self, nelem: u64, elsize: u64) -> wasmtime::Result<u64> {
        self.on_time(Call::Calloc)?;
        let Some(size) = nelem.checked_mul(elsize) else {
            return Ok(0);
        };
        if !self.within_budget(size.max(1), 1) {
            return Ok(0);
        }
        Ok(self.upstream.calloc(nelem, elsize))
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
            if !self.within_budget(new, 1) {
                return Ok(0);
            }
            let fresh = self.upstream.malloc(new);
            if fresh != 0 {
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
                self.transit.held_back.push((ptr, old));
            }
            return Ok(fresh);
        }
        if !self.within_budget(new.saturating_sub(old), 0) {
            return Ok(0);
        }
        match self.upstream.realloc(ptr, old, new) {
            Ok(addr) => Ok(addr),
            Err(f) => Err(self.caller_fault(Call::Realloc, ptr, old, f)),
        }
    }

    fn free(&mut self, ptr: u64, size: u64) -> wasmtime::Result<()> {
        self.on_time(Call::Free)?;
        if self.check_give_back(Call::Free, ptr, size)? {
            self.transit.held_back.push((ptr, size));
            return Ok(());
        }
        self.upstream
            .free(ptr, size)
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
        let per_block = size.saturating_add(LEDGER_ENTRY_COST);
        let granted = (self.budget_left() / per_block).min(count.into()) as u32;
        if granted < count {
            self.budget_refusals += 1;
        }
        Ok(self.upstream.malloc_many(size, granted))
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
fn check_lent(ledger: &Ledger, ptr: u64, size: u64) -> Result<(), CallerFault> {
    match ledger.get(ptr) {
        Some(e) if e.size == size => Ok(()),
        Some(e) => Err(TakeBack::WrongSize { recorded: e.size }),
        None => Err(ledger.why_unknown(ptr)),
    }
}

/// Bytes one step of a long `fill` or `copy` touches before the time is checked again.
const BYTES_CHUNK: u64 = 16 << 20;

impl bindings::allocbox::policy::bytes::Host for LinkState {
    fn read(&mut self, at: u64, len: u32) -> wasmtime::Result<Vec<u8>> {
        self.on_time(Call::BytesRead)?;
        let limit = self.read_limit;
        self.bounded(Call::BytesRead, Bound::ReadLength, len.into(), limit)?;
        self.check_bytes(Call::BytesRead, at, len.into(), true)?;
        let mut out = vec![0; len as usize];
        // SAFETY: check_bytes proved `[at, at+len)` lies inside one live upstream block
        // (or the block in transit, which lies inside one), and every block in a ledger
        // lies inside host memory allocated by SystemMemory and not yet released.
        unsafe { std::ptr::copy_nonoverlapping(at as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(out)
    }

    fn write(&mut self, at: u64, data: Vec<u8>) -> wasmtime::Result<()> {
        self.on_time(Call::BytesWrite)?;
        self.check_bytes(Call::BytesWrite, at, data.len() as u64, false)?;
        // SAFETY: as in `read`; the range is also not lent out, so no client holds it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), at as *mut u8, data.len()) };
        Ok(())
    }

    fn fill(&mut self, at: u64, len: u64, byte: u8) -> wasmtime::Result<()> {
        self.check_bytes(Call::BytesFill, at, len, false)?;
        let mut done = 0;
        while done < len {
            self.on_time(Call::BytesFill)?;
            let step = (len - done).min(BYTES_CHUNK);
            // SAFETY: as in `write`; `[at+done, at+done+step)` lies inside the checked range.
            unsafe { std::ptr::write_bytes((at + done) as *mut u8, byte, step as usize) };
            done += step;
        }
        Ok(())
    }

    fn copy(&mut self, dst: u64, src: u64, len: u64) -> wasmtime::Result<()> {
        self.check_bytes(Call::BytesCopy, src, len, true)?;
        self.check_bytes(Call::BytesCopy, dst, len, false)?;
        if dst > src && dst < src + len {
            // Overlapping with the destination above: chunks would overwrite source bytes
            // not yet copied, so one move (bounded by the checked ranges' size).
            self.on_time(Call::BytesCopy)?;
            // SAFETY: both ranges were checked as in `read`/`write`; `copy` allows overlap.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) };
            return Ok(());
        }
        let mut done = 0;
        while done < len {
            self.on_time(Call::BytesCopy)?;
            let step = (len - done).min(BYTES_CHUNK);
            // SAFETY: both ranges were checked as in `read`/`write`; ascending chunks are
            // correct when `dst` is not above an overlapping `src`, and `copy` allows
            // the overlap inside one chunk.
            unsafe {
                std::ptr::copy(
                    (src + done) as *const u8,
                    (dst + done) as *mut u8,
                    step as usize,
                )
            };
            done += step;
        }
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
        // SAFETY: as in `write`.
        unsafe { std::ptr::write_unaligned(at as *mut u64, value.to_le()) };
        Ok(())
    }
}

/// Why a link could not serve a free or realloc.
#[derive(Debug)]
pub(crate) enum LinkFault {
    /// The caller broke the rule; nothing happened.
    Caller(CallerFault),
    /// The link failed and is now poisoned.
    Link(Error),
}

/// Calls the host made into one policy of a chain, and what it has lent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinkStats {
    pub name: String,
    pub mallocs: u64,
    pub callocs: u64,
    pub reallocs: u64,
    pub frees: u64,
    pub malloc_many: u64,
    pub free_many: u64,
    pub live_blocks: u64,
    pub live_bytes: u64,
    pub peak_bytes: u64,
    /// Upstream requests answered "none" because they would have taken the policy past
    /// its overhead budget ([`Limits::overhead`]).
    pub budget_refusals: u64,
    /// Why the policy was stopped, if it was.
    pub failure: Option<String>,
}

/// A started, initialised policy instance.
pub(crate) struct Link {
    pub(crate) store: Store<LinkState>,
    bindings: bindings::Policy,
    pub(crate) info: PolicyInfo,
    pub(crate) poisoned: Option<Arc<Error>>,
    deadline_ticks: u64,
    limits: Limits,
    calls: LinkStats,
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
        bindings: bindings::Policy,
        info: PolicyInfo,
        deadline_ticks: u64,
        limits: Limits,
    ) -> Self {
        Link {
            store,
            bindings,
            info,
            poisoned: None,
            deadline_ticks,
            limits,
            calls: LinkStats::default(),
        }
    }

    /// This link's counters.
    pub(crate) fn stats(&self) -> LinkStats {
        let lent = self.lent();
        LinkStats {
            name: self.info.name.to_string(),
            live_blocks: lent.len() as u64,
            live_bytes: lent.bytes(),
            peak_bytes: lent.peak_bytes(),
            budget_refusals: self.store.data().budget_refusals,
            failure: self.poisoned.as_ref().map(|e| e.to_string()),
            ..self.calls.clone()
        }
    }

    pub(crate) fn name(&self) -> &Arc<str> {
        &self.info.name
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
        demand: u64,
        f: impl FnOnce(&Allocator, &mut Store<LinkState>) -> wasmtime::Result<R>,
    ) -> Result<R, Error> {
        if let Some(cause) = &self.poisoned {
            return Err(Error::Poisoned {
                policy: self.info.name.clone(),
                cause: cause.clone(),
            });
        }
        self.start_call(demand);
        match f(self.bindings.allocbox_policy_allocator(), &mut self.store) {
            Ok(r) => Ok(r),
            Err(e) => {
                let err = classify(&mut self.store, &self.limits, call, e);
                self.poison(err.clone());
                Err(err)
            }
        }
    }

    /// Arm the time limit of a call (the epoch for wasm code, the deadline for imports)
    /// and say what it asks for.
    fn start_call(&mut self, demand: u64) {
        self.store.set_epoch_deadline(self.deadline_ticks);
        let state = self.store.data_mut();
        state.deadline = state.clock.load(Ordering::Relaxed) + self.deadline_ticks;
        state.demand = demand;
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
            self.poison(Error::Poisoned {
                policy: cause.policy().unwrap_or("?").into(),
                cause: cause.clone(),
            });
        }
    }

    /// Stop the link for good. Its upstream blocks are given back once its client has
    /// given back everything it holds.
    pub(crate) fn poison(&mut self, cause: Error) {
        if self.poisoned.is_some() {
            return;
        }
        log::warn!("{cause}");
        self.poisoned = Some(Arc::new(cause));
        let state = self.store.data_mut();
        state.poison_count.fetch_add(1, Ordering::Relaxed);
        // Held-back memory may lie under the client's old block: it stays on the dead
        // link's books and is released with the rest once the client lets go.
        state.transit.end();
        self.release_if_done();
    }

    /// A dead link whose client holds nothing returns all its upstream memory.
    fn release_if_done(&mut self) {
        if self.poisoned.is_none() || !self.lent().is_empty() {
            return;
        }
        let state = self.store.data_mut();
        let held: Vec<(u64, u64)> = state
            .upstream
            .lent()
            .iter()
            .map(|(a, e)| (a, e.size))
            .collect();
        for (addr, size) in held {
            // These are exactly the recorded sizes, so the upstream cannot refuse them.
            let _ = state.upstream.free(addr, size);
        }
    }

    /// The rule a block this link returned breaks, if any.
    fn misplaced(&self, addr: u64, size: u64) -> Option<Rule> {
        let alignment = self.info.alignment;
        let state = self.store.data();
        if !addr.is_multiple_of(alignment) {
            Some(Rule::Misaligned { alignment })
        } else if let Some((released, released_size)) =
            state.transit.held_back_overlapping(addr, size)
        {
            Some(Rule::UseAfterFree {
                released,
                released_size,
            })
        } else if state.upstream.lent().containing(addr, size).is_none() {
            Some(Rule::OutsideOwned)
        } else {
            state
                .lent
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

    /// Check and record a block this link returned.
    fn admit(&mut self, call: Call, addr: u64, size: u64) -> Result<u64, Error> {
        match self.misplaced(addr, size) {
            None => {
                self.lent_mut().insert(addr, size);
                Ok(addr)
            }
            Some(rule) => Err(self.violation(call, addr, size, rule)),
        }
    }

    pub(crate) fn malloc(&mut self, size: u64) -> Result<u64, Error> {
        let size = size.max(1);
        self.calls.mallocs += 1;
        let addr = self.enter(Call::Malloc, size, |g, s| g.call_malloc(s, size))?;
        if addr == 0 {
            return Ok(0);
        }
        self.admit(Call::Malloc, addr, size)
    }

    /// `calloc`; an overflowing product is "none" without asking the policy (C3).
    pub(crate) fn calloc(&mut self, nelem: u64, elsize: u64) -> Result<u64, Error> {
        let Some(size) = nelem.checked_mul(elsize) else {
            return Ok(0);
        };
        let (nelem, elsize) = if size == 0 { (1, 1) } else { (nelem, elsize) };
        self.calls.callocs += 1;
        let addr = self.enter(Call::Calloc, size, |g, s| g.call_calloc(s, nelem, elsize))?;
        if addr == 0 {
            return Ok(0);
        }
        self.admit(Call::Calloc, addr, size.max(1))
    }

    /// Resize a block the caller holds with `old` bytes; 0 leaves it live and unchanged.
    pub(crate) fn realloc(&mut self, ptr: u64, old: u64, new: u64) -> Result<u64, LinkFault> {
        let new = new.max(1);
        if ptr == 0 {
            return self.malloc(new).map_err(LinkFault::Link);
        }
        check_lent(self.lent(), ptr, old).map_err(LinkFault::Caller)?;
        if self.poisoned.is_some() {
            return Ok(0);
        }
        self.calls.reallocs += 1;
        self.store.data_mut().transit.begin(ptr, old);
        let answer = self.enter(Call::Realloc, new, |g, s| g.call_realloc(s, ptr, old, new));
        let addr = match answer {
            Ok(0) => {
                // "None" means the old block stays live and unchanged; a policy that gave
                // back its memory on the way broke that. The memory was held back, so the
                // client's block is intact; the policy is stopped.
                let held_back = self.store.data_mut().transit.end();
                if let Some(&(addr, size)) = held_back.first() {
                    let rule = Rule::GaveBackLentMemory {
                        block: ptr,
                        block_size: old,
                    };
                    return Err(LinkFault::Link(self.violation(
                        Call::Realloc,
                        addr,
                        size,
                        rule,
                    )));
                }
                return Ok(0);
            }
            Ok(addr) => addr,
            Err(e) => return Err(LinkFault::Link(e)),
        };
        // The answer is checked while the transit still holds back what the policy gave
        // up, so an answer in that memory is refused (`use-after-free`); the old block
        // leaves the books only for the check, so the answer may reuse its place. Once
        // it is placed, it must hold the client's bytes: the old block is intact (no one
        // may write a lent block, and its memory is held back), so the host compares.
        let old_entry = self.lent_mut().remove(ptr).expect("checked above");
        let broken = self
            .misplaced(addr, new)
            .or_else(|| lost_byte(ptr, addr, old.min(new)));
        if let Some(rule) = broken {
            // The client still holds its old block, intact: the upstream block under it
            // was held back. It goes back on the books before the link is stopped, so
            // the stop cannot release that memory while the client holds it.
            self.lent_mut().insert(ptr, old_entry.size);
            return Err(LinkFault::Link(self.violation(
                Call::Realloc,
                addr,
                new,
                rule,
            )));
        }
        self.lent_mut().insert(addr, new);
        self.release_held_back();
        Ok(addr)
    }

    /// End the transit of an admitted realloc: what the policy gave back during it goes
    /// upstream now, when no block lent here lies inside it.
    fn release_held_back(&mut self) {
        let state = self.store.data_mut();
        for (addr, size) in state.transit.end() {
            // Sizes were checked when the policy asked, and each block once.
            let _ = state.upstream.free(addr, size);
        }
    }

    pub(crate) fn free(&mut self, ptr: u64, size: u64) -> Result<(), LinkFault> {
        self.lent_mut()
            .take_back(ptr, size)
            .map_err(LinkFault::Caller)?;
        if self.poisoned.is_some() {
            self.release_if_done();
            return Ok(());
        }
        self.calls.frees += 1;
        self.enter(Call::Free, 0, |g, s| g.call_free(s, ptr, size))
            .map_err(LinkFault::Link)
    }

    pub(crate) fn malloc_many(&mut self, size: u64, count: u32) -> Result<Vec<u64>, Error> {
        let size = size.max(1);
        self.calls.malloc_many += 1;
        let demand = size.saturating_mul(count.into());
        let blocks = self.enter(Call::MallocMany, demand, |g, s| {
            g.call_malloc_many(s, size, count)
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

    /// Give back several blocks of `size` bytes the caller holds. Every address is
    /// checked before any is given back, so a refused batch changes nothing.
    pub(crate) fn free_many(&mut self, ptrs: Vec<u64>, size: u64) -> Result<(), LinkFault> {
        for &ptr in &ptrs {
            check_lent(self.lent(), ptr, size).map_err(LinkFault::Caller)?;
        }
        for &ptr in &ptrs {
            self.lent_mut().remove(ptr);
        }
        if self.poisoned.is_some() {
            self.release_if_done();
            return Ok(());
        }
        self.calls.free_many += 1;
        self.enter(Call::FreeMany, 0, |g, s| g.call_free_many(s, &ptrs, size))
            .map_err(LinkFault::Link)
    }

    /// Ask this link, then every link below it, to give back what it caches.
    pub(crate) fn trim(&mut self) -> Result<(), Error> {
        let here = if self.poisoned.is_some() {
            Ok(())
        } else {
            self.start_call(0);
            let lifecycle = self.bindings.allocbox_policy_lifecycle();
            match lifecycle.call_trim(&mut self.store) {
                Ok(()) => Ok(()),
                Err(e) => {
                    let err = classify(&mut self.store, &self.limits, Call::Trim, e);
                    self.poison(err.clone());
                    Err(err)
                }
            }
        };
        self.store.data_mut().upstream.trim();
        here
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
