//! A value per thread that the thread finds without a thread-local variable.
//!
//! In a shared library (the NumPy bridge is one) a thread-local variable costs a call
//! into the dynamic linker on every access, more than the rest of a magazine hit. So
//! the first [`NAMED`] threads to ask each take a place named by their thread pointer
//! (one instruction to read, see [`thread_pointer`]), found in a few loads; later
//! threads, and platforms without a thread pointer, go through a `ThreadLocal`.
//!
//! A thread's pointer is reused only once that thread has exited, so two live threads
//! never share a place; a thread that takes over a dead one's pointer takes over its
//! place and value, as a thread that takes over a dead one's id takes over its
//! `ThreadLocal` entry.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use thread_local::ThreadLocal;

use crate::platform::thread_pointer;

/// How many threads find their value by their thread pointer (a power of two).
pub const NAMED: usize = 32;

/// How many places a thread looks at, from the one its pointer names.
const PROBES: usize = 4;

/// A value per thread, made on the thread's first [`ByThread::get_or`].
#[derive(Debug)]
pub struct ByThread<T: Send> {
    /// The thread pointer each named place belongs to; 0 while it is no one's.
    owners: [AtomicUsize; NAMED],
    /// Boxed, so that what holds a `ByThread` (a handler's caches, 32 slots of a few
    /// hundred bytes) stays small.
    named: Box<[OnceLock<T>; NAMED]>,
    others: ThreadLocal<T>,
}

impl<T: Send> Default for ByThread<T> {
    fn default() -> Self {
        ByThread {
            owners: std::array::from_fn(|_| AtomicUsize::new(0)),
            named: Box::new(std::array::from_fn(|_| OnceLock::new())),
            others: ThreadLocal::new(),
        }
    }
}

/// Where a thread's named places start: threads' pointers lie a stack apart, so their
/// high bits, mixed, spread them.
#[inline(always)]
fn first_place(me: usize) -> usize {
    me.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (usize::BITS - NAMED.trailing_zeros())
}

impl<T: Send> ByThread<T> {
    /// The calling thread's value, when it has one among the named places: a few loads,
    /// no call.
    #[inline(always)]
    pub fn named(&self) -> Option<&T> {
        let me = thread_pointer()?;
        let start = first_place(me);
        for probe in 0..PROBES {
            let at = (start + probe) & (NAMED - 1);
            // Acquire: pairs with the claim in `get_or`, after which the value is made.
            if self.owners[at].load(Ordering::Acquire) == me {
                return self.named[at].get();
            }
        }
        None
    }

    /// The calling thread's value, if it has one yet; makes none.
    #[inline]
    pub fn get(&self) -> Option<&T> {
        match self.named() {
            Some(value) => Some(value),
            None => self.others.get(),
        }
    }

    /// The calling thread's value, made by `make` on its first call.
    #[inline]
    pub fn get_or(&self, make: impl FnOnce() -> T) -> &T
    where
        T: Sync,
    {
        match self.get() {
            Some(value) => value,
            None => self.first_use(make),
        }
    }

    #[cold]
    fn first_use(&self, make: impl FnOnce() -> T) -> &T
    where
        T: Sync,
    {
        if let Some(me) = thread_pointer() {
            let start = first_place(me);
            for probe in 0..PROBES {
                let at = (start + probe) & (NAMED - 1);
                if self.owners[at]
                    .compare_exchange(0, me, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    // Made before this call returns, so the owner's next look finds it.
                    return self.named[at].get_or_init(make);
                }
            }
        }
        self.others.get_or(make);
        // thread_local 1.1.10 derives the reference `get_or` returns from a `&mut` to
        // the new entry, which another thread reading it (a claim of a thread cache)
        // invalidates under both of Miri's aliasing models; `get` derives one from the
        // shared entry.
        self.others.get().expect("the value was just made")
    }

    /// Every thread's value, in no order.
    pub fn iter(&self) -> impl Iterator<Item = &T>
    where
        T: Sync,
    {
        self.named
            .iter()
            .filter_map(OnceLock::get)
            .chain(self.others.iter())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Barrier;
    use std::sync::atomic::AtomicU32;

    use super::*;

    #[test]
    fn each_live_thread_finds_its_own_value_again_and_every_value_is_listed() {
        let by_thread: ByThread<u32> = ByThread::default();
        let next = AtomicU32::new(0);
        let make = || next.fetch_add(1, Ordering::Relaxed);
        // More threads than named places, all alive at once.
        let threads = NAMED + 8;
        let start = Barrier::new(threads);
        let mut values: Vec<u32> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        let mine = *by_thread.get_or(make);
                        assert_eq!(*by_thread.get_or(|| unreachable!()), mine, "found again");
                        assert_eq!(by_thread.get(), Some(&mine));
                        start.wait();
                        mine
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        values.sort();
        values.dedup();
        assert_eq!(values.len(), threads, "no two live threads share a value");
        assert_eq!(by_thread.iter().count(), threads);
        if thread_pointer().is_some() {
            let named = by_thread.named.iter().filter(|v| v.get().is_some()).count();
            assert!(
                named > NAMED / 2,
                "most threads found a named place: {named}"
            );
        }
    }

    #[test]
    fn a_thread_with_no_value_yet_finds_none_and_makes_none() {
        let by_thread: ByThread<u32> = ByThread::default();
        assert_eq!(by_thread.get(), None);
        assert_eq!(by_thread.iter().count(), 0);
        assert_eq!(*by_thread.get_or(|| 7), 7);
        assert_eq!(by_thread.named().is_some(), thread_pointer().is_some());
    }
}
