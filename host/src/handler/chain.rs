//! The chain behind a handler's lock: the top link (which owns the rest), the failure
//! that stopped it, and the slow paths of the thread caches that need the policy.
//!
//! The slow paths take the books locked ([`Books`]): a thread cache is reached only
//! through them, and a cache guard borrows them, so no policy is called while a cache
//! is held.

use std::collections::HashSet;
use std::sync::Arc;

use crate::clock::Deadline;
use crate::error::Error;
use crate::link::{Link, Upstream};
use crate::memhandler::Stats;
use crate::system::SystemMemory;
use allocbox_ledger::cache::{self, Locked, Mine, Unreachable};

pub(super) struct Chain {
    pub(super) head: Link,
    /// Every thread's counters folded so far.
    pub(super) stats: Stats,
    /// What was served under the lock while no magazines are kept (a handler that never
    /// keeps them, or one whose chain failed): counted here rather than in the calling
    /// thread's cache, which such a handler does not need. Folded after the threads'
    /// counters, which only count before it, so one thread's peak stays exact.
    pub(super) counts: cache::Counts,
    /// The first failure anywhere in the chain; from then on new requests go to the
    /// fallback or fail.
    pub(super) failure: Option<Arc<Error>>,
    /// Blocks the fallback handler served on this handler's behalf.
    pub(super) rerouted: HashSet<u64>,
}

/// The chain, locked, with the way to every thread cache.
pub(super) type Books<'l> = Locked<'l, Chain>;

impl Chain {
    /// Every link, top first.
    pub(super) fn links(&self) -> impl Iterator<Item = &Link> {
        std::iter::successors(Some(&self.head), |l| match l.upstream() {
            Upstream::Policy(next) => Some(&**next),
            Upstream::System(_) => None,
        })
    }

    /// Call `f` on every link, top first.
    pub(super) fn each_link_mut(&mut self, mut f: impl FnMut(&mut Link)) {
        let mut link = &mut self.head;
        loop {
            f(link);
            match &mut link.store.data_mut().upstream {
                Upstream::Policy(next) => link = next,
                Upstream::System(_) => return,
            }
        }
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

    /// Give a block back to the top policy.
    pub(super) fn give_back(
        &mut self,
        deadline: &mut Deadline,
        addr: u64,
        size: u64,
    ) -> Result<u64, Error> {
        self.head.free(deadline, addr, size).map(|()| 0)
    }
}

impl cache::Books for Chain {
    fn thread_ended(c: &mut Books<'_>, cached: Vec<(u64, Vec<u64>)>, lent: Vec<u64>) {
        for addr in lent {
            let found = c.head.lent_mut().set_cache(addr, None);
            debug_assert!(found, "a cache lends only blocks on the books");
        }
        // A thread's end is a call of the embedder's of its own.
        let deadline = &mut c.head.client_call();
        let answer = give_back_cached(c, deadline, cached);
        // A failure stops the chain for every thread; this one is ending.
        let _ = settle(c, answer);
    }
}

/// A thread cache that cannot be reached, as the handler's error.
pub(super) fn unreachable(c: &Books<'_>, reason: Unreachable) -> Error {
    Error::Unreachable {
        handler: c.head.name().clone(),
        reason,
    }
}

/// Finish a call into the chain: act on its failure, or on one deep down that the
/// head's guest saw as "none" and that travelled up beside the answer. A failure empties
/// every cache.
#[inline]
pub(super) fn settle(c: &mut Books<'_>, answer: Result<u64, Error>) -> Result<u64, Error> {
    let below = c.head.take_unreported();
    if below.is_none() && answer.is_ok() {
        return answer;
    }
    settle_failure(c, answer, below)
}

#[cold]
#[inline(never)]
fn settle_failure(
    c: &mut Books<'_>,
    answer: Result<u64, Error>,
    below: Option<Arc<Error>>,
) -> Result<u64, Error> {
    match (answer, below) {
        // A failure below happened first: the call's own failure, if any, came after it
        // (a guest that could not cope with "none", or ran out of the same time).
        (Err(_), Some(cause)) => {
            fail(c, cause.clone());
            Err((*cause).clone())
        }
        (Err(e), None) => {
            fail(c, Arc::new(e.clone()));
            Err(e)
        }
        (Ok(addr), None) => Ok(addr),
        (Ok(addr), Some(cause)) => {
            fail(c, cause.clone());
            // A block that was served is good; "none" caused by the failure is not an
            // answer, the failure is.
            match addr {
                0 => Err((*cause).clone()),
                _ => Ok(addr),
            }
        }
    }
}

pub(super) fn fail(c: &mut Books<'_>, cause: Arc<Error>) {
    if c.failure.is_none() {
        c.failure = Some(cause);
        c.stop_serving();
        let Chain { head, failure, .. } = &mut **c;
        head.retire(failure.as_ref().expect("just set"));
        // Every link is stopped: the magazines go back onto their books with no guest
        // called, so no deadline is needed.
        let _ = flush_magazines(c, &mut Deadline::passed());
    }
}

/// Fill `mine`'s empty magazine of `size` from the top policy and lend the client one
/// block of it.
/// Which way a block went between the client and the top policy: through a magazine
/// (the policy was not asked), or through the policy itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Via {
    Magazine,
    Policy,
}

pub(super) fn refill(
    c: &mut Books<'_>,
    deadline: &mut Deadline,
    mine: &mut Mine<'_>,
    size: u64,
) -> Result<(u64, Via), Error> {
    let count = {
        let mut t = c.own(mine);
        let magazines = t.magazines.as_mut().expect("the handler keeps magazines");
        let count = magazines.of_size(size).refill_count(size);
        let room = cache::MAGAZINES_THREAD_BYTES.saturating_sub(magazines.cached_bytes);
        // Past this thread's cap on cached bytes, the policy serves it.
        (room >= size * u64::from(count)).then_some(count)
    };
    let Some(count) = count else {
        return c
            .head
            .malloc(deadline, size)
            .map(|addr| (addr, Via::Policy));
    };
    let mut blocks = c.head.malloc_many(deadline, size, count)?;
    let Some(first) = blocks.pop() else {
        // The policy placed nothing in bulk; ask once the ordinary way.
        return c
            .head
            .malloc(deadline, size)
            .map(|addr| (addr, Via::Policy));
    };
    for &addr in blocks.iter().chain([&first]) {
        let named = c.head.lent_mut().set_cache(addr, Some(mine.id()));
        assert!(named, "just admitted");
    }
    let mut t = c.own(mine);
    t.lent.insert(first, size);
    let magazines = t.magazines.as_mut().expect("checked above");
    magazines.cached_bytes += size * blocks.len() as u64;
    magazines.of_size(size).blocks.extend(blocks);
    Ok((first, Via::Magazine))
}

/// Put a block the client gave back into `mine`'s magazine, spilling half of a full
/// magazine to the policy first; past the thread's byte cap the policy takes it.
pub(super) fn shelve(
    c: &mut Books<'_>,
    deadline: &mut Deadline,
    mine: &mut Mine<'_>,
    addr: u64,
    size: u64,
) -> Result<Via, Error> {
    let spill = {
        let mut t = c.own(mine);
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
        && let Err(e) = c.head.free_many(deadline, spill, size)
    {
        // The client gave this block up; off the books of the now dead link.
        let _ = c.head.free(deadline, addr, size);
        return Err(e);
    }
    if c.own(mine).keep(addr, size) {
        let named = c.head.lent_mut().set_cache(addr, Some(mine.id()));
        assert!(named, "the caller found it");
        return Ok(Via::Magazine);
    }
    c.give_back(deadline, addr, size).map(|_| Via::Policy)
}

/// Hand every thread's cached blocks back to the top policy.
pub(super) fn flush_magazines(c: &mut Books<'_>, deadline: &mut Deadline) -> Result<u64, Error> {
    let mut first_error = None;
    for slot in c.slots() {
        let drained = c
            .claim(slot)
            .map(|mut cache| cache.magazines.as_mut().map(cache::Magazines::drain));
        let drained = match drained {
            Ok(drained) => drained.unwrap_or_default(),
            Err(reason) => {
                first_error.get_or_insert(unreachable(c, reason));
                continue;
            }
        };
        if let Err(e) = give_back_cached(c, deadline, drained) {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(0), Err)
}

/// Give blocks a thread cache held back to the top policy, `(size, blocks)`.
fn give_back_cached(
    c: &mut Books<'_>,
    deadline: &mut Deadline,
    cached: Vec<(u64, Vec<u64>)>,
) -> Result<u64, Error> {
    let mut first_error = None;
    for (size, blocks) in cached {
        if let Err(e) = c.head.free_many(deadline, blocks, size) {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(0), Err)
}
