//! `arena`: carves large upstream chunks itself, so the common path never leaves the guest.
//!
//! - Chunks of `chunk-size` bytes (a power of two, 64 KiB..=1 GiB, default 1 MiB) come
//!   from upstream and are carved front to back by a bump pointer.
//! - Size classes: 16-byte steps up to 1024 bytes (64 classes: 16, 32, .., 1024), then
//!   powers of two from 2048 up to `chunk-size / 4`. Every class size is a multiple of
//!   16 and chunks are 16-aligned, so every block is 16-aligned; a block that is whole
//!   cache lines (64, 128, .., 1024, 2048, ..) starts on one.
//! - Freed blocks go on a per-class free list (a `Vec` in guest memory; the blocks
//!   themselves are never touched) and are reused last-in, first-out.
//! - Requests above `chunk-size / 4` go straight upstream; a map keyed by address keeps
//!   them, so `free` can check that it routes each one the way it came.
//! - `trim` gives back every chunk none of whose blocks is lent out, dropping those
//!   blocks from the free lists. Live counts are worked out only then (carved minus
//!   free-listed), which keeps the malloc and free paths to a `Vec` push or pop.
//!
//! When a chunk is too full for the next block its tail is left unused; the chunk still
//! goes back upstream once all its blocks are free.

use std::cell::RefCell;
use std::collections::BTreeMap;

use allocbox_policy::{Config, Info, Policy, bytes, export_policy, upstream};

const SMALL_STEP: u64 = 16;
const SMALL_MAX: u64 = 1024;
const SMALL_CLASSES: usize = (SMALL_MAX / SMALL_STEP) as usize;
const DEFAULT_CHUNK: u64 = 1 << 20;
const MIN_CHUNK: u64 = 64 << 10;
const MAX_CHUNK: u64 = 1 << 30;

fn class_of(size: u64) -> usize {
    // The host never sends 0, but a 0 must not wrap to a huge class.
    let size = size.max(1);
    if size <= SMALL_MAX {
        (size.div_ceil(SMALL_STEP) - 1) as usize
    } else {
        // ceil(log2(size)) - log2(2048) classes past the small ones.
        let log2 = 64 - (size - 1).leading_zeros();
        SMALL_CLASSES + (log2 - 11) as usize
    }
}

fn class_size(class: usize) -> u64 {
    if class < SMALL_CLASSES {
        (class as u64 + 1) * SMALL_STEP
    } else {
        (SMALL_MAX * 2) << (class - SMALL_CLASSES)
    }
}

/// Blocks that are whole cache lines start on one (and so, since each class is carved
/// in a run, every other block of their class does too); smaller ones on 16 bytes.
/// Carved from a 16-aligned chunk at its own stride, every block of a class shares one
/// offset in its line: at 48, every SIMD load of NumPy's 64 KiB arrays split lines, and
/// `c = b + a` ran 1.04-1.13x NumPy's default; line-aligned, 0.79-0.84x
/// (`python/bench_numpy.py`, mid-size).
fn line_alignment(size: u64) -> u64 {
    const LINE: u64 = 64;
    if size.is_multiple_of(LINE) {
        LINE
    } else {
        SMALL_STEP
    }
}

struct Arena {
    chunk_size: u64,
    /// Requests above this go straight upstream.
    large_limit: u64,
    /// Free blocks per size class.
    free: Vec<Vec<u64>>,
    /// Chunk base -> how many blocks were ever carved from it.
    chunks: BTreeMap<u64, u32>,
    /// The chunk being carved: its base, next free address and end (base 0: none yet).
    bump_base: u64,
    bump_next: u64,
    bump_end: u64,
    /// Upstream blocks lent out as they are: address -> size.
    large: BTreeMap<u64, u64>,
}

impl Arena {
    fn new(chunk_size: u64) -> Self {
        let large_limit = chunk_size / 4;
        Arena {
            chunk_size,
            large_limit,
            free: vec![Vec::new(); class_of(large_limit) + 1],
            chunks: BTreeMap::new(),
            bump_base: 0,
            bump_next: 0,
            bump_end: 0,
            large: BTreeMap::new(),
        }
    }

    fn is_large(&self, size: u64) -> bool {
        size > self.large_limit
    }

    /// A block for a small `size`, or 0 when upstream has no chunk for us.
    fn small(&mut self, size: u64) -> u64 {
        let class = class_of(size);
        if let Some(ptr) = self.free[class].pop() {
            return ptr;
        }
        let need = class_size(class);
        let mut ptr = self.bump_next.next_multiple_of(line_alignment(need));
        if self.bump_end.saturating_sub(ptr) < need {
            let base = upstream::malloc(self.chunk_size);
            if base == 0 {
                return 0;
            }
            self.chunks.insert(base, 0);
            self.bump_base = base;
            self.bump_end = base + self.chunk_size;
            ptr = base.next_multiple_of(line_alignment(need));
        }
        self.bump_next = ptr + need;
        *self
            .chunks
            .get_mut(&self.bump_base)
            .expect("bump chunk is tracked") += 1;
        ptr
    }

    fn lend_large(&mut self, ptr: u64, size: u64) -> u64 {
        if ptr != 0 {
            self.large.insert(ptr, size);
        }
        ptr
    }

    fn forget_large(&mut self, ptr: u64, size: u64) {
        match self.large.remove(&ptr) {
            Some(s) if s == size => {}
            found => {
                panic!("arena: large block {ptr:#x} of size {size} freed, but found {found:?}")
            }
        }
    }

    fn malloc(&mut self, size: u64) -> u64 {
        if self.is_large(size) {
            let ptr = upstream::malloc(size);
            self.lend_large(ptr, size)
        } else {
            self.small(size)
        }
    }

    fn free(&mut self, ptr: u64, size: u64) {
        if self.is_large(size) {
            self.forget_large(ptr, size);
            upstream::free(ptr, size);
        } else {
            self.free[class_of(size)].push(ptr);
        }
    }

    fn chunk_of(&self, ptr: u64) -> u64 {
        let (&base, _) = self
            .chunks
            .range(..=ptr)
            .next_back()
            .expect("block lies in a chunk");
        debug_assert!(ptr < base + self.chunk_size);
        base
    }

    fn trim(&mut self) {
        let mut idle: BTreeMap<u64, u32> = self.chunks.keys().map(|&b| (b, 0)).collect();
        for list in &self.free {
            for &ptr in list {
                *idle.get_mut(&self.chunk_of(ptr)).expect("chunk is tracked") += 1;
            }
        }
        // A chunk is dead when every block ever carved from it is on a free list.
        idle.retain(|base, free| *free == self.chunks[base]);
        if idle.is_empty() {
            return;
        }
        let mut free = std::mem::take(&mut self.free);
        for list in &mut free {
            list.retain(|&ptr| !idle.contains_key(&self.chunk_of(ptr)));
        }
        self.free = free;
        for &base in idle.keys() {
            self.chunks.remove(&base);
            upstream::free(base, self.chunk_size);
            if base == self.bump_base {
                self.bump_base = 0;
                self.bump_next = 0;
                self.bump_end = 0;
            }
        }
    }
}

/// The policy: the arena behind a `RefCell`, since the SDK lends it as `&self`. Upstream
/// cannot call back into us, so holding the borrow across its calls is fine; no borrow is
/// held across a call to our own methods.
struct ArenaPolicy {
    arena: RefCell<Arena>,
}

impl ArenaPolicy {
    fn with<R>(&self, f: impl FnOnce(&mut Arena) -> R) -> R {
        f(&mut self.arena.borrow_mut())
    }
}

fn parse_chunk_size(value: &str) -> Result<u64, String> {
    match value.parse::<u64>() {
        Ok(c) if c.is_power_of_two() && (MIN_CHUNK..=MAX_CHUNK).contains(&c) => Ok(c),
        _ => Err(format!(
            "want a power of two in bytes, {MIN_CHUNK}..={MAX_CHUNK}"
        )),
    }
}

impl Policy for ArenaPolicy {
    /// Its state (its free lists, its held memory) is this instance's alone: one per
    /// thread serves the same as one for all.
    fn info(&self) -> Info {
        Info::new().shardable(true)
    }

    fn init(config: &mut Config) -> Result<Self, String> {
        let chunk = config
            .get_with("chunk-size", parse_chunk_size)?
            .unwrap_or(DEFAULT_CHUNK);
        Ok(ArenaPolicy {
            arena: RefCell::new(Arena::new(chunk)),
        })
    }

    // The default `info` holds: every block is 16-aligned, and batching is welcome.

    fn malloc(&self, size: u64) -> u64 {
        self.with(|a| a.malloc(size))
    }

    fn calloc(&self, nelem: u64, elsize: u64) -> u64 {
        let Some(size) = nelem.checked_mul(elsize) else {
            return 0;
        };
        self.with(|a| {
            if a.is_large(size) {
                let ptr = upstream::calloc(nelem, elsize);
                return a.lend_large(ptr, size);
            }
            // Recycled blocks and fresh chunks both hold stale bytes.
            bytes::zeroed(a.small(size), size)
        })
    }

    fn realloc(&self, ptr: u64, old_size: u64, new_size: u64) -> u64 {
        if ptr == 0 {
            return self.malloc(new_size);
        }
        self.with(|a| {
            match (a.is_large(old_size), a.is_large(new_size)) {
                (true, true) => {
                    let new = upstream::realloc(ptr, old_size, new_size);
                    if new != 0 {
                        a.forget_large(ptr, old_size);
                        a.lend_large(new, new_size);
                    }
                    return new;
                }
                // The slot already holds `class_size >= new_size` bytes.
                (false, false) if class_of(old_size) == class_of(new_size) => return ptr,
                _ => {}
            }
            let new = a.malloc(new_size);
            if new != 0 {
                bytes::copy(new, ptr, old_size.min(new_size));
                a.free(ptr, old_size);
            }
            new
        })
    }

    fn free(&self, ptr: u64, size: u64) {
        if ptr != 0 {
            self.with(|a| a.free(ptr, size));
        }
    }

    fn malloc_many(&self, size: u64, count: u32) -> Vec<u64> {
        self.with(|a| {
            if a.is_large(size) {
                let ptrs = upstream::malloc_many(size, count);
                for &ptr in &ptrs {
                    a.lend_large(ptr, size);
                }
                return ptrs;
            }
            (0..count)
                .map(|_| a.small(size))
                .take_while(|&p| p != 0)
                .collect()
        })
    }

    fn free_many(&self, ptrs: Vec<u64>, size: u64) {
        self.with(|a| {
            if a.is_large(size) {
                for &ptr in &ptrs {
                    a.forget_large(ptr, size);
                }
                upstream::free_many(&ptrs, size);
            } else {
                a.free[class_of(size)].extend(ptrs);
            }
        });
    }

    fn trim(&self) {
        self.with(Arena::trim);
    }
}

export_policy!(ArenaPolicy, name = "arena");
