//! The host's own record of the blocks lent across one boundary.
//!
//! Ordered by address so that "which block contains this range" and "does this range
//! overlap a live block" are one `range` query each, O(log n); indexed by address too,
//! so the exact lookups of every client call (magazine hits, frees) are one hash probe.
//! The ledger never trusts the party it records: it is filled from what the host saw
//! cross the boundary.

use std::collections::BTreeMap;

use crate::fasthash::FastMap;

/// Names one of a handler's per-thread caches.
pub(crate) type CacheId = std::num::NonZeroU32;

/// One lent block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) size: u64,
    /// For the top policy's blocks: the thread cache that holds the block, in its
    /// magazine or lent from there to the client; `None` when the client holds it
    /// straight from the policy. Other boundaries leave it `None`.
    pub(crate) cache: Option<CacheId>,
}

/// Why a block cannot be taken back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TakeBack {
    /// Never lent, as far as the recent history tells.
    Unknown,
    /// Lent and given back not long ago.
    AlreadyFreed,
    /// Lent with another size.
    WrongSize { recorded: u64 },
}

/// How many recently freed addresses are remembered to tell a double free from a wild one.
const FREED_HISTORY: usize = 64;

#[derive(Debug)]
pub(crate) struct Ledger {
    /// Address -> size, for range queries.
    ranges: BTreeMap<u64, u64>,
    /// Address -> entry, for exact lookups.
    blocks: FastMap<u64, Entry>,
    bytes: u64,
    peak_bytes: u64,
    /// Boxed: a ledger sits inline in every link's state.
    freed: Box<[u64; FREED_HISTORY]>,
    freed_next: usize,
    /// Advances with every block recorded or taken off: a result derived from the
    /// ledger's blocks holds while the generation it was derived at is current.
    generation: u64,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger {
            ranges: BTreeMap::new(),
            blocks: FastMap::default(),
            bytes: 0,
            peak_bytes: 0,
            freed: Box::new([0; FREED_HISTORY]),
            freed_next: 0,
            generation: 0,
        }
    }
}

impl Ledger {
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Bytes in all live blocks.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The most bytes live at once.
    pub(crate) fn peak_bytes(&self) -> u64 {
        self.peak_bytes
    }

    pub(crate) fn get(&self, addr: u64) -> Option<Entry> {
        self.blocks.get(&addr).copied()
    }

    /// Name the thread cache that holds the block at `addr`; false if there is none.
    /// (The only change made to a block in place: its address and size never change.)
    pub(crate) fn set_cache(&mut self, addr: u64, cache: Option<CacheId>) -> bool {
        match self.blocks.get_mut(&addr) {
            Some(entry) => {
                entry.cache = cache;
                true
            }
            None => false,
        }
    }

    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// Every block, by address.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, Entry)> + '_ {
        self.ranges.keys().map(|a| (*a, self.blocks[a]))
    }

    /// The live block that `[addr, addr+len)` overlaps, if any (the lowest such block is
    /// not promised, only some block). `len` is at least 1 for every block the host
    /// records, so empty ranges never overlap.
    pub(crate) fn overlapping(&self, addr: u64, len: u64) -> Option<(u64, u64)> {
        let end = addr.checked_add(len)?;
        // The last block starting before `end` is the only candidate that can reach into
        // the range from below or start inside it; blocks never overlap each other.
        let (&start, &size) = self.ranges.range(..end).next_back()?;
        (start + size > addr).then_some((start, size))
    }

    /// Every live block overlapping `[addr, addr+len)`, highest first.
    pub(crate) fn overlapping_all(
        &self,
        addr: u64,
        len: u64,
    ) -> impl Iterator<Item = (u64, u64)> + '_ {
        let end = addr.saturating_add(len);
        // Blocks are disjoint and sorted: walking down from `end`, the first block that
        // ends at or before `addr` ends the walk.
        self.ranges
            .range(..end)
            .rev()
            .map(|(&start, &size)| (start, size))
            .take_while(move |&(start, size)| start + size > addr)
    }

    /// The free stretch around `[addr, addr+len)` (`len` at least 1): from the end of
    /// the nearest block below it to the start of the nearest block above it, or `None`
    /// when a block overlaps the range.
    pub(crate) fn gap_around(&self, addr: u64, len: u64) -> Option<(u64, u64)> {
        let end = addr.checked_add(len)?;
        let below = match self.ranges.range(..end).next_back() {
            Some((&start, &size)) if start + size > addr => return None,
            Some((&start, &size)) => start + size,
            None => 0,
        };
        let above = self
            .ranges
            .range(end..)
            .next()
            .map_or(u64::MAX, |(&a, _)| a);
        Some((below, above))
    }

    /// The live block that wholly contains `[addr, addr+len)`.
    pub(crate) fn containing(&self, addr: u64, len: u64) -> Option<(u64, u64)> {
        let end = addr.checked_add(len)?;
        let (&start, &size) = self.ranges.range(..=addr).next_back()?;
        (start + size >= end).then_some((start, size))
    }

    /// Record a newly lent block. The caller has checked that it overlaps nothing.
    pub(crate) fn insert(&mut self, addr: u64, size: u64) {
        debug_assert!(self.overlapping(addr, size).is_none());
        self.blocks.insert(addr, Entry { size, cache: None });
        self.ranges.insert(addr, size);
        self.bytes += size;
        self.peak_bytes = self.peak_bytes.max(self.bytes);
        self.generation += 1;
    }

    /// Take back the block at `addr` that must have been lent with `size` bytes.
    pub(crate) fn take_back(&mut self, addr: u64, size: u64) -> Result<Entry, TakeBack> {
        match self.blocks.get(&addr) {
            Some(e) if e.size == size => {}
            Some(e) => return Err(TakeBack::WrongSize { recorded: e.size }),
            None => return Err(self.why_unknown(addr)),
        }
        Ok(self.remove(addr).expect("block was just found"))
    }

    /// Remove the block at `addr` whatever its size.
    pub(crate) fn remove(&mut self, addr: u64) -> Option<Entry> {
        let entry = self.blocks.remove(&addr)?;
        self.ranges.remove(&addr);
        self.bytes -= entry.size;
        self.generation += 1;
        self.freed[self.freed_next] = addr;
        self.freed_next = (self.freed_next + 1) % FREED_HISTORY;
        Some(entry)
    }

    /// Why an address that is not live cannot be freed.
    pub(crate) fn why_unknown(&self, addr: u64) -> TakeBack {
        if addr != 0 && self.freed.contains(&addr) {
            TakeBack::AlreadyFreed
        } else {
            TakeBack::Unknown
        }
    }

    /// Do the address index and the range index hold the same blocks, disjoint, with the
    /// byte count their sum? O(n): for audits, not hot paths.
    pub(crate) fn check_consistent(&self) -> Result<(), &'static str> {
        if self.ranges.len() != self.blocks.len() {
            return Err("ledger indexes disagree on the number of blocks");
        }
        let mut end = 0;
        let mut bytes = 0u64;
        for (&addr, &size) in &self.ranges {
            if self.blocks.get(&addr).map(|e| e.size) != Some(size) {
                return Err("ledger indexes disagree on a block");
            }
            if addr < end {
                return Err("ledger holds overlapping blocks");
            }
            end = addr.saturating_add(size);
            bytes += size;
        }
        if bytes != self.bytes {
            return Err("ledger byte count is not the sum of its blocks");
        }
        Ok(())
    }

    /// Every block, emptying the ledger.
    pub(crate) fn drain(&mut self) -> Vec<(u64, Entry)> {
        self.bytes = 0;
        self.generation += 1;
        self.ranges.clear();
        std::mem::take(&mut self.blocks).into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger(blocks: &[(u64, u64)]) -> Ledger {
        let mut l = Ledger::default();
        for &(a, s) in blocks {
            l.insert(a, s);
        }
        l
    }

    #[test]
    fn overlap_is_found_from_below_inside_and_above() {
        let l = ledger(&[(100, 50), (200, 10)]);
        assert_eq!(
            l.overlapping(90, 11),
            Some((100, 50)),
            "reaches in from below"
        );
        assert_eq!(l.overlapping(120, 5), Some((100, 50)), "lies inside");
        assert_eq!(
            l.overlapping(149, 40),
            Some((100, 50)),
            "starts in the last byte"
        );
        assert_eq!(l.overlapping(50, 500), Some((200, 10)), "covers both");
        assert_eq!(l.overlapping(150, 50), None, "fits the gap exactly");
        assert_eq!(l.overlapping(90, 10), None, "ends where a block starts");
    }

    #[test]
    fn every_overlapping_block_is_found() {
        let l = ledger(&[(100, 10), (110, 10), (130, 10), (200, 10)]);
        let found: Vec<_> = l.overlapping_all(105, 30).collect();
        assert_eq!(found, [(130, 10), (110, 10), (100, 10)]);
        assert_eq!(l.overlapping_all(140, 60).count(), 0);
    }

    #[test]
    fn the_gap_around_a_range_reaches_the_neighbouring_blocks() {
        let l = ledger(&[(100, 10), (200, 10)]);
        assert_eq!(l.gap_around(150, 10), Some((110, 200)));
        assert_eq!(
            l.gap_around(110, 90),
            Some((110, 200)),
            "fills the gap exactly"
        );
        assert_eq!(l.gap_around(10, 5), Some((0, 100)));
        assert_eq!(l.gap_around(300, 5), Some((210, u64::MAX)));
        assert_eq!(l.gap_around(105, 1), None, "inside a block");
        assert_eq!(l.gap_around(150, 51), None, "reaches into the block above");
        assert_eq!(l.gap_around(u64::MAX, 2), None, "overflowing range");
    }

    #[test]
    fn every_change_of_blocks_advances_the_generation() {
        let mut l = ledger(&[(100, 10)]);
        let g = l.generation();
        assert!(l.set_cache(100, None));
        assert_eq!(l.generation(), g, "naming a cache moves no block");
        l.insert(200, 10);
        assert!(l.generation() > g);
        let g = l.generation();
        assert!(l.take_back(200, 9).is_err());
        assert_eq!(l.generation(), g, "a refused take-back changes nothing");
        l.take_back(200, 10).unwrap();
        assert!(l.generation() > g);
        let g = l.generation();
        l.drain();
        assert!(l.generation() > g);
    }

    #[test]
    fn containment_needs_the_whole_range_inside_one_block() {
        let l = ledger(&[(100, 50), (150, 50)]);
        assert_eq!(l.containing(100, 50), Some((100, 50)));
        assert_eq!(l.containing(120, 10), Some((100, 50)));
        assert_eq!(l.containing(140, 20), None, "spans two adjacent blocks");
        assert_eq!(l.containing(99, 2), None);
        assert_eq!(l.containing(u64::MAX, 2), None, "overflowing range");
    }

    #[test]
    fn take_back_enforces_the_sized_free_rule_and_tells_double_from_unknown() {
        let mut l = ledger(&[(100, 50)]);
        assert_eq!(
            l.take_back(100, 49),
            Err(TakeBack::WrongSize { recorded: 50 })
        );
        assert_eq!(l.bytes(), 50, "a refused free changes nothing");
        assert!(l.take_back(100, 50).is_ok());
        assert_eq!(l.take_back(100, 50), Err(TakeBack::AlreadyFreed));
        assert_eq!(l.take_back(300, 50), Err(TakeBack::Unknown));
        assert_eq!(l.bytes(), 0);
        assert!(l.is_empty());
    }
}
