//! Every thread's cache of one handler, and how a thread finds its own.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use super::magazine::Magazines;
use super::slot::{Mine, Slot};
use super::thread::ThreadCache;
use crate::by_thread::ByThread;
use crate::ledger::CacheId;
use crate::platform::barrier;

/// Every thread's cache of one handler.
///
/// A thread finds its slot by its thread pointer (the first [`crate::by_thread::NAMED`]
/// threads to call the handler) or through a thread-local lookup, which in a shared
/// library is the larger part of a magazine hit's cost.
#[derive(Debug)]
pub struct Slots {
    slots: ByThread<Slot>,
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
            slots: ByThread::default(),
            next_id: AtomicU32::new(1),
            magazines,
            serving: AtomicBool::new(magazines.is_some()),
        }
    }

    /// The calling thread's cache, made on its first call.
    #[inline]
    pub fn mine(&self) -> Mine<'_> {
        Mine::of(self.slots.get_or(|| self.new_slot()))
    }

    /// The calling thread's slot when it found it by its thread pointer: a few loads,
    /// no call.
    #[inline(always)]
    pub fn mine_by_pointer(&self) -> Option<Mine<'_>> {
        self.slots.named().map(Mine::of)
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
        self.slots.get()
    }

    /// The slot named `id` (a ledger entry's holder).
    pub(super) fn named(&self, id: CacheId) -> &Slot {
        self.iter()
            .find(|s| s.id == id)
            .expect("a ledger names only caches that exist")
    }

    pub fn iter(&self) -> impl Iterator<Item = &Slot> {
        self.slots.iter()
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
    use crate::platform::thread_pointer;

    #[test]
    fn every_thread_finds_its_own_slot_by_its_pointer_and_every_slot_is_reachable() {
        let slots = Slots::new(Some(crate::cache::magazine::MAGAZINE_DEPTH));
        let first = slots.mine().id();
        assert_eq!(slots.mine().id(), first, "found again, not made again");
        // Threads arriving together each get a slot of their own.
        let start = std::sync::Barrier::new(4);
        let mut ids: Vec<CacheId> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        let id = slots.mine().id();
                        assert_eq!(slots.mine().id(), id);
                        if thread_pointer().is_some() {
                            assert_eq!(slots.mine_by_pointer().map(|m| m.id()), Some(id));
                        }
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
}
