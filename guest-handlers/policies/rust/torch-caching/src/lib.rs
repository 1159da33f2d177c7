//! `torch-caching`: the shape of PyTorch's CUDA caching allocator, in a sandbox, to
//! compare with `gpu-pool` on a GPU program's trace. A device handler's blocks come from
//! segments of the GPU's memory (the `device` grant), cached once freed:
//!
//! - sizes are rounded up to 512 bytes;
//! - requests of up to 1 MiB come from the small pool, whose segments are 2 MiB; larger
//!   ones from the large pool, whose segments are 20 MiB for requests under 10 MiB and
//!   the request rounded up to 2 MiB otherwise;
//! - a request takes the smallest free block of its pool that holds it (best fit), split
//!   when what is left is worth keeping (at least 512 bytes in the small pool, more than
//!   1 MiB in the large); a freed block merges with free neighbours of its segment;
//! - when the GPU has no memory for a new segment, every segment with nothing lent from
//!   it is given back, and the segment asked for once more; `trim` gives them back too.
//!
//! The host gives a freed block back only once the work queued on its streams has
//! finished, so one stream-free pool serves every stream (PyTorch keeps a pool a
//! stream and waits on events itself).

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use allocbox_policy::memory::{self, GpuKind};
use allocbox_policy::{Config, Info, Policy, export_policy};

/// Every block's size is a multiple of this, and so is every offset in a segment.
const ROUND: u64 = 512;
/// The largest request the small pool serves.
const SMALL: u64 = 1 << 20;
const SMALL_SEGMENT: u64 = 2 << 20;
const LARGE_SEGMENT: u64 = 20 << 20;
/// Requests from here on get a segment of their own size, rounded to 2 MiB.
const LARGE_ALONE: u64 = 10 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Pool {
    Small,
    Large,
}

/// A stretch of a segment: lent or free.
#[derive(Clone, Copy)]
struct Block {
    size: u64,
    segment: u64,
    free: bool,
}

#[derive(Default)]
struct State {
    /// Every block, lent or free, by address.
    blocks: BTreeMap<u64, Block>,
    /// Free blocks of each pool, by `(size, address)`: the smallest that fits is the
    /// first from `(size, 0)`.
    free: BTreeMap<Pool, BTreeSet<(u64, u64)>>,
    /// Segments by start: `(size, pool, blocks lent from it)`.
    segments: BTreeMap<u64, (u64, Pool, u64)>,
    segment_bytes: u64,
    peak_segment_bytes: u64,
    splits: u64,
    released_to_retry: u64,
}

struct Caching {
    state: RefCell<State>,
}

fn rounded(size: u64) -> Option<u64> {
    size.max(1).checked_next_multiple_of(ROUND)
}

fn pool_of(size: u64) -> Pool {
    if size <= SMALL {
        Pool::Small
    } else {
        Pool::Large
    }
}

fn segment_for(size: u64) -> Option<u64> {
    match pool_of(size) {
        Pool::Small => Some(SMALL_SEGMENT),
        Pool::Large if size < LARGE_ALONE => Some(LARGE_SEGMENT),
        Pool::Large => size.checked_next_multiple_of(SMALL_SEGMENT),
    }
}

/// Is what is left of a block of `pool` after `size` of it worth a block of its own?
fn worth_splitting(pool: Pool, left: u64) -> bool {
    match pool {
        Pool::Small => left >= ROUND,
        Pool::Large => left > SMALL,
    }
}

impl State {
    fn free_set(&mut self, pool: Pool) -> &mut BTreeSet<(u64, u64)> {
        self.free.entry(pool).or_default()
    }

    fn mark_free(&mut self, addr: u64, block: Block, pool: Pool) {
        self.blocks.insert(
            addr,
            Block {
                free: true,
                ..block
            },
        );
        self.free_set(pool).insert((block.size, addr));
    }

    /// The smallest free block of `pool` that holds `size`, taken off the free set.
    fn best_fit(&mut self, pool: Pool, size: u64) -> Option<(u64, Block)> {
        let &(found, addr) = self.free_set(pool).range((size, 0)..).next()?;
        self.free_set(pool).remove(&(found, addr));
        Some((addr, self.blocks[&addr]))
    }

    /// Lend `size` bytes of the free block at `addr`, splitting off the rest when worth it.
    fn lend(&mut self, addr: u64, block: Block, size: u64, pool: Pool) -> u64 {
        let left = block.size - size;
        let size = if worth_splitting(pool, left) {
            self.splits += 1;
            let rest = Block {
                size: left,
                ..block
            };
            self.mark_free(addr + size, rest, pool);
            size
        } else {
            block.size
        };
        self.blocks.insert(
            addr,
            Block {
                size,
                segment: block.segment,
                free: false,
            },
        );
        self.segments
            .get_mut(&block.segment)
            .expect("its segment")
            .2 += 1;
        addr
    }

    /// Map a segment of `size` bytes for `pool`: its start.
    fn map_segment(&mut self, size: u64, pool: Pool) -> Option<u64> {
        let start = memory::map_gpu(size, GpuKind::Device).ok()?;
        self.segments.insert(start, (size, pool, 0));
        self.segment_bytes += size;
        self.peak_segment_bytes = self.peak_segment_bytes.max(self.segment_bytes);
        self.mark_free(
            start,
            Block {
                size,
                segment: start,
                free: true,
            },
            pool,
        );
        Some(start)
    }

    /// Give back every segment nothing is lent from.
    fn release_idle(&mut self) -> u64 {
        let idle: Vec<(u64, u64, Pool)> = self
            .segments
            .iter()
            .filter(|(_, segment)| segment.2 == 0)
            .map(|(&start, &(size, pool, _))| (start, size, pool))
            .collect();
        for &(start, size, pool) in &idle {
            // An idle segment is one free block: every block merged back.
            self.blocks.remove(&start);
            self.free_set(pool).remove(&(size, start));
            self.segments.remove(&start);
            self.segment_bytes -= size;
            memory::unmap(start, size);
        }
        idle.len() as u64
    }
}

impl Policy for Caching {
    fn init(_config: &mut Config) -> Result<Self, String> {
        Ok(Caching {
            state: RefCell::default(),
        })
    }

    fn info(&self) -> Info {
        // Segments start on 256 bytes at least; blocks lie at multiples of 512 in them.
        Info::new().alignment(256)
    }

    fn malloc(&self, size: u64) -> u64 {
        let state = &mut *self.state.borrow_mut();
        let (Some(size), Some(segment)) = (rounded(size), rounded(size).and_then(segment_for))
        else {
            return 0;
        };
        let pool = pool_of(size);
        if let Some((addr, block)) = state.best_fit(pool, size) {
            return state.lend(addr, block, size, pool);
        }
        let start = match state.map_segment(segment, pool) {
            Some(start) => start,
            None => {
                // Out of the GPU's memory: give back what is cached, and ask once more.
                state.released_to_retry += state.release_idle();
                match state.map_segment(segment, pool) {
                    Some(start) => start,
                    None => return 0,
                }
            }
        };
        let (addr, block) = state
            .best_fit(pool, size)
            .expect("the new segment holds it");
        debug_assert_eq!(addr, start);
        state.lend(addr, block, size, pool)
    }

    fn free(&self, ptr: u64, _size: u64) {
        let state = &mut *self.state.borrow_mut();
        let Some(&block) = state.blocks.get(&ptr) else {
            return;
        };
        let (_, pool, lent) = state.segments.get_mut(&block.segment).expect("its segment");
        *lent -= 1;
        let pool = *pool;
        let (mut addr, mut size) = (ptr, block.size);
        // Merge with the free block after it, then with the free one before it.
        if let Some(&next) = state.blocks.get(&(addr + size))
            && next.free
            && next.segment == block.segment
        {
            state.free_set(pool).remove(&(next.size, addr + size));
            state.blocks.remove(&(addr + size));
            size += next.size;
        }
        if let Some((&before, &prev)) = state.blocks.range(..addr).next_back()
            && prev.free
            && prev.segment == block.segment
            && before + prev.size == addr
        {
            state.free_set(pool).remove(&(prev.size, before));
            state.blocks.remove(&addr);
            addr = before;
            size += prev.size;
        }
        state.mark_free(
            addr,
            Block {
                size,
                segment: block.segment,
                free: true,
            },
            pool,
        );
    }

    fn trim(&self) {
        self.state.borrow_mut().release_idle();
    }

    fn report(&self) -> Vec<(String, u64)> {
        let state = self.state.borrow();
        let cached: u64 = state.free.values().flatten().map(|&(size, _)| size).sum();
        vec![
            ("segments".to_string(), state.segments.len() as u64),
            ("segment-bytes".to_string(), state.segment_bytes),
            ("peak-segment-bytes".to_string(), state.peak_segment_bytes),
            ("cached-bytes".to_string(), cached),
            ("splits".to_string(), state.splits),
            ("released-to-retry".to_string(), state.released_to_retry),
        ]
    }
}

export_policy!(Caching, name = "torch-caching");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_to_512_and_pools_and_segments_are_pytorch_s() {
        assert_eq!(rounded(1), Some(512));
        assert_eq!(rounded(513), Some(1024));
        assert_eq!(rounded(u64::MAX), None);
        assert_eq!(pool_of(SMALL), Pool::Small);
        assert_eq!(segment_for(4096), Some(SMALL_SEGMENT));
        assert_eq!(segment_for(3 << 20), Some(LARGE_SEGMENT));
        assert_eq!(segment_for((10 << 20) + 1), Some(12 << 20));
        assert!(worth_splitting(Pool::Small, 512) && !worth_splitting(Pool::Large, SMALL));
    }
}
