//! A value many threads read on every call without touching a count, and a rare writer
//! replaces: the writer gets the old value back only once no reader can still hold it.
//!
//! A reader marks itself on a line of its own (found by thread pointer, see
//! [`ByThread`]), then (a light barrier between) loads the pointer; the writer swaps the
//! pointer, then (a heavy barrier between) waits for every marked reader to unmark. The
//! pair orders memory as two full fences would, so either the reader loads the new
//! pointer or the writer sees its mark and waits for it: no reader holds the old value
//! once the writer has seen every mark clear. A reader's work is short (one
//! allocation); the writer yields while it waits.
//!
//! Numba's arrays placed process-wide read the bridge of the innermost
//! `allocbox.numba.use` block here on every array: a thread-local reference cached per
//! thread (what this replaces) cost a call into the dynamic linker and a borrow check,
//! about a sixth of an array's instructions.

use std::sync::Arc;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

use crate::by_thread::ByThread;
use crate::platform::barrier;
use crate::sync::yield_now;

/// A shared value readers borrow for a call, replaced by a writer that waits for them.
#[derive(Debug)]
pub struct Published<T: Send + Sync> {
    /// From `Arc::into_raw`, or null for none.
    current: AtomicPtr<T>,
    readers: ByThread<Reading>,
    /// Values replaced while the writer's own thread was reading: kept until a later
    /// replacement made while it is not, so that its read never outlives them.
    retired: std::sync::Mutex<Vec<Arc<T>>>,
}

/// Whether a thread is reading, on a line of its own: written only by that thread. 0
/// when it is not, else the [`forks`] count when it began plus one: a forked child
/// lacks every thread but the one that forked, and a mark its parent's threads left
/// must not keep the child's writer waiting.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Reading(AtomicU64);

/// What a thread marks while it reads, in this process.
#[inline(always)]
fn reading_mark() -> u64 {
    #[cfg(not(allocbox_loom))]
    let forks = crate::platform::fork::generation();
    #[cfg(allocbox_loom)]
    let forks = 0;
    forks + 1
}

impl<T: Send + Sync> Default for Published<T> {
    fn default() -> Self {
        barrier::prepare();
        // So that a forked child tells its parent's marks from its own.
        #[cfg(not(allocbox_loom))]
        crate::platform::fork::count_forks();
        Published {
            current: AtomicPtr::new(std::ptr::null_mut()),
            readers: ByThread::default(),
            retired: std::sync::Mutex::new(Vec::new()),
        }
    }
}

impl<T: Send + Sync> Published<T> {
    /// `f` with the value now published (`None`: none). A read inside another on the
    /// same thread (a callback that reads again) is part of the outer one.
    #[inline]
    pub fn read<R>(&self, f: impl FnOnce(Option<&T>) -> R) -> R {
        let mark = &self.readers.get_or(Reading::default).0;
        let reading = reading_mark();
        if mark.load(Ordering::Relaxed) == reading {
            // SAFETY: this thread's outer read keeps the value from being freed.
            return f(unsafe { self.current.load(Ordering::Acquire).as_ref() });
        }
        mark.store(reading, Ordering::Relaxed);
        barrier::light();
        /// Unmarks however `f` ends, so that a writer never waits for good.
        struct Done<'a>(&'a AtomicU64);
        impl Drop for Done<'_> {
            #[inline(always)]
            fn drop(&mut self) {
                // Release: a writer that sees this clear sees every use of the value done.
                self.0.store(0, Ordering::Release);
            }
        }
        let _done = Done(mark);
        // SAFETY: marked before the load (see the module's doc): a writer that replaced
        // this value waits for the mark before it gives the value back, so it lives
        // until `_done`.
        f(unsafe { self.current.load(Ordering::Acquire).as_ref() })
    }

    /// Whether `value` (by address) is the one published now.
    pub fn holds(&self, value: Option<&T>) -> bool {
        let value = value.map_or(std::ptr::null(), std::ptr::from_ref);
        std::ptr::eq(self.current.load(Ordering::Acquire), value)
    }

    /// Publish `new` and get the old value back once no reader holds it. Readers are
    /// short; the caller must not keep one waiting (a Python caller lets go of the
    /// interpreter, which a reader's event hook may need).
    pub fn replace(&self, new: Option<Arc<T>>) -> Option<Arc<T>> {
        let new = new.map_or(std::ptr::null_mut(), |v| Arc::into_raw(v).cast_mut());
        let old = self.current.swap(new, Ordering::AcqRel);
        barrier::heavy();
        let mine = self.readers.get().map(std::ptr::from_ref);
        let reading = reading_mark();
        for reader in self.readers.iter() {
            if Some(std::ptr::from_ref(reader)) == mine {
                continue;
            }
            while reader.0.load(Ordering::Acquire) == reading {
                yield_now();
            }
        }
        // SAFETY: `old` came from `Arc::into_raw` (or is null), and every reader that
        // could have loaded it is done with it.
        let old = (!old.is_null()).then(|| unsafe { Arc::from_raw(old.cast_const()) });
        let reading_here = mine.is_some_and(|r| {
            // SAFETY: this thread's own line, alive as long as `self`.
            unsafe { &*r }.0.load(Ordering::Relaxed) == reading
        });
        let mut retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
        if reading_here {
            retired.extend(old);
            return None;
        }
        let earlier = std::mem::take(&mut *retired);
        drop(retired);
        // Given back to the caller with the old value: dropped where it chooses.
        drop(earlier);
        old
    }
}

impl<T: Send + Sync> Drop for Published<T> {
    fn drop(&mut self) {
        let current = *self.current.get_mut();
        if !current.is_null() {
            // SAFETY: from `Arc::into_raw`; no reader is left (we are dropped).
            drop(unsafe { Arc::from_raw(current.cast_const()) });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;

    /// A value that says when it is dropped, and is poisoned then.
    struct Value {
        alive: AtomicBool,
        dropped: Arc<AtomicU64>,
    }

    impl Drop for Value {
        fn drop(&mut self) {
            self.alive.store(false, Ordering::SeqCst);
            self.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn value(dropped: &Arc<AtomicU64>) -> Arc<Value> {
        Arc::new(Value {
            alive: AtomicBool::new(true),
            dropped: dropped.clone(),
        })
    }

    #[test]
    fn readers_never_see_a_value_the_writer_got_back_and_dropped() {
        let dropped = Arc::new(AtomicU64::new(0));
        let published: Published<Value> = Published::default();
        assert!(published.read(|v| v.is_none()));
        let stop = AtomicBool::new(false);
        let reads = AtomicU64::new(0);
        let reading = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    let mut first = true;
                    loop {
                        published.read(|v| {
                            if let Some(v) = v {
                                assert!(v.alive.load(Ordering::SeqCst), "read after its drop");
                            }
                        });
                        reads.fetch_add(1, Ordering::Relaxed);
                        if std::mem::take(&mut first) {
                            reading.fetch_add(1, Ordering::Relaxed);
                        }
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                    }
                });
            }
            // Replaced once every reader has read: on two busy cores the writer had
            // finished before a reader first ran, and the test saw no read at all.
            while reading.load(Ordering::Relaxed) < 3 {
                std::thread::yield_now();
            }
            let replacements = if cfg!(miri) { 20 } else { 2000 };
            for _ in 0..replacements {
                drop(published.replace(Some(value(&dropped))));
            }
            stop.store(true, Ordering::Relaxed);
        });
        assert!(reads.load(Ordering::Relaxed) > 0);
        drop(published.replace(None));
        let replacements = if cfg!(miri) { 20 } else { 2000 };
        assert_eq!(dropped.load(Ordering::SeqCst), replacements);
    }

    #[test]
    fn a_mark_left_by_a_thread_of_the_parent_process_keeps_no_writer_waiting() {
        let dropped = Arc::new(AtomicU64::new(0));
        let published: Published<Value> = Published::default();
        drop(published.replace(Some(value(&dropped))));
        // Another thread's line, marked as a reader of the process before a fork marks
        // it (a thread a forked child does not have) ...
        std::thread::scope(|s| {
            s.spawn(|| published.read(|_| ()));
        });
        let other = published
            .readers
            .iter()
            .next()
            .expect("the other thread's line");
        other.0.store(reading_mark() + 1, Ordering::Relaxed);
        // ... is not waited for: this returns.
        assert!(published.replace(None).is_some());
        assert_eq!(dropped.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_replacement_inside_a_read_on_the_same_thread_keeps_the_old_value_until_later() {
        let dropped = Arc::new(AtomicU64::new(0));
        let published: Published<Value> = Published::default();
        drop(published.replace(Some(value(&dropped))));
        published.read(|outer| {
            let outer = outer.expect("published");
            assert!(published.replace(Some(value(&dropped))).is_none(), "kept");
            assert!(
                outer.alive.load(Ordering::SeqCst),
                "the outer read's value lives on"
            );
            published.read(|inner| assert!(inner.is_some()));
        });
        assert_eq!(dropped.load(Ordering::SeqCst), 0);
        drop(published.replace(None));
        assert_eq!(
            dropped.load(Ordering::SeqCst),
            2,
            "both given back once no read holds them"
        );
        drop(published);
    }
}
