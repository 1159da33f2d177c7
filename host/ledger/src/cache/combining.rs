//! Flat combining in front of the books' lock: while one thread holds the books, the
//! others queue their requests, and the holder serves them before it lets go.
//!
//! A policy asked on every call is one instance behind one lock. Handing that lock from
//! thread to thread costs more than the call (a wake-up, and the instance's memory
//! moving between processors), so with many threads a lock served in turn answers a
//! third of what one thread gets alone. Here the thread that holds the books runs the
//! queued requests itself, back to back, with the instance warm in its cache; the
//! others only wait for their answer.
//!
//! The protocol:
//!
//! - A request ([`Caches::combine`]) takes the lock if it is free and runs at once.
//!   Otherwise it pushes a [`Request`] (on its own stack) onto `waiting`, a lock-free
//!   stack, and waits on the request's `state`: spinning a little, yielding, then asleep
//!   on the state word itself (a futex: the server needs no handle of the thread).
//! - Whoever releases the books (a [`Locked`] dropped: a request's server or any other
//!   holder) first serves what is waiting: each request's work runs under the lock,
//!   its outcome is stored beside it, and its thread is told (`SERVED`, and a wake-up
//!   if it sleeps).
//!   Then it lets go, and looks once more: a request pushed after its last look, whose
//!   thread then failed to take the lock, is seen here (the look is a read-modify-write
//!   of the stack, ordered with every push: see
//!   [`Waiting::any_after_release`](super::waiting::Waiting::any_after_release)), and
//!   served if the lock is still free.
//! - One release serves at most [`SERVE_AT_MOST`] requests. Past that it hands the rest
//!   to one waiting thread (`YOURS`), which takes the lock, runs its own request and
//!   serves the others: no thread serves others for ever, and none is left waiting.
//! - A request's work that panics is caught and its panic handed to the request's own
//!   thread, which resumes it: the server goes on with the queue. If the server stops
//!   anyway while it holds requests it took off the queue,
//!   [`Unserved`](super::waiting::Unserved) hands them to
//!   one of their threads as above.
//!
//! Every request still does its own work under the lock, so whatever a request checks
//! (its ledger entry, its time limit) it checks for itself; only who runs it changes.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::ptr;

use super::caches::{Books, Caches, Locked};
use super::slot::Unreachable;
use super::waiting::{ASLEEP, QUEUED, Request, SERVED, Unserved, WAKING, YOURS, tell};
use crate::sync::{AtomicU32, Ordering, Sleeper, spin, yield_now};

/// The most requests one release of the books serves for other threads; the rest go to
/// one of their threads to serve. Large enough that a queue of every thread's request
/// is served in one go on any ordinary machine.
#[cfg(not(allocbox_loom))]
pub(super) const SERVE_AT_MOST: usize = 64;
/// One, so that the models reach the hand-off with three threads.
#[cfg(allocbox_loom)]
pub(super) const SERVE_AT_MOST: usize = 1;

/// How a waiting thread waits: it looks at its request [`SPINS`] times, then gives its
/// processor away [`YIELDS`] times, then sleeps until it is told. Measured with 16
/// threads on 2 cores (`benches/pairs.rs`), where a waiter that spins longer takes the
/// processor from the thread serving it, and one that sleeps early costs a wake-up (a
/// round trip of about 12 µs there) per request: more than the request.
#[cfg(not(allocbox_loom))]
const SPINS: u32 = 8;
#[cfg(not(allocbox_loom))]
const YIELDS: u32 = 200;
/// Under loom a waiter sleeps at once: the models then cover the wake-ups a sleeping
/// request relies on, which spinning would hide.
#[cfg(allocbox_loom)]
const SPINS: u32 = 0;
#[cfg(allocbox_loom)]
const YIELDS: u32 = 0;

/// A request's closure and, once run, its outcome (a panic included).
struct Work<F, R> {
    f: Option<F>,
    outcome: Option<Result<R, Box<dyn Any + Send>>>,
}

/// # Safety
/// `work` points to a live `Work<F, R>` and `locked` to a live `Locked<C>`, which
/// nothing else reaches meanwhile.
unsafe fn run_work<C, F, R>(work: *mut (), locked: *mut ())
where
    C: Books,
    F: FnOnce(&mut Locked<'_, C>) -> R,
{
    // SAFETY: by the caller's contract.
    let (work, locked) = unsafe {
        (
            &mut *work.cast::<Work<F, R>>(),
            &mut *locked.cast::<Locked<'_, C>>(),
        )
    };
    let f = work.f.take().expect("a request runs once");
    work.outcome = Some(catch_unwind(AssertUnwindSafe(|| f(locked))));
}

impl<C: Books> Caches<C> {
    /// Run `f` on the books, locked: at once if no other thread holds them, else queued
    /// for the thread that holds them to run (see the module doc). A panic in `f` comes
    /// back on this thread.
    pub fn combine<R, F>(&self, f: F) -> Result<R, Unreachable>
    where
        F: FnOnce(&mut Locked<'_, C>) -> R + Send,
        R: Send,
    {
        self.check_reachable()?;
        if let Some(mut locked) = self.try_lock() {
            return Ok(f(&mut locked));
        }
        let mut work = Work::<F, R> {
            f: Some(f),
            outcome: None,
        };
        let mut request = Request {
            next: ptr::null_mut(),
            state: AtomicU32::new(QUEUED),
            sleeper: Sleeper::new(),
            run: run_work::<C, F, R>,
            work: (&raw mut work).cast(),
            books: std::marker::PhantomData,
        };
        let request: *mut Request<C> = &raw mut request;
        self.waiting.push(request);
        let mut spins: u32 = 0;
        loop {
            if let Some(locked) = self.try_lock() {
                // Its release serves the queue, this request among them unless another
                // holder served it already or handed it the queue.
                drop(locked);
            }
            // Looked at after the `try_lock`: a wake-up that came while it was tried is
            // seen here rather than waited for.
            // SAFETY: the request lives in this frame; others only read its state and,
            // holding the lock, run its work and write its state.
            match unsafe { (*request).state.load(Ordering::Acquire) } {
                SERVED => break,
                YOURS => {
                    let mut locked = self.locked(self.books.lock());
                    // SAFETY: handed to this thread, the request is on no list: only
                    // this thread reaches it.
                    unsafe { serve(&mut locked, request) };
                    break;
                }
                // Its server is waking it and still uses the word: the answer comes
                // within the wake-up's system call.
                WAKING => {
                    spin();
                    continue;
                }
                _ => {}
            }
            spins = spins.saturating_add(1);
            if spins <= SPINS {
                spin();
            } else if spins <= SPINS + YIELDS {
                yield_now();
            } else {
                // SAFETY: as above.
                let (state, sleeper) = unsafe { (&(*request).state, &(*request).sleeper) };
                // Asleep only if still waiting: a server that answers from now on wakes it.
                if state
                    .compare_exchange(QUEUED, ASLEEP, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
                    || state.load(Ordering::Relaxed) == ASLEEP
                {
                    sleeper.sleep(state, ASLEEP);
                }
            }
        }
        match work
            .outcome
            .take()
            .expect("a served request has its outcome")
        {
            Ok(answer) => Ok(answer),
            Err(panic) => resume_unwind(panic),
        }
    }

    /// Whether requests wait for the books' holder to serve them.
    pub fn requests_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// The books if no thread holds them. Reachability is checked once per request,
    /// before it may be queued: a queued request's frame must outlive its place there.
    fn try_lock(&self) -> Option<Locked<'_, C>> {
        self.books.try_lock().map(|books| self.locked(books))
    }

    /// After the books were released by a holder other than a [`Locked`] (a fork's):
    /// serve what waited meanwhile.
    pub(super) fn serve_waiting(&self) {
        if self.waiting.any_after_release()
            && let Some(locked) = self.try_lock()
        {
            drop(locked);
        }
    }
}

/// Run `request`'s work and tell its thread.
///
/// # Safety
/// `request` waits (`QUEUED` or `YOURS`) and only the caller reaches it.
unsafe fn serve<C: Books>(locked: &mut Locked<'_, C>, request: *mut Request<C>) {
    // SAFETY: by the caller's contract the request and its work are live and reached
    // by this thread alone, until `SERVED` is stored; `run` was made for this `C`.
    unsafe {
        ((*request).run)((*request).work, (locked as *mut Locked<'_, C>).cast());
        tell(request, SERVED);
    }
}

impl<C: Books> Locked<'_, C> {
    /// Before the books are let go: serve what waits, at most [`SERVE_AT_MOST`] in all
    /// (`served` so far counts against it). True when the rest was handed to a waiting
    /// thread, which serves the queue on its own release.
    pub(super) fn serve_queue(&mut self, served: &mut usize) -> bool {
        let waiting = &self.caches().waiting;
        if waiting.is_empty() {
            return false;
        }
        loop {
            let mut unserved = Unserved {
                first: waiting.take_all(),
                waiting,
            };
            if unserved.first.is_null() {
                std::mem::forget(unserved);
                return false;
            }
            while *served < SERVE_AT_MOST {
                let Some(request) = unserved.next() else {
                    break;
                };
                // SAFETY: taken off the stack under the lock: it waits, and only this
                // thread reaches it.
                unsafe { serve(self, request) };
                *served += 1;
            }
            if !unserved.first.is_null() {
                // Dropped: handed off.
                return true;
            }
            std::mem::forget(unserved);
        }
    }

    /// Let the books go after serving what waits; look once more after letting go, and
    /// serve what came meanwhile if the books are still free.
    pub(super) fn release(&mut self) {
        let mut served = 0;
        loop {
            let handed_off = self.serve_queue(&mut served);
            // SAFETY: the guard is dropped once here, and either replaced below before
            // it is used again or never used again (the `Locked` is being dropped).
            unsafe { self.unlock() };
            if handed_off {
                return;
            }
            let caches = self.caches();
            if !caches.waiting.any_after_release() {
                return;
            }
            match caches.books.try_lock() {
                Some(books) => self.relock(books),
                // Its holder serves them when it lets go.
                None => return,
            }
        }
    }
}

#[cfg(all(test, allocbox_loom))]
mod models;

#[cfg(all(test, not(allocbox_loom)))]
mod tests;
