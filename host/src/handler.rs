//! A handler: a chain of policy instances behind one lock, checked on every boundary,
//! with the client's side of the contract checked here, and per-thread caches in front
//! of it ([`cache`]) so that most small requests never take that lock.

mod builder;
mod chain;

use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{ClientError, Error, InvariantBroken};
use crate::ledger::{Ordered, TakeBack};
use crate::link::{Link, PolicyInfo};
use crate::memhandler::{MemHandler, Stats};
use allocbox_ledger::cache::{
    self as cache, Caches, MAGAZINE_MAX_SIZE, MAGAZINE_TABLE_SIZE, Magazines, Mine, Reach,
    Unreachable,
};
pub use builder::HandlerBuilder;
use chain::{Books, Chain, flush_magazines, refill, settle, shelve, unreachable};

/// A NEP 49 data-memory handler whose placement decisions are made by a chain of
/// sandboxed policies. `Send + Sync`: many threads may call it at once. A malloc served
/// from the calling thread's magazine, and a free of such a block on that thread, touch
/// only that thread's cache; everything else takes the chain's lock.
pub struct Handler {
    caches: Arc<Caches<Chain>>,
    info: PolicyInfo,
    names: Vec<Arc<str>>,
    fallback: Option<Arc<Handler>>,
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
    /// What the top policy declared (name, version, alignment, batch).
    pub fn info(&self) -> &PolicyInfo {
        &self.info
    }

    /// The handler's name: the top policy's.
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// The names of the policies in the chain, top first.
    pub fn policy_names(&self) -> &[Arc<str>] {
        &self.names
    }

    /// The chain, locked, or why it cannot be.
    fn lock(&self) -> Result<Books<'_>, Error> {
        self.caches
            .lock()
            .map_err(|reason| self.unreachable(reason))
    }

    fn unreachable(&self, reason: Unreachable) -> Error {
        Error::Unreachable {
            handler: self.info.name.clone(),
            reason,
        }
    }

    /// A block of at least `size` bytes, `None` when out of memory.
    #[inline]
    pub fn malloc(&self, size: usize) -> Result<Option<NonNull<u8>>, Error> {
        self.lend::<false>((size as u64).max(1))
    }

    /// A block of `size` bytes (at least 1) for a `malloc`, or a zeroed one for a
    /// `calloc`: from the calling thread's magazine when the handler keeps them, else
    /// from the chain (refilling the magazine on the way).
    #[inline]
    fn lend<const ZEROED: bool>(&self, size: u64) -> Result<Option<NonNull<u8>>, Error> {
        let mut mine = self.caches.mine();
        let from_magazine = self.caches.keeps_magazines() && size <= MAGAZINE_MAX_SIZE;
        if from_magazine
            && let Some(addr) = mine.with(|c| {
                let addr = c.take::<{ Reach::FULL }>(size)?;
                count_request::<ZEROED>(&mut c.counts);
                Some(addr)
            })
        {
            return Ok(to_ptr(zeroed_if::<ZEROED>(addr, size)));
        }
        self.lend_from_chain::<ZEROED>(mine, size, from_magazine)
    }

    /// The most common magazine hits alone: a block from the calling thread's
    /// magazine for `size`, lent and counted as `malloc` would, or `None` (nothing
    /// changed) when this path cannot serve it; `malloc` can. It calls nothing, so a
    /// caller that inlines it and keeps its own slow path (`malloc`) out of line, as
    /// the NumPy bridge does, runs a hit with no stack frame. It serves the first
    /// thread to use the handler, sizes up to 1 KiB, while few blocks are lent.
    #[inline]
    pub fn malloc_from_magazine(&self, size: usize) -> Option<NonNull<u8>> {
        let size = (size as u64).max(1);
        if !self.caches.keeps_magazines() || size > MAGAZINE_TABLE_SIZE {
            return None;
        }
        let mut mine = self.caches.primary()?;
        mine.try_with(|c| {
            let addr = c.take::<{ Reach::IN_PLACE }>(size)?;
            c.counts.mallocs += 1;
            Some(addr)
        })?
        .and_then(to_ptr)
    }

    /// A request the calling thread's magazine could not serve.
    #[cold]
    #[inline(never)]
    fn lend_from_chain<const ZEROED: bool>(
        &self,
        mut mine: Mine<'_>,
        size: u64,
        from_magazine: bool,
    ) -> Result<Option<NonNull<u8>>, Error> {
        let mut c = self.lock()?;
        if c.failure.is_some() {
            count(&mut c, &mut mine, count_request::<ZEROED>);
            drop(c);
            return self.reroute(|f| match ZEROED {
                true => f.calloc(size as usize, 1),
                false => f.malloc(size as usize),
            });
        }
        let answer = match (from_magazine, ZEROED) {
            // A block for a magazine comes from `malloc-many`: zeroed here.
            (true, _) => {
                refill(&mut c, &mut mine, size).map(|addr| zeroed_if::<ZEROED>(addr, size))
            }
            (false, false) => c.head.malloc(size),
            // Magazines stopped since `calloc` looked (the chain failed meanwhile).
            (false, true) => c.head.calloc(size, 1),
        };
        let answer = settle(&mut c, answer);
        count(&mut c, &mut mine, |n| {
            count_request::<ZEROED>(n);
            if let Ok(addr) = answer {
                n.served(addr, size);
            }
        });
        Ok(to_ptr(answer?))
    }

    /// A zero-filled block of `nelem * elsize` bytes; `None` when out of memory or when
    /// the product overflows. A policy that batches serves small ones from the
    /// magazines as it serves a `malloc`, the host zeroing the block; otherwise the
    /// policy is asked for a `calloc`, and its answer is handed over zeroed
    /// (see `Link::calloc`).
    pub fn calloc(&self, nelem: usize, elsize: usize) -> Result<Option<NonNull<u8>>, Error> {
        let size = (nelem as u64).saturating_mul(elsize as u64).max(1);
        if nelem.checked_mul(elsize).is_some()
            && self.caches.keeps_magazines()
            && size <= MAGAZINE_MAX_SIZE
        {
            return self.lend::<true>(size);
        }
        let mut mine = self.caches.mine();
        let mut c = self.lock()?;
        if c.failure.is_some() {
            count(&mut c, &mut mine, |n| n.callocs += 1);
            drop(c);
            return self.reroute(|f| f.calloc(nelem, elsize));
        }
        let answer = c.head.calloc(nelem as u64, elsize as u64);
        let answer = settle(&mut c, answer);
        count(&mut c, &mut mine, |n| {
            n.callocs += 1;
            if let Ok(addr) = answer {
                n.served(addr, size);
            }
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
        let Some(ptr) = ptr else {
            return self.malloc(new_size);
        };
        let addr = ptr.as_ptr() as u64;
        let new = (new_size as u64).max(1);
        let mut mine = self.caches.mine();
        let mut c = self.lock()?;
        count(&mut c, &mut mine, |n| n.reallocs += 1);
        let Some(entry) = c.head.lent().get(addr) else {
            if c.rerouted.contains(&addr) {
                drop(c);
                let fallback = self
                    .fallback
                    .as_ref()
                    .expect("rerouted blocks have a fallback");
                let moved = fallback.realloc(Some(ptr), new_size)?;
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
        if entry.cache.is_some() && !self.take_from_cache(&mut c, &mut mine, addr)? {
            return Err(ClientError::UnknownRealloc { addr }.into());
        }
        if c.failure.is_some() {
            return self.move_to_fallback(c, &mut mine, addr, entry.size, new);
        }
        let answer = c.head.realloc(addr, entry.size, new);
        let moved = settle(&mut c, answer)?;
        count(&mut c, &mut mine, |n| match moved {
            0 => n.failed += 1,
            _ => {
                n.take_back(entry.size);
                n.lend(new);
            }
        });
        Ok(to_ptr(moved))
    }

    /// Give back a block. `size` should be what it was (re)allocated with; a wrong size
    /// is corrected from the ledger and counted, never passed on. `None` does nothing.
    #[inline]
    pub fn free(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<(), Error> {
        let Some(ptr) = ptr else {
            return Ok(());
        };
        // A block this thread's cache lent goes back into its magazine when there is
        // room; otherwise it takes the chain's path, still on the books.
        let mut mine = self.caches.mine();
        if self.caches.keeps_magazines()
            && mine.with(|c| c.put_back::<{ Reach::FULL }>(ptr.as_ptr() as u64, size as u64))
        {
            return Ok(());
        }
        self.free_to_chain(mine, ptr, size)
    }

    /// The most common magazine frees alone: true when the block went back into the
    /// calling thread's magazine, counted as `free` would; false leaves everything as
    /// it was, for `free` to do. Calls nothing, as [`Handler::malloc_from_magazine`].
    #[inline]
    pub fn free_to_magazine(&self, ptr: NonNull<u8>, size: usize) -> bool {
        // The size said is only a filter here (the recorded one is what counts): a block
        // said to be larger than the table's sizes is left to the full path.
        if !self.caches.keeps_magazines() || size as u64 > MAGAZINE_TABLE_SIZE {
            return false;
        }
        let Some(mut mine) = self.caches.primary() else {
            return false;
        };
        mine.try_with(|c| c.put_back::<{ Reach::IN_PLACE }>(ptr.as_ptr() as u64, size as u64))
            .unwrap_or(false)
    }

    /// A free the calling thread's magazine could not take.
    #[cold]
    #[inline(never)]
    fn free_to_chain(
        &self,
        mut mine: Mine<'_>,
        ptr: NonNull<u8>,
        size: usize,
    ) -> Result<(), Error> {
        let addr = ptr.as_ptr() as u64;
        let mut c = self.lock()?;
        let entry = match c.head.lent().get(addr) {
            Some(e) => e,
            None if c.rerouted.remove(&addr) => {
                count(&mut c, &mut mine, |n| n.frees += 1);
                drop(c);
                let fallback = self
                    .fallback
                    .as_ref()
                    .expect("rerouted blocks have a fallback");
                return fallback.free(Some(ptr), size);
            }
            None => {
                count(&mut c, &mut mine, |n| n.frees += 1);
                return Err(match c.head.lent().why_unknown(addr) {
                    TakeBack::AlreadyFreed => ClientError::DoubleFree { addr },
                    _ => ClientError::UnknownBlock { addr },
                }
                .into());
            }
        };
        // A block in a thread cache that the cache has not lent sits in a magazine:
        // the client gave it back already.
        if entry.cache.is_some() && !self.take_from_cache(&mut c, &mut mine, addr)? {
            count(&mut c, &mut mine, |n| n.frees += 1);
            return Err(ClientError::DoubleFree { addr }.into());
        }
        if (size as u64).max(1) != entry.size {
            log::debug!(
                "{}: free of {addr:#x} with {size} bytes corrected to {}",
                self.info.name,
                entry.size
            );
        }
        count(&mut c, &mut mine, |n| {
            n.frees += 1;
            n.freed(entry.size, size as u64);
        });
        let answer = match self.caches.keeps_magazines() && entry.size <= MAGAZINE_MAX_SIZE {
            true => shelve(&mut c, &mut mine, addr, entry.size),
            false => c.give_back(addr, entry.size),
        };
        settle(&mut c, answer).map(drop)
    }

    /// Give every cached block back: every thread's magazines, then each policy's
    /// `trim`, top first.
    pub fn trim(&self) -> Result<(), Error> {
        let mut c = self.lock()?;
        let flushed = flush_magazines(&mut c);
        settle(&mut c, flushed)?;
        let trimmed = c.head.trim().map(|()| 0);
        settle(&mut c, trimmed).map(drop)
    }

    /// A copy of the counters, every thread's included. Counts are exact. The peak is
    /// exact while one thread at a time uses the handler; with several at once it is the
    /// highest total seen when their counters are gathered (here and on each read).
    pub fn stats(&self) -> Result<Stats, Error> {
        let mut c = self.lock()?;
        for slot in c.slots() {
            let counts = c
                .claim(slot)
                .map(|mut cache| std::mem::take(&mut cache.counts));
            match counts {
                Ok(counts) => c.stats.fold(counts),
                Err(reason) => return Err(unreachable(&c, reason)),
            }
        }
        let mut stats = c.stats.clone();
        stats.budget_refusals = c.links().map(|l| l.stats().budget_refusals).sum();
        Ok(stats)
    }

    /// Check the host's own invariants, for tests and fuzzing: every block a link lent
    /// lies inside memory that link holds from its upstream, so every block a client
    /// holds lies in live host memory; no client block lies in memory the host released
    /// (with [`HandlerBuilder::quarantine`]); each ledger's indexes agree; the thread
    /// caches hold exactly the blocks the ledger says they hold.
    pub fn audit(&self) -> Result<(), InvariantBroken> {
        let unaudited = |reason| InvariantBroken {
            link: format!("{} (thread caches)", self.info.name),
            addr: 0,
            size: 0,
            what: match reason {
                Unreachable::Stuck { .. } => "is in a thread cache whose thread stopped in a call",
                Unreachable::ForkedMidCall => {
                    "is out of reach: the process forked while another thread was in a call"
                }
            },
        };
        let mut c = self.caches.lock().map_err(unaudited)?;
        self.audit_caches(&mut c).map_err(|e| e.either(unaudited))?;
        for link in c.links() {
            let broken = |addr, size, what| InvariantBroken {
                link: link.name().to_string(),
                addr,
                size,
                what,
            };
            let lent = link.lent();
            if let Err(what) = lent.check_consistent() {
                return Err(broken(0, 0, what));
            }
            let upstream = link.upstream().lent().order_afresh();
            for (addr, e) in lent.iter() {
                if Ordered::from(&upstream).containing(addr, e.size).is_none() {
                    return Err(broken(
                        addr,
                        e.size,
                        "lies outside the memory its policy holds from upstream",
                    ));
                }
                if let Some((released, _)) = c.bottom().released_overlapping(addr, e.size) {
                    return Err(broken(
                        addr,
                        e.size,
                        if released == addr {
                            "was released to the system while lent"
                        } else {
                            "lies in memory released to the system"
                        },
                    ));
                }
            }
        }
        c.bottom()
            .lent
            .check_consistent()
            .map_err(|what| InvariantBroken {
                link: "host memory".into(),
                addr: 0,
                size: 0,
                what,
            })
    }

    /// Every block a thread cache holds is the top policy's, recorded with its size and
    /// that cache; every block the ledger gives a cache is in it.
    fn audit_caches(&self, c: &mut Books<'_>) -> Result<(), AuditError> {
        let broken = |addr, size, what| InvariantBroken {
            link: format!("{} (thread caches)", self.info.name),
            addr,
            size,
            what,
        };
        let mut held = 0;
        for slot in c.slots() {
            let blocks: Vec<(u64, u64)> = c
                .claim(slot)
                .map(|t| {
                    let in_magazines = t.magazines.iter().flat_map(Magazines::blocks);
                    t.lent.iter().chain(in_magazines).collect()
                })
                .map_err(AuditError::Unreachable)?;
            for (addr, size) in blocks {
                let entry = c.head.lent().get(addr);
                if entry.is_none_or(|e| e.size != size || e.cache != Some(slot.id)) {
                    return Err(AuditError::Broken(broken(
                        addr,
                        size,
                        "is in a thread cache the ledger does not name",
                    )));
                }
                held += 1;
            }
        }
        let named: Vec<_> = c
            .head
            .lent()
            .iter()
            .filter(|(_, e)| e.cache.is_some())
            .collect();
        match named.len() == held {
            true => Ok(()),
            false => {
                let (addr, e) = named[0];
                Err(AuditError::Broken(broken(
                    addr,
                    e.size,
                    "is given to a thread cache that does not hold it",
                )))
            }
        }
    }

    /// The blocks the client holds, `(address, size)`, by address.
    pub fn live_blocks(&self) -> Result<Vec<(usize, usize)>, Error> {
        let mut c = self.lock()?;
        let mut blocks: Vec<(usize, usize)> = c
            .head
            .lent()
            .iter()
            .filter(|(_, e)| e.cache.is_none())
            .map(|(a, e)| (a as usize, e.size as usize))
            .collect();
        for slot in c.slots() {
            let lent = c.claim(slot).map(|t| {
                let lent = t.lent.iter().map(|(a, s)| (a as usize, s as usize));
                lent.collect::<Vec<_>>()
            });
            blocks.extend(lent.map_err(|reason| self.unreachable(reason))?);
        }
        blocks.sort_unstable();
        Ok(blocks)
    }

    /// The size a live block was (re)allocated with; `None` for a block the handler
    /// has not lent, or cannot reach.
    pub fn block_size(&self, ptr: NonNull<u8>) -> Option<usize> {
        let addr = ptr.as_ptr() as u64;
        let mut mine = self.caches.mine();
        let mut c = self.lock().ok()?;
        let e = c.head.lent().get(addr)?;
        let size = match e.cache {
            None => e.size,
            Some(id) => c.cache_of(&mut mine, id).ok()?.lent.get(addr)?,
        };
        Some(size as usize)
    }

    /// Counters of every policy in the chain, top first.
    pub fn link_stats(&self) -> Result<Vec<crate::link::LinkStats>, Error> {
        Ok(self.lock()?.links().map(Link::stats).collect())
    }

    /// Trim, then fail with a [`crate::error::Rule::Leak`] violation if the chain still holds memory
    /// from the host — to be called once the client has freed everything (a test's last
    /// assertion).
    pub fn leak_check(&self) -> Result<(), Error> {
        self.trim()?;
        let (blocks, bytes) = self.held_from_host()?;
        if blocks == 0 {
            return Ok(());
        }
        Err(Error::Violation(crate::error::Violation {
            policy: self.info.name.clone(),
            call: crate::error::Call::Trim,
            addr: 0,
            size: bytes,
            rule: crate::error::Rule::Leak { blocks, bytes },
        }))
    }

    /// Upstream blocks still held from the host's memory, `(blocks, bytes)`: after every
    /// block was freed and the handler trimmed, anything here is a leak.
    pub fn held_from_host(&self) -> Result<(usize, u64), Error> {
        let c = self.lock()?;
        let host = &c.bottom().lent;
        Ok((host.len(), host.bytes()))
    }

    /// The failure that stopped this handler's chain, or that keeps it out of reach.
    pub fn failure(&self) -> Option<Arc<Error>> {
        match self.lock() {
            Ok(c) => c.failure.clone(),
            Err(unreachable) => Some(Arc::new(unreachable)),
        }
    }

    /// Take a block the client holds out of the thread cache that lent it; the client
    /// holds it straight from the policy now. False when that cache has not lent it (it
    /// sits in a magazine).
    fn take_from_cache(
        &self,
        c: &mut Books<'_>,
        mine: &mut Mine<'_>,
        addr: u64,
    ) -> Result<bool, Error> {
        let entry = c.head.lent().get(addr).expect("the caller found it");
        let holder = entry.cache.expect("the caller saw a thread cache");
        let taken = c
            .cache_of(mine, holder)
            .map(|mut cache| cache.lent.remove(addr).is_some())
            .map_err(|reason| self.unreachable(reason))?;
        if taken {
            c.head.lent_mut().set_cache(addr, None);
        }
        Ok(taken)
    }

    fn reroute(
        &self,
        f: impl FnOnce(&Handler) -> Result<Option<NonNull<u8>>, Error>,
    ) -> Result<Option<NonNull<u8>>, Error> {
        let Some(fallback) = &self.fallback else {
            let c = self.lock()?;
            let cause = c.failure.clone().expect("rerouting only after a failure");
            return Err(poisoned(&cause));
        };
        let block = f(fallback)?;
        if let Some(p) = block {
            self.lock()?.rerouted.insert(p.as_ptr() as u64);
        }
        Ok(block)
    }

    /// Realloc on a failed chain: copy the block into the fallback, then release it here.
    fn move_to_fallback(
        &self,
        mut c: Books<'_>,
        mine: &mut Mine<'_>,
        addr: u64,
        old: u64,
        new: u64,
    ) -> Result<Option<NonNull<u8>>, Error> {
        let Some(fallback) = &self.fallback else {
            return Err(poisoned(c.failure.as_ref().expect("failed chain")));
        };
        let Some(fresh) = fallback.malloc(new as usize)? else {
            return Ok(None);
        };
        // SAFETY: `addr` is a live block of `old` bytes this handler lent (found in the
        // ledger, held by the client), and `fresh` a new block of at least `new` bytes
        // from another handler; distinct live blocks do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(addr as *const u8, fresh.as_ptr(), old.min(new) as usize)
        };
        count(&mut c, mine, |n| n.take_back(old));
        // The block was found with its size; a dead head only updates its books.
        let _ = c.head.free(addr, old);
        c.rerouted.insert(fresh.as_ptr() as u64);
        Ok(Some(fresh))
    }
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

/// Update the calling thread's counters.
fn count(c: &mut Books<'_>, mine: &mut Mine<'_>, f: impl FnOnce(&mut cache::Counts)) {
    f(&mut c.own(mine).counts);
}

/// Why an audit of the thread caches failed.
enum AuditError {
    Broken(InvariantBroken),
    Unreachable(Unreachable),
}

impl AuditError {
    fn either(self, unreachable: impl FnOnce(Unreachable) -> InvariantBroken) -> InvariantBroken {
        match self {
            AuditError::Broken(broken) => broken,
            AuditError::Unreachable(reason) => unreachable(reason),
        }
    }
}

impl MemHandler for Handler {
    fn name(&self) -> &str {
        Handler::name(self)
    }
    fn version(&self) -> u8 {
        self.info().version
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
