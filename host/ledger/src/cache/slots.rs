//! Every thread's cache of one handler, and how a thread finds its own.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use thread_local::ThreadLocal;

use super::magazine::Magazines;
use super::slot::{Mine, Slot};
use super::thread::ThreadCache;
use crate::ledger::CacheId;
use crate::platform::{barrier, thread_pointer};

/// Every thread's cache of one handler.
///
/// The first thread to call the handler gets the `primary` slot, found by its thread
/// pointer alone; every other thread's slot is found through `local`. Most programs
/// call a handler from one thread, and that lookup is the larger part of a magazine
/// hit's cost otherwise.
#[derive(Debug)]
pub struct Slots {
    /// The thread pointer of the primary slot's owner; 0 while there is none.
    primary_owner: AtomicUsize,
    primary: OnceLock<Slot>,
    local: ThreadLocal<Slot>,
    next_id: AtomicU32,
    /// The deepest a magazine may be; `None`: no magazines.
    magazines: Option<usize>,
    /// `magazines` until the chain fails: from then on no block enters a magazine. One
    /// flag for the hot path to read; only read there, so the line stays shared, not
    /// bounced.
    serving: AtomicBool,
}

impl Slots {
    pub fn new(magazines: Option<usize>) -> Self {
        barrier::prepare();
        Slots {
            primary_owner: AtomicUsize::new(0),
            primary: OnceLock::new(),
            local: ThreadLocal::new(),
            next_id: AtomicU32::new(1),
            magazines,
            serving: AtomicBool::new(magazines.is_some()),
        }
    }

    /// The calling thread's cache, made on its first call.
    #[inline]
    pub fn mine(&self) -> Mine<'_> {
        if let Some(mine) = self.primary() {
            return mine;
        }
        let slot = match self.local.get() {
            Some(slot) => slot,
            None => self.first_use(),
        };
        Mine::of(slot)
    }

    /// The primary slot, when the calling thread owns it: a compare, no call.
    #[inline(always)]
    pub fn primary(&self) -> Option<Mine<'_>> {
        // Acquire: pairs with the CAS in `first_use`. Only the owner, or a thread that
        // took over its thread pointer after it exited, sees its own pointer here.
        if self.primary_owner.load(Ordering::Acquire) != thread_pointer()? {
            return None;
        }
        self.primary.get().map(Mine::of)
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
        self.local.get_or(|| self.new_slot());
        // thread_local 1.1.10 derives the reference `get_or` returns from a `&mut` to
        // the new entry, which another thread's claim (reading `busy`) invalidates under
        // both of Miri's aliasing models; `get` derives one from the shared entry.
        self.local.get().expect("the slot was just made")
    }

    fn new_slot(&self) -> Slot {
        let id = CacheId::new(self.next_id.fetch_add(1, Ordering::Relaxed))
            .expect("fewer than 2^32 threads");
        Slot::new(
            id,
            ThreadCache {
                magazines: self.magazines.map(Magazines::at_most),
                ..ThreadCache::default()
            },
        )
    }

    /// The calling thread's slot, if it has one yet; makes none.
    pub(super) fn existing_mine(&self) -> Option<&Slot> {
        match self.primary() {
            Some(mine) => Some(mine.slot()),
            None => self.local.get(),
        }
    }

    /// The slot named `id` (a ledger entry's holder).
    pub(super) fn named(&self, id: CacheId) -> &Slot {
        self.iter()
            .find(|s| s.id == id)
            .expect("a ledger names only caches that exist")
    }

    pub fn iter(&self) -> impl Iterator<Item = &Slot> {
        self.primary.get().into_iter().chain(self.local.iter())
    }

    #[inline]
    pub fn keeps_magazines(&self) -> bool {
        self.serving.load(Ordering::Relaxed)
    }

    pub fn set_failed(&self) {
        self.serving.store(false, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_thread_takes_the_primary_slot_and_every_other_thread_its_own() {
        let slots = Slots::new(Some(crate::cache::magazine::MAGAZINE_DEPTH));
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
        let slots = Slots::new(Some(crate::cache::magazine::MAGAZINE_DEPTH));
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
}
