//! The chain behind a handler's lock: the top link (which owns the rest), the failure
//! that stopped it, and the slow paths of the thread caches that need the policy.

use std::collections::HashSet;
use std::sync::Arc;

use crate::error::Error;
use crate::link::{Link, Upstream};
use crate::memhandler::Stats;
use crate::system::SystemMemory;
use allocbox_ledger::cache::{self, Mine, Slots};

pub(super) struct Chain {
    pub(super) head: Link,
    /// Every thread's counters folded so far.
    pub(super) stats: Stats,
    /// The first failure anywhere in the chain; from then on new requests go to the
    /// fallback or fail.
    pub(super) failure: Option<Arc<Error>>,
    /// Blocks the fallback handler served on this handler's behalf.
    pub(super) rerouted: HashSet<u64>,
}

impl Chain {
    /// Every link, top first.
    pub(super) fn links(&self) -> impl Iterator<Item = &Link> {
        std::iter::successors(Some(&self.head), |l| match l.upstream() {
            Upstream::Policy(next) => Some(&**next),
            Upstream::System(_) => None,
        })
    }

    /// The host's own memory under the chain.
    pub(super) fn bottom(&self) -> &SystemMemory {
        let mut link = &self.head;
        loop {
            match link.upstream() {
                Upstream::System(s) => return s,
                Upstream::Policy(next) => link = next,
            }
        }
    }

    /// Finish a call into the chain: act on its failure, or on one deep down that the
    /// head's guest saw as "none" and that travelled up beside the answer. The caller
    /// holds no thread cache: a failure empties every cache.
    #[inline]
    pub(super) fn settle(
        &mut self,
        slots: &Slots,
        answer: Result<u64, Error>,
    ) -> Result<u64, Error> {
        let below = self.head.take_unreported();
        if below.is_none() && answer.is_ok() {
            return answer;
        }
        self.settle_failure(slots, answer, below)
    }

    #[cold]
    #[inline(never)]
    fn settle_failure(
        &mut self,
        slots: &Slots,
        answer: Result<u64, Error>,
        below: Option<Arc<Error>>,
    ) -> Result<u64, Error> {
        match (answer, below) {
            // A failure below happened first: the call's own failure, if any, came after
            // it (a guest that could not cope with "none", or ran out of the same time).
            (Err(_), Some(cause)) => {
                self.fail(slots, cause.clone());
                Err((*cause).clone())
            }
            (Err(e), None) => {
                self.fail(slots, Arc::new(e.clone()));
                Err(e)
            }
            (Ok(addr), None) => Ok(addr),
            (Ok(addr), Some(cause)) => {
                self.fail(slots, cause.clone());
                // A block that was served is good; "none" caused by the failure is not
                // an answer, the failure is.
                match addr {
                    0 => Err((*cause).clone()),
                    _ => Ok(addr),
                }
            }
        }
    }

    pub(super) fn fail(&mut self, slots: &Slots, cause: Arc<Error>) {
        if self.failure.is_none() {
            self.failure = Some(cause);
            slots.set_failed();
            let _ = self.flush_magazines(slots);
            self.head.retire(self.failure.as_ref().expect("just set"));
        }
    }

    /// Fill `slot`'s empty magazine of `size` from the top policy and lend the client
    /// one block of it. No policy is called while the cache is held.
    pub(super) fn refill(&mut self, slot: &Mine<'_>, size: u64) -> Result<u64, Error> {
        let count = {
            let mut t = slot.cache();
            let magazines = t.magazines.as_mut().expect("the handler keeps magazines");
            let count = magazines.of_size(size).refill_count(size);
            let room = cache::MAGAZINES_THREAD_BYTES.saturating_sub(magazines.cached_bytes);
            if room < size * u64::from(count) {
                // This thread's magazines are as full as allowed: the policy serves it.
                return self.head.malloc(size);
            }
            count
        };
        let mut blocks = self.head.malloc_many(size, count)?;
        let Some(first) = blocks.pop() else {
            // The policy placed nothing in bulk; ask once the ordinary way.
            return self.head.malloc(size);
        };
        for &addr in blocks.iter().chain([&first]) {
            let named = self.head.lent_mut().set_cache(addr, Some(slot.id()));
            assert!(named, "just admitted");
        }
        let mut t = slot.cache();
        t.lent.insert(first, size);
        let magazines = t.magazines.as_mut().expect("checked above");
        magazines.cached_bytes += size * blocks.len() as u64;
        magazines.of_size(size).blocks.extend(blocks);
        Ok(first)
    }

    /// Put a block the client gave back into `slot`'s magazine, spilling half of a full
    /// magazine to the policy first; past the thread's byte cap the policy takes it. No
    /// policy is called while the cache is held.
    pub(super) fn shelve(
        &mut self,
        slots: &Slots,
        slot: &Mine<'_>,
        addr: u64,
        size: u64,
    ) -> Result<u64, Error> {
        if !slots.keeps_magazines() {
            return self.give_back(addr, size);
        }
        let spill = {
            let mut t = slot.cache();
            let magazines = t.magazines.as_mut().expect("the handler keeps magazines");
            let magazine = magazines.of_size(size);
            let spill: Vec<u64> = match magazine.blocks.len() >= magazine.depth {
                true => magazine.blocks.drain(magazine.depth / 2..).collect(),
                false => Vec::new(),
            };
            magazines.cached_bytes -= size * spill.len() as u64;
            spill
        };
        if !spill.is_empty()
            && let Err(e) = self.head.free_many(spill, size)
        {
            // The client gave this block up; off the books of the now dead link.
            let _ = self.head.free(addr, size);
            return Err(e);
        }
        if slot.cache().keep(addr, size) {
            let named = self.head.lent_mut().set_cache(addr, Some(slot.id()));
            assert!(named, "the caller found it");
            return Ok(0);
        }
        self.give_back(addr, size)
    }

    /// Give a block back to the top policy.
    pub(super) fn give_back(&mut self, addr: u64, size: u64) -> Result<u64, Error> {
        self.head.free(addr, size).map(|()| 0)
    }

    /// Hand every thread's cached blocks back to the top policy.
    pub(super) fn flush_magazines(&mut self, slots: &Slots) -> Result<u64, Error> {
        let mut first_error = None;
        for slot in slots.iter() {
            let drained = match &mut slot.claim().magazines {
                Some(magazines) => magazines.drain(),
                None => continue,
            };
            for (size, blocks) in drained {
                if let Err(e) = self.head.free_many(blocks, size) {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(0), Err)
    }
}
