//! The per-call path of a handler that keeps no magazines: each malloc, calloc and free
//! is one request to the policy, queued while another thread holds the chain and served
//! by that thread ([`allocbox_ledger::cache::Caches::combine`]), so that many threads
//! share one instance at the throughput of one.
//!
//! A request does its own work whoever runs it: it makes its own deadline when it is
//! served (a wait for other threads' calls is not its guests' time), checks its own
//! block on the books, and is counted and answered as its own. A malloc or calloc that
//! waited in the queue past its client's time limit is not served: its client alone
//! gets [`Error::Waited`], and the policy, which did nothing wrong, goes on. A free
//! always is: the client has let the block go.
//!
//! Anything out of the ordinary (a failed chain, a block off the books) leaves the
//! queue and takes the lock the ordinary way, in the caller's thread: a queued request
//! never calls another handler or waits for the lock it runs under.

use std::ptr::NonNull;

use super::{Handler, count, count_request, served, settle, to_ptr};
use crate::error::Error;

/// How a lend ended under the chain: answered, or for the caller to take elsewhere.
enum Lent {
    Answered(Result<u64, Error>),
    /// The chain failed: the fallback serves, out of the queue.
    ChainFailed,
}

impl Handler {
    /// Whether requests go through the combining queue: the handler keeps no
    /// magazines (which have a path of their own) and its policy does not observe.
    #[inline]
    pub(super) fn combines(&self) -> bool {
        !self.caches.keeps_magazines() && self.observed.is_none()
    }

    /// A `malloc`, or with `ZEROED` a `calloc` of `nelem * elsize` bytes, `size` in
    /// all, asked of the policy through the queue.
    pub(super) fn lend_combined<const ZEROED: bool>(
        &self,
        nelem: u64,
        elsize: u64,
    ) -> Result<Option<NonNull<u8>>, Error> {
        let size = nelem.saturating_mul(elsize).max(1);
        // The client's time starts now, waiting included.
        let entered = self.client_call();
        let lent = self
            .caches
            .combine(|c| {
                if c.failure.is_some() {
                    return Lent::ChainFailed;
                }
                if self.clock.now() > entered.tick() {
                    count(c, &mut None, |n| {
                        count_request::<ZEROED>(n);
                        n.failed += 1;
                    });
                    return Lent::Answered(Err(self.waited()));
                }
                let deadline = &mut self.client_call();
                let answer = match ZEROED {
                    false => c.head.malloc(deadline, size),
                    true => c.head.calloc(deadline, nelem, elsize),
                };
                let answer = settle(c, answer);
                count(c, &mut None, |n| {
                    count_request::<ZEROED>(n);
                    served(n, &answer, size);
                });
                Lent::Answered(answer)
            })
            .map_err(|reason| self.unreachable(reason))?;
        match lent {
            // `Link::calloc` hands its answer over zeroed.
            Lent::Answered(answer) => Ok(to_ptr(answer?)),
            Lent::ChainFailed => self
                .lend_from_fallback::<ZEROED>(self.lock()?, None, size)
                .map(|(block, _)| block),
        }
    }

    /// A client's free through the queue: the block's size, or `None` when it is not
    /// an ordinary one (off the books, or the chain failed) and the caller should take
    /// the ordinary path, where nothing has changed yet.
    pub(super) fn free_combined(
        &self,
        ptr: NonNull<u8>,
        said: Option<u64>,
    ) -> Result<Option<u64>, Error> {
        let addr = ptr.as_ptr() as u64;
        self.caches
            .combine(|c| {
                if c.failure.is_some() {
                    return None;
                }
                // No cache lends this handler's blocks: every entry is the client's.
                let entry = c.head.lent_mut().remove_unless(addr, |_| false).ok()?;
                if let Some(said) = said
                    && said.max(1) != entry.size
                {
                    self.note_size_correction(addr, said, entry.size);
                }
                count(c, &mut None, |n| {
                    n.frees += 1;
                    n.freed(entry.size, said);
                });
                let deadline = &mut self.client_call();
                let answer = c.head.free_taken(deadline, addr, entry.size).map(|()| 0);
                Some(settle(c, answer).map(|_| entry.size))
            })
            .map_err(|reason| self.unreachable(reason))?
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use std::ptr::NonNull;
    use std::time::Duration;

    use crate::Limits;
    use crate::error::Error;
    use crate::handler::{Handler, HandlerBuilder};
    use crate::runtime::Runtime;

    fn per_call_system(call_time: Duration) -> Handler {
        let runtime = Runtime::shared();
        let policy = runtime
            .load_file(allocbox_artifacts::SYSTEM.path())
            .unwrap();
        HandlerBuilder::new(runtime)
            .limits(Limits {
                call_time,
                ..Limits::default()
            })
            .link(&policy)
            .magazines(false)
            .build()
            .unwrap()
    }

    /// The chain is held (as by a long call of another thread's) while a malloc waits
    /// in the queue until its client's time limit has passed, counted in the clock's
    /// ticks. Its client alone gets the timeout; the policy was not asked, is not
    /// stopped, and serves the next call.
    #[test]
    fn a_queued_request_whose_client_s_time_passed_fails_alone_and_the_policy_goes_on() {
        let h = per_call_system(Duration::from_millis(10));
        let before = h.stats().unwrap();
        let waited = std::thread::scope(|s| {
            let books = h.lock().unwrap();
            let start = h.clock.now();
            let client = s.spawn(|| h.malloc(64).map(|block| block.map(|p| p.as_ptr() as usize)));
            while !h.caches.requests_waiting() {
                std::thread::yield_now();
            }
            // Its deadline is at most `call_ticks` ticks after it entered, which was
            // after `start`.
            let past = start + h.call_ticks.ticks() + 1;
            while h.clock.now() <= past {
                std::thread::sleep(Duration::from_millis(1));
            }
            drop(books);
            client.join().unwrap()
        });
        let error = waited.expect_err("served past its client's time");
        assert!(matches!(error, Error::Waited { .. }), "{error}");
        assert_eq!(error.policy(), None, "no policy is at fault");
        let text = error.to_string();
        assert!(
            text.contains(
                "handler `system` did not reach this call within its time limit of 10 ms"
            ),
            "{text}"
        );
        let after = h.stats().unwrap();
        assert_eq!(after.mallocs - before.mallocs, 1);
        assert_eq!(after.failed - before.failed, 1);
        let block = h.malloc(64).unwrap().expect("the policy still serves");
        h.free(Some(block), 64).unwrap();
        assert_eq!(h.stats().unwrap().live_bytes, before.live_bytes);
    }

    /// A free queued behind a held chain is served whatever the wait: the client let
    /// the block go, and it goes back to the policy.
    #[test]
    fn a_queued_free_is_served_however_long_it_waited() {
        let h = per_call_system(Duration::from_millis(10));
        let block = h.malloc(64).unwrap().unwrap().as_ptr() as usize;
        let in_use = h.stats().unwrap().live_bytes;
        let h = &h;
        std::thread::scope(|s| {
            let books = h.lock().unwrap();
            let start = h.clock.now();
            let client = s.spawn(move || h.free(NonNull::new(block as *mut u8), 64));
            while !h.caches.requests_waiting() {
                std::thread::yield_now();
            }
            while h.clock.now() <= start + h.call_ticks.ticks() + 1 {
                std::thread::sleep(Duration::from_millis(1));
            }
            drop(books);
            client.join().unwrap().unwrap();
        });
        assert_eq!(h.stats().unwrap().live_bytes, in_use - 64);
    }
}
