//! A handler: a chain of policy instances behind one lock, checked on every boundary,
//! with the client's side of the contract checked here.

use std::collections::HashSet;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::error::{ClientError, Error, LoadError};
use crate::fasthash::FastMap;
use crate::ledger::TakeBack;
use crate::link::{Limits, Link, LinkFault, PolicyInfo, Upstream};
use crate::runtime::{Policy, Runtime};
use crate::system::SystemMemory;

/// Requests of at most this many bytes may be served from a magazine: NumPy's small and
/// mid-size arrays.
const MAGAZINE_MAX_SIZE: u64 = 64 << 10;
/// Sizes up to this have their magazine in a table indexed by size; larger ones in a map.
const MAGAZINE_TABLE_SIZE: u64 = 1024;
/// Bytes one magazine may cache: its depth is this many bytes of blocks, within
/// [`MAGAZINE_MIN_DEPTH`]..=[`MAGAZINE_DEPTH`] blocks, so a 16-byte magazine holds 64
/// blocks and a 64 KiB one 4.
const MAGAZINE_BYTES: u64 = 256 << 10;
/// Blocks a magazine holds at most before half of them are given back in one `free-many`.
const MAGAZINE_DEPTH: usize = 64;
const MAGAZINE_MIN_DEPTH: usize = 4;
/// The most blocks fetched with one `malloc-many` when a magazine runs empty.
const MAGAZINE_REFILL: u32 = 16;
/// Bytes all magazines of a handler may cache together; past it, frees go to the policy.
const MAGAZINES_TOTAL_BYTES: u64 = 16 << 20;

/// How many blocks of `size` bytes a magazine holds before it spills.
fn magazine_depth(size: u64) -> usize {
    ((MAGAZINE_BYTES / size) as usize).clamp(MAGAZINE_MIN_DEPTH, MAGAZINE_DEPTH)
}

/// The most blocks of `size` bytes one refill asks for: a quarter of the depth.
fn magazine_refill(size: u64) -> u32 {
    (magazine_depth(size) as u32 / 4).clamp(1, MAGAZINE_REFILL)
}

/// Builds a [`Handler`] from policies, top of the chain first.
#[derive(Debug)]
pub struct HandlerBuilder {
    runtime: Runtime,
    links: Vec<(Policy, Vec<(String, String)>)>,
    limits: Limits,
    host_memory_limit: u64,
    quarantine: u64,
    magazines: bool,
    fallback: Option<Arc<Handler>>,
}

impl HandlerBuilder {
    /// An empty chain on `runtime`.
    pub fn new(runtime: &Runtime) -> Self {
        HandlerBuilder {
            runtime: runtime.clone(),
            links: Vec::new(),
            limits: Limits::default(),
            host_memory_limit: u64::MAX,
            quarantine: 0,
            magazines: true,
            fallback: None,
        }
    }

    /// Add `policy` below the links added so far, with no configuration.
    pub fn link(self, policy: &Policy) -> Self {
        self.link_with(policy, &[])
    }

    /// Add `policy` below the links added so far, configured with key/value pairs.
    pub fn link_with(mut self, policy: &Policy, config: &[(&str, &str)]) -> Self {
        let config = config
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.links.push((policy.clone(), config));
        self
    }

    /// Bounds for every policy instance in the chain. Default: [`Limits::default`].
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Most bytes the host lends the bottom of the chain at once; past it requests are
    /// "none". Default: unlimited.
    pub fn host_memory_limit(mut self, bytes: u64) -> Self {
        self.host_memory_limit = bytes;
        self
    }

    /// Keep up to `bytes` of host memory given back by the chain poisoned (every byte
    /// [`crate::QUARANTINE_POISON`]) and unreleased, oldest released first, so that a use
    /// after free shows as poisoned bytes and [`Handler::audit`] can name a client block
    /// in released memory. For tests and fuzzing: it costs that much memory. Default: 0.
    pub fn quarantine(mut self, bytes: u64) -> Self {
        self.quarantine = bytes;
        self
    }

    /// Keep per-size magazines of blocks for a top policy that declares `batch`.
    /// Default: true.
    pub fn magazines(mut self, on: bool) -> Self {
        self.magazines = on;
        self
    }

    /// Where new requests go once this handler's chain has failed. Default: none (they
    /// fail with [`Error::Poisoned`]).
    pub fn fallback(mut self, handler: Arc<Handler>) -> Self {
        self.fallback = Some(handler);
        self
    }

    /// Start every policy, bottom first, and initialise it.
    pub fn build(self) -> Result<Handler, LoadError> {
        if self.links.is_empty() {
            return Err(LoadError::EmptyChain);
        }
        let poison_count = Arc::new(AtomicUsize::new(0));
        let mut upstream =
            Upstream::System(SystemMemory::new(self.host_memory_limit, self.quarantine));
        let mut names = Vec::new();
        for (policy, config) in self.links.iter().rev() {
            let link =
                self.runtime
                    .start(policy, config, upstream, &self.limits, poison_count.clone())?;
            names.push(link.name().clone());
            upstream = Upstream::Policy(Box::new(link));
        }
        let Upstream::Policy(head) = upstream else {
            unreachable!("the chain has at least one link")
        };
        names.reverse();
        let info = head.info.clone();
        let magazines = (self.magazines && info.batch).then(Magazines::default);
        Ok(Handler {
            chain: Mutex::new(Chain {
                head: *head,
                magazines,
                stats: Stats::default(),
                failure: None,
                poisonings_seen: 0,
                poison_count,
                rerouted: HashSet::new(),
            }),
            info,
            names,
            fallback: self.fallback,
        })
    }
}

/// Counts kept by a handler for everything its clients did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub mallocs: u64,
    pub callocs: u64,
    pub reallocs: u64,
    pub frees: u64,
    /// Requests answered "none" (out of memory).
    pub failed: u64,
    pub live_blocks: u64,
    pub live_bytes: u64,
    pub peak_bytes: u64,
    pub total_bytes: u64,
    /// Client frees whose size was not the block's; the policy got the right one.
    pub size_corrections: u64,
    /// Requests served from a magazine without calling the policy.
    pub magazine_hits: u64,
    /// Upstream requests of the chain's policies answered "none" for passing their
    /// overhead budget ([`Limits::overhead`]), summed over the chain.
    pub budget_refusals: u64,
}

impl Stats {
    fn lend(&mut self, size: u64) {
        self.live_blocks += 1;
        self.live_bytes += size;
        self.total_bytes += size;
        self.peak_bytes = self.peak_bytes.max(self.live_bytes);
    }

    fn take_back(&mut self, size: u64) {
        self.live_blocks -= 1;
        self.live_bytes -= size;
    }
}

/// Blocks of one size the top policy placed ahead of demand.
#[derive(Debug)]
struct Magazine {
    blocks: Vec<u64>,
    /// Blocks the next refill asks for. It starts at one and doubles with every refill
    /// up to [`magazine_refill`] (slow start): a size asked for once costs the policy one
    /// block, not a batch the client never uses; a size in steady use soon gets full
    /// batches.
    next_refill: u32,
}

impl Default for Magazine {
    fn default() -> Self {
        Magazine {
            blocks: Vec::new(),
            next_refill: 1,
        }
    }
}

/// One magazine per exact size up to [`MAGAZINE_MAX_SIZE`] (the ledger records exact
/// sizes, and a block goes back with the size it was lent with).
#[derive(Debug, Default)]
struct Magazines {
    /// Sizes up to [`MAGAZINE_TABLE_SIZE`], indexed by size: the hot path.
    small: Vec<Magazine>,
    mid: FastMap<u64, Magazine>,
    /// Bytes in all magazines' blocks.
    cached_bytes: u64,
}

impl Magazines {
    fn of_size(&mut self, size: u64) -> &mut Magazine {
        if size > MAGAZINE_TABLE_SIZE {
            return self.mid.entry(size).or_default();
        }
        let i = size as usize;
        if self.small.len() <= i {
            self.small
                .resize_with(MAGAZINE_TABLE_SIZE as usize + 1, Magazine::default);
        }
        &mut self.small[i]
    }

    /// Every non-empty magazine's blocks, emptying them, with their size.
    fn drain(&mut self) -> Vec<(u64, Vec<u64>)> {
        self.cached_bytes = 0;
        let small = self
            .small
            .iter_mut()
            .enumerate()
            .map(|(s, m)| (s as u64, m));
        let mid = self.mid.iter_mut().map(|(&s, m)| (s, m));
        small
            .chain(mid)
            .filter(|(_, m)| !m.blocks.is_empty())
            .map(|(size, m)| (size, std::mem::take(&mut m.blocks)))
            .collect()
    }
}

struct Chain {
    head: Link,
    magazines: Option<Magazines>,
    stats: Stats,
    /// The first failure anywhere in the chain; from then on new requests go to the
    /// fallback or fail.
    failure: Option<Arc<Error>>,
    poisonings_seen: usize,
    poison_count: Arc<AtomicUsize>,
    /// Blocks the fallback handler served on this handler's behalf.
    rerouted: HashSet<u64>,
}

/// A NEP 49 data-memory handler whose placement decisions are made by a chain of
/// sandboxed policies. `Send + Sync`: many threads may call it at once.
pub struct Handler {
    chain: Mutex<Chain>,
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

    /// A block of at least `size` bytes, `None` when out of memory.
    pub fn malloc(&self, size: usize) -> Result<Option<NonNull<u8>>, Error> {
        let mut c = self.chain.lock();
        c.stats.mallocs += 1;
        let size = (size as u64).max(1);
        if c.failure.is_some() {
            drop(c);
            return self.reroute(|f| f.malloc(size as usize));
        }
        let answer = match c.magazines.is_some() && size <= MAGAZINE_MAX_SIZE {
            true => c.malloc_from_magazine(size),
            false => c.head.malloc(size),
        };
        let addr = c.settle(answer)?;
        c.count_lend(addr, size);
        Ok(to_ptr(addr))
    }

    /// A zero-filled block of `nelem * elsize` bytes; `None` when out of memory or when
    /// the product overflows.
    pub fn calloc(&self, nelem: usize, elsize: usize) -> Result<Option<NonNull<u8>>, Error> {
        let mut c = self.chain.lock();
        c.stats.callocs += 1;
        if c.failure.is_some() {
            drop(c);
            return self.reroute(|f| f.calloc(nelem, elsize));
        }
        let answer = c.head.calloc(nelem as u64, elsize as u64);
        let addr = c.settle(answer)?;
        let size = (nelem as u64).saturating_mul(elsize as u64).max(1);
        c.count_lend(addr, size);
        Ok(to_ptr(addr))
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
        let mut c = self.chain.lock();
        c.stats.reallocs += 1;
        let Some(entry) = c.head.lent().get(addr).filter(|e| !e.cached) else {
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
                    let mut c = self.chain.lock();
                    c.rerouted.remove(&addr);
                    c.rerouted.insert(moved.as_ptr() as u64);
                }
                return Ok(moved);
            }
            return Err(ClientError::UnknownRealloc { addr }.into());
        };
        if c.failure.is_some() {
            return self.move_to_fallback(c, addr, entry.size, new);
        }
        let answer = match c.head.realloc(addr, entry.size, new) {
            Ok(a) => Ok(a),
            Err(LinkFault::Link(e)) => Err(e),
            Err(LinkFault::Caller(_)) => unreachable!("the block was found with its size"),
        };
        let moved = c.settle(answer)?;
        if moved != 0 {
            c.stats.take_back(entry.size);
            c.stats.lend(new);
        } else {
            c.stats.failed += 1;
        }
        Ok(to_ptr(moved))
    }

    /// Give back a block. `size` should be what it was (re)allocated with; a wrong size
    /// is corrected from the ledger and counted, never passed on. `None` does nothing.
    pub fn free(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<(), Error> {
        let Some(ptr) = ptr else {
            return Ok(());
        };
        let addr = ptr.as_ptr() as u64;
        let mut c = self.chain.lock();
        c.stats.frees += 1;
        let entry = match c.head.lent().get(addr) {
            Some(e) if !e.cached => e,
            Some(_) => return Err(ClientError::DoubleFree { addr }.into()),
            None if c.rerouted.remove(&addr) => {
                drop(c);
                let fallback = self
                    .fallback
                    .as_ref()
                    .expect("rerouted blocks have a fallback");
                return fallback.free(Some(ptr), size);
            }
            None => {
                return Err(match c.head.lent().why_unknown(addr) {
                    TakeBack::AlreadyFreed => ClientError::DoubleFree { addr },
                    _ => ClientError::UnknownBlock { addr },
                }
                .into());
            }
        };
        if (size as u64).max(1) != entry.size {
            c.stats.size_corrections += 1;
            log::debug!(
                "{}: free of {addr:#x} with {size} bytes corrected to {}",
                self.info.name,
                entry.size
            );
        }
        c.stats.take_back(entry.size);
        if c.magazines.is_some() && entry.size <= MAGAZINE_MAX_SIZE && c.failure.is_none() {
            let answer = c.free_into_magazine(addr, entry.size);
            return c.settle(answer).map(drop);
        }
        let answer = match c.head.free(addr, entry.size) {
            Ok(()) => Ok(0),
            Err(LinkFault::Link(e)) => Err(e),
            Err(LinkFault::Caller(_)) => unreachable!("the block was found with its size"),
        };
        c.settle(answer).map(drop)
    }

    /// Give every cached block back: the magazines, then each policy's `trim`, top first.
    pub fn trim(&self) -> Result<(), Error> {
        let mut c = self.chain.lock();
        let flushed = c.flush_magazines();
        c.settle(flushed)?;
        let trimmed = c.head.trim().map(|()| 0);
        c.settle(trimmed).map(drop)
    }

    /// A copy of the counters.
    pub fn stats(&self) -> Stats {
        let c = self.chain.lock();
        let mut stats = c.stats.clone();
        stats.budget_refusals = c.links().map(|l| l.stats().budget_refusals).sum();
        stats
    }

    /// Check the host's own invariants, for tests and fuzzing: every block a link lent
    /// lies inside memory that link holds from its upstream, so every block a client
    /// holds lies in live host memory; no client block lies in memory the host released
    /// (with [`HandlerBuilder::quarantine`]); each ledger's indexes agree.
    pub fn audit(&self) -> Result<(), crate::error::InvariantBroken> {
        let c = self.chain.lock();
        for link in c.links() {
            let broken = |addr, size, what| crate::error::InvariantBroken {
                link: link.name().to_string(),
                addr,
                size,
                what,
            };
            let lent = link.lent();
            if let Err(what) = lent.check_consistent() {
                return Err(broken(0, 0, what));
            }
            let upstream = link.upstream();
            for (addr, e) in lent.iter() {
                if upstream.lent().containing(addr, e.size).is_none() {
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
            .map_err(|what| crate::error::InvariantBroken {
                link: "host memory".into(),
                addr: 0,
                size: 0,
                what,
            })
    }

    /// The blocks the client holds, `(address, size)`, by address.
    pub fn live_blocks(&self) -> Vec<(usize, usize)> {
        let c = self.chain.lock();
        c.head
            .lent()
            .iter()
            .filter(|(_, e)| !e.cached)
            .map(|(a, e)| (a as usize, e.size as usize))
            .collect()
    }

    /// The size a live block was (re)allocated with.
    pub fn block_size(&self, ptr: NonNull<u8>) -> Option<usize> {
        let c = self.chain.lock();
        let e = c.head.lent().get(ptr.as_ptr() as u64)?;
        (!e.cached).then_some(e.size as usize)
    }

    /// Counters of every policy in the chain, top first.
    pub fn link_stats(&self) -> Vec<crate::link::LinkStats> {
        self.chain.lock().links().map(Link::stats).collect()
    }

    /// Trim, then fail with a [`Rule::Leak`] violation if the chain still holds memory
    /// from the host — to be called once the client has freed everything (a test's last
    /// assertion).
    pub fn leak_check(&self) -> Result<(), Error> {
        self.trim()?;
        let (blocks, bytes) = self.held_from_host();
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
    pub fn held_from_host(&self) -> (usize, u64) {
        let c = self.chain.lock();
        let host = &c.bottom().lent;
        (host.len(), host.bytes())
    }

    /// The failure that stopped this handler's chain, if any.
    pub fn failure(&self) -> Option<Arc<Error>> {
        self.chain.lock().failure.clone()
    }

    fn reroute(
        &self,
        f: impl FnOnce(&Handler) -> Result<Option<NonNull<u8>>, Error>,
    ) -> Result<Option<NonNull<u8>>, Error> {
        let Some(fallback) = &self.fallback else {
            let c = self.chain.lock();
            let cause = c.failure.clone().expect("rerouting only after a failure");
            return Err(poisoned(&cause));
        };
        let block = f(fallback)?;
        if let Some(p) = block {
            self.chain.lock().rerouted.insert(p.as_ptr() as u64);
        }
        Ok(block)
    }

    /// Realloc on a failed chain: copy the block into the fallback, then release it here.
    fn move_to_fallback(
        &self,
        mut c: parking_lot::MutexGuard<'_, Chain>,
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
        c.stats.take_back(old);
        // The block was found with its size; a dead head only updates its books.
        let _ = c.head.free(addr, old);
        c.rerouted.insert(fresh.as_ptr() as u64);
        Ok(Some(fresh))
    }
}

fn poisoned(cause: &Arc<Error>) -> Error {
    Error::Poisoned {
        policy: cause.policy().unwrap_or("?").into(),
        cause: cause.clone(),
    }
}

impl Chain {
    /// Every link, top first.
    fn links(&self) -> impl Iterator<Item = &Link> {
        std::iter::successors(Some(&self.head), |l| match l.upstream() {
            Upstream::Policy(next) => Some(&**next),
            Upstream::System(_) => None,
        })
    }

    /// The host's own memory under the chain.
    fn bottom(&self) -> &SystemMemory {
        let last = self.links().last().expect("a chain has a link");
        match last.upstream() {
            Upstream::System(s) => s,
            Upstream::Policy(_) => unreachable!("the last link's upstream is the host"),
        }
    }

    /// Finish a call into the chain: record a failure in it, including one deep down
    /// that the head absorbed as "none".
    fn settle(&mut self, answer: Result<u64, Error>) -> Result<u64, Error> {
        match answer {
            Err(e) => {
                self.fail(Arc::new(e.clone()));
                Err(e)
            }
            Ok(addr) => {
                let count = self.poison_count.load(Ordering::Relaxed);
                if count == self.poisonings_seen {
                    return Ok(addr);
                }
                self.poisonings_seen = count;
                let mut failures = Vec::new();
                if let Some(own) = &self.head.poisoned {
                    failures.push(own.clone());
                }
                self.head.upstream().failures(&mut failures);
                let Some(cause) = failures.into_iter().next() else {
                    return Ok(addr);
                };
                self.fail(cause.clone());
                // A block that was served is good; "none" caused by the failure is not
                // an answer, the failure is.
                if addr == 0 {
                    Err((*cause).clone())
                } else {
                    Ok(addr)
                }
            }
        }
    }

    fn fail(&mut self, cause: Arc<Error>) {
        if self.failure.is_none() {
            self.failure = Some(cause);
            let _ = self.flush_magazines();
            self.head.retire(self.failure.as_ref().expect("just set"));
            self.poisonings_seen = self.poison_count.load(Ordering::Relaxed);
        }
    }

    fn count_lend(&mut self, addr: u64, size: u64) {
        if addr == 0 {
            self.stats.failed += 1;
        } else {
            self.stats.lend(size);
        }
    }

    fn malloc_from_magazine(&mut self, size: u64) -> Result<u64, Error> {
        let Chain {
            head, magazines, ..
        } = self;
        let magazines = magazines.as_mut().expect("checked by caller");
        let magazine = magazines.of_size(size);
        if let Some(addr) = magazine.blocks.pop() {
            magazines.cached_bytes -= size;
            head.lent_mut()
                .get_mut(addr)
                .expect("cached blocks are lent")
                .cached = false;
            self.stats.magazine_hits += 1;
            return Ok(addr);
        }
        let count = magazine.next_refill;
        magazine.next_refill = (count * 2).min(magazine_refill(size));
        let mut blocks = head.malloc_many(size, count)?;
        let Some(first) = blocks.pop() else {
            // The policy placed nothing in bulk; ask once the ordinary way.
            return head.malloc(size);
        };
        for &addr in &blocks {
            head.lent_mut().get_mut(addr).expect("just admitted").cached = true;
        }
        magazines.cached_bytes += size * blocks.len() as u64;
        magazines.of_size(size).blocks.extend(blocks);
        Ok(first)
    }

    fn free_into_magazine(&mut self, addr: u64, size: u64) -> Result<u64, Error> {
        let Chain {
            head, magazines, ..
        } = self;
        let magazines = magazines.as_mut().expect("checked by caller");
        if magazines.cached_bytes + size > MAGAZINES_TOTAL_BYTES {
            // Every magazine is as full as the handler allows: the policy takes it.
            return match head.free(addr, size) {
                Ok(()) => Ok(0),
                Err(LinkFault::Link(e)) => Err(e),
                Err(LinkFault::Caller(_)) => unreachable!("the block was found with its size"),
            };
        }
        let depth = magazine_depth(size);
        let stack = &mut magazines.of_size(size).blocks;
        if stack.len() >= depth {
            let spill: Vec<u64> = stack.drain(depth / 2..).collect();
            magazines.cached_bytes -= size * spill.len() as u64;
            match head.free_many(spill, size) {
                Ok(()) => {}
                Err(LinkFault::Link(e)) => {
                    // The client gave this block up; off the books of the now dead link.
                    let _ = head.free(addr, size);
                    return Err(e);
                }
                Err(LinkFault::Caller(_)) => unreachable!("cached blocks are lent"),
            }
        }
        head.lent_mut()
            .get_mut(addr)
            .expect("found by caller")
            .cached = true;
        magazines.of_size(size).blocks.push(addr);
        magazines.cached_bytes += size;
        Ok(0)
    }

    /// Hand every cached block back to the top policy.
    fn flush_magazines(&mut self) -> Result<u64, Error> {
        let Some(magazines) = &mut self.magazines else {
            return Ok(0);
        };
        let mut first_error = None;
        for (size, blocks) in magazines.drain() {
            if let Err(LinkFault::Link(e)) = self.head.free_many(blocks, size) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(0), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magazine_depth_is_bounded_by_bytes_and_refills_by_depth() {
        assert_eq!(magazine_depth(16), MAGAZINE_DEPTH);
        assert_eq!(magazine_depth(4096), 64);
        assert_eq!(magazine_depth(16 << 10), 16);
        assert_eq!(magazine_depth(64 << 10), MAGAZINE_MIN_DEPTH);
        assert_eq!(magazine_refill(16), MAGAZINE_REFILL);
        assert_eq!(magazine_refill(16 << 10), 4);
        assert_eq!(magazine_refill(64 << 10), 1);
    }
}
