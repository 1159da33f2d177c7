//! Where the contract checker's upstream places blocks ([`super::Adversary`]): one
//! address-space reservation per handler, placed by a seeded generator so the same
//! requests get the same offsets in every process, at the same address wherever it is
//! free. Reservations are kept from one handler to the next, their first pages resident.

use std::collections::BTreeMap;

/// Where the reservation goes when that address is free: far from where the kernel
/// places mappings and the heap, so that it usually is.
const PREFERRED_BASE: u64 = 0x4000_0000_0000;
/// The reservation: address space only (`MAP_NORESERVE`), its pages made as they are
/// touched, and all the memory the upstream has: a check's blocks add up to a few
/// hundred MiB at most, and past it requests are "none", as a machine's memory runs out
/// (a shrinking script's sizes halve down from 2^63; each one that fits is filled).
const RESERVATION: u64 = 1 << 30;
/// A smaller reservation, where the large one is refused (`ulimit -v`).
const SMALL_RESERVATION: u64 = 256 << 20;
/// Below this size a block's offset varies within [`SMALL_WINDOW`] bytes, from it
/// within a page.
const SMALL_BLOCK: u64 = 4096;
/// A cache line: small blocks land on one a quarter of the time, and the gap before a
/// block averages half of it, so that a block costs the host about what the C
/// allocator's chunk would (`footprint`), which the overhead budget counts.
const SMALL_WINDOW: u64 = 64;
/// Free ranges looked at before a block is placed at the end instead.
const FIT_TRIES: usize = 8;
/// Freed ranges at least this large give their whole pages back to the kernel, where
/// they lie past [`KEEP_RESIDENT`].
const RETURN_PAGES_FROM: u64 = 64 << 10;
const PAGE: u64 = 4096;
/// The first bytes of a reservation stay resident from one arena to the next. A check
/// starts thousands of handlers, each on an arena of its own, and faulting the same
/// pages in again for each cost most of a check's time; what a reused page held does
/// not show, since every block is filled before it is lent ([`super::FRESH_MEMORY`], or
/// zeros for `calloc`).
const KEEP_RESIDENT: u64 = 256 << 20;
/// Reservations kept for the next arenas once theirs are dropped: one per client of the
/// checker at once, in the usual runs.
const KEPT_RESERVATIONS: usize = 2;

/// An address-space reservation an arena places blocks in.
#[derive(Debug)]
struct Reservation {
    base: u64,
    len: u64,
}

/// Reservations whose arenas were dropped, each resident up to [`KEEP_RESIDENT`].
static KEPT: std::sync::Mutex<Vec<Reservation>> = std::sync::Mutex::new(Vec::new());

impl Reservation {
    /// A kept reservation, or a new one: the large size if the process may map it.
    fn take() -> Option<Reservation> {
        let kept = KEPT.lock().unwrap_or_else(|p| p.into_inner()).pop();
        kept.or_else(|| {
            [RESERVATION, SMALL_RESERVATION]
                .into_iter()
                .find_map(|len| {
                    Some(Reservation {
                        base: reserve(len)?,
                        len,
                    })
                })
        })
    }

    /// Keep the reservation for the next arena, its pages from [`KEEP_RESIDENT`] up to
    /// `touched` given back to the kernel; or unmap it when enough are kept.
    fn give_back(self, touched: u64) {
        let mut kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() >= KEPT_RESERVATIONS {
            drop(kept);
            // SAFETY: the reservation was mapped by `reserve` with exactly this address
            // and length; its arena released every block first and is gone.
            unsafe { libc::munmap(self.base as *mut libc::c_void, self.len as usize) };
            return;
        }
        forget_pages(self.base, KEEP_RESIDENT, touched.min(self.len));
        kept.push(self);
    }
}

/// Give the whole pages of `[start, end)` past [`KEEP_RESIDENT`] of the reservation at
/// `base` back to the kernel; they read as zero when next touched.
fn forget_pages(base: u64, start: u64, end: u64) {
    let first = start.max(KEEP_RESIDENT).next_multiple_of(PAGE);
    let last = end / PAGE * PAGE;
    if first < last {
        // SAFETY: `[first, last)` lies inside the reservation at `base` and inside a
        // range no block occupies; dropping its pages only makes them read as zero when
        // next touched.
        unsafe {
            libc::madvise(
                (base + first) as *mut libc::c_void,
                (last - first) as usize,
                libc::MADV_DONTNEED,
            )
        };
    }
}

/// Blocks placed in one address-space reservation by a seeded generator. Offsets,
/// not addresses, are what it decides; only the base depends on the process.
#[derive(Debug)]
pub(super) struct Arena {
    /// `None` only while the arena is dropped.
    reservation: Option<Reservation>,
    base: u64,
    len: u64,
    /// Every offset at or past this is free.
    top: u64,
    /// The highest `top` has been: pages past it were never touched.
    touched: u64,
    /// Free ranges below `top`: start offset to end offset, never touching each other.
    free: BTreeMap<u64, u64>,
    rng: u64,
}

impl Arena {
    /// Reserve the address space; `None` when the process may not have even the small
    /// reservation.
    pub(super) fn new(seed: u64) -> Option<Arena> {
        let reservation = Reservation::take()?;
        Some(Arena {
            base: reservation.base,
            len: reservation.len,
            reservation: Some(reservation),
            top: 0,
            touched: 0,
            free: BTreeMap::new(),
            rng: seed ^ 0x9E37_79B9_7F4A_7C15,
        })
    }

    /// splitmix64: the seed's stream of choices.
    fn next(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn chance(&mut self) -> bool {
        self.next() & 1 == 0
    }

    /// Where in its window a block of `size` bytes starts: a multiple of 16, and at the
    /// window's start only one time in 4 (small) or 256 (the rest).
    fn skew(&mut self, size: u64) -> (u64, u64) {
        let window = if size < SMALL_BLOCK {
            SMALL_WINDOW
        } else {
            PAGE
        };
        (window, 16 * (self.next() % (window / 16)))
    }

    /// Place a block of `size` bytes; its address, or `None` when it does not fit.
    pub(super) fn alloc(&mut self, size: u64) -> Option<u64> {
        let (window, skew) = self.skew(size);
        let offset = match self.chance() {
            true => self
                .fit(size, window, skew)
                .or_else(|| self.bump(size, window, skew)),
            false => self
                .bump(size, window, skew)
                .or_else(|| self.fit(size, window, skew)),
        }?;
        Some(self.base + offset)
    }

    /// The first offset at or past `from` that is `skew` past a multiple of `window`.
    fn placed(from: u64, window: u64, skew: u64) -> Option<u64> {
        let start = (from / window).checked_mul(window)?.checked_add(skew)?;
        if start >= from {
            Some(start)
        } else {
            start.checked_add(window)
        }
    }

    /// A place in a free range, looking at a few from a random one on.
    fn fit(&mut self, size: u64, window: u64, skew: u64) -> Option<u64> {
        if self.free.is_empty() {
            return None;
        }
        let from = self.next() % self.top.max(1);
        let found = self
            .free
            .range(from..)
            .chain(self.free.range(..from))
            .take(FIT_TRIES)
            .find_map(|(&start, &end)| {
                let at = Self::placed(start, window, skew)?;
                (at.checked_add(size)? <= end).then_some((start, end, at))
            });
        let (start, end, at) = found?;
        self.free.remove(&start);
        if start < at {
            self.free.insert(start, at);
        }
        if at + size < end {
            self.free.insert(at + size, end);
        }
        Some(at)
    }

    /// A place at the end of everything placed so far.
    fn bump(&mut self, size: u64, window: u64, skew: u64) -> Option<u64> {
        let at = Self::placed(self.top, window, skew)?;
        let end = at.checked_add(size).filter(|&end| end <= self.len)?;
        if self.top < at {
            self.release(self.top, at);
        }
        self.top = end;
        self.touched = self.touched.max(end);
        Some(at)
    }

    /// Give the block at `addr` of `size` bytes back.
    pub(super) fn free(&mut self, addr: u64, size: u64) {
        let start = addr - self.base;
        self.release(start, start + size);
    }

    /// Whether the block at `addr` of `old` bytes can grow to `new` bytes where it is,
    /// and if the seed says so, grow it; a shrink in place is always possible.
    pub(super) fn resize_in_place(&mut self, addr: u64, old: u64, new: u64) -> bool {
        if !self.chance() {
            return false;
        }
        let (start, old_end) = (addr - self.base, addr - self.base + old);
        let Some(new_end) = start.checked_add(new) else {
            return false;
        };
        if new_end <= old_end {
            self.release(new_end, old_end);
            return true;
        }
        if old_end == self.top {
            if new_end > self.len {
                return false;
            }
            self.top = new_end;
            self.touched = self.touched.max(new_end);
            return true;
        }
        match self.free.get(&old_end) {
            Some(&end) if new_end <= end => {
                self.free.remove(&old_end);
                if new_end < end {
                    self.free.insert(new_end, end);
                }
                true
            }
            _ => false,
        }
    }

    /// Make `[start, end)` free, joined to the free ranges it touches; the whole pages
    /// of a large one go back to the kernel.
    fn release(&mut self, mut start: u64, mut end: u64) {
        if start >= end {
            return;
        }
        if let Some((&before, &before_end)) = self.free.range(..start).next_back()
            && before_end == start
        {
            self.free.remove(&before);
            start = before;
        }
        if let Some(after_end) = self.free.remove(&end) {
            end = after_end;
        }
        if end == self.top {
            self.top = start;
        } else {
            self.free.insert(start, end);
        }
        if end - start >= RETURN_PAGES_FROM {
            forget_pages(self.base, start, end);
        }
    }
}

impl Drop for Arena {
    /// The host memory that owned the arena released every block first.
    fn drop(&mut self) {
        if let Some(reservation) = self.reservation.take() {
            reservation.give_back(self.touched);
        }
    }
}

/// Map `len` bytes of address space, at [`PREFERRED_BASE`] when that range is free.
fn reserve(len: u64) -> Option<u64> {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a new anonymous mapping that replaces nothing (NOREPLACE); its range
        // is this arena's alone until `Drop` unmaps it.
        let at = unsafe {
            libc::mmap(
                PREFERRED_BASE as *mut libc::c_void,
                len as usize,
                prot,
                flags | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if at as u64 == PREFERRED_BASE {
            return Some(PREFERRED_BASE);
        }
        if at != libc::MAP_FAILED {
            // A kernel that ignores the flag put it elsewhere: take what it gave.
            return Some(at as u64);
        }
    }
    // SAFETY: a new anonymous mapping wherever the kernel puts it.
    let at = unsafe { libc::mmap(std::ptr::null_mut(), len as usize, prot, flags, -1, 0) };
    (at != libc::MAP_FAILED).then_some(at as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(seed: u64) -> Vec<u64> {
        let mut arena = Arena::new(seed).unwrap();
        let mut out = Vec::new();
        let mut live = Vec::new();
        for i in 0..200u64 {
            let size = 1 + i * 37 % 9000;
            let addr = arena.alloc(size).unwrap();
            out.push(addr - arena.base);
            live.push((addr, size));
            if i % 3 == 0 {
                let (addr, size) = live.swap_remove((i as usize * 7) % live.len());
                arena.free(addr, size);
            }
        }
        out
    }

    #[test]
    fn the_same_seed_places_the_same_requests_at_the_same_offsets() {
        assert_eq!(blocks(7), blocks(7));
        assert_ne!(blocks(7), blocks(8));
    }

    #[test]
    fn blocks_are_16_aligned_and_rarely_more() {
        let mut arena = Arena::new(1).unwrap();
        let addrs: Vec<u64> = (0..400).map(|_| arena.alloc(5000).unwrap()).collect();
        assert!(addrs.iter().all(|a| a % 16 == 0));
        let line_aligned = addrs.iter().filter(|&&a| a % 64 == 0).count();
        assert!(line_aligned < 200, "{line_aligned} of 400 on a cache line");
        let page_aligned = addrs.iter().filter(|&&a| a % 4096 == 0).count();
        assert!(page_aligned < 20, "{page_aligned} of 400 on a page");
    }

    #[test]
    fn placed_blocks_never_overlap_and_freed_space_is_used_again() {
        let mut arena = Arena::new(3).unwrap();
        let mut live: Vec<(u64, u64)> = Vec::new();
        for i in 0..2000u64 {
            if i % 2 == 1 && !live.is_empty() {
                let (addr, size) = live.swap_remove((i as usize * 13) % live.len());
                arena.free(addr, size);
                continue;
            }
            let size = 1 + (i * 7919) % 20_000;
            let addr = arena.alloc(size).unwrap();
            for &(other, other_size) in &live {
                assert!(addr + size <= other || other + other_size <= addr);
            }
            live.push((addr, size));
        }
        assert!(
            arena.top < 64 << 20,
            "reuse keeps the arena small: {}",
            arena.top
        );
    }
}
