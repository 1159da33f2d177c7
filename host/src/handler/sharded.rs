//! One chain per thread, for policies whose state is per instance (0.2.0 `sharding`):
//! threads that each have their own instance never wait for one another's calls.
//!
//! Each shard is a whole [`Handler`] (its chain, its ledger, its own upstream), started
//! the first time a thread is given it, up to a fixed number; from then on threads
//! share them in turn. The limits are the handler's in all: each shard gets an even
//! share of the overhead budget, of the host memory and of the linear memory.
//!
//! A block always goes back to the shard that lent it. Each shard keeps a table of the
//! blocks it lent the client (address to size), on cache lines of its own, so that a
//! thread that frees its own blocks touches nothing another thread writes; a free
//! looks in the calling thread's shard's table first, then in the others. A free from
//! a thread of another shard (or of none: a thread that only frees is given none) is
//! queued for that shard and given back at its next call, when a thread that uses the
//! handler ends, when the queue grows past [`QUEUED_AT_MOST`] (by the thread that fills
//! it), or before anything reads the shards' state (statistics, trim, the leak check).
//! The queued block is the client's no more: its entry leaves the table at once, so a
//! second free of it is refused as a double free (its shard still has it lent).
//!
//! The handler takes part in a fork before its shards do: see [`forking`].

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use allocbox_ledger::cache::Unreachable;
use allocbox_ledger::platform::fork;

use super::{Handler, HandlerBuilder};
use crate::error::{ClientError, Error, LoadError};
use crate::memhandler::{MemHandler, Stats};

/// Frees queued for one shard before the thread that queues the next one gives them
/// back itself: a shard whose threads have stopped calling holds at most this many.
const QUEUED_AT_MOST: usize = 256;

/// A handler whose policies may run as one instance per thread: see the module doc.
/// Built by [`HandlerBuilder::build_sharded`].
pub struct ShardedHandler {
    shared: Arc<Shared>,
}

struct Shared {
    /// Shard 0 is started with the handler; the others when a thread is first given
    /// them. A shard that could not start stays empty and its threads use shard 0.
    shards: Box<[OnceLock<Option<Handler>>]>,
    /// Starts the shards after the first: the same chain and configuration, each with
    /// its share of the limits.
    builder: HandlerBuilder,
    /// The next shard to give a thread, round robin.
    next_seat: AtomicUsize,
    /// The blocks each shard lent the client, and their sizes.
    lent: Box<[Padded<Mutex<Lent>>]>,
    /// Frees of each shard's blocks from other shards' threads, `(address, size said)`.
    queued: Box<[Padded<Queue>]>,
    /// Threads inside the start of each shard (or waiting for it): a forked child
    /// whose parent was starting a shard never waits for that start ([`fork`]).
    starting: Box<[AtomicUsize]>,
    /// Set in a forked child for each shard whose start its parent was in: the
    /// child's threads given that shard use shard 0.
    start_forked_away: Box<[AtomicBool]>,
    /// Set in a forked child when the fork came while another thread held one of the
    /// locks above: the child never takes them, and every call is refused.
    forked_mid_call: AtomicBool,
    /// How long a fork waits for other threads to let the locks go.
    fork_patience: Duration,
}

/// The blocks one shard lent the client: address to size.
type Lent = HashMap<u64, u64, foldhash::fast::FixedState>;

/// A value on cache lines of its own: one shard's table is written by its thread alone,
/// and a neighbour's writes must not take the line from it (128: two lines, as the
/// adjacent-line prefetcher of x86 fetches them in pairs).
#[derive(Default)]
#[repr(align(128))]
struct Padded<T>(T);

/// Frees queued for one shard: `(address, size said)`.
type QueuedFrees = Vec<(u64, Option<u64>)>;

#[derive(Default)]
struct Queue {
    frees: Mutex<QueuedFrees>,
    /// Something is queued: read on every call, so the lock is taken only then.
    pending: AtomicBool,
    /// Held while frees taken from the queue are given back, so that a read of the
    /// shards waits for frees another thread (one ending, say) is giving back.
    giving_back: Mutex<()>,
}

impl std::fmt::Debug for ShardedHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedHandler")
            .field("policies", &self.shard(0).policy_names())
            .field("shards", &self.started().count())
            .finish_non_exhaustive()
    }
}

impl HandlerBuilder {
    /// A handler that starts one chain per thread that calls it, up to `most` chains
    /// (then threads share them), when every policy of the chain says its state is per
    /// instance (0.2.0 `sharding`); one chain otherwise. Every shard keeps no
    /// magazines: each request is its own instance's call. The limits are the
    /// handler's in all, shared evenly by the `most` chains; where a share of the
    /// guest memory is too small for the chain to start in, fewer chains are started,
    /// each with a larger share (down to one with all of it): [`Self::shard_count`]
    /// says how many.
    pub fn build_sharded(self, most: usize) -> Result<ShardedHandler, LoadError> {
        let mut most = most.max(1);
        loop {
            match self.clone().build_shards(most) {
                Err(LoadError::Start(error))
                    if most > 1 && matches!(*error, Error::MemoryLimit { .. }) =>
                {
                    most /= 2;
                }
                built => return built,
            }
        }
    }

    fn build_shards(self, most: usize) -> Result<ShardedHandler, LoadError> {
        let share = |total: u64| (total / most as u64).max(1);
        let mut limits = self.limits.clone();
        limits.overhead = share(limits.overhead);
        limits.memory = share(limits.memory);
        let host_memory_limit = share(self.host_memory_limit);
        let builder = self
            .limits(limits)
            .host_memory_limit(host_memory_limit)
            .magazines(false);
        let first = builder.clone().build()?;
        let count = if first.shardable() { most } else { 1 };
        let shards: Box<[OnceLock<Option<Handler>>]> =
            (0..count).map(|_| OnceLock::new()).collect();
        let _ = shards[0].set(Some(first));
        let fork_patience = builder.fork_patience();
        let shared = Arc::new(Shared {
            shards,
            builder,
            next_seat: AtomicUsize::new(0),
            lent: (0..count).map(|_| Padded::default()).collect(),
            queued: (0..count).map(|_| Padded::default()).collect(),
            starting: (0..count).map(|_| AtomicUsize::new(0)).collect(),
            start_forked_away: (0..count).map(|_| AtomicBool::new(false)).collect(),
            forked_mid_call: AtomicBool::new(false),
            fork_patience,
        });
        fork::register_outer(Arc::downgrade(&shared) as std::sync::Weak<dyn fork::Forkable>);
        Ok(ShardedHandler { shared })
    }
}

impl ShardedHandler {
    /// The shards the handler may start: 1 when a policy of the chain is not
    /// shardable.
    pub fn shard_count(&self) -> usize {
        self.shared.shards.len()
    }

    /// The handlers of the shards started so far, shard 0 first.
    pub fn started(&self) -> impl Iterator<Item = &Handler> {
        self.shared.started()
    }

    /// The handler's name: its chain's, as [`Handler::name`].
    pub fn name(&self) -> &str {
        self.shard(0).name()
    }

    fn shard(&self, index: usize) -> &Handler {
        self.shared.shard(index)
    }

    /// A block of at least `size` bytes from the calling thread's shard.
    pub fn malloc(&self, size: usize) -> Result<Option<NonNull<u8>>, Error> {
        self.lend(size as u64, |h| h.malloc(size))
    }

    /// A zero-filled block from the calling thread's shard.
    pub fn calloc(&self, nelem: usize, elsize: usize) -> Result<Option<NonNull<u8>>, Error> {
        let size = (nelem as u64).saturating_mul(elsize as u64);
        self.lend(size, |h| h.calloc(nelem, elsize))
    }

    fn lend(
        &self,
        size: u64,
        ask: impl FnOnce(&Handler) -> Result<Option<NonNull<u8>>, Error>,
    ) -> Result<Option<NonNull<u8>>, Error> {
        self.reachable()?;
        let index = self.shared.seat();
        self.shared.give_back_queued(index);
        let block = ask(self.shard(index))?;
        if let Some(block) = block {
            self.shared.lent_by(block, index, size.max(1));
        }
        Ok(block)
    }

    /// Resize a block, by the shard that lent it; `None` acts as `malloc`.
    pub fn realloc(
        &self,
        ptr: Option<NonNull<u8>>,
        new_size: usize,
    ) -> Result<Option<NonNull<u8>>, Error> {
        let Some(ptr) = ptr else {
            return self.malloc(new_size);
        };
        self.reachable()?;
        let Some((index, size)) = self
            .shared
            .take_lent(ptr, self.shared.existing_seat().unwrap_or(0))
        else {
            if self.queued(ptr) {
                let addr = ptr.as_ptr() as u64;
                return Err(ClientError::UnknownRealloc { addr }.into());
            }
            // Not lent by any shard: shard 0 names the client's mistake.
            return self.shard(0).realloc(Some(ptr), new_size);
        };
        match self.shard(index).realloc(Some(ptr), new_size) {
            Ok(Some(moved)) => {
                self.shared.lent_by(moved, index, (new_size as u64).max(1));
                Ok(Some(moved))
            }
            // The old block is still live and unchanged.
            other => {
                self.shared.lent_by(ptr, index, size);
                other
            }
        }
    }

    /// Give back a block, to the shard that lent it: at once from a thread of that
    /// shard, else queued for it. A wrong size is corrected by that shard, as
    /// [`Handler::free`] does.
    pub fn free(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<(), Error> {
        match ptr {
            Some(ptr) => self.give_back(ptr, Some(size as u64)).map(drop),
            None => Ok(()),
        }
    }

    /// Give back a block whose client does not say its size; returns the size it was
    /// lent with.
    pub fn free_unsized(&self, ptr: NonNull<u8>) -> Result<usize, Error> {
        self.give_back(ptr, None).map(|size| size as usize)
    }

    fn give_back(&self, ptr: NonNull<u8>, said: Option<u64>) -> Result<u64, Error> {
        self.reachable()?;
        // A thread that has no instance (it only frees: a collector's thread) is
        // given none for this: its frees are queued as every other thread's are.
        let mine = self.shared.existing_seat();
        let Some((owner, size)) = self.shared.take_lent(ptr, mine.unwrap_or(0)) else {
            if self.queued(ptr) {
                let addr = ptr.as_ptr() as u64;
                return Err(ClientError::DoubleFree { addr }.into());
            }
            // Not lent by any shard: shard 0 names the client's mistake.
            return self.shard(0).give_back(ptr, said);
        };
        if mine != Some(owner) {
            self.shared.queue(owner, ptr.as_ptr() as u64, said);
            return Ok(size);
        }
        self.shared.give_back_queued(owner);
        self.shard(owner).give_back(ptr, said).map(|_| size)
    }

    /// Is `ptr` a block the client gave back that waits to go back to its shard (or is
    /// going back now)? Its shard still has it lent; the table of the client's blocks
    /// does not.
    #[cold]
    fn queued(&self, ptr: NonNull<u8>) -> bool {
        self.started().any(|shard| shard.block_size(ptr).is_some())
    }

    /// Refuse every call in a forked child whose parent had another thread holding
    /// the handler's own locks: the child has no such thread to let them go.
    fn reachable(&self) -> Result<(), Error> {
        match self.shared.forked_mid_call.load(Ordering::Relaxed) {
            false => Ok(()),
            true => Err(self.shard(0).unreachable(Unreachable::ForkedMidCall)),
        }
    }
}

impl Shared {
    fn started(&self) -> impl Iterator<Item = &Handler> {
        self.shards.iter().filter_map(|s| s.get()?.as_ref())
    }

    fn shard(&self, index: usize) -> &Handler {
        match self.shards[index].get() {
            Some(Some(shard)) => shard,
            _ => self.shards[0]
                .get()
                .and_then(Option::as_ref)
                .expect("shard 0 starts with the handler"),
        }
    }

    /// The calling thread's shard, started if it is the first to be given it.
    #[inline]
    fn seat(self: &Arc<Self>) -> usize {
        match self.shards.len() {
            1 => 0,
            _ => exit::seat(self).unwrap_or_else(|| self.first_seat()),
        }
    }

    /// The calling thread's shard, if it was given one.
    #[inline]
    fn existing_seat(self: &Arc<Self>) -> Option<usize> {
        match self.shards.len() {
            1 => Some(0),
            _ => exit::seat(self),
        }
    }

    #[cold]
    fn first_seat(self: &Arc<Self>) -> usize {
        let index = self.next_seat.fetch_add(1, Ordering::Relaxed) % self.shards.len();
        // A shard that cannot start (the instance pool is full, its share of the
        // limits too small for `init`, its start left half-done by a fork) leaves its
        // threads on shard 0.
        let index = match self.start(index) {
            true => index,
            false => 0,
        };
        exit::remember(self, index);
        index
    }

    /// Start shard `index` unless it is started; whether it runs.
    fn start(&self, index: usize) -> bool {
        if self.start_forked_away[index].load(Ordering::Relaxed) {
            return false;
        }
        self.starting[index].fetch_add(1, Ordering::AcqRel);
        let started = self.shards[index].get_or_init(|| self.builder.clone().build().ok());
        self.starting[index].fetch_sub(1, Ordering::AcqRel);
        started.is_some()
    }

    fn lent_by(&self, block: NonNull<u8>, shard: usize, size: u64) {
        locked(&self.lent[shard].0).insert(block.as_ptr() as u64, size);
    }

    /// Take `block` out of the table of the shard that lent it: shard `first` (the
    /// calling thread's: its own blocks, the common case), then every other.
    fn take_lent(&self, block: NonNull<u8>, first: usize) -> Option<(usize, u64)> {
        let addr = block.as_ptr() as u64;
        let order = std::iter::once(first).chain((0..self.lent.len()).filter(|&s| s != first));
        for shard in order {
            if let Some(size) = locked(&self.lent[shard].0).remove(&addr) {
                return Some((shard, size));
            }
        }
        None
    }

    /// Queue a free for shard `owner`; past [`QUEUED_AT_MOST`], give them back now.
    fn queue(&self, owner: usize, addr: u64, said: Option<u64>) {
        let queue = &self.queued[owner].0;
        let full = {
            let mut frees = locked(&queue.frees);
            frees.push((addr, said));
            queue.pending.store(true, Ordering::Release);
            frees.len() >= QUEUED_AT_MOST
        };
        if full {
            self.give_back_queued(owner);
        }
    }

    /// Give shard `index` the frees queued for it.
    #[inline]
    fn give_back_queued(&self, index: usize) {
        if self.queued[index].0.pending.load(Ordering::Acquire) {
            self.give_back_queued_now(index);
        }
    }

    #[cold]
    fn give_back_queued_now(&self, index: usize) {
        let queue = &self.queued[index].0;
        let _giving_back = locked(&queue.giving_back);
        let frees = {
            let mut frees = locked(&queue.frees);
            queue.pending.store(false, Ordering::Release);
            std::mem::take(&mut *frees)
        };
        let shard = self.shard(index);
        for (addr, said) in frees {
            let block = NonNull::new(addr as usize as *mut u8).expect("a lent block");
            // The client's part was checked when it was queued (the block was lent, by
            // this shard); a failure of the policy's stops this shard's chain, and the
            // shard's `failure` names it.
            let _ = shard.give_back(block, said);
        }
    }

    /// Give every shard its queued frees, and wait for those other threads are giving
    /// back: what is read next counts every free the client made. Nothing in a forked
    /// child whose parent's threads held the locks.
    fn give_back_all_queued(&self) {
        if self.forked_mid_call.load(Ordering::Relaxed) {
            return;
        }
        (0..self.queued.len()).for_each(|index| self.give_back_queued_now(index));
    }
}

/// A lock of the handler's own. Standard mutexes rather than parking_lot's: a forked
/// child lets go of the locks the fork took, and a standard unlock is one futex word,
/// where parking_lot's may visit its process-wide table of parked threads, whose locks
/// a thread that is not in the child may hold. Poisoning is ignored: each is held for
/// one insert, remove, push or take, which leaves its table or queue whole.
fn locked<T>(lock: &Mutex<T>) -> MutexGuard<'_, T> {
    lock.lock().unwrap_or_else(PoisonError::into_inner)
}

impl MemHandler for ShardedHandler {
    fn name(&self) -> &str {
        ShardedHandler::name(self)
    }
    fn version(&self) -> u8 {
        self.shard(0).info().version
    }
    fn alignment(&self) -> u64 {
        self.shard(0).info().alignment
    }
    fn malloc(&self, size: usize) -> Result<Option<NonNull<u8>>, Error> {
        ShardedHandler::malloc(self, size)
    }
    fn calloc(&self, nelem: usize, elsize: usize) -> Result<Option<NonNull<u8>>, Error> {
        ShardedHandler::calloc(self, nelem, elsize)
    }
    fn realloc(
        &self,
        ptr: Option<NonNull<u8>>,
        new_size: usize,
    ) -> Result<Option<NonNull<u8>>, Error> {
        ShardedHandler::realloc(self, ptr, new_size)
    }
    fn free(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<(), Error> {
        ShardedHandler::free(self, ptr, size)
    }
    fn free_unsized(&self, ptr: NonNull<u8>) -> Result<usize, Error> {
        ShardedHandler::free_unsized(self, ptr)
    }
    fn stats(&self) -> Result<Stats, Error> {
        ShardedHandler::stats(self)
    }
    fn usable(&self) -> Result<(), Error> {
        self.started().try_for_each(MemHandler::usable)
    }
}

mod exit;
mod forking;
mod inspect;
