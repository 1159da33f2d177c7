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
    MAGAZINE_MAX_SIZE, MAGAZINE_TABLE_SIZE, MAGAZINES_THREAD_BYTES, Magazine, Magazines,
};
pub use slot::{CacheGuard, Mine, Slot, Unreachable};
pub use thread::{Reach, ThreadCache};
