//! The ledger's address index: address -> record, for every live block.
//!
//! Most blocks live for one malloc/free pair, and a hash insert and removal for each was
//! the larger part of what a ledger costs a component call. So the newest few blocks
//! wait in a short array beside the hash map and enter it only when newer ones push them
//! out; a block taken back before then never touches the map. A lookup scans the array
//! first: a few compares, newest first, which is where a pair's free finds its block.
//! (callgrind, a `system` per-op pair, which passes two ledgers: the host's
//! instructions went from 1,876 to 1,559 with this.)

use crate::fasthash::FastMap;

/// How many of the newest blocks wait outside the hash map.
pub(super) const RECENT: usize = 4;

#[derive(Debug)]
pub(super) struct Index<R> {
    /// The newest blocks, oldest first: `recent[..recent_len]`. None of them is in `map`.
    recent: [(u64, R); RECENT],
    recent_len: usize,
    map: FastMap<u64, R>,
}

impl<R: Copy + Default> Default for Index<R> {
    fn default() -> Self {
        Index {
            recent: [(0, R::default()); RECENT],
            recent_len: 0,
            map: FastMap::default(),
        }
    }
}

impl<R: Copy + Default> Index<R> {
    pub(super) fn len(&self) -> usize {
        self.recent_len + self.map.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where `addr` waits among the recent blocks, newest first.
    #[inline]
    fn recent_at(&self, addr: u64) -> Option<usize> {
        self.recent[..self.recent_len]
            .iter()
            .rposition(|&(a, _)| a == addr)
    }

    #[inline]
    pub(super) fn get(&self, addr: u64) -> Option<&R> {
        match self.recent_at(addr) {
            Some(i) => Some(&self.recent[i].1),
            None => self.map.get(&addr),
        }
    }

    #[inline]
    pub(super) fn get_mut(&mut self, addr: u64) -> Option<&mut R> {
        match self.recent_at(addr) {
            Some(i) => Some(&mut self.recent[i].1),
            None => self.map.get_mut(&addr),
        }
    }

    /// Record a block that is not in the index.
    #[inline]
    pub(super) fn insert(&mut self, addr: u64, record: R) {
        debug_assert!(self.get(addr).is_none(), "a live block is recorded once");
        if self.recent_len == RECENT {
            self.evict_oldest();
        }
        self.recent[self.recent_len] = (addr, record);
        self.recent_len += 1;
    }

    /// Move the oldest recent block into the map. Out of line: a pair never needs it.
    #[cold]
    #[inline(never)]
    fn evict_oldest(&mut self) {
        let (addr, record) = self.recent[0];
        self.map.insert(addr, record);
        self.recent.copy_within(1..self.recent_len, 0);
        self.recent_len -= 1;
    }

    /// Take the block at `addr` off the index if `keep` does not hold for its record:
    /// `Ok` with its record, `Err(Some)` with the record left in place when `keep`
    /// holds, `Err(None)` when there is no such block. One probe either way.
    #[inline]
    pub(super) fn remove_unless(
        &mut self,
        addr: u64,
        keep: impl FnOnce(&R) -> bool,
    ) -> Result<R, Option<R>> {
        if let Some(i) = self.recent_at(addr) {
            let record = self.recent[i].1;
            if keep(&record) {
                return Err(Some(record));
            }
            // The newest, in a pair: nothing after it to move (and no `memmove` call).
            if i + 1 < self.recent_len {
                self.recent.copy_within(i + 1..self.recent_len, i);
            }
            self.recent_len -= 1;
            return Ok(record);
        }
        match self.map.entry(addr) {
            std::collections::hash_map::Entry::Occupied(found) if !keep(found.get()) => {
                Ok(found.remove())
            }
            std::collections::hash_map::Entry::Occupied(found) => Err(Some(*found.get())),
            std::collections::hash_map::Entry::Vacant(_) => Err(None),
        }
    }

    pub(super) fn remove(&mut self, addr: u64) -> Option<R> {
        self.remove_unless(addr, |_| false).ok()
    }

    /// Every block, in no particular order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, &R)> {
        self.recent[..self.recent_len]
            .iter()
            .map(|(a, r)| (*a, r))
            .chain(self.map.iter().map(|(&a, r)| (a, r)))
    }

    /// Every block, emptying the index.
    pub(super) fn take_all(&mut self) -> Vec<(u64, R)> {
        let mut all: Vec<(u64, R)> = self.recent[..self.recent_len].to_vec();
        self.recent_len = 0;
        all.extend(std::mem::take(&mut self.map));
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_never_touches_the_map_and_older_blocks_move_into_it() {
        let mut index: Index<u64> = Index::default();
        index.insert(1, 10);
        assert_eq!(index.remove(1), Some(10));
        assert!(index.map.is_empty() && index.is_empty());
        for a in 1..=6 {
            index.insert(a, a * 10);
        }
        assert_eq!((index.recent_len, index.map.len()), (RECENT, 2));
        for a in 1..=6 {
            assert_eq!(index.get(a), Some(&(a * 10)));
        }
        // A block in the middle of the recent ones, and one in the map.
        assert_eq!(index.remove(4), Some(40));
        assert_eq!(index.remove(1), Some(10));
        assert_eq!(index.remove(1), None);
        let mut all: Vec<u64> = index.iter().map(|(a, _)| a).collect();
        all.sort_unstable();
        assert_eq!(all, [2, 3, 5, 6]);
        assert_eq!(index.take_all().len(), 4);
        assert!(index.is_empty());
    }

    #[test]
    fn a_kept_record_stays_where_it_was() {
        let mut index: Index<u64> = Index::default();
        for a in 1..=6 {
            index.insert(a, a);
        }
        for a in [1, 6] {
            assert_eq!(index.remove_unless(a, |_| true), Err(Some(a)));
            *index.get_mut(a).unwrap() += 100;
            assert_eq!(index.remove_unless(a, |&r| r != a + 100), Ok(a + 100));
        }
        assert_eq!(index.remove_unless(7, |_| false), Err(None));
        assert_eq!(index.len(), 4);
    }
}
