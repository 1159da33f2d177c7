//! A handler per thread in a process that forks. Its own locks are held across calls
//! into its shards (a queue's `giving_back` while the frees go back), so the fork takes
//! them first, while the shards still let threads in, and lets them go after the
//! shards do (`fork::register_outer`): the forking thread waits, within the handler's
//! patience, until no other thread holds one, and keeps them out until the fork is
//! done. The shards take part in the fork as every handler does.
//!
//! In the child, whose only thread is the forking one:
//! - the tables and queues are whole (no thread was inside one), and the queued frees
//!   go back as ever: at their shard's next call or a read of the statistics;
//! - a shard whose start a thread of the parent was in is never waited for: that
//!   thread is not there to finish it, and the child's threads given it use shard 0;
//! - if some lock stayed held past the patience, its holder is a thread the child
//!   lacks: the child refuses every call of the handler
//!   ([`Unreachable::ForkedMidCall`](allocbox_ledger::cache::Unreachable)) rather
//!   than wait on it for ever.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use allocbox_ledger::platform::fork::{self, AfterFork, Forkable};

use super::{Lent, QueuedFrees, Shared};

/// The handler's locks, held across a fork. Fields drop in order: the guards, which
/// borrow from `shared`, before it; the tables' before the queues' (taken after them).
struct ForkHeld {
    // Held for their drop.
    _lent: Vec<MutexGuard<'static, Lent>>,
    _frees: Vec<MutexGuard<'static, QueuedFrees>>,
    _giving_back: Vec<MutexGuard<'static, ()>>,
    /// Every lock was taken within the patience.
    complete: bool,
    shared: Arc<Shared>,
}

impl Forkable for Shared {
    fn before_fork(self: Arc<Self>) -> Box<dyn AfterFork> {
        let give_up = Instant::now() + self.fork_patience;
        // Outer before inner, as every thread takes them: a queue's `giving_back`,
        // then its frees; a table alone.
        let giving_back = within(self.queued.iter().map(|q| &q.0.giving_back), give_up);
        let frees = within(self.queued.iter().map(|q| &q.0.frees), give_up);
        let lent = within(self.lent.iter().map(|l| &l.0), give_up);
        let complete = [giving_back.len(), frees.len()] == [self.queued.len(); 2]
            && lent.len() == self.lent.len();
        // SAFETY: the guards borrow from `*self`, which `ForkHeld::shared` keeps alive;
        // `ForkHeld`'s fields drop in declaration order, the guards before that `Arc`,
        // and the guards never leave it.
        let held = unsafe {
            ForkHeld {
                _lent: extend(lent),
                _frees: extend(frees),
                _giving_back: extend(giving_back),
                complete,
                shared: self,
            }
        };
        Box::new(held)
    }
}

impl AfterFork for ForkHeld {
    fn after_fork(self: Box<Self>, in_child: bool) {
        if in_child {
            let shared = &self.shared;
            // Whoever was starting a shard is the parent's: the start never ends here.
            for (starting, away) in shared.starting.iter().zip(&shared.start_forked_away) {
                if starting.load(Ordering::Acquire) > 0 {
                    away.store(true, Ordering::Relaxed);
                }
            }
            if !self.complete {
                // Refuse before anything is let go: the child's only thread is this
                // one, so no call can start in between.
                shared.forked_mid_call.store(true, Ordering::Relaxed);
            }
        }
        // Dropped here: the locks are let go, in the parent to its waiting threads, in
        // the child to nobody (a standard mutex's unlock wakes a futex, harmless where
        // its waiters do not exist).
    }
}

/// Every lock of `locks` in turn, each waited for until `give_up`; stops at the first
/// that is not let go by then.
fn within<'a, T: 'a>(
    locks: impl Iterator<Item = &'a Mutex<T>>,
    give_up: Instant,
) -> Vec<MutexGuard<'a, T>> {
    locks
        .map_while(|lock| fork::lock_before(lock, give_up))
        .collect()
}

/// The guards with their borrow widened to `'static`.
///
/// # Safety
/// The caller keeps every lock they borrow alive until the guards are dropped.
unsafe fn extend<T>(guards: Vec<MutexGuard<'_, T>>) -> Vec<MutexGuard<'static, T>> {
    // SAFETY: the same type with another lifetime; the caller's contract keeps the
    // borrow valid for as long as the guards live.
    unsafe { std::mem::transmute::<Vec<MutexGuard<'_, T>>, Vec<MutexGuard<'static, T>>>(guards) }
}

#[cfg(test)]
mod tests {
    use std::sync::Barrier;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    use allocbox_ledger::platform::fork::Forkable;

    use super::super::{ShardedHandler, locked};
    use crate::Limits;
    use crate::handler::{HandlerBuilder, PolicyHandler};
    use crate::runtime::Runtime;

    /// `size-classes`, a chain per thread up to `most`, with a short call limit: a fork
    /// waits the limit and a second for the handler's locks.
    fn sharded(most: usize) -> ShardedHandler {
        let runtime = Runtime::shared();
        let policy = runtime
            .load_file(allocbox_artifacts::SIZE_CLASSES.path())
            .unwrap();
        HandlerBuilder::new(runtime)
            .limits(Limits {
                call_time: Duration::from_millis(1),
                ..Limits::default()
            })
            .link(&policy)
            .build_sharded(most)
            .unwrap()
    }

    /// Not a real fork, which would leave the test harness's threads behind: the
    /// handler's own before and after, as the child sees them.
    fn as_in_a_child(h: &ShardedHandler) {
        let held = Forkable::before_fork(h.shared.clone());
        held.after_fork(true);
    }

    #[test]
    fn a_child_forked_while_another_thread_held_a_queue_refuses_every_call() {
        let h = sharded(2);
        let block = h.malloc(64).unwrap();
        let (holding, release) = (Barrier::new(2), Barrier::new(2));
        std::thread::scope(|s| {
            let holder = s.spawn(|| {
                let _frees = locked(&h.shared.queued[0].0.frees);
                holding.wait();
                release.wait();
            });
            holding.wait();
            as_in_a_child(&h);
            release.wait();
            holder.join().unwrap();
        });
        let refused = h
            .malloc(64)
            .expect_err("a lock the child lacks the holder of");
        let text = refused.to_string();
        assert!(
            text.contains("forked while another thread was inside a call of this handler"),
            "{text}"
        );
        assert!(h.free(block, 64).is_err());
        assert!(h.stats().is_err());
        assert!(h.leak_check().is_err());
    }

    #[test]
    fn a_child_forked_while_no_thread_held_the_locks_goes_on_as_before() {
        let h = sharded(2);
        let block = h.malloc(64).unwrap();
        as_in_a_child(&h);
        h.free(block, 64).unwrap();
        assert_eq!(h.stats().unwrap().live_blocks, 0);
        h.leak_check().unwrap();
    }

    /// A thread of the parent was in the start of shard 1: the child's threads given
    /// that shard use shard 0 rather than wait for a start nobody finishes.
    #[test]
    fn a_shard_whose_start_the_parent_was_in_is_never_waited_for_in_the_child() {
        let h = sharded(2);
        h.shared.starting[1].fetch_add(1, Ordering::AcqRel);
        as_in_a_child(&h);
        h.shared.starting[1].fetch_sub(1, Ordering::AcqRel);
        assert!(!h.shared.start(1), "shard 1 is given up");
        assert_eq!(h.started().count(), 1);
        // Threads given shard 1 are served by shard 0.
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    let block = h.malloc(64).unwrap();
                    h.free(block, 64).unwrap();
                });
            }
        });
        assert_eq!(h.started().count(), 1);
        h.leak_check().unwrap();
    }
}
