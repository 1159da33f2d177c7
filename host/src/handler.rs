//! A handler: a chain of policy instances behind one lock, checked on every boundary,
//! with the client's side of the contract checked here, and per-thread caches in front
//! of it ([`cache`]) so that most small requests never take that lock.
//!
//! The invariants this layer keeps (ARCHITECTURE.md's map names them in short):
//! The client is checked before anything reaches a policy. A request served by
//! another thread (`combined.rs`) makes its own deadline when it is served and does
//! its own ledger check; a lend that waited past its client's time limit gets
//! `Error::Waited`, which stops nothing; a free is always served. A failure
//! anywhere stops the whole chain once (`Chain::fail`); new requests go to the
//! fallback or fail with `Error::Poisoned`; live blocks stay usable. A
//! `ShardedHandler` is whole `Handler`s, one per thread up to a bound, each with an
//! even share of the limits; each chain has a table of the blocks it lent the
//! client, padded to cache lines of its own, looked up the calling thread's chain
//! first (an entry leaves it before the block goes back, so a second free finds
//! none, and a block whose free is queued or under way is a double free), and a
//! free from another chain's thread is queued for the maker (at most 256, then
//! given back by the thread that fills the queue), given back at the maker's next
//! call, at any seated thread's end, and before anything reads the chains (which
//! waits for a give-back under way on another thread). A fork takes a
//! `ShardedHandler`'s own locks before its chains' (`fork::register_outer`: a
//! queue's give-back lock is held while the chain is called), within the chains'
//! patience; a child whose parent held one past it refuses every call
//! (`Unreachable::ForkedMidCall`), and one whose parent was starting a chain never
//! waits for that start.

mod builder;
mod chain;
mod combined;
mod device;
mod fallback;
mod give_back;
mod inspect;
mod observed;
mod policy_handler;
mod sharded;

use std::ptr::NonNull;
use std::sync::Arc;

use crate::clock::{CallTicks, Clock, Deadline};
use crate::error::{Call, ClientError, Error};
use crate::gpu::Placement;
use crate::ledger::CacheId;
use crate::link::PolicyInfo;
use crate::memhandler::{MemHandler, Stats};
use crate::observe::Observations;
use allocbox_ledger::cache::{
    self as cache, Caches, MAGAZINE_MAX_SIZE, MAGAZINE_TABLE_SIZE, Mine, Reach, Unreachable,
};
pub use builder::HandlerBuilder;
use chain::{Books, Chain, Via, flush_magazines, refill, settle, shelve};
pub use device::{Deferral, DeviceHandler, PendingFrees};
pub use policy_handler::PolicyHandler;
pub use sharded::ShardedHandler;

/// A NEP 49 data-memory handler whose placement decisions are made by a chain of
/// sandboxed policies. `Send + Sync`: many threads may call it at once. A malloc served
/// from the calling thread's magazine, and a free of such a block on that thread, touch
/// only that thread's cache; everything else takes the chain's lock.
pub struct Handler {
    caches: Arc<Caches<Chain>>,
    info: PolicyInfo,
    /// The chain's policies' names, top first, joined by `>`.
    name: Arc<str>,
    names: Vec<Arc<str>>,
    fallback: Option<Arc<Handler>>,
    diagnoses: bool,
    /// Every policy of the chain says its state is per instance (0.2.0 `sharding`).
    shardable: bool,
    /// When the top policy observes (0.2.0 `observer`): what was served without asking
    /// it, and its lease.
    observed: Option<Arc<Observations>>,
    /// The clock every call of the chain is timed by, and how long one call of the
    /// client's may take, every guest call it causes included.
    clock: Arc<Clock>,
    call_ticks: CallTicks,
    call_time: std::time::Duration,
    /// Where its blocks lie: host memory, or a GPU's for a [`DeviceHandler`], whose
    /// handler never zeroes or copies a block.
    placement: Placement,
}

impl std::fmt::Debug for Handler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handler")
            .field("policies", &self.names)
            .finish_non_exhaustive()
    }
}

fn to_ptr(addr: u64) -> Option<NonNull<u8>> {
    NonNull::new(addr as usize as *mut u8)
}

impl Handler {
    /// Where the handler's blocks lie.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// Refuse `call`, which zeroes or copies bytes, on a handler of GPU memory.
    #[inline]
    fn on_host(&self, call: Call) -> Result<(), Error> {
        match self.placement {
            Placement::Host => Ok(()),
            Placement::Device(device) => {
                Err(Error::Client(ClientError::DeviceBytes { call, device }))
            }
        }
    }

    /// What the top policy declared (name, version, alignment, batch).
    pub fn info(&self) -> &PolicyInfo {
        &self.info
    }

    /// The handler's name: its policy's, or for a chain every policy's, top first,
    /// joined by `>` (`aligned>size-classes`), as NumPy reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Does a policy of the chain say it diagnoses its client (0.2.0 `info.diagnoses`)?
    /// An embedder then records where each block was allocated, to name it when a policy
    /// reports its misuse ([`Handler::take_client_misuse`]) or a client faults in a
    /// guard page ([`crate::mapped::guard_page_at`]).
    pub fn diagnoses(&self) -> bool {
        self.diagnoses
    }

    /// Does every policy of the chain say its state is per instance (0.2.0
    /// `sharding`)? Then [`HandlerBuilder::build_sharded`] may start one chain per
    /// thread.
    pub fn shardable(&self) -> bool {
        self.shardable
    }

    /// The names of the policies in the chain, top first.
    pub fn policy_names(&self) -> &[Arc<str>] {
        &self.names
    }

    /// Whether small requests are served from per-thread magazines: the builder allowed
    /// them ([`HandlerBuilder::magazines`]) and the top policy batches or observes.
    pub fn keeps_magazines(&self) -> bool {
        self.caches.keeps_magazines()
    }

    /// The calling thread's cache while the handler keeps magazines. Without them it
    /// needs none: what it serves is counted under the chain's lock (see [`count`]).
    #[inline]
    fn thread_cache(&self) -> Option<Mine<'_>> {
        self.caches.keeps_magazines().then(|| self.caches.mine())
    }

    /// The chain, locked, or why it cannot be.
    #[inline]
    fn lock(&self) -> Result<Books<'_>, Error> {
        self.caches
            .lock()
            .map_err(|reason| self.unreachable(reason))
    }

    /// The deadline of a call of the client's that enters here: every guest call it
    /// causes runs under it. Only an entry point of the handler makes one: once it holds
    /// the chain's lock, or, for a call that takes the lock more than once, before it,
    /// each wait excused ([`Self::lock_for`]): waiting for another thread's call is not
    /// this call's time.
    #[inline]
    fn client_call(&self) -> Deadline {
        Deadline::for_client_call(&self.clock, self.call_ticks)
    }

    /// The chain, locked for a call under `deadline`: the time spent waiting for
    /// another thread's call is not this call's guests' time.
    #[inline]
    fn lock_for(&self, deadline: &mut Deadline) -> Result<Books<'_>, Error> {
        let since = self.clock.now();
        let c = self.lock()?;
        deadline.excuse(self.clock.now().saturating_sub(since));
        Ok(c)
    }

    /// A request that waited for other threads' calls past its client's time limit.
    #[cold]
    fn waited(&self) -> Error {
        Error::Waited {
            handler: self.name.clone(),
            limit: self.call_time,
        }
    }

    #[cold]
    fn unreachable(&self, reason: Unreachable) -> Error {
        Error::Unreachable {
            handler: self.name.clone(),
            reason,
        }
    }

    /// A block of at least `size` bytes, `None` when out of memory.
    #[inline]
    pub fn malloc(&self, size: usize) -> Result<Option<NonNull<u8>>, Error> {
        // The commonest hits first, on the path that builds no `Result`.
        if let Some(block) = self.malloc_from_magazine(size) {
            return Ok(Some(block));
        }
        self.malloc_past_magazine(size)
    }

    /// [`Handler::malloc`] for a caller that has just tried
    /// [`Handler::malloc_from_magazine`] (the NumPy bridge): the rest of the path, so
    /// that a miss does not look up the thread's cache in place twice.
    #[inline]
    pub fn malloc_past_magazine(&self, size: usize) -> Result<Option<NonNull<u8>>, Error> {
        self.lend::<false>((size as u64).max(1))
    }

    /// A block of `size` bytes (at least 1) for a `malloc`, or a zeroed one for a
    /// `calloc`: from the calling thread's magazine when the handler keeps them, else
    /// from the chain (refilling the magazine on the way).
    #[inline]
    fn lend<const ZEROED: bool>(&self, size: u64) -> Result<Option<NonNull<u8>>, Error> {
        if let Some(obs) = &self.observed {
            return self.lend_observed::<ZEROED>(obs, size);
        }
        let mut mine = self.thread_cache();
        let from_magazine = mine.is_some() && size <= MAGAZINE_MAX_SIZE;
        if from_magazine
            && let Some(mine) = &mut mine
            && let Some(addr) = take_counted::<ZEROED>(mine, size)
        {
            return Ok(to_ptr(zeroed_if::<ZEROED>(addr, size)));
        }
        self.lend_from_chain::<ZEROED>(None, mine, size, from_magazine)
            .map(|(block, _)| block)
    }

    /// The most common magazine hits alone: a block from the calling thread's
    /// magazine for `size`, lent and counted as `malloc` would, or `None` (nothing
    /// changed) when this path cannot serve it; `malloc` can. It calls nothing, so a
    /// caller that inlines it and keeps its own slow path (`malloc`) out of line, as
    /// the NumPy bridge does, runs a hit with no stack frame. It serves the threads
    /// that find their cache by thread pointer (the first 32 to use the handler), sizes
    /// up to 1 KiB, while few blocks are lent.
    #[inline]
    pub fn malloc_from_magazine(&self, size: usize) -> Option<NonNull<u8>> {
        self.take_in_place::<false>((size as u64).max(1))
    }

    /// [`Handler::malloc_from_magazine`] for a `calloc`: the block zeroed, counted as
    /// `calloc` would; `None` also for a product that overflows (`calloc` says so).
    #[inline]
    pub fn calloc_from_magazine(&self, nelem: usize, elsize: usize) -> Option<NonNull<u8>> {
        let size = nelem.checked_mul(elsize)?;
        self.take_in_place::<true>((size as u64).max(1))
    }

    #[inline(always)]
    fn take_in_place<const ZEROED: bool>(&self, size: u64) -> Option<NonNull<u8>> {
        if !self.caches.keeps_magazines() || size > MAGAZINE_TABLE_SIZE || self.observed.is_some() {
            return None;
        }
        let mut mine = self.caches.mine_by_pointer()?;
        let addr = mine.try_with(|c| {
            let addr = c.take::<{ Reach::IN_PLACE }>(size)?;
            count_request::<ZEROED>(&mut c.counts);
            Some(addr)
        })??;
        to_ptr(zeroed_if::<ZEROED>(addr, size))
    }

    /// A request the calling thread's magazine could not serve, and which way its
    /// block came.
    #[cold]
    #[inline(never)]
    fn lend_from_chain<const ZEROED: bool>(
        &self,
        deadline: Option<&mut Deadline>,
        mut mine: Option<Mine<'_>>,
        size: u64,
        from_magazine: bool,
    ) -> Result<(Option<NonNull<u8>>, Via), Error> {
        if mine.is_none() && deadline.is_none() && self.combines() {
            let block = self.lend_combined::<ZEROED>(size, 1)?;
            return Ok((block, Via::Policy));
        }
        let mut fresh;
        let (mut c, deadline) = match deadline {
            Some(deadline) => (self.lock_for(deadline)?, deadline),
            None => {
                let c = self.lock()?;
                fresh = self.client_call();
                (c, &mut fresh)
            }
        };
        if c.failure.is_some() {
            return self.lend_from_fallback::<ZEROED>(c, mine, size);
        }
        let (answer, via) = match (&mut mine, from_magazine, ZEROED) {
            // A block for a magazine comes from `malloc-many`: zeroed here.
            (Some(mine), true, _) => match refill(&mut c, deadline, mine, size) {
                Ok((addr, via)) => (Ok(zeroed_if::<ZEROED>(addr, size)), via),
                Err(e) => (Err(e), Via::Policy),
            },
            (_, _, false) => (c.head.malloc(deadline, size), Via::Policy),
            // Magazines stopped since `calloc` looked (the chain failed meanwhile).
            (_, _, true) => (c.head.calloc(deadline, size, 1), Via::Policy),
        };
        let answer = settle(&mut c, answer);
        count(&mut c, &mut mine, |n| {
            count_request::<ZEROED>(n);
            served(n, &answer, size);
        });
        Ok((to_ptr(answer?), via))
    }

    /// A zero-filled block of `nelem * elsize` bytes; `None` when out of memory or when
    /// the product overflows. A policy that batches serves small ones from the
    /// magazines as it serves a `malloc`, the host zeroing the block; otherwise the
    /// policy is asked for a `calloc`, and its answer is handed over zeroed
    /// (see `Link::calloc`).
    pub fn calloc(&self, nelem: usize, elsize: usize) -> Result<Option<NonNull<u8>>, Error> {
        self.on_host(Call::Calloc)?;
        let size = (nelem as u64).saturating_mul(elsize as u64).max(1);
        if nelem.checked_mul(elsize).is_some()
            && (self.observed.is_some()
                || (self.caches.keeps_magazines() && size <= MAGAZINE_MAX_SIZE))
        {
            return self.lend::<true>(size);
        }
        if self.combines() {
            return self.lend_combined::<true>(nelem as u64, elsize as u64);
        }
        let mut mine = self.thread_cache();
        let mut c = self.lock()?;
        let deadline = &mut self.client_call();
        if c.failure.is_some() {
            let unserved = self.fallback.is_none();
            count(&mut c, &mut mine, |n| {
                n.callocs += 1;
                n.failed += u64::from(unserved);
            });
            drop(c);
            return self.reroute(|f| f.calloc(nelem, elsize));
        }
        let answer = c.head.calloc(deadline, nelem as u64, elsize as u64);
        let answer = settle(&mut c, answer);
        count(&mut c, &mut mine, |n| {
            n.callocs += 1;
            served(n, &answer, size);
        });
        Ok(to_ptr(answer?))
    }

    /// Resize a block; `None` for `ptr` acts as `malloc`. On `Ok(None)` and on `Err` the
    /// old block is still live and unchanged.
    pub fn realloc(
        &self,
        ptr: Option<NonNull<u8>>,
        new_size: usize,
    ) -> Result<Option<NonNull<u8>>, Error> {
        self.on_host(Call::Realloc)?;
        let Some(ptr) = ptr else {
            return self.malloc(new_size);
        };
        let addr = ptr.as_ptr() as u64;
        let new = (new_size as u64).max(1);
        let mut mine = self.thread_cache();
        let mut c = self.lock()?;
        let deadline = &mut self.client_call();
        count(&mut c, &mut mine, |n| n.reallocs += 1);
        let Some(entry) = c.head.lent().get(addr) else {
            if c.rerouted.contains(&addr) {
                drop(c);
                let moved = self.rerouted_to().realloc(Some(ptr), new_size)?;
                if let Some(moved) = moved {
                    // The block may have moved: the fallback now lends it at its new
                    // address, on this handler's behalf.
                    let mut c = self.lock()?;
                    c.rerouted.remove(&addr);
                    c.rerouted.insert(moved.as_ptr() as u64);
                }
                return Ok(moved);
            }
            return Err(ClientError::UnknownRealloc { addr }.into());
        };
        // Only the policy resizes: the block leaves its thread cache, and the client
        // holds it straight from the policy from now on.
        if let Some(holder) = entry.cache
            && !self.take_from_cache(&mut c, &mut mine, addr, holder)?
        {
            return Err(ClientError::UnknownRealloc { addr }.into());
        }
        if c.failure.is_some() {
            return self.move_to_fallback(c, deadline, &mut mine, addr, entry.size, new);
        }
        // An observing policy's lease covers the growth, renewed if need be.
        let growth = new.saturating_sub(entry.size);
        if let Some(obs) = &self.observed
            && growth > 0
            && !obs.reserve(growth)
        {
            let renewed = c.head.renew(deadline, growth).map(|()| 0);
            settle(&mut c, renewed)?;
            if !obs.reserve(growth) {
                count(&mut c, &mut mine, |n| n.failed += 1);
                return Ok(None);
            }
        }
        let answer = c.head.realloc(deadline, addr, entry.size, new);
        if let Some(obs) = &self.observed {
            match answer {
                Ok(moved) if moved != 0 && growth > 0 => obs.served_by_policy(growth),
                Ok(moved) if moved != 0 => obs.shrunk(entry.size - new),
                _ if growth > 0 => obs.cancel(growth),
                _ => {}
            }
        }
        let moved = settle(&mut c, answer).inspect_err(|_| {
            count(&mut c, &mut mine, |n| n.failed += 1);
        })?;
        count(&mut c, &mut mine, |n| match moved {
            0 => n.failed += 1,
            _ => {
                n.take_back(entry.size);
                n.lend(new);
            }
        });
        Ok(to_ptr(moved))
    }

    /// Give every cached block back: every thread's magazines, then each policy's
    /// `trim`, top first.
    pub fn trim(&self) -> Result<(), Error> {
        let mut c = self.lock()?;
        let deadline = &mut self.client_call();
        let delivered = c.head.deliver(deadline).map(|()| 0);
        settle(&mut c, delivered)?;
        let flushed = flush_magazines(&mut c, deadline);
        settle(&mut c, flushed)?;
        let trimmed = c.head.trim(deadline).map(|()| 0);
        settle(&mut c, trimmed).map(drop)
    }

    /// Take a block the client holds out of the thread cache that lent it; the client
    /// holds it straight from the policy now. `holder` is the cache the ledger names for
    /// it. False when that cache has not lent it (it sits in a magazine).
    fn take_from_cache<'h>(
        &'h self,
        c: &mut Books<'_>,
        mine: &mut Option<Mine<'h>>,
        addr: u64,
        holder: CacheId,
    ) -> Result<bool, Error> {
        // A cache lent it, so the handler kept magazines; they may have stopped since.
        let mine = mine.get_or_insert_with(|| self.caches.mine());
        let taken = c
            .cache_of(mine, holder)
            .map(|mut cache| cache.lent.remove(addr).is_some())
            .map_err(|reason| self.unreachable(reason))?;
        if taken {
            c.head.lent_mut().set_cache(addr, None);
        }
        Ok(taken)
    }
}

/// A block of `size` bytes from the calling thread's magazine, counted as a request.
#[inline(always)]
fn take_counted<const ZEROED: bool>(mine: &mut Mine<'_>, size: u64) -> Option<u64> {
    mine.with(|c| {
        let addr = c.take::<{ Reach::FULL }>(size)?;
        count_request::<ZEROED>(&mut c.counts);
        Some(addr)
    })
}

/// Count a `malloc` or, `ZEROED`, a `calloc`.
#[inline(always)]
fn count_request<const ZEROED: bool>(counts: &mut cache::Counts) {
    match ZEROED {
        true => counts.callocs += 1,
        false => counts.mallocs += 1,
    }
}

/// `addr`, a block of `size` bytes just lent for a `calloc` (`ZEROED`), zeroed: a block
/// from a magazine holds whatever its last user left. 0 stays 0.
#[inline(always)]
fn zeroed_if<const ZEROED: bool>(addr: u64, size: u64) -> u64 {
    if ZEROED && addr != 0 {
        // SAFETY: `addr` is a block of `size` bytes this handler just lent to its
        // client, who has not seen it yet; a magazine block lies in live memory the top
        // policy holds.
        unsafe { std::ptr::write_bytes(addr as *mut u8, 0, size as usize) };
    }
    addr
}

/// Count a request's answer: a block lent, or none (out of memory, or a failure that
/// stopped the chain): either way the client got no block.
fn served(counts: &mut cache::Counts, answer: &Result<u64, Error>, size: u64) {
    match answer {
        Ok(addr) => counts.served(*addr, size),
        Err(_) => counts.failed += 1,
    }
}

/// Count under the chain's lock: in the calling thread's cache while the handler keeps
/// magazines (its fast path counts there too), else in the chain's own counters.
#[inline]
fn count(c: &mut Books<'_>, mine: &mut Option<Mine<'_>>, f: impl FnOnce(&mut cache::Counts)) {
    match mine {
        Some(mine) if c.keeps_magazines() => f(&mut c.own(mine).counts),
        _ => f(&mut c.counts),
    }
}

impl MemHandler for Handler {
    fn name(&self) -> &str {
        Handler::name(self)
    }
    fn version(&self) -> u8 {
        self.info().version
    }
    fn alignment(&self) -> u64 {
        self.info().alignment
    }
    fn malloc(&self, size: usize) -> Result<Option<NonNull<u8>>, Error> {
        Handler::malloc(self, size)
    }
    fn calloc(&self, nelem: usize, elsize: usize) -> Result<Option<NonNull<u8>>, Error> {
        Handler::calloc(self, nelem, elsize)
    }
    fn realloc(
        &self,
        ptr: Option<NonNull<u8>>,
        new_size: usize,
    ) -> Result<Option<NonNull<u8>>, Error> {
        Handler::realloc(self, ptr, new_size)
    }
    fn free(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<(), Error> {
        Handler::free(self, ptr, size)
    }
    fn free_unsized(&self, ptr: NonNull<u8>) -> Result<usize, Error> {
        Handler::free_unsized(self, ptr)
    }
    fn stats(&self) -> Result<Stats, Error> {
        Handler::stats(self)
    }
    fn usable(&self) -> Result<(), Error> {
        match self.failure() {
            None => Ok(()),
            Some(cause) => Err(Error::Poisoned {
                policy: cause.policy().unwrap_or("?").into(),
                cause,
            }),
        }
    }
}

fn poisoned(cause: &Arc<Error>) -> Error {
    Error::Poisoned {
        policy: cause.policy().unwrap_or("?").into(),
        cause: cause.clone(),
    }
}
