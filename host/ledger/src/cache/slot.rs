//! The claim protocol: how the owner thread reaches its cache with no atomic
//! read-modify-write, and how another thread may still reach it.
//!
//! Its invariant: **at most one [`CacheGuard`] of a slot is live at a time.** The owner
//! enters by setting `busy`, a light barrier, and finding `claimed` clear; a claimer,
//! holding `held` (and, through [`super::Locked`], the books' lock), sets `claimed`, a
//! heavy barrier, and waits until `busy` is clear. The two barriers pair as two full
//! fences would (Dekker's protocol with asymmetric fences): either the owner sees the
//! claim and steps back (to wait on `held`), or the claimer sees the owner busy and
//! waits. The loom models in `models.rs` check every interleaving of it, and that it
//! fails without the light barrier.

use std::marker::PhantomData;
use std::mem::ManuallyDrop;

use super::thread::ThreadCache;
use crate::ledger::CacheId;
use crate::platform::barrier;
use crate::sync::{Access, AtomicBool, Cell, Mutex, MutexGuard, Ordering, yield_now};

/// How many times a claimer yields waiting for an owner to leave its fast path before
/// it gives up ([`Unreachable::Stuck`]). The fast path calls nothing and runs in nanoseconds, so an
/// owner still on it after this many yields (seconds) has stopped: it ended or was
/// killed mid-path, which the protocol cannot repair.
#[cfg(not(allocbox_loom))]
const CLAIM_YIELDS: u64 = 1 << 22;
/// Under loom a waiting claimer yields to the scheduler, which runs the owner.
#[cfg(allocbox_loom)]
const CLAIM_YIELDS: u64 = u64::MAX;

/// Why a thread cache, or the handler in front of it, cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unreachable {
    /// A claimed cache's owner never left its fast path: its thread stopped on it.
    #[error(
        "thread cache {cache} stayed in use by its thread through {CLAIM_YIELDS} yields: \
         that thread stopped inside a call of this handler, and the blocks it holds stay \
         there"
    )]
    Stuck { cache: CacheId },
    /// The process forked while another thread was inside a call of this handler, and
    /// the child, which lacks that thread, cannot finish it.
    #[error(
        "this process was forked while another thread was inside a call of this handler, \
         which the child cannot finish; make a new handler in the child, or fork while no \
         other thread calls this one"
    )]
    ForkedMidCall,
}

/// A thread's cache, on a line of its own so that two threads never write one line.
/// Claims are rare (frees of blocks another thread took, statistics, trims, audits,
/// failures, a thread's exit, a fork); an owner that finds its cache claimed waits on
/// `held`.
#[derive(Debug)]
#[repr(align(128))]
pub struct Slot {
    pub id: CacheId,
    busy: AtomicBool,
    claimed: AtomicBool,
    held: Mutex<()>,
    cache: Cell<ThreadCache>,
    /// Whether the owner's exit is known to give this cache back; set by the owner,
    /// cleared when it is given back (a later thread may inherit the slot).
    exit_known: AtomicBool,
}

// SAFETY: `cache` is reached only through a `CacheGuard`, and the protocol above gives
// each guard exclusive access; everything else in a slot is atomic, a mutex or immutable.
unsafe impl Sync for Slot {}

impl Slot {
    /// A slot named `id` holding `cache`, claimed by no one.
    pub fn new(id: CacheId, cache: ThreadCache) -> Self {
        Slot {
            id,
            busy: AtomicBool::new(false),
            claimed: AtomicBool::new(false),
            held: Mutex::new(()),
            cache: Cell::new(cache),
            exit_known: AtomicBool::new(false),
        }
    }

    /// Mark the owner's exit known; true if it was not before. Only the owner calls it.
    pub(super) fn mark_exit_known(&self) -> bool {
        // A load first: after the first call it is all there is, where a swap would be
        // a locked instruction on every call of the chain's path (`Locked::own`).
        !self.exit_known.load(Ordering::Relaxed) && !self.exit_known.swap(true, Ordering::Relaxed)
    }

    /// The cache, from any thread: claim it, then wait until its owner is off its fast
    /// path. Costs a process-wide barrier. Only [`super::Locked`] calls it, so every
    /// claim is made under the books' lock, one at a time.
    pub(super) fn claim(&self) -> Result<CacheGuard<'_>, Unreachable> {
        self.claim_holding(self.held.lock())
    }

    /// In a forked child, where the forking thread is the only one and is on no fast
    /// path: no owner is busy. Two kinds of slot may still say one is. A slot the fork
    /// claimed, whose owner had stepped onto its fast path, seen the fork's claim and not
    /// yet stepped back: it touched nothing. A slot the fork did not claim, made by
    /// another thread after the forking thread looked at the slots: its cache is as it
    /// was made (everything beyond the fast path waits for the books, which the fork
    /// held, and the fast path of an empty cache changes nothing). Either is left free
    /// to claim, so that the child gives its cache back.
    #[cfg(not(allocbox_loom))]
    pub(super) fn release_after_fork(&self) {
        self.busy.store(false, Ordering::Release);
    }

    /// As an owner between stepping onto its fast path and seeing a claim: busy.
    #[cfg(all(test, not(allocbox_loom)))]
    pub(super) fn step_on_as_owner(&self) {
        self.busy.store(true, Ordering::Relaxed);
    }

    /// [`Slot::claim`], waiting at most `patience` for another holder of the slot to
    /// let go: `None` when it did not, or when the owner never left its fast path.
    #[cfg(not(allocbox_loom))]
    pub(super) fn claim_within(&self, patience: std::time::Duration) -> Option<CacheGuard<'_>> {
        self.claim_holding(self.held.lock_within(patience)?).ok()
    }

    fn claim_holding<'a>(
        &'a self,
        held: MutexGuard<'a, ()>,
    ) -> Result<CacheGuard<'a>, Unreachable> {
        debug_assert!(
            !self.claimed.load(Ordering::Relaxed),
            "one claim at a time, under the books' lock"
        );
        self.claimed.store(true, Ordering::Relaxed);
        barrier::heavy();
        let mut yields = 0u64;
        while self.busy.load(Ordering::Acquire) {
            if yields == CLAIM_YIELDS {
                self.claimed.store(false, Ordering::Release);
                return Err(Unreachable::Stuck { cache: self.id });
            }
            yields += 1;
            yield_now();
        }
        Ok(CacheGuard {
            access: ManuallyDrop::new(self.cache.access()),
            slot: self,
            held: Some(held),
            claimed: true,
        })
    }
}

/// Exclusive access to one thread's cache; see the module doc.
#[derive(Debug)]
pub struct CacheGuard<'a> {
    slot: &'a Slot,
    /// Held while the guard lives: loom checks no other access overlaps it. Ended
    /// first in `drop`, before the flags let another thread in.
    access: ManuallyDrop<Access<ThreadCache>>,
    /// `None` on the owner's fast path.
    held: Option<MutexGuard<'a, ()>>,
    claimed: bool,
}

impl CacheGuard<'_> {
    /// The cache was given back: the next thread to own the slot makes its exit known
    /// again.
    pub(super) fn forget_owner(&mut self) {
        self.slot.exit_known.store(false, Ordering::Relaxed);
    }
}

impl std::ops::Deref for CacheGuard<'_> {
    type Target = ThreadCache;
    fn deref(&self) -> &ThreadCache {
        // SAFETY: a guard is the only way to the cache, and only one guard of a slot
        // lives at a time (the module doc): the owner's fast path between `busy` set and
        // cleared with no claim seen, or the holder of `held` (the owner itself, whose
        // fast path is then not running, or a claimer that saw `busy` clear).
        unsafe { self.access.get() }
    }
}

impl std::ops::DerefMut for CacheGuard<'_> {
    fn deref_mut(&mut self) -> &mut ThreadCache {
        // SAFETY: as in `deref`; `&mut self` keeps this borrow unique within the guard.
        unsafe { self.access.get() }
    }
}

impl Drop for CacheGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: `access` is not used again: this is the guard's end.
        unsafe { ManuallyDrop::drop(&mut self.access) };
        if self.held.is_none() {
            debug_assert!(self.slot.busy.load(Ordering::Relaxed), "the owner entered");
            // Release: a later claimer that sees `busy` clear sees the owner's writes.
            self.slot.busy.store(false, Ordering::Release);
        } else if self.claimed {
            debug_assert!(self.slot.claimed.load(Ordering::Relaxed), "still claimed");
            // Release: the owner's next fast path, seeing no claim, sees these writes.
            self.slot.claimed.store(false, Ordering::Release);
        }
    }
}

/// The calling thread's own slot. Not `Send`: only the owner may take the fast path;
/// its methods take `&mut self`, so one thread holds at most one guard of its own cache.
#[derive(Debug)]
pub struct Mine<'a> {
    slot: &'a Slot,
    _not_send: PhantomData<*const ()>,
}

impl<'a> Mine<'a> {
    /// The calling thread's own `slot` (the caller knows it is).
    pub(super) fn of(slot: &'a Slot) -> Self {
        Mine {
            slot,
            _not_send: PhantomData,
        }
    }

    /// The slot itself.
    pub fn slot(&self) -> &'a Slot {
        self.slot
    }

    /// Step onto the fast path: mark the owner busy, then see whether a claim came
    /// first. False (busy cleared again) when another thread has the cache claimed.
    #[inline(always)]
    fn enter(&self) -> bool {
        let slot = self.slot;
        debug_assert!(
            !slot.busy.load(Ordering::Relaxed),
            "one guard of a thread's own cache at a time"
        );
        slot.busy.store(true, Ordering::Relaxed);
        barrier::light();
        // Acquire: pairs with the release of the last claim, so its writes are seen.
        if !slot.claimed.load(Ordering::Acquire) {
            return true;
        }
        slot.busy.store(false, Ordering::Release);
        false
    }

    /// The cache, on the fast path unless another thread has it claimed (then after
    /// that claim). Under the books' lock use [`super::Locked::own`] instead, which
    /// keeps the lock's work from running while the guard lives.
    #[inline]
    pub(super) fn cache(&mut self) -> CacheGuard<'_> {
        let slot = self.slot;
        // The owner's fast path is not running while it waits on `held`, so holding
        // it is enough to exclude everyone.
        let held = (!self.enter()).then(|| slot.held.lock());
        CacheGuard {
            slot,
            access: ManuallyDrop::new(slot.cache.access()),
            held,
            claimed: false,
        }
    }

    /// Run `f` on the cache: [`Mine::cache`] with no guard to carry, for the magazine
    /// hit, so that its common case is a few instructions around `f`.
    #[inline(always)]
    pub fn with<R>(&mut self, f: impl FnOnce(&mut ThreadCache) -> R) -> R {
        if !self.enter() {
            return self.with_held(f);
        }
        // SAFETY: `enter` just returned true.
        unsafe { self.entered(f) }
    }

    /// [`Mine::with`] that steps back instead of waiting when another thread has the
    /// cache claimed: `None` then.
    #[inline(always)]
    pub fn try_with<R>(&mut self, f: impl FnOnce(&mut ThreadCache) -> R) -> Option<R> {
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
    unsafe fn entered<R>(&mut self, f: impl FnOnce(&mut ThreadCache) -> R) -> R {
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
        let access = self.slot.cache.access();
        // SAFETY: by the caller's contract `busy` is set and no claim was seen after the
        // barrier, so no claimer reaches the cache until `busy` is cleared; `&mut self`
        // keeps the owner from holding another guard meanwhile.
        f(unsafe { access.get() })
    }

    #[cold]
    #[inline(never)]
    fn with_held<R>(&mut self, f: impl FnOnce(&mut ThreadCache) -> R) -> R {
        f(&mut self.cache())
    }

    pub fn id(&self) -> CacheId {
        self.slot.id
    }
}
