//! The requests waiting for a handler's books while another thread holds them: a
//! lock-free stack of [`Request`]s, each on its own thread's stack, pushed by their
//! threads and taken whole by the holder, who serves them (`combining.rs`) and tells
//! each thread its answer is there, waking it if it sleeps.

use std::ptr;

use crate::sync::{AtomicPtr, AtomicU32, Ordering, Sleeper};

/// A request's state: waiting (awake, or asleep and to be woken), being woken (its
/// server still uses the word: the thread waits for the answer before it leaves),
/// answered, or handed the queue.
pub(super) const QUEUED: u32 = 0;
pub(super) const ASLEEP: u32 = 1;
pub(super) const WAKING: u32 = 2;
pub(super) const SERVED: u32 = 3;
pub(super) const YOURS: u32 = 4;

/// Requests waiting for the books: a stack of [`Request`]s, each on its thread's stack,
/// pushed by their threads and taken whole by whoever holds the books. On a line of its
/// own (see `Caches`).
#[derive(Debug)]
#[repr(align(128))]
pub(super) struct Waiting<C> {
    top: AtomicPtr<Request<C>>,
}

impl<C> Default for Waiting<C> {
    fn default() -> Self {
        Waiting {
            top: AtomicPtr::new(ptr::null_mut()),
        }
    }
}

/// The work of one request and how it reaches its thread again.
pub(super) struct Request<C> {
    /// The next request down the stack (older), or in a taken list the next to serve.
    pub(super) next: *mut Request<C>,
    pub(super) state: AtomicU32,
    pub(super) sleeper: Sleeper,
    /// Runs the closure behind `work` once on the `Locked<C>` behind its second
    /// argument, storing its outcome beside the closure. (Erased, so that the queue
    /// needs no bound on the books.)
    pub(super) run: unsafe fn(*mut (), *mut ()),
    pub(super) work: *mut (),
    pub(super) books: std::marker::PhantomData<fn(&mut C)>,
}

impl<C> Waiting<C> {
    /// Push `request`, which stays where it is until it is `SERVED` or `YOURS`.
    pub(super) fn push(&self, request: *mut Request<C>) {
        let mut top = self.top.load(Ordering::Relaxed);
        loop {
            // SAFETY: `request` is the caller's, not yet shared.
            unsafe { (*request).next = top };
            // Acquire as well: see `Waiting::any_after_release`.
            match self
                .top
                .compare_exchange_weak(top, request, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(now) => top = now,
            }
        }
    }

    /// Push a list already linked, `first` to `last`, back.
    pub(super) fn push_list(&self, first: *mut Request<C>, last: *mut Request<C>) {
        let mut top = self.top.load(Ordering::Relaxed);
        loop {
            // SAFETY: the list was taken off the stack under the books' lock, which the
            // caller holds: its requests wait and nothing else reaches them.
            unsafe { (*last).next = top };
            match self
                .top
                .compare_exchange_weak(top, first, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(now) => top = now,
            }
        }
    }

    /// Every request waiting, oldest first; null when none. Only under the books' lock.
    pub(super) fn take_all(&self) -> *mut Request<C> {
        let mut newest_first = self.top.swap(ptr::null_mut(), Ordering::Acquire);
        let mut oldest_first = ptr::null_mut();
        while !newest_first.is_null() {
            // SAFETY: a request taken off the stack waits until it is served, and only
            // the holder of the lock reaches it.
            unsafe {
                let next = (*newest_first).next;
                (*newest_first).next = oldest_first;
                oldest_first = newest_first;
                newest_first = next;
            }
        }
        oldest_first
    }

    pub(super) fn is_empty(&self) -> bool {
        self.top.load(Ordering::Relaxed).is_null()
    }

    /// Whether requests wait, looked at by a thread that just let the books go: a
    /// read-modify-write that writes back what it read, so that it and every push are
    /// in one order. A push before it is seen here; a push after it reads from it (a
    /// release, which the push acquires), so the pusher's `try_lock`, later, sees the
    /// books let go. Either this thread serves the request or its own thread takes the
    /// books: none sleeps with nobody to serve it.
    pub(super) fn any_after_release(&self) -> bool {
        let mut top = self.top.load(Ordering::Relaxed);
        loop {
            match self
                .top
                .compare_exchange_weak(top, top, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return !top.is_null(),
                Err(now) => top = now,
            }
        }
    }

    /// How many requests wait; only under the books' lock, which keeps every one of
    /// them where it is.
    #[cfg(test)]
    pub(super) fn count(&self) -> usize {
        let mut count = 0;
        let mut at = self.top.load(Ordering::Acquire);
        while !at.is_null() {
            count += 1;
            // SAFETY: a queued request stays until the lock's holder serves it.
            at = unsafe { (*at).next };
        }
        count
    }

    /// In a forked child: the threads whose requests wait do not exist there.
    pub(super) fn forget_all(&self) {
        self.top.store(ptr::null_mut(), Ordering::Relaxed);
    }
}

/// Put `request` in `state` (served, or handed the queue), and wake its thread if it
/// sleeps.
///
/// # Safety
/// `request` waits, reached by the caller alone; from the last store on its thread may
/// return, taking the request with it, so nothing of it is used after.
pub(super) unsafe fn tell<C>(request: *mut Request<C>, state: u32) {
    // SAFETY: by the caller's contract, live until the last store: a thread that finds
    // its request `WAKING` waits for that store.
    unsafe {
        let word = &(*request).state;
        if word
            .compare_exchange(QUEUED, state, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
        // Asleep: only its own thread goes from `QUEUED` to `ASLEEP`, and only this
        // one from `ASLEEP` on.
        let waker = (*request).sleeper.waker(word);
        word.store(WAKING, Ordering::Relaxed);
        waker.wake();
        word.store(state, Ordering::Release);
    }
}

/// Requests taken off the stack and not yet served; if their server stops before it
/// served them, they are handed to one of their threads.
pub(super) struct Unserved<'a, C> {
    pub(super) first: *mut Request<C>,
    pub(super) waiting: &'a Waiting<C>,
}

impl<C> Unserved<'_, C> {
    /// The next request to serve, off the list.
    pub(super) fn next(&mut self) -> Option<*mut Request<C>> {
        let request = self.first;
        if request.is_null() {
            return None;
        }
        // SAFETY: a request on this list waits, reached only by the lock's holder.
        self.first = unsafe { (*request).next };
        Some(request)
    }

    /// Hand the rest to the first one's thread: it serves itself and, pushed back, the
    /// others.
    pub(super) fn hand_off(&mut self) {
        let Some(first) = self.next() else { return };
        let rest = std::mem::replace(&mut self.first, ptr::null_mut());
        if !rest.is_null() {
            let mut last = rest;
            // SAFETY: as in `next`.
            while let next = unsafe { (*last).next }
                && !next.is_null()
            {
                last = next;
            }
            self.waiting.push_list(rest, last);
        }
        // SAFETY: `first` waits, reached by this thread alone.
        unsafe { tell(first, YOURS) };
    }
}

impl<C> Drop for Unserved<'_, C> {
    fn drop(&mut self) {
        self.hand_off();
    }
}
