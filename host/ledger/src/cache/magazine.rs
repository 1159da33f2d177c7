//! Magazines: blocks of one size the top policy placed ahead of demand, one magazine per
//! exact size, per thread.

use crate::fasthash::FastMap;

/// Requests of at most this many bytes may be served from a magazine: NumPy's small and
/// mid-size arrays up to 64 KiB, and Numba's, whose block holds a 48-byte header and up
/// to 31 bytes of alignment padding before the data.
pub const MAGAZINE_MAX_SIZE: u64 = (64 << 10) + 128;
/// Sizes up to this have their magazine in a table indexed by size; larger ones in a map.
pub const MAGAZINE_TABLE_SIZE: u64 = 1024;
/// Bytes one magazine may cache: its depth is this many bytes of blocks, within
/// [`MAGAZINE_MIN_DEPTH`]..=[`MAGAZINE_DEPTH`] blocks, so a 16-byte magazine holds 64
/// blocks and a 64 KiB one 4.
const MAGAZINE_BYTES: u64 = 256 << 10;
/// Blocks a magazine holds at most before half of them are given back in one `free-many`.
pub const MAGAZINE_DEPTH: usize = 64;
const MAGAZINE_MIN_DEPTH: usize = 4;
/// The most blocks fetched with one `malloc-many` when a magazine runs empty.
const MAGAZINE_REFILL: u32 = 16;
/// Bytes all magazines of one thread cache may hold together; past it, frees go to the
/// policy. Thread ids and pointers are reused, so a handler has at most
/// [`crate::by_thread::NAMED`] more caches (places of exited threads, given back empty)
/// than threads ever ran on it at once.
pub const MAGAZINES_THREAD_BYTES: u64 = 16 << 20;

/// How many blocks of `size` bytes a magazine holds before it spills.
fn magazine_depth(size: u64) -> usize {
    ((MAGAZINE_BYTES / size) as usize).clamp(MAGAZINE_MIN_DEPTH, MAGAZINE_DEPTH)
}

/// The most blocks of `size` bytes one refill asks for: a quarter of the depth.
fn magazine_refill(size: u64) -> u32 {
    (magazine_depth(size) as u32 / 4).clamp(1, MAGAZINE_REFILL)
}

/// Blocks of one size the top policy placed ahead of demand.
#[derive(Debug)]
pub struct Magazine {
    pub blocks: Vec<u64>,
    /// [`magazine_depth`] of its size, kept so that the hot path does not divide.
    pub depth: usize,
    /// Blocks the next refill asks for. It starts at one and doubles with every refill
    /// up to [`magazine_refill`] (slow start): a size asked for once costs the policy one
    /// block, not a batch the client never uses; a size in steady use soon gets full
    /// batches.
    next_refill: u32,
}

impl Magazine {
    /// A magazine for `size`, at most `most` blocks deep.
    fn new(size: u64, most: usize) -> Self {
        Magazine {
            blocks: Vec::new(),
            depth: magazine_depth(size).min(most.max(1)),
            next_refill: 1,
        }
    }

    /// How many blocks to ask the policy for now; grows the next refill.
    pub fn refill_count(&mut self, size: u64) -> u32 {
        let count = self.next_refill;
        let most = (self.depth as u32 / 4).max(1);
        self.next_refill = (count * 2).min(magazine_refill(size)).min(most);
        count
    }
}

/// One magazine per exact size up to [`MAGAZINE_MAX_SIZE`] (the ledger records exact
/// sizes, and a block goes back with the size it was lent with).
#[derive(Debug)]
pub struct Magazines {
    /// Sizes up to [`MAGAZINE_TABLE_SIZE`], indexed by size: the hot path. Built with
    /// the cache, so that a lookup is one bounds check (which is also the size check).
    pub(super) small: Box<[Magazine; MAGAZINE_TABLE_SIZE as usize + 1]>,
    mid: FastMap<u64, Magazine>,
    /// Bytes in all magazines' blocks.
    pub cached_bytes: u64,
    /// The deepest a magazine is ([`MAGAZINE_DEPTH`] but for the contract checker's).
    most: usize,
}

impl Default for Magazines {
    fn default() -> Self {
        Magazines::new()
    }
}

impl Magazines {
    pub fn new() -> Self {
        Magazines::at_most(MAGAZINE_DEPTH)
    }

    /// Magazines of at most `most` blocks each: the contract checker's shallower ones
    /// give a policy back and ask it for blocks in smaller batches, more often.
    pub fn at_most(most: usize) -> Self {
        Magazines {
            small: (0..=MAGAZINE_TABLE_SIZE)
                .map(|s| Magazine::new(s.max(1), most))
                .collect::<Box<[_]>>()
                .try_into()
                .expect("one magazine per size up to the table's"),
            mid: FastMap::default(),
            cached_bytes: 0,
            most,
        }
    }

    #[inline(always)]
    pub fn of_size(&mut self, size: u64) -> &mut Magazine {
        if size <= MAGAZINE_TABLE_SIZE {
            // The table's length is in its type, so this compare is the only check.
            return &mut self.small[size as usize];
        }
        self.of_mid_size(size)
    }

    /// The magazine for `size` if it may take one more block: under the thread's byte
    /// bound and its depth. `IN_PLACE` asks for a table size whose blocks have spare
    /// capacity, so that the push neither calls nor allocates (see [`Reach`]).
    #[inline(always)]
    pub(super) fn with_room<const IN_PLACE: bool>(&mut self, size: u64) -> Option<&mut Magazine> {
        if self.cached_bytes + size > MAGAZINES_THREAD_BYTES {
            return None;
        }
        let magazine = match IN_PLACE {
            true if size <= MAGAZINE_TABLE_SIZE => &mut self.small[size as usize],
            true => return None,
            false => self.of_size(size),
        };
        let len = magazine.blocks.len();
        let room = len < magazine.depth && (!IN_PLACE || len < magazine.blocks.capacity());
        room.then_some(magazine)
    }

    /// Out of line: a hash lookup inlined into the small sizes' path would spread it
    /// over more instruction-cache lines.
    #[inline(never)]
    fn of_mid_size(&mut self, size: u64) -> &mut Magazine {
        let most = self.most;
        self.mid
            .entry(size)
            .or_insert_with(|| Magazine::new(size, most))
    }

    /// Every non-empty magazine's blocks, emptying them, with their size, smallest size
    /// first: the order the policy is given them back in depends on nothing but what
    /// the magazines hold (a map's order would differ from process to process, and a
    /// checker's script would not replay).
    pub fn drain(&mut self) -> Vec<(u64, Vec<u64>)> {
        self.cached_bytes = 0;
        let small = self
            .small
            .iter_mut()
            .enumerate()
            .map(|(s, m)| (s as u64, m));
        let mut mid: Vec<_> = self.mid.iter_mut().map(|(&s, m)| (s, m)).collect();
        mid.sort_unstable_by_key(|&(size, _)| size);
        small
            .chain(mid)
            .filter(|(_, m)| !m.blocks.is_empty())
            .map(|(size, m)| (size, std::mem::take(&mut m.blocks)))
            .collect()
    }

    /// Every cached block with its size, for audits.
    pub fn blocks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let small = self.small.iter().enumerate().map(|(s, m)| (s as u64, m));
        let mid = self.mid.iter().map(|(&s, m)| (s, m));
        small
            .chain(mid)
            .flat_map(|(size, m)| m.blocks.iter().map(move |&a| (a, size)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magazine_depth_is_bounded_by_bytes_and_refills_by_depth() {
        assert_eq!(magazine_depth(16), MAGAZINE_DEPTH);
        assert_eq!(magazine_depth(4096), 64);
        assert_eq!(magazine_depth(16 << 10), 16);
        assert_eq!(magazine_depth(64 << 10), MAGAZINE_MIN_DEPTH);
        assert_eq!(magazine_refill(16), MAGAZINE_REFILL);
        assert_eq!(magazine_refill(16 << 10), 4);
        assert_eq!(magazine_refill(64 << 10), 1);
    }

    #[test]
    fn a_shallow_magazine_refills_and_holds_in_smaller_batches() {
        let mut shallow = Magazines::at_most(8);
        let magazine = shallow.of_size(64);
        assert_eq!(magazine.depth, 8);
        let refills: Vec<u32> = (0..4).map(|_| magazine.refill_count(64)).collect();
        assert_eq!(refills, [1, 2, 2, 2], "a quarter of its depth at most");
        assert_eq!(
            shallow.of_size(60_000).depth,
            MAGAZINE_MIN_DEPTH,
            "never deeper"
        );
        let mut production = Magazines::new();
        let refills: Vec<u32> = (0..6)
            .map(|_| production.of_size(64).refill_count(64))
            .collect();
        assert_eq!(refills, [1, 2, 4, 8, 16, 16]);
    }

    #[test]
    fn magazines_drain_smallest_size_first() {
        let mut magazines = Magazines::new();
        for size in [60_000, 2048, 16, 40_000, 1025] {
            magazines.of_size(size).blocks.push(size * 16);
        }
        let sizes: Vec<u64> = magazines.drain().into_iter().map(|(s, _)| s).collect();
        assert_eq!(sizes, [16, 1025, 2048, 40_000, 60_000]);
    }
}
