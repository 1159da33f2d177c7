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
//! - [`calls`]: the policy's allocator, called under the client call's deadline;
//! - [`admit`]: every block a policy answers, checked before the client sees it;
//! - [`stopping`]: a failed link's failure, recorded once, and the memory it gives back;
//! - [`observer`]: what the host tells and asks a policy besides its allocator calls:
//!   observation (terms, deliveries, renewals) and its counters.
//!
//! The invariants this layer keeps (ARCHITECTURE.md's map names them in short):
//! Every block a policy returns is admitted by `misplaced` (one place for
//! alignment, use-after-free, ownership, overlap) and, for a moved realloc,
//! compared with the client's bytes; a `calloc` answer is zero before the client
//! sees it (`make_zero`: left alone inside memory known zero in the call,
//! `link/zeroed.rs`, else zeroed, or named in checked mode). A link's failure is
//! recorded once, in the link (`poison`), and travels up beside the answer
//! (`LinkState::unreported` → `Link::take_unreported`). A call of the embedder's
//! has one deadline (`clock::Deadline`), made only where it enters (the handler's
//! entry points, loading a policy, a thread's end, a hook's event: `clock.rs`'s
//! test lists the files) and passed by value to every guest call it causes: every
//! `Link` method that enters a guest takes it, refills, flushes, deliveries,
//! renewals and reports included, and a link called from the import of the link
//! above runs under the caller's; when a link below runs out of time, the link
//! above is stopped with that failure, and `Chain::settle` reports the first
//! failure. A stopped link gives its upstream memory back only once the link below
//! is stopped too, so a give-back never calls a guest no call is waiting for: at
//! the stop every upstream block no client block lies in, the rest once its client
//! lets go. A request's allowance on the overhead budget ends with its answer
//! (`end_allowance`).

mod bytes;
mod clearance;
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
pub use sandbox::{BYTES_PER_WORK, DEFAULT_CALL_WORK, Grants, IMPORT_WORK, Limits};
use transit::Transit;
pub(crate) use upstream::Upstream;
use zeroed::Zeroed;

use std::sync::Arc;

use wasmtime::Store;
use wasmtime_wasi::{WasiCtxView, WasiView};

use crate::clock::{CallTicks, Deadline};
use crate::error::{Call, Error};
use crate::gpu::Placement;
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

// After the macro, which they use.
mod admit;
mod calls;
mod stopping;

/// What a policy declared about itself at start-up, checked by the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyInfo {
    pub name: Arc<str>,
    pub version: u8,
    pub alignment: u64,
    pub batch: bool,
    /// It reports its client's misuse (0.2.0): allocation sites are worth recording.
    pub diagnoses: bool,
    /// Its state is per instance (0.2.0 `sharding`): the host may give each thread an
    /// instance of its own.
    pub shardable: bool,
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
    /// Bytes of the current call's request the host may still move for the policy
    /// uncounted ([`Limits::call_work`]): the client chose them, once a call.
    excused_left: u64,
    batch_limit: u32,
    read_limit: u64,
    overhead_limit: u64,
    budget_refusals: u64,
    /// Of those, the ones the request would have fit alone: see
    /// [`LinkStats::budget_refusals_held`].
    budget_refusals_held: u64,
    /// What the last full `bytes` check cleared; see [`clearance::Clearance`].
    clearance: Option<clearance::Clearance>,
    /// Upstream memory known to hold only zeros in the current call.
    zeroed: Zeroed,
    /// Deep checks ([`crate::HandlerBuilder::checked`]): a `calloc` answer that is not
    /// zero is a violation rather than zeroed by the host.
    checked: bool,
    /// Regions mapped for this policy through `memory` (0.2.0), and the client misuse it
    /// reported.
    mapped: Mapped,
    /// Where the blocks this policy lends must lie: in host memory, or on the GPU its
    /// handler serves. Upstream memory is in the upstream's placement
    /// ([`LinkState::upstream_placement`]).
    place: Placement,
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
    /// Of those, the ones that fit the budget alone, refused because of what the policy
    /// already held beyond its client's bytes (caches, free lists: a budget smaller
    /// than they grow to); the rest were for sizes no budget covers.
    pub budget_refusals_held: u64,
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
    /// Why its latest request for GPU memory (pinned or device) was refused as
    /// unavailable, in the driver's words ("no CUDA driver was found ..."), if one was.
    pub gpu_unavailable: Option<String>,
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

/// Everything a link starts with but its policy and configuration: what it is given to
/// place its blocks in, the bounds and grants it runs under, whether the checker's
/// extra checks are on, and whose memory it serves.
pub(crate) struct LinkStart<'a> {
    pub(crate) upstream: Upstream,
    /// Its bounds, and the kinds of memory it may map ([`Limits::grants`]).
    pub(crate) limits: &'a Limits,
    /// The contract checker's mode: every byte a policy reads checked as written.
    pub(crate) checked: bool,
    pub(crate) place: Placement,
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
            budget_refusals_held: state.budget_refusals_held,
            failure: self.poisoned.as_ref().map(|e| e.to_string()),
            mapped_regions: state.mapped.regions() as u64,
            mapped_bytes: state.mapped.bytes(),
            client_misuse: state.mapped.misuse_total(),
            recent_misuse: state.mapped.recent_misuse().to_vec(),
            ungranted: state.mapped.ungranted(),
            gpu_unavailable: state.mapped.gpu_unavailable().map(str::to_owned),
            ..self.calls.clone()
        }
    }

    /// Regions mapped for this policy that `[addr, addr+size)` lies in, if any.
    pub(crate) fn mapped_containing(&self, addr: u64, size: u64) -> Option<(u64, u64)> {
        let (start, len, _) = self.store.data().mapped.containing(addr, size)?;
        Some((start, len))
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
        state.excused_left = demand;
        state.on_allowance = false;
        state.zeroed.clear();
        armed.arm(&mut self.store);
    }

    /// A call into the guest ended: the embedder's call takes on the host work excused
    /// in it, so the next guest call it causes runs under the same, moved, deadline.
    #[inline]
    fn end_call(&mut self, deadline: &mut Deadline) {
        deadline.extend_to(self.store.data().sandbox.deadline());
    }
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
