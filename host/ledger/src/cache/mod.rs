//! Per-thread caches: the hot path of a handler.
//!
//! Each thread that calls a handler gets its own [`ThreadCache`]: magazines of blocks the
//! top policy placed ahead of demand, the blocks lent from them to the client, and the
//! thread's counters. A malloc served from a magazine and the free of such a block on the
//! same thread touch only that thread's cache: no lock, no atomic read-modify-write, and
//! no cache line that another thread writes (see [`Slot`] for how another thread may
//! still reach it).
//!
//! Every block stays on the host's books. The top link's ledger records each block it
//! lent, and for the blocks a thread cache holds it names that cache
//! ([`crate::ledger::Entry::cache`]); the cache knows whether the block is in a magazine
//! or lent to the client, and with which size. So a block freed by another thread is
//! found through the ledger, and a double free of a block that is back in a magazine is
//! still caught: the cache that holds it has not lent it.
//!
//! Order: a thread claims another thread's cache only while it holds the books' lock
//! ([`Locked::claim`]), and a thread on its own fast path waits for nothing, so no two
//! threads wait on each other.
//!
//! Each file here uses only those after it (`tests/layers.rs`): flat combining in front
//! of the books, the books and their caches, the slots threads claim, one thread's
//! cache, its magazines, what it lent and its counts, and the queue of waiting requests.
//!
//! Module order: `combining` > `caches` > `slots` > `slot` > `thread` > `magazine` > `lent` > `counts` > `waiting`
//!
//! The invariants this layer keeps (ARCHITECTURE.md's map names them in short):
//! Each block a cache holds is named in the top link's ledger (`Entry::cache`); the
//! cache knows whether it is in a magazine or lent. Only the owner thread touches
//! its cache without a claim (`Mine::with`, its fast path); another thread claims
//! it only through `Locked` (the books' lock, as a type: `Locked::claim`), and the
//! owner's `Mine` takes `&mut self`, so a thread holds one guard of its own cache
//! at a time. The owner and a claimer pair asymmetric fences (`membarrier` on
//! Linux: EPERM registers again, any other error after registration is fatal;
//! SeqCst fences elsewhere, under Miri and under loom). A claimer that waits
//! through `CLAIM_YIELDS` yields ends with `Unreachable::Stuck` instead of spinning
//! under the lock. A thread finds its own cache by its thread pointer (the first
//! 32 threads to use a handler, `Slots::mine_by_pointer`, `by_thread.rs`) or through a
//! `ThreadLocal`; a slot is
//! reused only by a thread that took over a dead thread's pointer or id, never
//! shared by two live threads. `malloc` and `free` try the calling thread's
//! magazine on the full path (`Reach::FULL`); `Handler::malloc_from_magazine` /
//! `free_to_magazine` are the commonest hits alone and call nothing
//! (`Reach::IN_PLACE`: a slot found by thread pointer, table sizes, the recent array, spare
//! capacity, no claim), so the NumPy bridge inlines them with no stack frame and
//! calls `malloc` / `free` for the rest. `cache/models.rs` holds the loom models of
//! the claim protocol. Flat combining (`cache/combining.rs`, `Caches::combine`): a
//! request that finds the books held pushes itself (on its own stack) onto a
//! lock-free stack and waits on its state (spin, yield, then park); every release
//! of the books (`Locked`'s drop, or a fork's) serves what waits, at most
//! `SERVE_AT_MOST` (64) requests, then hands the rest to one waiting thread, which
//! serves them on its own release; after letting go it looks again, so a request
//! pushed behind its last look is seen (a `SeqCst` fence on both sides). A
//! request's work runs under `catch_unwind`, its panic resumed on its own thread.
//! Its loom models are `cache/combining/models.rs`.

mod caches;
mod combining;
mod counts;
mod lent;
mod magazine;
#[cfg(all(test, allocbox_loom))]
mod models;
mod slot;
mod slots;
mod thread;
mod waiting;

pub use caches::{Books, Caches, Locked};
pub use counts::Counts;
pub use lent::Lent;
pub use magazine::{
    MAGAZINE_DEPTH, MAGAZINE_MAX_SIZE, MAGAZINE_TABLE_SIZE, MAGAZINES_THREAD_BYTES, Magazine,
    Magazines,
};
pub use slot::{CacheGuard, Mine, Slot, Unreachable};
pub use thread::{Reach, ThreadCache};
