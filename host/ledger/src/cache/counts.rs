//! A thread's counters, kept without atomics and gathered into a handler's statistics
//! when they are read. A handler that keeps no magazines has one set of its own,
//! updated under its lock.

/// What one thread did on a handler since its counters were last folded into the
/// handler's statistics. Live counts are signed: a thread may free what another took.
#[derive(Debug, Default)]
pub struct Counts {
    pub mallocs: u64,
    pub callocs: u64,
    pub reallocs: u64,
    pub frees: u64,
    pub failed: u64,
    pub size_corrections: u64,
    pub magazine_hits: u64,
    /// Bytes lent, summed over every block lent.
    pub total_bytes: u64,
    pub live_blocks: i64,
    pub live_bytes: i64,
    /// The most `live_bytes` reached since the last fold (0 counts: the fold's start).
    pub peak_live_bytes: i64,
}

impl Counts {
    #[inline]
    pub fn lend(&mut self, size: u64) {
        self.live_blocks += 1;
        self.live_bytes += size as i64;
        self.total_bytes += size;
        self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes);
    }

    #[inline]
    pub fn take_back(&mut self, size: u64) {
        self.live_blocks -= 1;
        self.live_bytes -= size as i64;
    }

    /// Count a request's answer: a block of `size` bytes, or "none" for address 0.
    #[inline]
    pub fn served(&mut self, addr: u64, size: u64) {
        if addr == 0 {
            self.failed += 1;
        } else {
            self.lend(size);
        }
    }

    /// Count a client free of a block recorded with `recorded` bytes, said to have
    /// `said` (`None` from a client whose free says no size, as Numba's runtime: the
    /// ledger's size is the only one, so nothing was corrected).
    #[inline]
    pub fn freed(&mut self, recorded: u64, said: Option<u64>) {
        if said.is_some_and(|said| said.max(1) != recorded) {
            self.size_corrections += 1;
        }
        self.take_back(recorded);
    }
}
