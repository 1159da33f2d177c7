//! One thread's share of a handler: its magazines, what it lent from them, its counters,
//! and the hits that serve a request from them.

use super::counts::Counts;
use super::lent::Lent;
use super::magazine::{MAGAZINE_TABLE_SIZE, Magazines};

/// One thread's share of a handler.
#[derive(Debug, Default)]
pub struct ThreadCache {
    /// `None` when the handler keeps no magazines.
    pub magazines: Option<Magazines>,
    /// Blocks taken from this cache's magazines that the client holds: address → size.
    pub lent: Lent,
    pub counts: Counts,
}

/// How far a magazine hit may reach. `IN_PLACE` touches only the cache's fixed parts
/// (the size table, the recent array, capacity already there): it calls nothing and
/// allocates nothing, so the hit inlined into a caller needs no stack frame, and
/// anything else is left to the full path. `FULL` also uses the lent map, mid sizes,
/// and grows a magazine.
#[derive(Debug)]
pub struct Reach;

impl Reach {
    pub const IN_PLACE: bool = true;
    pub const FULL: bool = false;
}

impl ThreadCache {
    /// A client's request of `size` bytes served from a magazine, counted as a hit and
    /// lent (the caller counts the request); `None` when the magazine is empty, or it is
    /// beyond [`Reach`] `IN_PLACE` (nothing changed then).
    #[inline(always)]
    pub fn take<const IN_PLACE: bool>(&mut self, size: u64) -> Option<u64> {
        let magazines = self.magazines.as_mut()?;
        let magazine = match IN_PLACE {
            true if size <= MAGAZINE_TABLE_SIZE => &mut magazines.small[size as usize],
            true => return None,
            false => magazines.of_size(size),
        };
        // In place, the block's record goes into a free place of the array or nowhere.
        let place = match IN_PLACE {
            true => Some(self.lent.free_place()?),
            false => None,
        };
        let addr = magazine.blocks.pop()?;
        magazines.cached_bytes -= size;
        match place {
            Some(place) => self.lent.put(place, addr, size),
            None => self.lent.insert(addr, size),
        }
        self.counts.magazine_hits += 1;
        self.counts.lend(size);
        Some(addr)
    }

    /// A client's free of `addr`, said to have `said` bytes (`None`: it said no size),
    /// taken back into a magazine if this cache lent it and the magazine has room: the
    /// size it was lent with. None leaves everything as it was (also for what is beyond
    /// [`Reach`] `IN_PLACE`).
    #[inline(always)]
    pub fn put_back<const IN_PLACE: bool>(&mut self, addr: u64, said: Option<u64>) -> Option<u64> {
        let (place, recorded) = match self.lent.recent_place(addr) {
            Some(place) => (Some(place), self.lent.recent[place].1),
            None if IN_PLACE => return None,
            None => (None, self.lent.older_size(addr)?),
        };
        let magazines = self.magazines.as_mut()?;
        let magazine = magazines.with_room::<IN_PLACE>(recorded)?;
        magazine.blocks.push(addr);
        magazines.cached_bytes += recorded;
        match place {
            Some(place) => self.lent.recent[place] = (0, 0),
            None => {
                self.lent.remove_older(addr);
            }
        }
        self.counts.frees += 1;
        self.counts.freed(recorded, said);
        Some(recorded)
    }

    /// Put a block the client gave back into its magazine if there is room without a
    /// spill. Returns whether it did.
    pub fn keep(&mut self, addr: u64, size: u64) -> bool {
        let Some(magazines) = self.magazines.as_mut() else {
            return false;
        };
        let Some(magazine) = magazines.with_room::<{ Reach::FULL }>(size) else {
            return false;
        };
        magazine.blocks.push(addr);
        magazines.cached_bytes += size;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::lent::RECENT;

    fn cache_with(size: u64, blocks: &[u64]) -> ThreadCache {
        let mut cache = ThreadCache {
            magazines: Some(Magazines::new()),
            ..ThreadCache::default()
        };
        let magazines = cache.magazines.as_mut().unwrap();
        let magazine = magazines.of_size(size);
        magazine.blocks = blocks.to_vec();
        magazines.cached_bytes = size * blocks.len() as u64;
        cache
    }

    #[test]
    fn an_in_place_hit_leaves_to_the_full_path_what_would_need_a_call() {
        const IN_PLACE: bool = Reach::IN_PLACE;
        const FULL: bool = Reach::FULL;
        let blocks: Vec<u64> = (1..=12).map(|i| i * 0x1000).collect();
        let mut c = cache_with(16, &blocks);
        // The recent array's places fill up; then the record would go to the map.
        let taken: Vec<u64> = (0..RECENT)
            .map(|_| c.take::<IN_PLACE>(16).unwrap())
            .collect();
        c.counts.mallocs += RECENT as u64;
        assert_eq!(c.take::<IN_PLACE>(16), None);
        assert_eq!(c.magazines.as_ref().unwrap().small[16].blocks.len(), 4);
        let spilled_by = c.take::<FULL>(16).unwrap();
        c.counts.mallocs += 1;
        assert_eq!(c.lent.older.len(), 1, "the oldest record moved to the map");
        // A block recorded in the map goes back only on the full path.
        let in_map = taken[0];
        assert!(c.put_back::<IN_PLACE>(in_map, Some(16)).is_none());
        assert_eq!(c.lent.get(in_map), Some(16), "nothing changed");
        // With no spare capacity, in place would have to grow the magazine.
        c.magazines.as_mut().unwrap().small[16]
            .blocks
            .shrink_to_fit();
        assert!(c.put_back::<IN_PLACE>(spilled_by, Some(16)).is_none());
        assert_eq!(c.lent.get(spilled_by), Some(16), "nothing changed");
        assert_eq!(c.put_back::<FULL>(spilled_by, Some(16)), Some(16));
        assert_eq!(c.put_back::<FULL>(in_map, Some(16)), Some(16));
        // Now there is room: in place takes a recent block back.
        assert_eq!(c.put_back::<IN_PLACE>(taken[1], Some(16)), Some(16));
        assert_eq!(c.lent.get(taken[1]), None);
        assert_eq!((c.counts.mallocs, c.counts.frees), (9, 3));
        // Mid sizes are the full path's.
        let mut mid = cache_with(4096, &[0x10000]);
        assert_eq!(mid.take::<IN_PLACE>(4096), None);
        assert_eq!(mid.take::<FULL>(4096), Some(0x10000));
    }
}
