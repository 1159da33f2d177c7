//! A handler's books and its thread caches together, and the rules for reaching them:
//! the books only under their lock ([`Locked`]); another thread's cache only with the
//! lock held (a claim is a method of [`Locked`]); one cache guard at a time per lock, and
//! none while the books are in use (a guard borrows the [`Locked`] it came from, so no
//! policy is called while a cache is held); and a thread's own cache outside the lock
//! only on its fast path ([`Mine::with`]).
//!
//! Around them, the process's lifecycle: a thread that ends gives its magazines back
//! ([`Books::thread_ended`]), and a `fork` happens only while no other thread is inside
//! the books or a cache, or the child refuses the handler
//! ([`Unreachable::ForkedMidCall`]).

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::slot::{CacheGuard, Mine, Slot, Unreachable};
use super::slots::Slots;
use super::waiting::Waiting;
use crate::ledger::CacheId;
#[cfg(not(allocbox_loom))]
use crate::platform::fork::{AfterFork, Forkable};
use crate::sync::{Mutex, MutexGuard, OwnLine};

/// What a handler's books do when a thread's cache is given back.
pub trait Books: Send + Sized + 'static {
    /// A thread ended (or, in a forked child, does not exist): `cached` are the blocks
    /// its magazines held, by size, to give back to the policy; `lent` the blocks it
    /// took from its magazines for the client, who keeps them, from now on held
    /// straight from the books.
    fn thread_ended(locked: &mut Locked<'_, Self>, cached: Vec<(u64, Vec<u64>)>, lent: Vec<u64>);
}

/// A handler's books (`C`) behind one lock, and every thread's cache in front of them.
#[derive(Debug)]
pub struct Caches<C> {
    /// Its lock word is written by every call that takes the books, so it is on lines of
    /// its own, as `waiting` is: beside the flags every call reads, a chain asked on every
    /// call by two Numba workers took 2.4 times as long (`bench_numba.py`'s per-call
    /// column: 100-106 ms against 42-44, depending on where the handler was allocated).
    pub(super) books: OwnLine<Mutex<C>>,
    /// Requests queued for whoever holds `books` to serve ([`Caches::combine`]).
    pub(super) waiting: Waiting<C>,
    slots: Slots,
    /// Set in a forked child when the fork came while another thread was inside: the
    /// books and caches may be half-updated, and their locks held by a thread that
    /// does not exist here.
    forked_mid_call: AtomicBool,
    /// Set in a forked child: the caches of threads that do not exist there are given
    /// back at the next lock.
    ghosts: AtomicBool,
    /// In a forked child, the cache of the thread that forked, which is not a ghost.
    survivor: std::sync::Mutex<Option<CacheId>>,
    /// How long a `fork` waits for other threads to leave the books and caches.
    fork_patience: Duration,
    this: Weak<Caches<C>>,
}

impl<C: Books> Caches<C> {
    /// `books` with one cache per calling thread, each with magazines at most
    /// `magazines` blocks deep (none if `None`). A `fork` waits up to `fork_patience`
    /// for other threads to leave their calls.
    pub fn new(books: C, magazines: Option<usize>, fork_patience: Duration) -> Arc<Self> {
        let caches = Arc::new_cyclic(|this| Caches {
            books: OwnLine(Mutex::new(books)),
            waiting: Waiting::default(),
            slots: Slots::new(magazines),
            forked_mid_call: AtomicBool::new(false),
            ghosts: AtomicBool::new(false),
            survivor: std::sync::Mutex::new(None),
            fork_patience,
            this: this.clone(),
        });
        #[cfg(not(allocbox_loom))]
        crate::platform::fork::register(Arc::downgrade(&caches) as Weak<dyn Forkable>);
        caches
    }

    /// The calling thread's cache, made on its first call.
    #[inline(always)]
    pub fn mine(&self) -> Mine<'_> {
        self.slots.mine()
    }

    /// The calling thread's cache when it finds it by its thread pointer: see
    /// [`Slots::mine_by_pointer`].
    #[inline(always)]
    pub fn mine_by_pointer(&self) -> Option<Mine<'_>> {
        self.slots.mine_by_pointer()
    }

    /// Whether blocks may go into magazines: false once the books failed (see
    /// [`Locked::stop_serving`]), and in a child forked mid-call.
    #[inline(always)]
    pub fn keeps_magazines(&self) -> bool {
        self.slots.keeps_magazines()
    }

    /// Every thread's cache, for claims under the lock.
    pub fn slots(&self) -> impl Iterator<Item = &Slot> {
        self.slots.iter()
    }

    /// The books, under their lock.
    #[inline]
    pub fn lock(&self) -> Result<Locked<'_, C>, Unreachable> {
        self.check_reachable()?;
        Ok(self.locked(self.books.lock()))
    }

    /// Whether the books may be reached at all: not in a child forked mid-call.
    #[inline]
    pub(super) fn check_reachable(&self) -> Result<(), Unreachable> {
        match self.forked_mid_call.load(Ordering::Relaxed) {
            true => Err(Unreachable::ForkedMidCall),
            false => Ok(()),
        }
    }

    /// The books, just locked, as a [`Locked`]; the first lock in a forked child gives
    /// the caches of threads that are not there back.
    #[inline]
    pub(super) fn locked<'l>(&'l self, books: MutexGuard<'l, C>) -> Locked<'l, C> {
        let mut locked = Locked {
            books: ManuallyDrop::new(books),
            caches: self,
        };
        if self.ghosts.load(Ordering::Relaxed) {
            self.give_back_ghosts(&mut locked);
        }
        locked
    }

    /// The thread that owned `id` ended: its magazines go back, and the blocks it lent
    /// are the books' own from now on, so that the thread that inherits the slot starts
    /// empty.
    fn thread_ended(&self, id: CacheId) {
        let Ok(mut locked) = self.lock() else {
            return;
        };
        let slot = self.slots.named(id);
        locked.end(slot);
    }

    /// In a forked child, at the first lock: every cache but the forking thread's
    /// belongs to a thread that is not there.
    #[cold]
    fn give_back_ghosts<'l>(&'l self, locked: &mut Locked<'l, C>) {
        self.ghosts.store(false, Ordering::Relaxed);
        let survivor = *self.survivor.lock().unwrap_or_else(|p| p.into_inner());
        for slot in self.slots.iter().filter(|s| Some(s.id) != survivor) {
            locked.end(slot);
        }
    }
}

/// The books, locked; the way to every thread cache. See the module doc for its rules.
/// Dropped, it serves the requests queued meanwhile before it lets the books go
/// ([`Caches::combine`]).
#[derive(Debug)]
pub struct Locked<'l, C: Books> {
    books: ManuallyDrop<MutexGuard<'l, C>>,
    caches: &'l Caches<C>,
}

impl<C: Books> Drop for Locked<'_, C> {
    fn drop(&mut self) {
        self.release();
    }
}

impl<'l, C: Books> Locked<'l, C> {
    pub(super) fn caches(&self) -> &'l Caches<C> {
        self.caches
    }

    /// Let the books go.
    ///
    /// # Safety
    /// Once per lock: the books are not reached again until [`Locked::relock`].
    pub(super) unsafe fn unlock(&mut self) {
        // SAFETY: by the caller's contract, the guard is dropped once.
        unsafe { ManuallyDrop::drop(&mut self.books) };
    }

    /// Hold the books again, after [`Locked::unlock`].
    pub(super) fn relock(&mut self, books: MutexGuard<'l, C>) {
        self.books = ManuallyDrop::new(books);
    }
}

impl<C: Books> std::ops::Deref for Locked<'_, C> {
    type Target = C;
    fn deref(&self) -> &C {
        &self.books
    }
}

impl<C: Books> std::ops::DerefMut for Locked<'_, C> {
    fn deref_mut(&mut self) -> &mut C {
        &mut self.books
    }
}

impl<'l, C: Books> Locked<'l, C> {
    /// Another thread's cache, or any thread's: claimed, which waits for its owner to
    /// leave its fast path. While the guard lives, the books are out of reach.
    pub fn claim(&mut self, slot: &'l Slot) -> Result<CacheGuard<'_>, Unreachable> {
        slot.claim()
    }

    /// The cache named `id` (a ledger entry's holder): on the owner's fast path when it
    /// is `mine`, else claimed.
    pub fn cache_of<'g>(
        &'g mut self,
        mine: &'g mut Mine<'_>,
        id: CacheId,
    ) -> Result<CacheGuard<'g>, Unreachable> {
        match mine.id() == id {
            true => Ok(self.own(mine)),
            false => self.caches.slots.named(id).claim(),
        }
    }

    /// The calling thread's own cache. A cache that is about to get blocks is known to
    /// its thread's exit from here on, which gives them back.
    #[inline]
    pub fn own<'g>(&'g mut self, mine: &'g mut Mine<'_>) -> CacheGuard<'g> {
        #[cfg(not(allocbox_loom))]
        if mine.slot().mark_exit_known() {
            self.remember_exit(mine.id());
        }
        mine.cache()
    }

    /// Once a thread: out of line, so that [`Locked::own`] stays small enough to inline.
    #[cfg(not(allocbox_loom))]
    #[cold]
    #[inline(never)]
    fn remember_exit(&self, id: CacheId) {
        exit::remember(self.caches.this.clone(), id);
    }

    /// Every thread's cache, to claim one by one.
    pub fn slots(&self) -> impl Iterator<Item = &'l Slot> + use<'l, C> {
        self.caches.slots.iter()
    }

    /// Whether blocks may go into magazines: see [`Caches::keeps_magazines`]. Under the
    /// lock it only goes from true to false.
    #[inline(always)]
    pub fn keeps_magazines(&self) -> bool {
        self.caches.keeps_magazines()
    }

    /// No block enters a magazine from now on: the books failed.
    pub fn stop_serving(&self) {
        self.caches.slots.set_failed();
    }

    /// Give `slot`'s cache back to the books: see [`Books::thread_ended`].
    fn end(&mut self, slot: &'l Slot) {
        let (cached, lent) = match self.claim(slot) {
            Ok(mut cache) => {
                cache.forget_owner();
                let cached = cache.magazines.as_mut().map(|m| m.drain());
                (cached.unwrap_or_default(), cache.lent.take_all())
            }
            // Its thread stopped on its fast path: it keeps its blocks.
            Err(_) => return,
        };
        if !cached.is_empty() || !lent.is_empty() {
            C::thread_ended(self, cached, lent);
        }
    }
}

#[cfg(not(allocbox_loom))]
impl<C: Books> Forkable for Caches<C> {
    fn before_fork(self: Arc<Self>) -> Box<dyn AfterFork> {
        let patience = self.fork_patience;
        let books = self.books.lock_within(patience);
        let mut claims = Vec::new();
        let mut complete = books.is_some();
        if complete {
            for slot in self.slots.iter() {
                match slot.claim_within(patience) {
                    Some(claim) => claims.push(claim),
                    None => {
                        complete = false;
                        break;
                    }
                }
            }
        }
        // SAFETY: the guards borrow from `*self`, which `held.caches` keeps alive; the
        // fields of `ForkHeld` drop in order, the guards before that `Arc`, and the
        // guards never leave it.
        let (books, claims) = unsafe {
            (
                std::mem::transmute::<Option<MutexGuard<'_, C>>, Option<MutexGuard<'static, C>>>(
                    books,
                ),
                std::mem::transmute::<Vec<CacheGuard<'_>>, Vec<CacheGuard<'static>>>(claims),
            )
        };
        Box::new(ForkHeld {
            _claims: claims,
            _books: books,
            complete,
            caches: self,
        })
    }
}

/// The books' lock and every cache's claim, held across a fork.
#[cfg(not(allocbox_loom))]
struct ForkHeld<C: 'static> {
    // Held for their drop, which comes first: the guards borrow from `caches`.
    _claims: Vec<CacheGuard<'static>>,
    _books: Option<MutexGuard<'static, C>>,
    complete: bool,
    caches: Arc<Caches<C>>,
}

#[cfg(not(allocbox_loom))]
impl<C: Books> AfterFork for ForkHeld<C> {
    fn after_fork(self: Box<Self>, in_child: bool) {
        let caches = self.caches.clone();
        if in_child {
            // The threads whose requests wait are the parent's.
            caches.waiting.forget_all();
            if self.complete {
                for slot in caches.slots.iter() {
                    slot.release_after_fork();
                }
                *caches.survivor.lock().unwrap_or_else(|p| p.into_inner()) =
                    caches.slots.existing_mine().map(|s| s.id);
                caches.ghosts.store(true, Ordering::Relaxed);
            } else {
                // Refuse before anything is released: the child's only thread is this
                // one, so no call can start in between.
                caches.slots.set_failed();
                caches.forked_mid_call.store(true, Ordering::Relaxed);
            }
        }
        // A released lock whose waiters were parked wakes them with one futex call,
        // harmless in a child where they do not exist.
        drop(self);
        // Requests queued while the fork held the books are served now.
        caches.serve_waiting();
    }
}

/// Giving a thread's caches back when it ends.
#[cfg(not(allocbox_loom))]
mod exit {
    use std::cell::RefCell;
    use std::sync::Weak;

    use super::{Books, Caches};
    use crate::ledger::CacheId;

    /// A handler whose cache a thread holds.
    trait Ended {
        fn thread_ended(&self, id: CacheId);
    }

    impl<C: Books> Ended for Caches<C> {
        fn thread_ended(&self, id: CacheId) {
            Caches::thread_ended(self, id);
        }
    }

    /// The calling thread's caches; dropped when it ends.
    #[derive(Default)]
    struct Held(RefCell<Vec<(Weak<dyn Ended>, CacheId)>>);

    impl Drop for Held {
        fn drop(&mut self) {
            for (caches, id) in self.0.take() {
                if let Some(caches) = caches.upgrade() {
                    caches.thread_ended(id);
                }
            }
        }
    }

    std::thread_local! {
        static HELD: Held = Held::default();
    }

    /// Give the calling thread's cache `id` of `caches` back when the thread ends.
    pub(super) fn remember<C: Books>(caches: Weak<Caches<C>>, id: CacheId) {
        // A thread already ending keeps what it takes now: nothing is lost, only kept
        // until a trim.
        let _ = HELD.try_with(|held| {
            let mut held = held.0.borrow_mut();
            held.retain(|(c, _)| c.strong_count() > 0);
            held.push((caches as Weak<dyn Ended>, id));
        });
    }
}

#[cfg(all(test, not(allocbox_loom)))]
mod tests;
