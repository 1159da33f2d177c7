//! Per-thread caches: the hot path of a handler.
//!
//! Each thread that calls a handler gets its own [`ThreadCache`]: magazines of blocks the
//! top policy placed ahead of demand, the blocks lent from them to the client, and the
//! thread's counters. A malloc served from a magazine and the free of such a block on the
//! same thread touch only that thread's cache: no lock, no atomic read-modify-write, and
//! no cache line that another thread writes (see [`Slot`] for how another thread may
//! still reach it).
//!
//! Every block stays on the host's books. The top link's ledger records each block it
//! lent, and for the blocks a thread cache holds it names that cache
//! ([`crate::ledger::Entry::cache`]); the cache knows whether the block is in a magazine
//! or lent to the client, and with which size. So a block freed by another thread is
//! found through the ledger, and a double free of a block that is back in a magazine is
//! still caught: the cache that holds it has not lent it.
//!
//! Order: a thread claims another thread's cache only while it holds the chain's lock,
//! and a thread on its own fast path waits for nothing, so no two threads wait on each
//! other.

use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use parking_lot::{Mutex, MutexGuard};
use thread_local::ThreadLocal;

use crate::fasthash::FastMap;
use crate::ledger::CacheId;
use crate::memhandler::Stats;

/// Requests of at most this many bytes may be served from a magazine: NumPy's small and
/// mid-size arrays.
pub(super) const MAGAZINE_MAX_SIZE: u64 = 64 << 10;
/// Sizes up to this have their magazine in a table indexed by size; larger ones in a map.
pub(super) const MAGAZINE_TABLE_SIZE: u64 = 1024;
/// Bytes one magazine may cache: its depth is this many bytes of blocks, within
/// [`MAGAZINE_MIN_DEPTH`]..=[`MAGAZINE_DEPTH`] blocks, so a 16-byte magazine holds 64
/// blocks and a 64 KiB one 4.
const MAGAZINE_BYTES: u64 = 256 << 10;
/// Blocks a magazine holds at most before half of them are given back in one `free-many`.
const MAGAZINE_DEPTH: usize = 64;
const MAGAZINE_MIN_DEPTH: usize = 4;
/// The most blocks fetched with one `malloc-many` when a magazine runs empty.
const MAGAZINE_REFILL: u32 = 16;
/// Bytes all magazines of one thread cache may hold together; past it, frees go to the
/// policy. Thread ids are reused, so a handler has at most one more cache (the primary
/// one, see [`Slots`]) than threads ever ran on it at once.
pub(super) const MAGAZINES_THREAD_BYTES: u64 = 16 << 20;

/// How many blocks of `size` bytes a magazine holds before it spills.
fn magazine_depth(size: u64) -> usize {
    ((MAGAZINE_BYTES / size) as usize).clamp(MAGAZINE_MIN_DEPTH, MAGAZINE_DEPTH)
}

/// The most blocks of `size` bytes one refill asks for: a quarter of the depth.
fn magazine_refill(size: u64) -> u32 {
    (magazine_depth(size) as u32 / 4).clamp(1, MAGAZINE_REFILL)
}

/// Blocks of one size the top policy placed ahead of demand.
#[derive(Debug)]
pub(super) struct Magazine {
    pub(super) blocks: Vec<u64>,
    /// [`magazine_depth`] of its size, kept so that the hot path does not divide.
    pub(super) depth: usize,
    /// Blocks the next refill asks for. It starts at one and doubles with every refill
    /// up to [`magazine_refill`] (slow start): a size asked for once costs the policy one
    /// block, not a batch the client never uses; a size in steady use soon gets full
    /// batches.
    next_refill: u32,
}

impl Magazine {
    fn new(size: u64) -> Self {
        Magazine {
            blocks: Vec::new(),
            depth: magazine_depth(size),
            next_refill: 1,
        }
    }

    /// How many blocks to ask the policy for now; grows the next refill.
    pub(super) fn refill_count(&mut self, size: u64) -> u32 {
        let count = self.next_refill;
        self.next_refill = (count * 2).min(magazine_refill(size));
        count
    }
}

/// One magazine per exact size up to [`MAGAZINE_MAX_SIZE`] (the ledger records exact
/// sizes, and a block goes back with the size it was lent with).
#[derive(Debug)]
pub(super) struct Magazines {
    /// Sizes up to [`MAGAZINE_TABLE_SIZE`], indexed by size: the hot path. Built with
    /// the cache, so that a lookup is one bounds check (which is also the size check).
    small: Box<[Magazine; MAGAZINE_TABLE_SIZE as usize + 1]>,
    mid: FastMap<u64, Magazine>,
    /// Bytes in all magazines' blocks.
    pub(super) cached_bytes: u64,
}

impl Magazines {
    pub(super) fn new() -> Self {
        Magazines {
            small: (0..=MAGAZINE_TABLE_SIZE)
                .map(|s| Magazine::new(s.max(1)))
                .collect::<Box<[_]>>()
                .try_into()
                .expect("one magazine per size up to the table's"),
            mid: FastMap::default(),
            cached_bytes: 0,
        }
    }

    #[inline(always)]
    pub(super) fn of_size(&mut self, size: u64) -> &mut Magazine {
        if size <= MAGAZINE_TABLE_SIZE {
            // The table's length is in its type, so this compare is the only check.
            return &mut self.small[size as usize];
        }
        self.of_mid_size(size)
    }

    /// The magazine for `size` if it may take one more block: under the thread's byte
    /// bound and its depth. `IN_PLACE` asks for a table size whose blocks have spare
    /// capacity, so that the push neither calls nor allocates (see [`Reach`]).
    #[inline(always)]
    fn with_room<const IN_PLACE: bool>(&mut self, size: u64) -> Option<&mut Magazine> {
        if self.cached_bytes + size > MAGAZINES_THREAD_BYTES {
            return None;
        }
        let magazine = match IN_PLACE {
            true if size <= MAGAZINE_TABLE_SIZE => &mut self.small[size as usize],
            true => return None,
            false => self.of_size(size),
        };
        let len = magazine.blocks.len();
        let room = len < magazine.depth && (!IN_PLACE || len < magazine.blocks.capacity());
        room.then_some(magazine)
    }

    /// Out of line: a hash lookup inlined into the small sizes' path would spread it
    /// over more instruction-cache lines.
    #[inline(never)]
    fn of_mid_size(&mut self, size: u64) -> &mut Magazine {
        self.mid.entry(size).or_insert_with(|| Magazine::new(size))
    }

    /// Every non-empty magazine's blocks, emptying them, with their size.
    pub(super) fn drain(&mut self) -> Vec<(u64, Vec<u64>)> {
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

    /// Every cached block with its size, for audits.
    pub(super) fn blocks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let small = self.small.iter().enumerate().map(|(s, m)| (s as u64, m));
        let mid = self.mid.iter().map(|(&s, m)| (s, m));
        small
            .chain(mid)
            .flat_map(|(size, m)| m.blocks.iter().map(move |&a| (a, size)))
    }
}

/// What one thread did on a handler since its counters were last folded into the
/// handler's [`Stats`]. Live counts are signed: a thread may free what another took.
#[derive(Debug, Default)]
pub(super) struct Counts {
    pub(super) mallocs: u64,
    pub(super) callocs: u64,
    pub(super) reallocs: u64,
    pub(super) frees: u64,
    pub(super) failed: u64,
    pub(super) size_corrections: u64,
    pub(super) magazine_hits: u64,
    total_bytes: u64,
    live_blocks: i64,
    live_bytes: i64,
    /// The most `live_bytes` reached since the last fold (0 counts: the fold's start).
    peak_live_bytes: i64,
}

impl Counts {
    #[inline]
    pub(super) fn lend(&mut self, size: u64) {
        self.live_blocks += 1;
        self.live_bytes += size as i64;
        self.total_bytes += size;
        self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes);
    }

    #[inline]
    pub(super) fn take_back(&mut self, size: u64) {
        self.live_blocks -= 1;
        self.live_bytes -= size as i64;
    }

    /// Count a request's answer: a block of `size` bytes, or "none" for address 0.
    pub(super) fn served(&mut self, addr: u64, size: u64) {
        if addr == 0 {
            self.failed += 1;
        } else {
            self.lend(size);
        }
    }

    /// Count a client free of a block recorded with `recorded` bytes, said to have `said`.
    #[inline]
    pub(super) fn freed(&mut self, recorded: u64, said: u64) {
        if said.max(1) != recorded {
            self.size_corrections += 1;
        }
        self.take_back(recorded);
    }
}

impl Stats {
    /// Add a thread's counters and reset them. The peak is exact while one thread at a
    /// time uses the handler (between two folds only that thread moved the live total);
    /// with several threads at once it is each thread's peak over the total at its fold.
    pub(super) fn fold(&mut self, c: &mut Counts) {
        let c = std::mem::take(c);
        self.mallocs += c.mallocs;
        self.callocs += c.callocs;
        self.reallocs += c.reallocs;
        self.frees += c.frees;
        self.failed += c.failed;
        self.size_corrections += c.size_corrections;
        self.magazine_hits += c.magazine_hits;
        self.total_bytes += c.total_bytes;
        let peak = self.live_bytes as i64 + c.peak_live_bytes;
        self.peak_bytes = self.peak_bytes.max(peak.max(0) as u64);
        self.live_bytes = (self.live_bytes as i64 + c.live_bytes) as u64;
        self.live_blocks = (self.live_blocks as i64 + c.live_blocks) as u64;
    }
}

/// How many of the blocks lent last sit in [`Lent`]'s array rather than its map.
const RECENT: usize = 8;

/// Blocks a thread cache lent to the client: address → size. The last few lent sit in
/// a small array that is scanned before the map, so a block freed soon after it was
/// taken (a temporary) never touches the map. Each block is in exactly one of the two.
#[derive(Debug, Default)]
pub(super) struct Lent {
    /// `(address, size)`; address 0 marks a free place (no block lies at 0).
    recent: [(u64, u64); RECENT],
    next: usize,
    older: FastMap<u64, u64>,
}

impl Lent {
    /// The array's next place, when it is free.
    #[inline(always)]
    fn free_place(&self) -> Option<usize> {
        // Reduced here rather than when stored, so that the index needs no bounds check.
        let next = self.next % RECENT;
        (self.recent[next].0 == 0).then_some(next)
    }

    #[inline(always)]
    fn put(&mut self, place: usize, addr: u64, size: u64) {
        self.recent[place] = (addr, size);
        self.next = place + 1;
    }

    #[inline]
    pub(super) fn insert(&mut self, addr: u64, size: u64) {
        let place = match self.free_place() {
            Some(place) => place,
            None => self.make_place(),
        };
        self.put(place, addr, size);
    }

    // The map's paths are out of line, so that the hits around them stay short.

    /// Free the array's next place: its block's record moves to the map.
    #[inline(never)]
    fn make_place(&mut self) -> usize {
        let place = self.next % RECENT;
        let (addr, size) = std::mem::take(&mut self.recent[place]);
        self.older.insert(addr, size);
        place
    }

    #[inline(never)]
    fn older_size(&self, addr: u64) -> Option<u64> {
        self.older.get(&addr).copied()
    }

    #[inline(never)]
    fn remove_older(&mut self, addr: u64) -> Option<u64> {
        self.older.remove(&addr)
    }

    /// The array place that records `addr`.
    #[inline(always)]
    fn recent_place(&self, addr: u64) -> Option<usize> {
        self.recent.iter().position(|&(a, _)| a == addr)
    }

    /// Take the block at `addr` off the record, with its size.
    pub(super) fn remove(&mut self, addr: u64) -> Option<u64> {
        match self.recent_place(addr) {
            Some(place) => Some(std::mem::take(&mut self.recent[place]).1),
            None => self.remove_older(addr),
        }
    }

    pub(super) fn get(&self, addr: u64) -> Option<u64> {
        match self.recent.iter().find(|(a, _)| *a == addr) {
            Some(&(_, size)) => Some(size),
            None => self.older.get(&addr).copied(),
        }
    }

    /// Every block, `(address, size)`, in no order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let recent = self.recent.iter().copied().filter(|&(a, _)| a != 0);
        recent.chain(self.older.iter().map(|(&a, &s)| (a, s)))
    }
}

/// One thread's share of a handler.
#[derive(Debug, Default)]
pub(super) struct ThreadCache {
    /// `None` when the handler keeps no magazines.
    pub(super) magazines: Option<Magazines>,
    /// Blocks taken from this cache's magazines that the client holds: address → size.
    pub(super) lent: Lent,
    pub(super) counts: Counts,
}

/// How far a magazine hit may reach. `IN_PLACE` touches only the cache's fixed parts
/// (the size table, the recent array, capacity already there): it calls nothing and
/// allocates nothing, so the hit inlined into a caller needs no stack frame, and
/// anything else is left to the full path. `FULL` also uses the lent map, mid sizes,
/// and grows a magazine.
pub(super) struct Reach;

impl Reach {
    pub(super) const IN_PLACE: bool = true;
    pub(super) const FULL: bool = false;
}

impl ThreadCache {
    /// A client's request of `size` bytes served from a magazine, counted as a hit and
    /// lent (the caller counts the request); `None` when the magazine is empty, or it is
    /// beyond [`Reach`] `IN_PLACE` (nothing changed then).
    #[inline(always)]
    pub(super) fn take<const IN_PLACE: bool>(&mut self, size: u64) -> Option<u64> {
        let magazines = self.magazines.as_mut()?;
        let magazine = match IN_PLACE {
            true if size <= MAGAZINE_TABLE_SIZE => &mut magazines.small[size as usize],
            true => return None,
            false => magazines.of_size(size),
        };
        // In place, the block's record goes into a free place of the array or nowhere.
        let place = match IN_PLACE {
            true => Some(self.lent.free_place()?),
            false => None,
        };
        let addr = magazine.blocks.pop()?;
        magazines.cached_bytes -= size;
        match place {
            Some(place) => self.lent.put(place, addr, size),
            None => self.lent.insert(addr, size),
        }
        self.counts.magazine_hits += 1;
        self.counts.lend(size);
        Some(addr)
    }

    /// A client's free of `addr`, said to have `said` bytes, taken back into a magazine
    /// if this cache lent it and the magazine has room. False leaves everything as it
    /// was (also for what is beyond [`Reach`] `IN_PLACE`).
    #[inline(always)]
    pub(super) fn put_back<const IN_PLACE: bool>(&mut self, addr: u64, said: u64) -> bool {
        let (place, recorded) = match self.lent.recent_place(addr) {
            Some(place) => (Some(place), self.lent.recent[place].1),
            None if IN_PLACE => return false,
            None => match self.lent.older_size(addr) {
                Some(size) => (None, size),
                None => return false,
            },
        };
        let Some(magazines) = self.magazines.as_mut() else {
            return false;
        };
        let Some(magazine) = magazines.with_room::<IN_PLACE>(recorded) else {
            return false;
        };
        magazine.blocks.push(addr);
        magazines.cached_bytes += recorded;
        match place {
            Some(place) => self.lent.recent[place] = (0, 0),
            None => {
                self.lent.remove_older(addr);
            }
        }
        self.counts.frees += 1;
        self.counts.freed(recorded, said);
        true
    }

    /// Put a block the client gave back into its magazine if there is room without a
    /// spill. Returns whether it did.
    pub(super) fn keep(&mut self, addr: u64, size: u64) -> bool {
        let Some(magazines) = self.magazines.as_mut() else {
            return false;
        };
        let Some(magazine) = magazines.with_room::<{ Reach::FULL }>(size) else {
            return false;
        };
        magazine.blocks.push(addr);
        magazines.cached_bytes += size;
        true
    }
}

/// A thread's cache, on a line of its own so that two threads never write one line.
///
/// The owner thread reaches its cache with no atomic read-modify-write: it marks itself
/// `busy` (a plain store and a compiler-only barrier) and checks that no other thread
/// has `claimed` the cache. Another thread claims it under `held`, issues a process-wide
/// barrier (`membarrier`), and waits until the owner is not busy. The two barriers pair
/// up as one full fence would (Dekker's protocol with asymmetric fences), so either the
/// owner sees the claim and steps back, or the claimer sees the owner busy and waits:
/// the cache is never reached by two threads at once. Claims are rare (frees of blocks
/// another thread took, statistics, trims, audits, failures); an owner that finds its
/// cache claimed waits on `held`.
#[derive(Debug)]
#[repr(align(128))]
pub(super) struct Slot {
    pub(super) id: CacheId,
    busy: AtomicBool,
    claimed: AtomicBool,
    held: Mutex<()>,
    cache: UnsafeCell<ThreadCache>,
}

// SAFETY: `cache` is reached only through a `CacheGuard`, and the protocol above gives
// each guard exclusive access; everything else in a slot is atomic, a mutex or immutable.
unsafe impl Sync for Slot {}

impl Slot {
    /// The cache, from any thread: claim it, then wait until its owner is off its fast
    /// path. Costs a process-wide barrier.
    pub(super) fn claim(&self) -> CacheGuard<'_> {
        let held = self.held.lock();
        self.claimed.store(true, Ordering::Relaxed);
        super::barrier::heavy();
        while self.busy.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
        CacheGuard {
            slot: self,
            held: Some(held),
            claimed: true,
        }
    }
}

/// Exclusive access to one thread's cache; see [`Slot`].
pub(super) struct CacheGuard<'a> {
    slot: &'a Slot,
    /// `None` on the owner's fast path.
    held: Option<MutexGuard<'a, ()>>,
    claimed: bool,
}

impl std::ops::Deref for CacheGuard<'_> {
    type Target = ThreadCache;
    fn deref(&self) -> &ThreadCache {
        // SAFETY: a guard is the only way to the cache, and only one guard of a slot
        // lives at a time (see `Slot`): the owner's fast path between `busy` set and
        // cleared with no claim seen, or the holder of `held` (the owner itself, whose
        // fast path is then not running, or a claimer that saw `busy` clear).
        unsafe { &*self.slot.cache.get() }
    }
}

impl std::ops::DerefMut for CacheGuard<'_> {
    fn deref_mut(&mut self) -> &mut ThreadCache {
        // SAFETY: as in `deref`; `&mut self` keeps this borrow unique within the guard.
        unsafe { &mut *self.slot.cache.get() }
    }
}

impl Drop for CacheGuard<'_> {
    fn drop(&mut self) {
        if self.held.is_none() {
            // Release: a later claimer that sees `busy` clear sees the owner's writes.
            self.slot.busy.store(false, Ordering::Release);
        } else if self.claimed {
            // Release: the owner's next fast path, seeing no claim, sees these writes.
            self.slot.claimed.store(false, Ordering::Release);
        }
    }
}

/// The calling thread's own slot. Not `Send`: only the owner may take the fast path.
pub(super) struct Mine<'a> {
    pub(super) slot: &'a Slot,
    _not_send: PhantomData<*const ()>,
}

impl<'a> Mine<'a> {
    /// Step onto the fast path: mark the owner busy, then see whether a claim came
    /// first. False (busy cleared again) when another thread has the cache claimed.
    #[inline(always)]
    fn enter(&self) -> bool {
        let slot = self.slot;
        slot.busy.store(true, Ordering::Relaxed);
        super::barrier::light();
        // Acquire: pairs with the release of the last claim, so its writes are seen.
        if !slot.claimed.load(Ordering::Acquire) {
            return true;
        }
        slot.busy.store(false, Ordering::Release);
        false
    }

    /// The cache, on the fast path unless another thread has it claimed.
    #[inline]
    pub(super) fn cache(&self) -> CacheGuard<'a> {
        let slot = self.slot;
        // The owner's fast path is not running while it waits on `held`, so holding
        // it is enough to exclude everyone.
        let held = (!self.enter()).then(|| slot.held.lock());
        CacheGuard {
            slot,
            held,
            claimed: false,
        }
    }

    /// Run `f` on the cache: [`Mine::cache`] with no guard to carry, for the magazine
    /// hit, so that its common case is a few instructions around `f`.
    #[inline(always)]
    pub(super) fn with<R>(&self, f: impl FnOnce(&mut ThreadCache) -> R) -> R {
        if !self.enter() {
            return self.with_held(f);
        }
        // SAFETY: `enter` just returned true.
        unsafe { self.entered(f) }
    }

    /// [`Mine::with`] that steps back instead of waiting when another thread has the
    /// cache claimed: `None` then.
    #[inline(always)]
    pub(super) fn try_with<R>(&self, f: impl FnOnce(&mut ThreadCache) -> R) -> Option<R> {
        if !self.enter() {
            return None;
        }
        // SAFETY: `enter` just returned true.
        Some(unsafe { self.entered(f) })
    }

    /// Run `f` on the cache, then clear `busy`.
    ///
    /// # Safety
    /// `enter` returned true, and `busy` has not been cleared since.
    #[inline(always)]
    unsafe fn entered<R>(&self, f: impl FnOnce(&mut ThreadCache) -> R) -> R {
        /// Clears `busy` however `f` ends, so that a claimer never waits for good.
        struct Leave<'a>(&'a AtomicBool);
        impl Drop for Leave<'_> {
            #[inline(always)]
            fn drop(&mut self) {
                // Release: a later claimer that sees `busy` clear sees the writes of `f`.
                self.0.store(false, Ordering::Release);
            }
        }
        let _leave = Leave(&self.slot.busy);
        // SAFETY: by the caller's contract `busy` is set and no claim was seen after the
        // barrier, so no claimer reaches the cache until `busy` is cleared (see `Slot`);
        // the owner holds no other guard across this call (callers pass `f`s that take
        // none).
        f(unsafe { &mut *self.slot.cache.get() })
    }

    #[cold]
    #[inline(never)]
    fn with_held<R>(&self, f: impl FnOnce(&mut ThreadCache) -> R) -> R {
        f(&mut self.cache())
    }

    pub(super) fn id(&self) -> CacheId {
        self.slot.id
    }
}

/// Names the calling thread among the live ones: its thread pointer, which the
/// platform's ABI keeps in a register for thread-local storage. Reading it costs one
/// instruction, where a thread-local variable in a shared library (the NumPy bridge)
/// costs a call into the dynamic linker. A thread's pointer is reused only once that
/// thread has exited, as its thread id is. (x86-64 only: other targets are not built
/// and tested here.)
#[cfg(all(
    target_arch = "x86_64",
    any(target_os = "linux", target_os = "android")
))]
#[inline(always)]
fn thread_pointer() -> Option<usize> {
    let tp: usize;
    // SAFETY: the x86-64 ELF TLS ABI keeps the thread control block at the %fs base, and
    // its first word points to the block itself; every thread has one, so the load is
    // always valid, and it writes nothing.
    unsafe {
        std::arch::asm!(
            "mov {}, qword ptr fs:[0]",
            out(reg) tp,
            options(nostack, readonly, preserves_flags, pure)
        );
    }
    Some(tp)
}

/// Elsewhere every thread's slot is found through `local`.
#[cfg(not(all(
    target_arch = "x86_64",
    any(target_os = "linux", target_os = "android")
)))]
#[inline(always)]
fn thread_pointer() -> Option<usize> {
    None
}

/// Every thread's cache of one handler.
///
/// The first thread to call the handler gets the `primary` slot, found by its thread
/// pointer alone; every other thread's slot is found through `local`. Most programs
/// call a handler from one thread, and that lookup is the larger part of a magazine
/// hit's cost otherwise.
#[derive(Debug)]
pub(super) struct Slots {
    /// The thread pointer of the primary slot's owner; 0 while there is none.
    primary_owner: AtomicUsize,
    primary: OnceLock<Slot>,
    local: ThreadLocal<Slot>,
    next_id: AtomicU32,
    magazines: bool,
    /// `magazines` until the chain fails: from then on no block enters a magazine. One
    /// flag for the hot path to read; only read there, so the line stays shared, not
    /// bounced.
    serving: AtomicBool,
}

impl Slots {
    pub(super) fn new(magazines: bool) -> Self {
        super::barrier::prepare();
        Slots {
            primary_owner: AtomicUsize::new(0),
            primary: OnceLock::new(),
            local: ThreadLocal::new(),
            next_id: AtomicU32::new(1),
            magazines,
            serving: AtomicBool::new(magazines),
        }
    }

    /// The calling thread's cache, made on its first call.
    #[inline]
    pub(super) fn mine(&self) -> Mine<'_> {
        if let Some(mine) = self.primary() {
            return mine;
        }
        let slot = match self.local.get() {
            Some(slot) => slot,
            None => self.first_use(),
        };
        Mine {
            slot,
            _not_send: PhantomData,
        }
    }

    /// The primary slot, when the calling thread owns it: a compare, no call.
    #[inline(always)]
    pub(super) fn primary(&self) -> Option<Mine<'_>> {
        // Acquire: pairs with the CAS in `first_use`. Only the owner, or a thread that
        // took over its thread pointer after it exited, sees its own pointer here.
        if self.primary_owner.load(Ordering::Acquire) != thread_pointer()? {
            return None;
        }
        self.primary.get().map(|slot| Mine {
            slot,
            _not_send: PhantomData,
        })
    }

    /// A thread's first call: the first thread to get here takes the primary slot,
    /// every other one a slot in `local`.
    #[cold]
    fn first_use(&self) -> &Slot {
        if let Some(tp) = thread_pointer()
            && self
                .primary_owner
                .compare_exchange(0, tp, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            // Made before this call returns, so the owner's next `mine` finds it.
            return self.primary.get_or_init(|| self.new_slot());
        }
        self.local.get_or(|| self.new_slot())
    }

    fn new_slot(&self) -> Slot {
        Slot {
            id: CacheId::new(self.next_id.fetch_add(1, Ordering::Relaxed))
                .expect("fewer than 2^32 threads"),
            busy: AtomicBool::new(false),
            claimed: AtomicBool::new(false),
            held: Mutex::new(()),
            cache: UnsafeCell::new(ThreadCache {
                magazines: self.magazines.then(Magazines::new),
                ..ThreadCache::default()
            }),
        }
    }

    /// The cache named `id` (a ledger entry's holder), from `mine`'s thread: on the fast
    /// path when it is the caller's own.
    pub(super) fn cache_of<'a>(&'a self, mine: &Mine<'a>, id: CacheId) -> CacheGuard<'a> {
        if id == mine.id() {
            return mine.cache();
        }
        self.iter()
            .find(|s| s.id == id)
            .expect("a ledger names only caches that exist")
            .claim()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Slot> {
        self.primary.get().into_iter().chain(self.local.iter())
    }

    #[inline]
    pub(super) fn keeps_magazines(&self) -> bool {
        self.serving.load(Ordering::Relaxed)
    }

    pub(super) fn set_failed(&self) {
        self.serving.store(false, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_thread_takes_the_primary_slot_and_every_other_thread_its_own() {
        let slots = Slots::new(true);
        let first = slots.mine().id();
        assert_eq!(slots.mine().id(), first, "found again, not made again");
        if thread_pointer().is_some() {
            assert_eq!(slots.primary.get().map(|p| p.id), Some(first));
        }
        // Threads arriving together each get a slot of their own.
        let start = std::sync::Barrier::new(4);
        let mut ids: Vec<CacheId> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        let id = slots.mine().id();
                        assert_eq!(slots.mine().id(), id);
                        // All alive at once: an exited thread's slot may be reused.
                        start.wait();
                        id
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        ids.push(first);
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 5);
        assert_eq!(
            slots.iter().count(),
            5,
            "every slot is reachable for claims"
        );
    }

    #[test]
    fn a_race_for_the_primary_slot_has_one_winner() {
        let slots = Slots::new(true);
        let start = std::sync::Barrier::new(4);
        let ids: Vec<CacheId> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        let id = slots.mine().id();
                        start.wait();
                        id
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut distinct = ids.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), 4, "{ids:?}");
        assert!(slots.primary.get().is_some() == thread_pointer().is_some());
    }

    fn cache_with(size: u64, blocks: &[u64]) -> ThreadCache {
        let mut cache = ThreadCache {
            magazines: Some(Magazines::new()),
            ..ThreadCache::default()
        };
        let magazines = cache.magazines.as_mut().unwrap();
        let magazine = magazines.of_size(size);
        magazine.blocks = blocks.to_vec();
        magazines.cached_bytes = size * blocks.len() as u64;
        cache
    }

    #[test]
    fn an_in_place_hit_leaves_to_the_full_path_what_would_need_a_call() {
        const IN_PLACE: bool = Reach::IN_PLACE;
        const FULL: bool = Reach::FULL;
        let blocks: Vec<u64> = (1..=12).map(|i| i * 0x1000).collect();
        let mut c = cache_with(16, &blocks);
        // The recent array's places fill up; then the record would go to the map.
        let taken: Vec<u64> = (0..RECENT)
            .map(|_| c.take::<IN_PLACE>(16).unwrap())
            .collect();
        c.counts.mallocs += RECENT as u64;
        assert_eq!(c.take::<IN_PLACE>(16), None);
        assert_eq!(c.magazines.as_ref().unwrap().small[16].blocks.len(), 4);
        let spilled_by = c.take::<FULL>(16).unwrap();
        c.counts.mallocs += 1;
        assert_eq!(c.lent.older.len(), 1, "the oldest record moved to the map");
        // A block recorded in the map goes back only on the full path.
        let in_map = taken[0];
        assert!(!c.put_back::<IN_PLACE>(in_map, 16));
        assert_eq!(c.lent.get(in_map), Some(16), "nothing changed");
        // With no spare capacity, in place would have to grow the magazine.
        c.magazines.as_mut().unwrap().small[16]
            .blocks
            .shrink_to_fit();
        assert!(!c.put_back::<IN_PLACE>(spilled_by, 16));
        assert_eq!(c.lent.get(spilled_by), Some(16), "nothing changed");
        assert!(c.put_back::<FULL>(spilled_by, 16));
        assert!(c.put_back::<FULL>(in_map, 16));
        // Now there is room: in place takes a recent block back.
        assert!(c.put_back::<IN_PLACE>(taken[1], 16));
        assert_eq!(c.lent.get(taken[1]), None);
        assert_eq!((c.counts.mallocs, c.counts.frees), (9, 3));
        // Mid sizes are the full path's.
        let mut mid = cache_with(4096, &[0x10000]);
        assert_eq!(mid.take::<IN_PLACE>(4096), None);
        assert_eq!(mid.take::<FULL>(4096), Some(0x10000));
    }

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

    #[test]
    fn a_fold_keeps_the_peak_of_one_thread_exact() {
        let mut stats = Stats::default();
        let mut c = Counts::default();
        c.lend(100);
        c.lend(50);
        c.take_back(100);
        stats.fold(&mut c);
        assert_eq!((stats.live_bytes, stats.peak_bytes), (50, 150));
        c.take_back(50);
        c.lend(10);
        stats.fold(&mut c);
        assert_eq!(
            (stats.live_bytes, stats.peak_bytes, stats.live_blocks),
            (10, 150, 1)
        );
    }

    #[test]
    fn a_thread_may_free_more_than_it_took() {
        let mut stats = Stats::default();
        let mut taker = Counts::default();
        let mut freer = Counts::default();
        taker.lend(64);
        freer.take_back(64);
        stats.fold(&mut freer);
        stats.fold(&mut taker);
        assert_eq!((stats.live_bytes, stats.live_blocks), (0, 0));
    }
}
