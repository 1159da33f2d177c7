//! `fork` in a process whose handlers other threads call. Before the fork, the forking
//! thread waits until no other thread is inside any handler's books or caches and keeps
//! them out (the handler's own patience bounds the wait); after it, the parent lets them
//! back in, and the child, whose only thread is the forking one, settles what the other
//! threads left: see `Caches`' `Forkable` implementation.
//!
//! A child also lacks every other thread its parent ran, such as a runtime's clock:
//! [`generation`] tells code that keeps such a thread to start it again.
//!
//! The invariants this layer keeps (ARCHITECTURE.md's map names them in short):
//! A thread that ends gives its magazines back through a thread-local destructor
//! (`Books::thread_ended`); the blocks it lent stay the client's, held from the
//! books. `pthread_atfork` takes every live handler's lock and claims every cache
//! before a fork, waiting at most the call limit plus a second: in the child, the
//! caches of threads that are not there are given back at the first lock; if a
//! thread stayed inside a call past that patience, the child refuses the handler
//! (`Unreachable::ForkedMidCall`). In a child the epoch ticker starts again on the
//! first call (`Clock::now_ticking`), and compiling uses a rayon pool of the
//! child's own (the global pool's threads stayed in the parent).

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, Once, PoisonError, TryLockError, Weak};
use std::time::{Duration, Instant};

/// What takes part in a fork: a handler's caches, a recording's lock.
pub trait Forkable: Send + Sync {
    /// Before the fork, in the forking thread: wait (within its own patience) until no
    /// other thread is inside what it guards, and keep them out. The answer is ended
    /// after the fork, in the parent and in the child.
    fn before_fork(self: std::sync::Arc<Self>) -> Box<dyn AfterFork>;
}

/// What [`Forkable::before_fork`] holds across the fork.
pub trait AfterFork {
    /// Let the other threads back in; in the child, first settle what the fork left.
    fn after_fork(self: Box<Self>, in_child: bool);
}

/// Everything that takes part in forks (every live handler's caches, ...): prepared in
/// this order before a fork, let go in the reverse order after it.
static FORKABLE: Mutex<Vec<Weak<dyn Forkable>>> = Mutex::new(Vec::new());

/// How many forks separate this process from the first: 0 in it, 1 in its child, ...
static GENERATION: AtomicU64 = AtomicU64::new(0);

type Held = (
    MutexGuard<'static, Vec<Weak<dyn Forkable>>>,
    Vec<Box<dyn AfterFork>>,
);

std::thread_local! {
    /// What the forking thread holds from before the fork to after it, in the parent
    /// and in the child (the same thread on both sides).
    static HELD: RefCell<Option<Held>> = const { RefCell::new(None) };
}

/// How many forks separate this process from the first one. Code that keeps a thread of
/// its own starts it again when this changed: a forked child has only the thread that
/// forked.
#[inline]
pub fn generation() -> u64 {
    GENERATION.load(Ordering::Relaxed)
}

/// Count forks from now on, so that [`generation`] tells a child from its parent.
pub fn count_forks() {
    static HANDLERS: Once = Once::new();
    // Miri runs no fork, and has no `pthread_atfork`.
    #[cfg(not(miri))]
    HANDLERS.call_once(|| {
        // SAFETY: the three handlers are `extern "C"` functions with no arguments, as
        // `pthread_atfork` requires, and live for the whole process.
        let status = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
        assert_eq!(
            status, 0,
            "pthread_atfork refused its handlers: out of memory"
        );
    });
}

/// Take part in every fork from now on, while `forkable` lives.
pub fn register(forkable: Weak<dyn Forkable>) {
    enrol(forkable, |all, forkable| all.push(forkable));
}

/// Take part in every fork from now on, while `forkable` lives, ahead of everything
/// registered so far or later with [`register`]: for what holds its own locks while it
/// calls into handlers (a handler per thread giving a shard its queued frees), whose
/// locks the fork must take while those handlers still let threads in, and let go
/// after they do.
pub fn register_outer(forkable: Weak<dyn Forkable>) {
    enrol(forkable, |all, forkable| all.insert(0, forkable));
}

fn enrol(
    forkable: Weak<dyn Forkable>,
    place: impl FnOnce(&mut Vec<Weak<dyn Forkable>>, Weak<dyn Forkable>),
) {
    count_forks();
    let mut all = FORKABLE.lock().unwrap_or_else(PoisonError::into_inner);
    all.retain(|f| f.strong_count() > 0);
    place(&mut all, forkable);
}

/// `lock`, for a [`Forkable::before_fork`]: taken when its holder lets it go, or `None`
/// if it still holds it at `give_up` (a thread the child will not have, then).
pub fn lock_before<T>(lock: &Mutex<T>, give_up: Instant) -> Option<MutexGuard<'_, T>> {
    loop {
        match lock.try_lock() {
            Ok(guard) => return Some(guard),
            Err(TryLockError::Poisoned(poisoned)) => return Some(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) if Instant::now() >= give_up => return None,
            Err(TryLockError::WouldBlock) => std::thread::sleep(Duration::from_micros(50)),
        }
    }
}

/// One lock of what an `Arc` owns, taken before a fork (until `give_up`, by
/// [`lock_before`]) and held across it, for a [`Forkable::before_fork`] to hand its
/// [`AfterFork`]: dropping it after the fork lets the lock go, in the parent to its
/// waiting threads, in the child to nobody.
pub struct HeldLock<O: 'static, T: 'static> {
    // Declared first: dropped before the owner whose lock it borrows.
    guard: Option<MutexGuard<'static, T>>,
    owner: std::sync::Arc<O>,
}

impl<O: 'static, T: 'static> std::fmt::Debug for HeldLock<O, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldLock")
            .field("taken", &self.taken())
            .finish_non_exhaustive()
    }
}

impl<O: 'static, T: 'static> HeldLock<O, T> {
    /// The lock `lock` finds in `owner`, taken when its holder lets it go, or not taken
    /// if it is still held at `give_up`.
    pub fn take(
        owner: std::sync::Arc<O>,
        lock: impl FnOnce(&O) -> &Mutex<T>,
        give_up: Instant,
    ) -> Self {
        let guard = lock_before(lock(&owner), give_up);
        // SAFETY: the guard borrows a mutex inside `*owner`, which the `owner` field
        // keeps alive; `guard` is declared before `owner`, so it is dropped first, and
        // it never leaves this struct.
        let guard = guard.map(|guard| unsafe {
            std::mem::transmute::<MutexGuard<'_, T>, MutexGuard<'static, T>>(guard)
        });
        HeldLock { guard, owner }
    }

    /// Whether the lock was taken: if not, a thread kept it past the patience, and in
    /// the child it is that gone thread's forever.
    pub fn taken(&self) -> bool {
        self.guard.is_some()
    }

    pub fn owner(&self) -> &std::sync::Arc<O> {
        &self.owner
    }
}

extern "C" fn prepare() {
    // Held until after the fork, so that no handler is made meanwhile and missed.
    let all = FORKABLE.lock().unwrap_or_else(PoisonError::into_inner);
    let held = all
        .iter()
        .filter_map(Weak::upgrade)
        .map(Forkable::before_fork)
        .collect();
    HELD.with(|h| *h.borrow_mut() = Some((all, held)));
}

extern "C" fn parent() {
    after_fork(false);
}

extern "C" fn child() {
    GENERATION.fetch_add(1, Ordering::Relaxed);
    after_fork(true);
}

fn after_fork(in_child: bool) {
    let Some((all, held)) = HELD.with(|h| h.borrow_mut().take()) else {
        return;
    };
    for after in held.into_iter().rev() {
        after.after_fork(in_child);
    }
    drop(all);
}
