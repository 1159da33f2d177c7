//! The host's own record of the blocks lent across one boundary.
//!
//! Indexed by address, so the exact lookups of every client call (magazine hits, frees)
//! are one hash probe; ordered by address too, so that "which block contains this
//! range" and "does this range overlap a live block" are one `range` query each,
//! O(log n). The ledger never trusts the party it records: it is filled from what the
//! host saw cross the boundary.
//!
//! The order is kept lazily. Most blocks live for one malloc/free pair, and no range
//! query falls between their two ends: a B-tree insert and remove for each would be
//! a third of what the host adds to a component call (callgrind, `system` per op).
//! So a new block waits in a short list, and goes into the B-tree only when the list
//! fills or a query needs the whole order; a block taken back before then leaves no
//! trace there. The nearest-block queries of the hot checks ([`Ledger::nearby`]) scan a
//! short list beside the B-tree instead: a policy that reads a block's header once
//! before giving it back (NEP 49's `aligned`) still orders nothing.

use std::collections::BTreeMap;

use index::Index;

mod index;

/// Names one of a handler's per-thread caches.
pub type CacheId = std::num::NonZeroU32;

/// One lent block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Entry {
    pub size: u64,
    /// For the top policy's blocks: the thread cache that holds the block, in its
    /// magazine or lent from there to the client; `None` when the client holds it
    /// straight from the policy. Other boundaries leave it `None`.
    pub cache: Option<CacheId>,
}

/// A block as the ledger keeps it: an [`Entry`]'s fields laid out flat, so that the
/// flag shares the entry's padding and a record takes 16 bytes rather than 24.
#[derive(Debug, Clone, Copy, Default)]
struct Record {
    size: u64,
    cache: Option<CacheId>,
    /// In `ranges`; otherwise in `unordered`.
    ordered: bool,
}

impl Record {
    fn entry(&self) -> Entry {
        Entry {
            size: self.size,
            cache: self.cache,
        }
    }
}

/// Why a block cannot be taken back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TakeBack {
    /// Never lent, as far as the recent history tells.
    Unknown,
    /// Lent and given back not long ago.
    AlreadyFreed,
    /// Lent with another size.
    WrongSize { recorded: u64 },
}

/// How many recently freed addresses are remembered to tell a double free from a wild one.
const FREED_HISTORY: usize = 64;

/// How many blocks may wait outside the order: a bound on the ledger's own memory (the
/// list is allocated once) and on the work one range query may have to do first.
const UNORDERED_LIMIT: usize = 64;

/// How many waiting blocks a nearest-block query scans rather than orders.
const SCAN_LIMIT: usize = 8;

#[derive(Debug)]
pub struct Ledger {
    /// What one block's memory costs the host beyond its record: the allocator's own
    /// footprint for blocks of the host's memory, nothing more for blocks carved from a
    /// policy's.
    footprint: fn(u64) -> u64,
    /// The sum of `footprint` over the live blocks.
    footprint_bytes: u64,
    /// Address -> block: every live block.
    blocks: Index<Record>,
    /// Address -> size, for range queries: the live blocks marked `ordered`.
    ranges: BTreeMap<u64, u64>,
    /// Address and size of exactly the live blocks not in `ranges`. Newest last.
    unordered: Vec<(u64, u64)>,
    bytes: u64,
    peak_bytes: u64,
    /// Boxed: a ledger sits inline in every link's state.
    freed: Box<[u64; FREED_HISTORY]>,
    freed_next: usize,
    /// Advances with every block recorded or taken off: a result derived from the
    /// ledger's blocks holds while the generation it was derived at is current.
    generation: u64,
}

/// Host memory one block's record takes at most, in the address index and the order
/// together (`ledger::tests::a_block_s_record_costs_at_most_the_ledger_entry_cost`
/// measures it: about 67 bytes a block at 100,000 blocks, 92 just after the index
/// doubled).
pub const LEDGER_ENTRY_COST: u64 = 128;

impl Default for Ledger {
    /// A ledger of blocks carved from a policy's memory: a block costs the host its
    /// record only.
    fn default() -> Self {
        Ledger::with_footprint(|size| size)
    }
}

impl Ledger {
    /// A ledger of blocks of the host's own memory, each costing `footprint(size)`
    /// bytes of it besides its record.
    pub fn with_footprint(footprint: fn(u64) -> u64) -> Self {
        Ledger {
            footprint,
            footprint_bytes: 0,
            blocks: Index::default(),
            ranges: BTreeMap::new(),
            unordered: Vec::with_capacity(UNORDERED_LIMIT),
            bytes: 0,
            peak_bytes: 0,
            freed: Box::new([0; FREED_HISTORY]),
            freed_next: 0,
            generation: 0,
        }
    }
}

impl Ledger {
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Host memory the live blocks take with their records.
    pub fn cost(&self) -> u64 {
        self.footprint_bytes
            .saturating_add(self.len() as u64 * LEDGER_ENTRY_COST)
    }

    /// Host memory one more block of `size` bytes would take with its record.
    #[inline]
    pub fn cost_of(&self, size: u64) -> u64 {
        (self.footprint)(size).saturating_add(LEDGER_ENTRY_COST)
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Bytes in all live blocks.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The most bytes live at once.
    pub fn peak_bytes(&self) -> u64 {
        self.peak_bytes
    }

    #[inline]
    pub fn get(&self, addr: u64) -> Option<Entry> {
        self.blocks.get(addr).map(Record::entry)
    }

    /// Name the thread cache that holds the block at `addr`; false if there is none.
    /// (The only change made to a block in place: its address and size never change.)
    pub fn set_cache(&mut self, addr: u64, cache: Option<CacheId>) -> bool {
        match self.blocks.get_mut(addr) {
            Some(record) => {
                record.cache = cache;
                true
            }
            None => false,
        }
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Every block, by address. O(n log n), from the address index alone: for audits
    /// and for releasing a dead link's memory, not hot paths.
    pub fn iter(&self) -> impl Iterator<Item = (u64, Entry)> + use<> {
        let mut all: Vec<(u64, Entry)> = self.blocks.iter().map(|(a, r)| (a, r.entry())).collect();
        all.sort_unstable_by_key(|&(a, _)| a);
        all.into_iter()
    }

    /// The order of every live block built afresh from the address index, for audits,
    /// which should not rely on the lazily kept order they check: see
    /// [`Ordered::from`].
    pub fn order_afresh(&self) -> BTreeMap<u64, u64> {
        self.iter().map(|(a, e)| (a, e.size)).collect()
    }

    /// The order of every live block, for range queries.
    pub fn ordered(&mut self) -> Ordered<'_> {
        for (addr, size) in self.unordered.drain(..) {
            let record = self.blocks.get_mut(addr).expect("waiting blocks are live");
            record.ordered = true;
            self.ranges.insert(addr, size);
        }
        Ordered(&self.ranges)
    }

    /// Every live block for the nearest-block queries: the order, and the blocks still
    /// waiting outside it while they are few enough to scan.
    pub fn nearby(&mut self) -> Nearby<'_> {
        if self.unordered.len() > SCAN_LIMIT {
            self.ordered();
        }
        Nearby {
            ordered: Ordered(&self.ranges),
            waiting: &self.unordered,
        }
    }

    /// Record a newly lent block. The caller has checked that it overlaps nothing.
    #[inline]
    pub fn insert(&mut self, addr: u64, size: u64) {
        debug_assert!(!self.overlaps_any(addr, size));
        if self.unordered.len() == UNORDERED_LIMIT {
            self.ordered();
        }
        self.unordered.push((addr, size));
        let record = Record {
            size,
            cache: None,
            ordered: false,
        };
        self.blocks.insert(addr, record);
        self.bytes += size;
        self.footprint_bytes += (self.footprint)(size);
        self.peak_bytes = self.peak_bytes.max(self.bytes);
        self.generation += 1;
    }

    /// Does `[addr, addr+size)` overlap a live block? Leaves the order as lazy as it
    /// was, so that checking it in debug builds does not change what tests exercise.
    fn overlaps_any(&self, addr: u64, size: u64) -> bool {
        Nearby {
            ordered: Ordered(&self.ranges),
            waiting: &self.unordered,
        }
        .overlapping(addr, size)
        .is_some()
    }

    /// Take back the block at `addr` that must have been lent with `size` bytes.
    #[inline]
    pub fn take_back(&mut self, addr: u64, size: u64) -> Result<Entry, TakeBack> {
        match self.remove_unless(addr, |e| e.size != size) {
            Ok(entry) => Ok(entry),
            Err(Some(kept)) => Err(TakeBack::WrongSize {
                recorded: kept.size,
            }),
            Err(None) => Err(self.why_unknown(addr)),
        }
    }

    /// Remove the block at `addr` unless `keep` holds for it: `Ok` with the entry removed,
    /// `Err(Some)` with the entry left on the books, `Err(None)` when no block starts
    /// there. One probe for the look and the removal: every give-back's path.
    #[inline]
    pub fn remove_unless(
        &mut self,
        addr: u64,
        keep: impl FnOnce(&Entry) -> bool,
    ) -> Result<Entry, Option<Entry>> {
        match self.blocks.remove_unless(addr, |r| keep(&r.entry())) {
            Ok(record) => Ok(self.forget(addr, record)),
            Err(kept) => Err(kept.map(|r| r.entry())),
        }
    }

    /// Remove the block at `addr` whatever its size.
    pub fn remove(&mut self, addr: u64) -> Option<Entry> {
        let record = self.blocks.remove(addr)?;
        Some(self.forget(addr, record))
    }

    /// The bookkeeping of a block just removed from the address index.
    #[inline]
    fn forget(&mut self, addr: u64, record: Record) -> Entry {
        if record.ordered {
            self.ranges.remove(&addr);
        } else if self.unordered.last().is_some_and(|&(a, _)| a == addr) {
            // The common life: lent and taken back with nothing in between.
            self.unordered.pop();
        } else {
            self.unlist(addr);
        }
        self.bytes -= record.size;
        self.footprint_bytes -= (self.footprint)(record.size);
        self.generation += 1;
        self.freed[self.freed_next] = addr;
        self.freed_next = (self.freed_next + 1) % FREED_HISTORY;
        record.entry()
    }

    /// Take a block that is not the newest off the waiting list. Out of line, so that
    /// the common take-back stays short.
    #[cold]
    #[inline(never)]
    fn unlist(&mut self, addr: u64) {
        let at = self
            .unordered
            .iter()
            .rposition(|&(a, _)| a == addr)
            .expect("a block outside the order waits in the list");
        self.unordered.remove(at);
    }

    /// Why an address that is not live cannot be freed.
    pub fn why_unknown(&self, addr: u64) -> TakeBack {
        if addr != 0 && self.freed.contains(&addr) {
            TakeBack::AlreadyFreed
        } else {
            TakeBack::Unknown
        }
    }

    /// Do the address index, the order and the waiting list hold the same blocks,
    /// disjoint, with the byte count their sum? O(n log n): for audits, not hot paths.
    pub fn check_consistent(&self) -> Result<(), &'static str> {
        let ordered = self.blocks.iter().filter(|(_, r)| r.ordered).count();
        if self.ranges.len() != ordered {
            return Err("ledger order and address index disagree on the number of blocks");
        }
        for (&addr, &size) in &self.ranges {
            match self.blocks.get(addr) {
                Some(r) if r.ordered && r.size == size => {}
                _ => return Err("ledger order and address index disagree on a block"),
            }
        }
        let waiting = self.blocks.iter().filter(|(_, r)| !r.ordered).count();
        let listed = self.unordered.iter().all(|&(a, size)| {
            self.blocks
                .get(a)
                .is_some_and(|r| !r.ordered && r.size == size)
        });
        if waiting != self.unordered.len() || !listed {
            return Err("ledger's waiting list and address index disagree");
        }
        let mut end = 0;
        let mut bytes = 0u64;
        for (addr, entry) in self.iter() {
            if addr < end {
                return Err("ledger holds overlapping blocks");
            }
            end = addr.saturating_add(entry.size);
            bytes += entry.size;
        }
        if bytes != self.bytes {
            return Err("ledger byte count is not the sum of its blocks");
        }
        Ok(())
    }

    /// Every block, emptying the ledger.
    pub fn drain(&mut self) -> Vec<(u64, Entry)> {
        self.bytes = 0;
        self.footprint_bytes = 0;
        self.generation += 1;
        self.ranges.clear();
        self.unordered.clear();
        self.blocks
            .take_all()
            .into_iter()
            .map(|(a, r)| (a, r.entry()))
            .collect()
    }
}

/// A ledger's live blocks in address order; they never overlap each other.
#[derive(Debug, Clone, Copy)]
pub struct Ordered<'a>(&'a BTreeMap<u64, u64>);

impl<'a> From<&'a BTreeMap<u64, u64>> for Ordered<'a> {
    /// Disjoint blocks, address -> size, in order.
    fn from(blocks: &'a BTreeMap<u64, u64>) -> Self {
        Ordered(blocks)
    }
}

impl<'a> Ordered<'a> {
    /// The live block that `[addr, addr+len)` overlaps, if any (the lowest such block is
    /// not promised, only some block). `len` is at least 1 for every block the host
    /// records, so empty ranges never overlap.
    pub fn overlapping(self, addr: u64, len: u64) -> Option<(u64, u64)> {
        let end = addr.checked_add(len)?;
        // The last block starting before `end` is the only candidate that can reach into
        // the range from below or start inside it; blocks never overlap each other.
        let (&start, &size) = self.0.range(..end).next_back()?;
        (start + size > addr).then_some((start, size))
    }

    /// Every live block overlapping `[addr, addr+len)`, highest first.
    pub fn overlapping_all(self, addr: u64, len: u64) -> impl Iterator<Item = (u64, u64)> + 'a {
        let end = addr.saturating_add(len);
        // Blocks are disjoint and sorted: walking down from `end`, the first block that
        // ends at or before `addr` ends the walk.
        self.0
            .range(..end)
            .rev()
            .map(|(&start, &size)| (start, size))
            .take_while(move |&(start, size)| start + size > addr)
    }

    /// The free stretch around `[addr, addr+len)` (`len` at least 1): from the end of
    /// the nearest block below it to the start of the nearest block above it, or `None`
    /// when a block overlaps the range.
    pub fn gap_around(self, addr: u64, len: u64) -> Option<(u64, u64)> {
        let end = addr.checked_add(len)?;
        let below = match self.0.range(..end).next_back() {
            Some((&start, &size)) if start + size > addr => return None,
            Some((&start, &size)) => start + size,
            None => 0,
        };
        let above = self.0.range(end..).next().map_or(u64::MAX, |(&a, _)| a);
        Some((below, above))
    }

    /// The live block that wholly contains `[addr, addr+len)`.
    pub fn containing(self, addr: u64, len: u64) -> Option<(u64, u64)> {
        let end = addr.checked_add(len)?;
        let (&start, &size) = self.0.range(..=addr).next_back()?;
        (start + size >= end).then_some((start, size))
    }
}

/// A ledger's live blocks for the queries that need only the blocks nearest a range:
/// the ordered ones, and the few still waiting outside the order, scanned.
#[derive(Debug, Clone, Copy)]
pub struct Nearby<'a> {
    ordered: Ordered<'a>,
    waiting: &'a [(u64, u64)],
}

impl Nearby<'_> {
    /// As [`Ordered::overlapping`].
    pub fn overlapping(self, addr: u64, len: u64) -> Option<(u64, u64)> {
        let end = addr.checked_add(len)?;
        self.ordered.overlapping(addr, len).or_else(|| {
            self.waiting
                .iter()
                .copied()
                .find(|&(start, size)| start < end && start + size > addr)
        })
    }

    /// As [`Ordered::gap_around`].
    pub fn gap_around(self, addr: u64, len: u64) -> Option<(u64, u64)> {
        let end = addr.checked_add(len)?;
        let (mut below, mut above) = self.ordered.gap_around(addr, len)?;
        for &(start, size) in self.waiting {
            if start >= end {
                above = above.min(start);
            } else if start + size <= addr {
                below = below.max(start + size);
            } else {
                return None;
            }
        }
        Some((below, above))
    }

    /// As [`Ordered::containing`]: blocks are disjoint, so at most one contains it.
    pub fn containing(self, addr: u64, len: u64) -> Option<(u64, u64)> {
        let end = addr.checked_add(len)?;
        self.ordered.containing(addr, len).or_else(|| {
            self.waiting
                .iter()
                .copied()
                .find(|&(start, size)| start <= addr && end <= start + size)
        })
    }
}

#[cfg(test)]
mod tests;
