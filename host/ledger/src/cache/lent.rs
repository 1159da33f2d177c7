//! The blocks a thread cache lent to its client.

use crate::fasthash::FastMap;

/// How many of the blocks lent last sit in [`Lent`]'s array rather than its map.
pub(super) const RECENT: usize = 8;

/// Blocks a thread cache lent to the client: address → size. The last few lent sit in
/// a small array that is scanned before the map, so a block freed soon after it was
/// taken (a temporary) never touches the map. Each block is in exactly one of the two.
#[derive(Debug, Default)]
pub struct Lent {
    /// `(address, size)`; address 0 marks a free place (no block lies at 0).
    pub(super) recent: [(u64, u64); RECENT],
    next: usize,
    pub(super) older: FastMap<u64, u64>,
}

impl Lent {
    /// The array's next place, when it is free.
    #[inline(always)]
    pub(super) fn free_place(&self) -> Option<usize> {
        // Reduced here rather than when stored, so that the index needs no bounds check.
        let next = self.next % RECENT;
        (self.recent[next].0 == 0).then_some(next)
    }

    #[inline(always)]
    pub(super) fn put(&mut self, place: usize, addr: u64, size: u64) {
        self.recent[place] = (addr, size);
        self.next = place + 1;
    }

    #[inline]
    pub fn insert(&mut self, addr: u64, size: u64) {
        let place = match self.free_place() {
            Some(place) => place,
            None => self.make_place(),
        };
        self.put(place, addr, size);
    }

    // The map's paths are out of line, so that the hits around them stay short.

    /// Free the array's next place: its block's record moves to the map.
    #[inline(never)]
    fn make_place(&mut self) -> usize {
        let place = self.next % RECENT;
        let (addr, size) = std::mem::take(&mut self.recent[place]);
        self.older.insert(addr, size);
        place
    }

    #[inline(never)]
    pub(super) fn older_size(&self, addr: u64) -> Option<u64> {
        self.older.get(&addr).copied()
    }

    #[inline(never)]
    pub(super) fn remove_older(&mut self, addr: u64) -> Option<u64> {
        self.older.remove(&addr)
    }

    /// The array place that records `addr`: the last one put first, as a temporary
    /// freed right after it was taken is, then the others, compared without a branch
    /// each: NumPy frees its temporaries out of order, and a branch per place was
    /// mispredicted on most of its frees.
    #[inline(always)]
    pub(super) fn recent_place(&self, addr: u64) -> Option<usize> {
        let last = self.next.wrapping_sub(1) % RECENT;
        if self.recent[last].0 == addr {
            return Some(last);
        }
        let matches = (self.recent.iter().enumerate()).fold(0u32, |found, (place, &(a, _))| {
            found | u32::from(a == addr) << place
        });
        (matches != 0).then(|| matches.trailing_zeros() as usize)
    }

    /// Take the block at `addr` off the record, with its size.
    pub fn remove(&mut self, addr: u64) -> Option<u64> {
        match self.recent_place(addr) {
            Some(place) => Some(std::mem::take(&mut self.recent[place]).1),
            None => self.remove_older(addr),
        }
    }

    pub fn get(&self, addr: u64) -> Option<u64> {
        match self.recent.iter().find(|(a, _)| *a == addr) {
            Some(&(_, size)) => Some(size),
            None => self.older.get(&addr).copied(),
        }
    }

    /// Every block, `(address, size)`, in no order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let recent = self.recent.iter().copied().filter(|&(a, _)| a != 0);
        recent.chain(self.older.iter().map(|(&a, &s)| (a, s)))
    }

    /// Every block's address, taking them all off the record.
    pub fn take_all(&mut self) -> Vec<u64> {
        let blocks = self.iter().map(|(addr, _)| addr).collect();
        *self = Lent::default();
        blocks
    }
}
