//! The host's own memory: the last upstream of every chain.
//!
//! Blocks come from the global allocator with a fixed alignment. Because the ledger
//! checks every give-back against the size the block was lent with, the `Layout` passed
//! to `dealloc`/`realloc` is always the one the block was allocated with — the sized-free
//! rule is what makes this memory-safe.
//!
//! The invariants this layer keeps (ARCHITECTURE.md's map names them in short):
//! Only the bottom of a chain touches the C allocator; released memory can be
//! quarantined and poisoned so a use after free shows. A block's layout is a
//! function of its size alone (16-aligned; 4 KiB up to 4 MiB, on a 64-byte line),
//! so the sized-free check proves every release uses the block's own layout.

mod adversary;
mod arena;

use std::alloc::{self, Layout};
use std::collections::{BTreeMap, VecDeque};
use std::ptr::NonNull;
use std::sync::Arc;

pub use adversary::{Adversary, Injected, Refusal};
use arena::Arena;

use crate::ledger::{Ledger, TakeBack};

/// Every block the host lends is aligned to at least this (mid-size blocks, to a cache
/// line).
pub const SYSTEM_ALIGNMENT: u64 = 16;

/// Blocks from [`LINE_ALIGNED_FROM`] bytes up to the huge-page threshold start on a cache
/// line of this size.
const LINE: u64 = 64;

/// From this size on, blocks start on a cache line. glibc hands out 16-aligned blocks,
/// so an array's SIMD loads split lines on three blocks out of four: NumPy's
/// `c = b + a` over 64 KiB arrays ran 0.95-1.11x its default handler from run to run,
/// as the arrays' offsets in their lines fell, and 0.77-0.84x on line-aligned blocks
/// (`python/bench_numpy.py`, mid-size). Below a page it is not applied: small arrays
/// cost per call more than per load, and an aligned allocation takes glibc's slower
/// memalign path and may leave up to 48 bytes unused. Huge-page sized
/// temporaries are bound by memory bandwidth, not loads, and ran 1.01-1.05x aligned
/// against 0.95-1.02x not, so they keep glibc's own placement.
const LINE_ALIGNED_FROM: u64 = 4096;

/// Blocks at least this large are advised to use transparent huge pages, as NumPy's
/// default handler does: with THP in `madvise` mode a large temporary otherwise takes a
/// page fault every 4 KiB (3x slower `a + b + c` on 8-64 MiB arrays, measured).
const HUGEPAGE_THRESHOLD: usize = 1 << 22;

/// Bytes of host memory a block of `size` bytes takes from the global allocator at
/// most (glibc's malloc): a chunk of the size and an 8-byte header rounded up to 16,
/// at least 32; with the slack of an aligned allocation for line-aligned sizes; whole
/// pages with a header page for mapped ones. The overhead budget counts this, not the
/// size: a policy holding a million 1-byte blocks holds 32 MB of chunks.
pub(crate) fn footprint(size: u64) -> u64 {
    // Most blocks, first: every block of a per-op pair passes here three times.
    if size < LINE_ALIGNED_FROM {
        return size.saturating_add(8).next_multiple_of(16).max(32);
    }
    let Some(layout) = SystemMemory::layout(size) else {
        return size;
    };
    if size >= HUGEPAGE_THRESHOLD as u64 {
        return size.saturating_add(4096).next_multiple_of(4096);
    }
    let chunk = size.saturating_add(8).next_multiple_of(16).max(32);
    match layout.align() as u64 {
        SYSTEM_ALIGNMENT => chunk,
        aligned => chunk + aligned,
    }
}

/// Advise huge pages for the whole pages inside `[ptr, ptr + size)` if it is large.
pub(crate) fn advise_huge_pages(ptr: NonNull<u8>, size: usize) {
    if size < HUGEPAGE_THRESHOLD {
        return;
    }
    let page = 4096;
    let start = (ptr.as_ptr() as usize).next_multiple_of(page);
    let end = (ptr.as_ptr() as usize + size) & !(page - 1);
    if end > start {
        // SAFETY: [start, end) lies inside the live block at `ptr`; MADV_HUGEPAGE is
        // advice only and changes no contents. Failure (no THP support) is harmless.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

pub use crate::fill::{FRESH_MEMORY, QUARANTINE_POISON};

/// Memory given back and kept unreleased and poisoned, so that a use after free reads
/// poison and an audit can find a client block in it.
#[derive(Debug, Default)]
struct Quarantine {
    capacity: u64,
    bytes: u64,
    /// Oldest first.
    order: VecDeque<(u64, u64)>,
    /// Address -> size, for overlap queries.
    ranges: BTreeMap<u64, u64>,
}

#[derive(Debug)]
pub(crate) struct SystemMemory {
    pub(crate) lent: Ledger,
    /// In checked mode, what every fresh block's bytes (and a grown block's new bytes)
    /// are set to, so that what a case shows never depends on what the process's heap
    /// held before: a check's verdict replays.
    fresh: Option<u8>,
    /// Most bytes lent at once; requests past it are "none".
    limit: u64,
    quarantine: Quarantine,
    /// The contract checker's upstream, in place of the C allocator
    /// ([`crate::HandlerBuilder::adversary`]).
    checker: Option<(Arc<Adversary>, Arena)>,
}

impl SystemMemory {
    /// Host memory lending at most `limit` bytes at once, keeping up to `quarantine`
    /// bytes of what comes back poisoned and unreleased.
    pub(crate) fn new(limit: u64, quarantine: u64) -> Self {
        SystemMemory {
            lent: Ledger::with_footprint(footprint),
            fresh: None,
            limit,
            quarantine: Quarantine {
                capacity: quarantine,
                ..Quarantine::default()
            },
            checker: None,
        }
    }

    /// Lend from `adversary`'s arena instead of the C allocator; false when the arena's
    /// address space cannot be reserved. Called before anything is lent.
    pub(crate) fn serve_adversarially(&mut self, adversary: Arc<Adversary>) -> bool {
        debug_assert!(self.lent.is_empty(), "set before the first block");
        let Some(arena) = Arena::new(adversary.seed()) else {
            return false;
        };
        self.checker = Some((adversary, arena));
        true
    }

    /// Fill every fresh block with `byte` (see [`SystemMemory::fresh`]).
    pub(crate) fn fill_fresh_with(&mut self, byte: u8) {
        self.fresh = Some(byte);
    }

    /// A quarantined range that `[addr, addr+len)` overlaps, if any.
    pub(crate) fn released_overlapping(&self, addr: u64, len: u64) -> Option<(u64, u64)> {
        let end = addr.checked_add(len)?;
        let (&start, &size) = self.quarantine.ranges.range(..end).next_back()?;
        (start + size > addr).then_some((start, size))
    }

    /// Release a block that is off the books: to the system, or into quarantine.
    #[inline]
    fn release(&mut self, ptr: u64, size: u64) {
        if size > self.quarantine.capacity {
            // SAFETY: the caller took `ptr` off the books: it was allocated here with
            // exactly `size` bytes and is released once.
            unsafe { give_back(&mut self.checker, ptr, size) };
            return;
        }
        self.hold_in_quarantine(ptr, size);
    }

    /// [`Self::release`] of a block the quarantine takes. Out of line: most handlers
    /// keep no quarantine, and every pair releases a block.
    #[cold]
    #[inline(never)]
    fn hold_in_quarantine(&mut self, ptr: u64, size: u64) {
        let q = &mut self.quarantine;
        // SAFETY: the caller took `ptr` off the books: it is live host memory of `size`
        // bytes, allocated here, that no one may use any more; poisoning it shows any
        // later use.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, QUARANTINE_POISON, size as usize) };
        q.order.push_back((ptr, size));
        q.ranges.insert(ptr, size);
        q.bytes += size;
        while q.bytes > q.capacity {
            let (oldest, oldest_size) = q.order.pop_front().expect("bytes are in blocks");
            q.ranges.remove(&oldest);
            q.bytes -= oldest_size;
            // SAFETY: quarantined blocks were allocated here with exactly their size
            // and left the books when quarantined; each leaves the quarantine once.
            unsafe { give_back(&mut self.checker, oldest, oldest_size) };
        }
    }

    /// How a block of `size` bytes is allocated, and so released: a function of the
    /// size alone, which the ledger checks on every give-back.
    fn layout(size: u64) -> Option<Layout> {
        let align = if (LINE_ALIGNED_FROM..HUGEPAGE_THRESHOLD as u64).contains(&size) {
            LINE
        } else {
            SYSTEM_ALIGNMENT
        };
        Layout::from_size_align(usize::try_from(size).ok()?, align as usize).ok()
    }

    fn within_limit(&self, extra: u64) -> bool {
        self.lent
            .bytes()
            .checked_add(extra)
            .is_some_and(|t| t <= self.limit)
    }

    /// A block of `size` (> 0) bytes, zeroed if asked; 0 when memory runs out.
    pub(crate) fn malloc(&mut self, size: u64, zeroed: bool) -> u64 {
        debug_assert!(size > 0, "the host never asks for 0 bytes");
        let Some(layout) = Self::layout(size).filter(|_| self.within_limit(size)) else {
            return 0;
        };
        let ptr = match &mut self.checker {
            Some((adversary, arena)) => Self::checker_alloc(adversary, arena, size, zeroed),
            // SAFETY: `layout` has a non-zero size (sizes are normalised to at least 1).
            None => unsafe {
                if zeroed {
                    alloc::alloc_zeroed(layout)
                } else {
                    alloc::alloc(layout)
                }
            },
        };
        let Some(block) = NonNull::new(ptr) else {
            return 0;
        };
        advise_huge_pages(block, size as usize);
        if let (Some(byte), false) = (self.fresh, zeroed) {
            // SAFETY: `block` was just allocated with `size` bytes and no one else has it.
            unsafe { std::ptr::write_bytes(block.as_ptr(), byte, size as usize) };
        }
        self.lent.insert(ptr as u64, size);
        ptr as u64
    }

    /// [`Self::malloc`] from the contract checker's arena, which may refuse. Out of line:
    /// only the checker's own handlers take it.
    #[cold]
    #[inline(never)]
    fn checker_alloc(adversary: &Adversary, arena: &mut Arena, size: u64, zeroed: bool) -> *mut u8 {
        if adversary.refuses(size) {
            return std::ptr::null_mut();
        }
        let Some(addr) = arena.alloc(size) else {
            return std::ptr::null_mut();
        };
        if zeroed {
            // SAFETY: the arena just placed `size` bytes at `addr`, inside its reservation
            // and under no other block; they may hold a freed block's bytes.
            unsafe { std::ptr::write_bytes(addr as *mut u8, 0, size as usize) };
        }
        addr as *mut u8
    }

    pub(crate) fn realloc(&mut self, ptr: u64, old: u64, new: u64) -> Result<u64, TakeBack> {
        let entry = self
            .lent
            .get(ptr)
            .ok_or_else(|| self.lent.why_unknown(ptr))?;
        if entry.size != old {
            return Err(TakeBack::WrongSize {
                recorded: entry.size,
            });
        }
        let grow = new.saturating_sub(old);
        let old_layout = Self::layout(old).expect("a lent block has a valid layout");
        let Some(new_layout) = Self::layout(new).filter(|_| new > 0 && self.within_limit(grow))
        else {
            return Ok(0);
        };
        if self.checker.is_some() {
            return Ok(self.realloc_adversarially(ptr, old, new));
        }
        if self.quarantine.capacity > 0 || new_layout.align() != old_layout.align() {
            // Move by hand: so that the old memory goes through the quarantine, or
            // because `alloc::realloc` keeps the old alignment, and the block must be
            // released with the layout of its new size.
            let moved = self.malloc(new, false);
            if moved == 0 {
                return Ok(0);
            }
            // SAFETY: `ptr` is a live block of `old` bytes and `moved` a new one of `new`
            // bytes, both allocated here; distinct live blocks do not overlap.
            unsafe { copy_kept(ptr, old, moved, new) };
            self.lent.remove(ptr);
            self.release(ptr, old);
            return Ok(moved);
        }
        // SAFETY: `ptr` was allocated by this allocator with `old_layout` (the ledger
        // recorded exactly `old` bytes for it and it is still live), and `new` is
        // non-zero and forms a valid layout with the same alignment (checked above).
        let moved = unsafe { alloc::realloc(ptr as *mut u8, old_layout, new as usize) };
        let Some(block) = NonNull::new(moved) else {
            return Ok(0);
        };
        advise_huge_pages(block, new as usize);
        if let Some(byte) = self.fresh
            && new > old
        {
            // SAFETY: `block` is now a live block of `new` bytes; its bytes past `old`
            // are new and held by no one.
            unsafe {
                std::ptr::write_bytes(block.as_ptr().add(old as usize), byte, (new - old) as usize)
            };
        }
        self.lent.remove(ptr);
        self.lent.insert(moved as u64, new);
        Ok(moved as u64)
    }

    /// [`SystemMemory::realloc`] from the checker's arena: in place or moved, at the
    /// seed's choice, and refused when the checker says so.
    fn realloc_adversarially(&mut self, ptr: u64, old: u64, new: u64) -> u64 {
        let (adversary, arena) = self.checker.as_mut().expect("the checker serves");
        if adversary.refuses(new) {
            return 0;
        }
        let moved = if arena.resize_in_place(ptr, old, new) {
            ptr
        } else {
            let Some(moved) = arena.alloc(new) else {
                return 0;
            };
            // SAFETY: `ptr` is a live block of `old` bytes and `moved` a block of `new`
            // bytes the arena just placed under no other block, so they do not overlap.
            unsafe { copy_kept(ptr, old, moved, new) };
            moved
        };
        if let Some(byte) = self.fresh
            && new > old
        {
            // SAFETY: `moved` is now a block of `new` bytes; its bytes past `old` are
            // new and held by no one.
            unsafe { std::ptr::write_bytes((moved + old) as *mut u8, byte, (new - old) as usize) };
        }
        self.lent.remove(ptr);
        if moved != ptr {
            self.release(ptr, old);
        }
        self.lent.insert(moved, new);
        moved
    }

    pub(crate) fn free(&mut self, ptr: u64, size: u64) -> Result<(), TakeBack> {
        self.lent.take_back(ptr, size)?;
        // The ledger proved `ptr` is live and was allocated with exactly `size` bytes; it
        // is now off the books, so it is released once.
        self.release(ptr, size);
        Ok(())
    }
}

/// Copy what a resized block keeps, the first `min(old, new)` bytes, from the block at
/// `from` (of `old` bytes) to the block at `to` (of `new` bytes).
///
/// # Safety
/// Both are live blocks of host memory of at least those sizes, and they do not
/// overlap (distinct live blocks never do).
pub(crate) unsafe fn copy_kept(from: u64, old: u64, to: u64, new: u64) {
    // SAFETY: the caller's contract: both ranges are live and disjoint.
    unsafe {
        std::ptr::copy_nonoverlapping(from as *const u8, to as *mut u8, old.min(new) as usize)
    };
}

/// Give a block back to the checker's arena, if the memory serves from one, else to
/// the global allocator.
///
/// # Safety
/// `ptr` was allocated by this [`SystemMemory`] with exactly `size` bytes (so, from the
/// global allocator, with `SystemMemory::layout(size)`), is no longer used by anyone,
/// and is released once.
unsafe fn give_back(checker: &mut Option<(Arc<Adversary>, Arena)>, ptr: u64, size: u64) {
    if let Some((_, arena)) = checker {
        arena.free(ptr, size);
        return;
    }
    let layout = SystemMemory::layout(size).expect("a lent block has a valid layout");
    // SAFETY: the caller's contract: allocated with this layout, released once.
    unsafe { alloc::dealloc(ptr as *mut u8, layout) };
}

impl Drop for SystemMemory {
    /// A handler dropped with blocks still out frees them: the host owns this memory,
    /// whatever the policies above did.
    fn drop(&mut self) {
        for (addr, entry) in self.lent.drain() {
            // SAFETY: each entry is a live block allocated here with exactly its size;
            // draining removed it from the books, so it is freed once.
            unsafe { give_back(&mut self.checker, addr, entry.size) };
        }
        for (addr, size) in self.quarantine.order.drain(..) {
            // SAFETY: quarantined blocks were allocated here with exactly their size and
            // are off the books; draining releases each once.
            unsafe { give_back(&mut self.checker, addr, size) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_a_free_with_the_wrong_size_and_keeps_the_block() {
        let mut m = SystemMemory::new(u64::MAX, 0);
        let p = m.malloc(100, false);
        assert_ne!(p, 0);
        assert_eq!(m.free(p, 99), Err(TakeBack::WrongSize { recorded: 100 }));
        assert_eq!(m.free(p, 100), Ok(()));
        assert_eq!(m.free(p, 100), Err(TakeBack::AlreadyFreed));
    }

    #[test]
    fn sizes_past_the_address_space_or_the_limit_are_none() {
        let mut m = SystemMemory::new(1 << 20, 0);
        assert_eq!(m.malloc(u64::MAX - 8, false), 0);
        assert_eq!(m.malloc(2 << 20, false), 0);
        let p = m.malloc(1 << 19, true);
        assert_ne!(p, 0);
        assert_eq!(
            m.realloc(p, 1 << 19, 4 << 20),
            Ok(0),
            "growing past the limit"
        );
        assert_eq!(m.lent.bytes(), 1 << 19, "a refused realloc keeps the block");
    }

    #[test]
    fn blocks_of_a_page_or_more_start_on_a_cache_line_across_reallocs() {
        let mut m = SystemMemory::new(u64::MAX, 0);
        let mut kept = Vec::new();
        for size in [4096, 4097, 65536, 100_000] {
            let p = m.malloc(size, false);
            assert_eq!(p % LINE, 0, "{size} bytes");
            kept.push((p, size));
        }
        // Growing into the line-aligned sizes moves the block to a line; growing past
        // them and shrinking back keep the bytes, and every block is released with the
        // layout of its size.
        let p = m.malloc(100, false);
        // SAFETY: `p` is a live 100-byte block lent by `m`.
        unsafe { std::ptr::write_bytes(p as *mut u8, 9, 100) };
        let q = m.realloc(p, 100, 8192).unwrap();
        assert_eq!(q % LINE, 0);
        let big = m.realloc(q, 8192, 5 << 20).unwrap();
        assert_ne!(big, 0);
        let r = m.realloc(big, 5 << 20, 200).unwrap();
        // SAFETY: `r` is a live 200-byte block; its first 100 bytes were kept.
        let bytes = unsafe { std::slice::from_raw_parts(r as *const u8, 100) };
        assert!(bytes.iter().all(|&b| b == 9));
        m.free(r, 200).unwrap();
        for (p, size) in kept {
            m.free(p, size).unwrap();
        }
    }

    #[test]
    fn calloc_memory_is_zero_and_realloc_keeps_bytes() {
        let mut m = SystemMemory::new(u64::MAX, 0);
        let p = m.malloc(64, true);
        // SAFETY: `p` is a live 64-byte block lent by `m`.
        let bytes = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, 64) };
        assert!(bytes.iter().all(|&b| b == 0));
        bytes.copy_from_slice(&[7; 64]);
        let q = m.realloc(p, 64, 4096).unwrap();
        // SAFETY: `q` is a live 4096-byte block lent by `m`; its first 64 bytes were kept.
        let moved = unsafe { std::slice::from_raw_parts(q as *const u8, 64) };
        assert!(moved.iter().all(|&b| b == 7));
        m.free(q, 4096).unwrap();
    }
}
