//! The NEP 49 vocabulary: what a data-memory handler is ([`MemHandler`]) and the
//! statistics every handler reports ([`Stats`]), shared by the wasm handler
//! ([`crate::Handler`]), the native default ([`crate::NumpyDefault`]) and everything
//! that drives either (`nep49`, `trace`, the Python bridge).

use std::fmt;
use std::ptr::NonNull;

use allocbox_ledger::cache::Counts;

use crate::error::Error;

/// A data-memory handler: NumPy's `PyDataMem_Handler` (name, version, and the four
/// routines), implemented by wasm policy chains ([`crate::Handler`]) and natively
/// ([`crate::NumpyDefault`]).
pub trait MemHandler: Send + Sync + fmt::Debug {
    /// 1..=127 bytes, shown by `handler_name`.
    fn name(&self) -> &str;
    /// The handler contract version.
    fn version(&self) -> u8 {
        1
    }
    /// The alignment every block it lends has (C6): 16 unless a policy declares
    /// otherwise.
    fn alignment(&self) -> u64 {
        16
    }
    fn malloc(&self, size: usize) -> Result<Option<NonNull<u8>>, Error>;
    fn calloc(&self, nelem: usize, elsize: usize) -> Result<Option<NonNull<u8>>, Error>;
    fn realloc(
        &self,
        ptr: Option<NonNull<u8>>,
        new_size: usize,
    ) -> Result<Option<NonNull<u8>>, Error>;
    fn free(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<(), Error>;
    /// Give back a block whose client does not say its size (Numba's runtime frees so):
    /// the handler's own record of the block supplies it. Returns that size.
    fn free_unsized(&self, ptr: NonNull<u8>) -> Result<usize, Error>;
    /// The counters; an error when the handler cannot be reached to read them.
    fn stats(&self) -> Result<Stats, Error>;
    /// Can this handler take new requests? A chain stopped by a violation cannot.
    fn usable(&self) -> Result<(), Error> {
        Ok(())
    }
}

/// Counts kept by a handler for everything its clients did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub mallocs: u64,
    pub callocs: u64,
    pub reallocs: u64,
    pub frees: u64,
    /// Requests that got no block: answered "none" (out of memory), or refused because
    /// the policy broke a rule or was stopped (with no fallback to serve them).
    pub failed: u64,
    pub live_blocks: u64,
    pub live_bytes: u64,
    /// The most bytes live at once; see [`crate::Handler::stats`] for how exact it is with several threads.
    pub peak_bytes: u64,
    pub total_bytes: u64,
    /// Client frees whose size was not the block's; the policy got the right one.
    pub size_corrections: u64,
    /// Requests served from a cache of freed blocks without calling the allocator
    /// behind it: allocbox's magazines, or NumPy's small-block cache in the native
    /// default.
    pub magazine_hits: u64,
    /// Upstream requests of the chain's policies answered "none" for passing their
    /// overhead budget ([`crate::Limits::overhead`]), summed over the chain.
    pub budget_refusals: u64,
    /// Of those, the ones refused for what a policy held beyond its client's bytes
    /// ([`crate::LinkStats::budget_refusals_held`]).
    pub budget_refusals_held: u64,
    /// Blocks the top policy lent that wait in the host's magazines for reuse: freed by
    /// the client, not yet given back to the policy. The top policy's
    /// [`crate::LinkStats::live_blocks`] is always `live_blocks + cached_blocks`.
    pub cached_blocks: u64,
}

impl Stats {
    /// Count a block of `size` bytes given to the client.
    pub(crate) fn lend(&mut self, size: u64) {
        self.live_blocks += 1;
        self.live_bytes += size;
        self.total_bytes += size;
        self.peak_bytes = self.peak_bytes.max(self.live_bytes);
    }

    /// Count a block of `size` bytes the client gave back.
    pub(crate) fn take_back(&mut self, size: u64) {
        self.live_blocks -= 1;
        self.live_bytes -= size;
    }
}

/// Gathering a thread cache's counters (`allocbox_ledger::cache::Counts`).
impl Stats {
    /// Add a thread's counters (taken from it, so they start again at zero). The peak is exact while one thread at a
    /// time uses the handler (between two folds only that thread moved the live total);
    /// with several threads at once it is each thread's peak over the total at its fold.
    pub(crate) fn fold(&mut self, c: Counts) {
        self.mallocs += c.mallocs;
        self.callocs += c.callocs;
        self.reallocs += c.reallocs;
        self.frees += c.frees;
        self.failed += c.failed;
        self.size_corrections += c.size_corrections;
        self.magazine_hits += c.magazine_hits;
        self.total_bytes += c.total_bytes;
        let peak = self.live_bytes as i64 + c.peak_live_bytes;
        self.peak_bytes = self.peak_bytes.max(peak.max(0) as u64);
        self.live_bytes = (self.live_bytes as i64 + c.live_bytes) as u64;
        self.live_blocks = (self.live_blocks as i64 + c.live_blocks) as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fold_keeps_the_peak_of_one_thread_exact() {
        let mut stats = Stats::default();
        let mut c = Counts::default();
        c.lend(100);
        c.lend(50);
        c.take_back(100);
        stats.fold(std::mem::take(&mut c));
        assert_eq!((stats.live_bytes, stats.peak_bytes), (50, 150));
        c.take_back(50);
        c.lend(10);
        stats.fold(std::mem::take(&mut c));
        assert_eq!(
            (stats.live_bytes, stats.peak_bytes, stats.live_blocks),
            (10, 150, 1)
        );
    }

    #[test]
    fn a_thread_may_free_more_than_it_took() {
        let mut stats = Stats::default();
        let mut taker = Counts::default();
        let mut freer = Counts::default();
        taker.lend(64);
        freer.take_back(64);
        stats.fold(std::mem::take(&mut freer));
        stats.fold(std::mem::take(&mut taker));
        assert_eq!((stats.live_bytes, stats.live_blocks), (0, 0));
    }
}
