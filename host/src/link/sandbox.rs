//! What every guest store holds, policy or hook, and the bounds on a guest.
//!
//! The invariants this layer keeps (ARCHITECTURE.md's map names them in short):
//! The virtual, allow-listed WASI (`wasi.rs`: no real time, nothing waits, no
//! thread started, at most 256 handles); one budget for all memories and tables
//! (`GuestBudget`) and bounded counts of instances, memories and tables; the
//! current call's deadline, which the epoch consults through a callback (so host
//! work the client chose can be given back, `excuse_since`) and which is 0 until a
//! call arms it; a rule broken inside an import becomes the trap's typed error,
//! other failures one escaped sentence.

use crate::clock::{Clock, Deadline};
use std::sync::Arc;
use std::time::Duration;

use wasmtime::Trap;
use wasmtime::component::ResourceTableError;
use wasmtime_wasi::{I32Exit, WasiCtxView, WasiView};

use crate::error::{Bound, Call, Error, TimeLimit};
use crate::wasi::{GuestView, GuestWasi};

/// Bounds on one policy instance: every unit of host work and host memory a policy can
/// cause is bounded by one of these. See SECURITY.md for what each one covers.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Most bytes of linear memory (and tables) the guest may grow to; also the longest
    /// `bytes.read` (an answer that could never fit in the guest). Default 128 MiB: a
    /// JavaScript engine alone grows to about 67 MiB under a long workload.
    pub memory: u64,
    /// Longest a single call into the guest may run, time spent in its imports
    /// included. A chain's call is bounded by the sum of its links' limits. Passing it
    /// stops the policy with [`Error::Timeout`]. Default 1 s. Under a counted runtime
    /// ([`crate::Runtime::counted`]) it is a safety net far above [`Limits::call_work`],
    /// which decides instead.
    pub call_time: Duration,
    /// Under a counted runtime (the checker's): the most work one call into the guest
    /// may do, counted rather than timed, so the same call passes or fails on a quiet
    /// machine and a busy one. The guest's own code is counted by wasmtime's fuel (about
    /// a unit per wasm instruction), and the host's work in its imports, separately,
    /// against the same number: [`IMPORT_WORK`] units an import, a unit per
    /// [`BYTES_PER_WORK`] bytes it reads, writes, fills, copies or takes from upstream
    /// beyond what the client asked for. Passing either stops the policy with
    /// [`Error::Timeout`]. Unused by a clocked runtime. Default [`DEFAULT_CALL_WORK`].
    pub call_work: u64,
    /// Most blocks one `malloc-many` or `free-many` may ask of the host. Passing it stops
    /// the policy with [`Error::WorkLimit`]. Default 4096.
    pub batch: u32,
    /// Most bytes a policy may hold from its upstream beyond what its client holds and
    /// is asking for in the current call (its overhead: caches, headers, free lists),
    /// each upstream block counted at what it costs the host: the allocator's footprint
    /// for a block of the host's memory, and [`crate::LEDGER_ENTRY_COST`] for the
    /// host's record of it. An upstream request past it is answered "none", as out of memory,
    /// and counted in [`crate::LinkStats::budget_refusals`]. It bounds overhead, not size: a
    /// client may still get a single block of many GiB. Default 256 MiB.
    pub overhead: u64,
    /// Guest stdout/stderr kept for error messages and the log. Default 16 KiB.
    pub output: usize,
    /// What WASI grants the guest beyond nothing. Default: nothing.
    pub grants: Grants,
}

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
    /// Kinds of memory a policy may ask the host to map for it (0.2.0 `memory`).
    pub memory: crate::mapped::KindGrants,
    /// The GPUs behind the `pinned` and `device` kinds: the CUDA driver unless a stand-in
    /// is given.
    pub gpu: crate::gpu::Gpu,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory: 128 << 20,
            call_time: Duration::from_secs(1),
            call_work: DEFAULT_CALL_WORK,
            batch: 4096,
            overhead: 256 << 20,
            output: 16 << 10,
            grants: Grants::default(),
        }
    }
}

/// [`Limits::call_work`]'s default: 200 million units, a fifth of a second or so of a
/// Rust policy's code here, and far more than any shipped policy's call takes.
pub const DEFAULT_CALL_WORK: u64 = 200_000_000;
/// Units of counted work an import costs the host before what it moves
/// ([`Limits::call_work`]): about what its checks cost, in wasm instructions' time.
pub const IMPORT_WORK: u64 = 64;
/// Bytes the host moves for a guest per unit of counted work ([`Limits::call_work`]):
/// about what a wasm instruction's time moves.
pub const BYTES_PER_WORK: u64 = 8;

/// What a call into a guest is armed with: the epoch ticks left of its deadline, and
/// under a counted runtime the fuel its code may burn.
#[derive(Debug, Clone, Copy)]
#[must_use]
pub(crate) struct Armed {
    ticks: u64,
    fuel: Option<u64>,
}

impl Armed {
    /// Set the store's epoch deadline and fuel for the call about to run.
    #[inline]
    pub(crate) fn arm<T>(self, store: &mut wasmtime::Store<T>) {
        store.set_epoch_deadline(self.ticks);
        if let Some(fuel) = self.fuel {
            // Fuel is set only under a counted runtime, whose engine consumes it: the
            // call cannot fail there.
            let _ = store.set_fuel(fuel);
        }
    }
}

/// What every guest store holds, policy or hook: its virtual WASI, the memory cap, and
/// a rule the guest broke inside an import.
pub(crate) struct Sandbox {
    pub(crate) name: Arc<str>,
    /// What the guest did wrong inside one of its imports (a broken rule, a passed
    /// bound); the trap it causes is reported as this error.
    pub(super) fault: Option<Error>,
    pub(super) limiter: GuestBudget,
    wasi: GuestWasi,
    /// The runtime's tick count, advanced with the engine's epoch.
    clock: Arc<Clock>,
    /// When the current call runs out of time: the deadline of the embedder's call that
    /// caused it, which covers its wasm code, the host's work in its imports, the links
    /// below it and every other guest call that embedder's call causes. Passed until a
    /// call arms it: a guest runs only under a deadline.
    deadline: Deadline,
    /// Under a counted runtime, [`Limits::call_work`]: each call's fuel, and the bound on
    /// `host_work`.
    work: Option<u64>,
    /// The host's counted work in this call's imports so far.
    host_work: u64,
    /// The wall clock's limit, said when it stops a call.
    call_time: Duration,
}

impl Sandbox {
    /// `counted`: the runtime counts each call's work ([`Limits::call_work`]).
    pub(crate) fn new(name: Arc<str>, limits: &Limits, clock: Arc<Clock>, counted: bool) -> Self {
        Sandbox {
            name,
            fault: None,
            limiter: GuestBudget::new(limits.memory),
            wasi: GuestWasi::new(&limits.grants.env, limits.grants.clocks, limits.output),
            clock,
            deadline: Deadline::passed(),
            work: counted.then_some(limits.call_work),
            host_work: 0,
            call_time: limits.call_time,
        }
    }

    pub(crate) fn limiter(&mut self) -> &mut dyn wasmtime::ResourceLimiter {
        &mut self.limiter
    }

    /// A new call into the guest begins, under the deadline of the embedder's call that
    /// causes it. Returns what to arm: the epoch ticks left of the deadline, at least
    /// one, so that a callee whose time is already out is stopped at once, and under a
    /// counted runtime a call's fuel. A growth the budget refused in an earlier call,
    /// which the guest survived, does not explain a failure in this one.
    #[inline]
    pub(crate) fn begin_call(&mut self, deadline: Deadline) -> Armed {
        self.limiter.hit = false;
        self.deadline = deadline;
        self.host_work = 0;
        Armed {
            ticks: deadline
                .tick()
                .saturating_sub(self.clock.now_ticking())
                .max(1),
            fuel: self.work,
        }
    }

    /// Count `units` of host work done for the guest in this call (nothing under a
    /// clocked runtime, whose deadline times that work).
    #[inline]
    pub(crate) fn charge(&mut self, units: u64) {
        if self.work.is_some() {
            self.host_work = self.host_work.saturating_add(units);
        }
    }

    /// The limit a call that is out of time passed: the counted one when the host's
    /// work passed it, else the wall clock's.
    pub(crate) fn limit_passed(&self) -> TimeLimit {
        match self.work {
            Some(work) if self.host_work >= work => TimeLimit::Work(work),
            _ => TimeLimit::Clock(self.call_time),
        }
    }

    /// The clock the guest is timed by.
    pub(crate) fn clock(&self) -> &Arc<Clock> {
        &self.clock
    }

    /// The runtime's tick count now.
    #[inline]
    pub(crate) fn now(&self) -> u64 {
        self.clock.now()
    }

    /// The current call's deadline, moved on by the host work excused in it.
    pub(crate) fn deadline(&self) -> Deadline {
        self.deadline
    }

    /// Has the current call reached its deadline, or (counted) the host's work in it its
    /// bound? The epoch stops wasm code at the same tick, and its fuel at the same bound.
    #[inline]
    pub(crate) fn out_of_time(&self) -> bool {
        self.now() >= self.deadline.tick() || self.work.is_some_and(|w| self.host_work >= w)
    }

    /// Give the current call back the ticks spent since `since` on host work that the
    /// client, not the guest, chose the length of (copying or comparing the client's
    /// block in transit, once a call): the guest is not stopped for its client's
    /// large resize.
    pub(crate) fn excuse_since(&mut self, since: u64) {
        let spent = self.now().saturating_sub(since);
        self.deadline.excuse(spent);
    }

    /// A deadline of a call below that ended: it may have moved on by host work excused
    /// there, which this call's deadline includes too.
    pub(crate) fn extend_to(&mut self, deadline: Deadline) {
        self.deadline.extend_to(deadline);
    }

    /// What the epoch does when it reaches the armed tick: go on until the deadline (it
    /// may have moved on since the tick was armed), or stop the guest.
    pub(crate) fn on_epoch(&self) -> wasmtime::UpdateDeadline {
        match self.deadline.tick().checked_sub(self.now()) {
            Some(left) if left > 0 => wasmtime::UpdateDeadline::Continue(left),
            _ => wasmtime::UpdateDeadline::Interrupt,
        }
    }

    /// Turn a failed call into the error that says what happened: one sentence, the
    /// policy's own text escaped, wasm backtraces left to the log.
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
                limit: TimeLimit::Clock(limits.call_time),
            };
        }
        if err.downcast_ref::<Trap>() == Some(&Trap::OutOfFuel) {
            return Error::Timeout {
                policy,
                call,
                limit: TimeLimit::Work(self.work.unwrap_or(limits.call_work)),
            };
        }
        if let Some(ResourceTableError::Full) = err.downcast_ref::<ResourceTableError>() {
            let limit = crate::wasi::MAX_RESOURCES as u64;
            return Error::WorkLimit {
                policy,
                call,
                bound: Bound::Resources,
                asked: limit + 1,
                limit,
            };
        }
        if let Some((asked, limit)) = object_count_passed(&err) {
            return Error::WorkLimit {
                policy,
                call,
                bound: Bound::Objects,
                asked,
                limit,
            };
        }
        log::debug!("policy `{policy}` failed in `{call}`: {err:?}");
        let mut message = match (err.downcast_ref::<Trap>(), err.downcast_ref::<I32Exit>()) {
            (Some(trap), _) => trap.to_string(),
            (None, Some(I32Exit(status))) => format!("it called `exit` with status {status}"),
            (None, None) => err.root_cause().to_string(),
        };
        let said = self.wasi.output.contents();
        if !said.is_empty() {
            let said = String::from_utf8_lossy(&said);
            // Rust's std ends a panic with advice for the policy's own terminal.
            let lines: Vec<&str> = said
                .trim_end()
                .lines()
                .filter(|line| {
                    !line.trim().is_empty() && !line.starts_with("note: run with `RUST_BACKTRACE=")
                })
                .collect();
            let tail = &lines[lines.len().saturating_sub(OUTPUT_LINES_SHOWN)..];
            message.push_str(&format!(" (its last output: {})", tail.join(" | ")));
        }
        Error::Trap {
            policy,
            call,
            message: crate::untrusted::escape(&message),
        }
    }
}

/// The count and its bound when `err` is wasmtime refusing one more core instance,
/// memory or table than [`GuestBudget`] allows (wasmtime says so only in words:
/// "resource limit exceeded: table count too high at 9").
fn object_count_passed(err: &wasmtime::Error) -> Option<(u64, u64)> {
    let message = err.root_cause().to_string();
    let rest = message.strip_prefix("resource limit exceeded: ")?;
    let (what, count) = rest.split_once(" count too high at ")?;
    let limit = match what {
        "instance" => MAX_INSTANCES,
        "memory" => MAX_MEMORIES,
        "table" => MAX_TABLES,
        _ => return None,
    };
    Some((count.parse().ok()?, limit as u64))
}

/// Lines of what a policy printed that its error shows (the rest is in the log).
const OUTPUT_LINES_SHOWN: usize = 3;

impl WasiView for Sandbox {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        crate::wasi::wasi_view(&mut self.wasi)
    }
}

impl GuestView for Sandbox {
    fn guest_wasi(&mut self) -> &mut GuestWasi {
        &mut self.wasi
    }
}

impl Drop for Sandbox {
    /// What the guest printed goes to the host's log.
    fn drop(&mut self) {
        let said = self.wasi.output.contents();
        if !said.is_empty() {
            log::info!(
                "guest `{}` said: {}",
                self.name,
                crate::untrusted::escape(String::from_utf8_lossy(&said).trim_end())
            );
        }
    }
}

/// One budget for everything a guest's instance can make the host map for it: the bytes
/// of all its linear memories and all its tables together count against
/// [`Limits::memory`], and the number of core instances, memories and tables is bounded.
/// A growth past the budget fails as the core specification allows (`memory.grow` and
/// `table.grow` answer -1, instantiation fails); the budget remembers it, so that a trap
/// that follows in the same call is reported as [`Error::MemoryLimit`].
#[derive(Debug)]
pub(super) struct GuestBudget {
    limit: u64,
    /// Bytes of every memory and table the guest has, including a growth the budget
    /// allowed that may still fail (`pending`).
    used: u64,
    pending: u64,
    pub(super) hit: bool,
}

/// Core module instances one guest store may hold: a componentize-py policy has 14
/// (CPython, its libraries and adapters), a Rust one 3.
pub const MAX_INSTANCES: usize = 32;
/// Linear memories one guest store may hold: every shipped policy has one.
pub const MAX_MEMORIES: usize = 4;
/// Tables one guest store may hold: every shipped policy has at most two.
pub const MAX_TABLES: usize = 8;
/// Host bytes one table element takes (wasmtime keeps a pointer per element), charged
/// to [`Limits::memory`].
pub const TABLE_ELEMENT_BYTES: u64 = 8;

impl GuestBudget {
    pub(super) fn new(limit: u64) -> Self {
        GuestBudget {
            limit,
            used: 0,
            pending: 0,
            hit: false,
        }
    }

    /// Take `bytes` more from the budget for a growth about to happen, if they fit.
    fn grow(&mut self, bytes: u64) -> bool {
        match self.used.checked_add(bytes).filter(|&u| u <= self.limit) {
            Some(used) => {
                self.used = used;
                self.pending = bytes;
                true
            }
            None => {
                self.hit = true;
                false
            }
        }
    }

    /// The growth the budget allowed did not happen: give its bytes back.
    fn growth_failed(&mut self) {
        self.used -= std::mem::take(&mut self.pending);
    }
}

impl wasmtime::ResourceLimiter for GuestBudget {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(self.grow(desired.saturating_sub(current) as u64))
    }

    fn memory_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        self.growth_failed();
        Ok(())
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let elements = desired.saturating_sub(current) as u64;
        Ok(self.grow(elements.saturating_mul(TABLE_ELEMENT_BYTES)))
    }

    fn table_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        self.growth_failed();
        Ok(())
    }

    fn instances(&self) -> usize {
        MAX_INSTANCES
    }

    fn tables(&self) -> usize {
        MAX_TABLES
    }

    fn memories(&self) -> usize {
        MAX_MEMORIES
    }
}
