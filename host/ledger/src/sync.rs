//! The primitives the thread caches' protocol is built from: the standard library's, or
//! loom's under `--cfg allocbox_loom`, so that loom explores every interleaving of the
//! very code that runs (as crossbeam's `primitive` module does).
//!
//! Only the protocol's own state goes through here (a slot's flags, locks and cell, the
//! books' lock, the barrier's decision); the data structures inside a cache are plain
//! Rust.
//!
//! The locks are the standard library's rather than parking_lot's: a standard mutex is
//! one futex word, so a forked child may release a lock its parent's thread took before
//! the fork. parking_lot's unlock may visit its process-wide table of parked threads,
//! whose bucket locks a thread that does not exist in the child may hold.

#[cfg(not(allocbox_loom))]
mod imp {
    pub(crate) use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, Ordering};
    use std::sync::{PoisonError, TryLockError};
    use std::time::{Duration, Instant};

    /// Give the processor to another thread while waiting.
    pub(crate) fn yield_now() {
        std::thread::yield_now();
    }

    /// Wait a moment on this processor, for a value another thread is about to write.
    #[inline(always)]
    pub(crate) fn spin() {
        std::hint::spin_loop();
    }

    /// A thread that may sleep on a word until another thread changes it and wakes it:
    /// a futex on the word itself, so the waker needs only its address, and no handle
    /// of the sleeper's thread (which a thread that is ending may no longer give).
    #[derive(Debug, Default)]
    pub(crate) struct Sleeper;

    /// How to wake a [`Sleeper`]: the address of the word it sleeps on, which its
    /// owner keeps until the waker is done (see `combining::tell`).
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Waker(*mut u32);

    impl Sleeper {
        pub(crate) fn new() -> Self {
            Sleeper
        }

        /// Sleep while `word` holds `value` (or until woken, or for no reason: the
        /// caller looks again).
        pub(crate) fn sleep(&self, word: &AtomicU32, value: u32) {
            // SAFETY: FUTEX_WAIT reads the word at a valid, aligned address and
            // compares it with `value` before it sleeps.
            unsafe {
                libc::syscall(
                    libc::SYS_futex,
                    word.as_ptr(),
                    libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                    value,
                    std::ptr::null::<libc::timespec>(),
                );
            }
        }

        /// What wakes this sleeper on `word`; made before the word is changed.
        pub(crate) fn waker(&self, word: &AtomicU32) -> Waker {
            Waker(word.as_ptr())
        }
    }

    impl Waker {
        pub(crate) fn wake(self) {
            // SAFETY: FUTEX_WAKE of a private futex takes the address as a key; the
            // word is still there (its owner waits for the waker to finish).
            unsafe {
                libc::syscall(
                    libc::SYS_futex,
                    self.0,
                    libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
                    1,
                );
            }
        }
    }

    /// A mutual-exclusion lock that is never poisoned: the books it guards are checked
    /// by their own invariants, and a panic while holding it is a host bug that the
    /// panic itself reports.
    #[derive(Debug, Default)]
    pub(crate) struct Mutex<T>(std::sync::Mutex<T>);

    pub(crate) type MutexGuard<'a, T> = std::sync::MutexGuard<'a, T>;

    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Self {
            Mutex(std::sync::Mutex::new(value))
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(PoisonError::into_inner)
        }

        /// The lock if no other thread holds it.
        #[inline]
        pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
            match self.0.try_lock() {
                Ok(guard) => Some(guard),
                Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
                Err(TryLockError::WouldBlock) => None,
            }
        }

        /// The lock, waiting at most `patience` for it; for taking locks before a fork,
        /// where waiting without end would hang the forking thread.
        pub(crate) fn lock_within(&self, patience: Duration) -> Option<MutexGuard<'_, T>> {
            let give_up = Instant::now() + patience;
            loop {
                match self.0.try_lock() {
                    Ok(guard) => return Some(guard),
                    Err(TryLockError::Poisoned(poisoned)) => return Some(poisoned.into_inner()),
                    Err(TryLockError::WouldBlock) if Instant::now() >= give_up => return None,
                    Err(TryLockError::WouldBlock) => std::thread::sleep(Duration::from_micros(50)),
                }
            }
        }
    }

    /// A cell whose contents one thread at a time reaches, through [`Cell::access`].
    #[derive(Debug)]
    pub(crate) struct Cell<T>(std::cell::UnsafeCell<T>);

    impl<T> Cell<T> {
        pub(crate) fn new(value: T) -> Self {
            Cell(std::cell::UnsafeCell::new(value))
        }

        /// The contents, for one exclusive access (loom checks it is one).
        #[inline(always)]
        pub(crate) fn access(&self) -> Access<T> {
            Access(self.0.get())
        }
    }

    /// One exclusive access to a [`Cell`]'s contents.
    #[derive(Debug)]
    pub(crate) struct Access<T>(*mut T);

    impl<T> Access<T> {
        /// # Safety
        /// No other access to the cell is live, and the cell outlives `'a`.
        #[inline(always)]
        pub(crate) unsafe fn get<'a>(&self) -> &'a mut T {
            // SAFETY: by the caller's contract.
            unsafe { &mut *self.0 }
        }
    }
}

#[cfg(allocbox_loom)]
mod imp {
    pub(crate) use loom::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, Ordering, fence};

    pub(crate) fn yield_now() {
        loom::thread::yield_now();
    }

    /// A spin is a yield to loom, which must see every waiting loop give way.
    pub(crate) fn spin() {
        loom::thread::yield_now();
    }

    /// loom has no futex: a sleeper parks its loom thread, and its waker unparks it.
    #[derive(Debug)]
    pub(crate) struct Sleeper(loom::thread::Thread);

    #[derive(Debug, Clone)]
    pub(crate) struct Waker(loom::thread::Thread);

    impl Sleeper {
        pub(crate) fn new() -> Self {
            Sleeper(loom::thread::current())
        }

        pub(crate) fn sleep(&self, word: &AtomicU32, value: u32) {
            if word.load(Ordering::Acquire) == value {
                loom::thread::park();
            }
        }

        pub(crate) fn waker(&self, _word: &AtomicU32) -> Waker {
            Waker(self.0.clone())
        }
    }

    impl Waker {
        pub(crate) fn wake(self) {
            self.0.unpark();
        }
    }

    #[derive(Debug)]
    pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

    pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Self {
            Mutex(loom::sync::Mutex::new(value))
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            self.0
                .lock()
                .expect("loom locks are not poisoned in these models")
        }

        pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
            self.0.try_lock().ok()
        }
    }

    #[derive(Debug)]
    pub(crate) struct Cell<T>(loom::cell::UnsafeCell<T>);

    impl<T> Cell<T> {
        pub(crate) fn new(value: T) -> Self {
            Cell(loom::cell::UnsafeCell::new(value))
        }

        /// loom records the access from here until the `Access` is dropped, and fails
        /// the model if another thread's access overlaps it.
        pub(crate) fn access(&self) -> Access<T> {
            Access(self.0.get_mut())
        }
    }

    #[derive(Debug)]
    pub(crate) struct Access<T>(loom::cell::MutPtr<T>);

    impl<T> Access<T> {
        /// # Safety
        /// No other access to the cell is live, and the cell outlives `'a`.
        pub(crate) unsafe fn get<'a>(&self) -> &'a mut T {
            // SAFETY: by the caller's contract; loom checks the first half.
            unsafe { &mut *(self.0.deref() as *mut T) }
        }
    }
}

pub(crate) use imp::*;

/// A value on cache lines of its own: one that threads write often, kept from sharing a
/// line with what every call reads (each write would take the line from every reader).
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct OwnLine<T>(pub(crate) T);

impl<T> std::ops::Deref for OwnLine<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}
