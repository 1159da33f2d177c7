//! The claim protocol: how the owner thread reaches its cache with no atomic
//! read-modify-write, and how another thread may still reach it.

use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Mutex, MutexGuard};

use super::thread::ThreadCache;
use crate::ledger::CacheId;
use crate::platform::barrier;

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
pub struct Slot {
    pub id: CacheId,
    busy: AtomicBool,
    claimed: AtomicBool,
    held: Mutex<()>,
    cache: UnsafeCell<ThreadCache>,
}

impl Slot {
    /// A slot named `id` holding `cache`, claimed by no one.
    pub(super) fn new(id: CacheId, cache: ThreadCache) -> Self {
        Slot {
            id,
            busy: AtomicBool::new(false),
            claimed: AtomicBool::new(false),
            held: Mutex::new(()),
            cache: UnsafeCell::new(cache),
        }
    }
}

// SAFETY: `cache` is reached only through a `CacheGuard`, and the protocol above gives
// each guard exclusive access; everything else in a slot is atomic, a mutex or immutable.
unsafe impl Sync for Slot {}

impl Slot {
    /// The cache, from any thread: claim it, then wait until its owner is off its fast
    /// path. Costs a process-wide barrier.
    pub fn claim(&self) -> CacheGuard<'_> {
        let held = self.held.lock();
        self.claimed.store(true, Ordering::Relaxed);
        barrier::heavy();
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
#[derive(Debug)]
pub struct CacheGuard<'a> {
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
#[derive(Debug)]
pub struct Mine<'a> {
    pub slot: &'a Slot,
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

    /// Step onto the fast path: mark the owner busy, then see whether a claim came
    /// first. False (busy cleared again) when another thread has the cache claimed.
    #[inline(always)]
    fn enter(&self) -> bool {
        let slot = self.slot;
        slot.busy.store(true, Ordering::Relaxed);
        barrier::light();
        // Acquire: pairs with the release of the last claim, so its writes are seen.
        if !slot.claimed.load(Ordering::Acquire) {
            return true;
        }
        slot.busy.store(false, Ordering::Release);
        false
    }

    /// The cache, on the fast path unless another thread has it claimed.
    #[inline]
    pub fn cache(&self) -> CacheGuard<'a> {
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
    pub fn with<R>(&self, f: impl FnOnce(&mut ThreadCache) -> R) -> R {
        if !self.enter() {
            return self.with_held(f);
        }
        // SAFETY: `enter` just returned true.
        unsafe { self.entered(f) }
    }

    /// [`Mine::with`] that steps back instead of waiting when another thread has the
    /// cache claimed: `None` then.
    #[inline(always)]
    pub fn try_with<R>(&self, f: impl FnOnce(&mut ThreadCache) -> R) -> Option<R> {
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

    pub fn id(&self) -> CacheId {
        self.slot.id
    }
}
