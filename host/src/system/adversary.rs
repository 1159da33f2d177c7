//! The contract checker's upstream ([`crate::HandlerBuilder::adversary`]): host memory
//! that is no kinder than the contract, with every choice drawn from a seed.
//!
//! The host's real memory is kinder than the contract promises: glibc puts blocks of a
//! page and more on a cache line, reuses addresses in a pattern of its own, and never
//! runs out. A policy can come to rely on any of that and pass every check on one host
//! and fail on the next. Here instead:
//!
//! - every block starts at a random multiple of 16 inside a window of a cache line
//!   (small blocks) or a page (the rest), so a block is aligned to exactly what the
//!   contract promises and to more only by chance;
//! - blocks come from one address-space reservation of their own, at the same address
//!   in every process where it is free, and are placed by the seed alone: the same
//!   requests get the same addresses, so a check's failure replays;
//! - an address comes back into use at once or much later, at the seed's choice, and a
//!   `realloc` grows in place or moves, at the seed's choice;
//! - requests are refused on purpose ([`Adversary::refuse_after`],
//!   [`Adversary::refuse_every`], [`Adversary::refuse_above`]) so a policy's
//!   out-of-memory paths run, wherever the request is made: in a call of the client's,
//!   or part way through a batch the host's magazines asked for or gave back; the last
//!   refusal is kept so a report can name it, and all are counted (a long run refuses
//!   millions, so no list of them is kept).
//!
//! Where blocks go is `arena.rs`'s business; what fresh and grown memory holds is
//! [`super::SystemMemory`]'s, as on the production path.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use parking_lot::Mutex;

/// [`Adversary`]'s count of requests to let through when none is to be refused.
const OFF: u64 = u64::MAX;

/// The contract checker's control of its upstream: shared between the checker, which
/// asks for refusals, and the handler's host memory, which makes them. Every choice of
/// the upstream is drawn from [`Adversary::seed`].
#[derive(Debug)]
pub struct Adversary {
    seed: u64,
    /// [`Adversary::refuse_after`]'s count; [`OFF`]: nothing is to be refused.
    refuse_after: AtomicU64,
    /// Requests made since the client's operation began ([`Adversary::begin_operation`]).
    operation_requests: AtomicU64,
    /// 0: off.
    refuse_every: AtomicU32,
    /// `u64::MAX`: off.
    refuse_above: AtomicU64,
    requests: AtomicU64,
    refusals: AtomicU64,
    last_refusal: Mutex<Option<Refusal>>,
}

/// Why a request was refused on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Injected {
    /// [`Adversary::refuse_after`], with the requests of the operation it let through
    /// first.
    After(u64),
    /// [`Adversary::refuse_every`].
    Every(u32),
    /// [`Adversary::refuse_above`].
    Above(u64),
}

/// An upstream request the checker refused on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// The request's number, counting from 1: every `malloc`, `calloc` and `realloc`
    /// that reached the host's memory, each block of a batch on its own.
    pub request: u64,
    /// The bytes asked for.
    pub size: u64,
    pub why: Injected,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let why = match self.why {
            Injected::After(0) => "`oom next`".to_string(),
            Injected::After(n) => format!("`oom after {n}`"),
            Injected::Every(n) => format!("`oom every {n}`"),
            Injected::Above(size) => format!("`oom above {size}`"),
        };
        write!(
            f,
            "upstream request {} ({} bytes) was refused on purpose by {why}",
            self.request, self.size
        )
    }
}

impl Adversary {
    /// An upstream drawing every choice from `seed`, refusing nothing yet.
    pub fn new(seed: u64) -> Arc<Adversary> {
        Arc::new(Adversary {
            seed,
            refuse_after: AtomicU64::new(OFF),
            operation_requests: AtomicU64::new(0),
            refuse_every: AtomicU32::new(0),
            refuse_above: AtomicU64::new(u64::MAX),
            requests: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
            last_refusal: Mutex::new(None),
        })
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// In the next client operation that makes more than `requests` upstream requests,
    /// let `requests` through and refuse the one after, whatever it is: with `requests`
    /// past 0, one part way through a batch (a magazine's refill, a policy's own
    /// `malloc-many`). 0 refuses the next request. The count starts from this call, and
    /// again from the start of each operation.
    ///
    /// Counted within one operation, so that the refusal lands on the same request of
    /// the same operation however many operations came before it: deleting operations
    /// while shrinking keeps the point of injection.
    pub fn refuse_after(&self, requests: u64) {
        self.begin_operation();
        self.refuse_after
            .store(requests.min(OFF - 1), Ordering::Relaxed);
    }

    /// A client operation begins: [`Adversary::refuse_after`] counts from here.
    pub fn begin_operation(&self) {
        self.operation_requests.store(0, Ordering::Relaxed);
    }

    /// Whether [`Adversary::refuse_after`] refuses the operation's request `index`
    /// (from 0); it refuses once.
    fn refused_in_operation(&self, index: u64) -> bool {
        self.refuse_after
            .compare_exchange(index, OFF, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// From now on refuse every `n`th request, counting from the first request ever
    /// made; 0 stops it.
    pub fn refuse_every(&self, n: u32) {
        self.refuse_every.store(n, Ordering::Relaxed);
    }

    /// From now on refuse every request for more than `size` bytes.
    pub fn refuse_above(&self, size: u64) {
        self.refuse_above.store(size, Ordering::Relaxed);
    }

    /// The latest request refused on purpose, if any was.
    pub fn last_refusal(&self) -> Option<Refusal> {
        *self.last_refusal.lock()
    }

    /// Requests refused on purpose so far.
    pub fn refusals(&self) -> u64 {
        self.refusals.load(Ordering::Relaxed)
    }

    /// Requests made so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Count a request for `size` bytes and say whether it is refused.
    pub(super) fn refuses(&self, size: u64) -> bool {
        let request = self.requests.fetch_add(1, Ordering::Relaxed) + 1;
        let in_operation = self.operation_requests.fetch_add(1, Ordering::Relaxed);
        let every = self.refuse_every.load(Ordering::Relaxed);
        let why = if self.refused_in_operation(in_operation) {
            Injected::After(in_operation)
        } else if every > 0 && request.is_multiple_of(u64::from(every)) {
            Injected::Every(every)
        } else if size > self.refuse_above.load(Ordering::Relaxed) {
            Injected::Above(self.refuse_above.load(Ordering::Relaxed))
        } else {
            return false;
        };
        self.refusals.fetch_add(1, Ordering::Relaxed);
        *self.last_refusal.lock() = Some(Refusal { request, size, why });
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_follow_the_plan_and_the_last_is_kept() {
        let adversary = Adversary::new(0);
        adversary.refuse_every(3);
        let refused: Vec<bool> = (0..6).map(|_| adversary.refuses(8)).collect();
        assert_eq!(refused, [false, false, true, false, false, true]);
        adversary.refuse_every(0);
        adversary.refuse_above(100);
        adversary.refuse_after(0);
        assert!(adversary.refuses(8), "the next one");
        assert_eq!(
            adversary.last_refusal().map(|r| r.why),
            Some(Injected::After(0))
        );
        assert!(!adversary.refuses(100));
        assert!(adversary.refuses(101));
        assert_eq!(adversary.refusals(), 4);
        assert_eq!(
            adversary.last_refusal().unwrap().to_string(),
            "upstream request 9 (101 bytes) was refused on purpose by `oom above 100`"
        );
    }

    #[test]
    fn a_refusal_after_n_requests_lands_in_the_first_operation_that_makes_more_than_n() {
        let adversary = Adversary::new(0);
        adversary.refuse_after(2);
        let mut refused = Vec::new();
        // Operations of 1, 2, 4 and 4 requests: the third's third request is refused.
        for requests in [1, 2, 4, 4] {
            adversary.begin_operation();
            refused.push(
                (0..requests)
                    .map(|_| adversary.refuses(8))
                    .collect::<Vec<_>>(),
            );
        }
        let expected = [
            vec![false],
            vec![false, false],
            vec![false, false, true, false],
            vec![false; 4],
        ];
        assert_eq!(refused, expected);
        assert_eq!(
            adversary.last_refusal().unwrap().to_string(),
            "upstream request 6 (8 bytes) was refused on purpose by `oom after 2`"
        );
    }
}
