//! NumPy's default data-memory handler, ported to Rust: what NumPy users have today, so
//! that wasm policies can be compared with it.
//!
//! As in NumPy's `alloc.c`: requests below 1024 bytes are served from an exact-size cache
//! of at most 7 freed blocks per size; everything else goes to the C library; blocks of
//! 4 MiB and more get the transparent-huge-page hint. Unlike NumPy, the cache is
//! thread-safe on its own (NumPy leans on the GIL, yet calls realloc without it), and a
//! block freed with a size larger than it really has is never cached under that size.
//! Its live counters count what the C library set aside for each live block (its
//! usable size), read from the block itself: exact through reallocs and wrong-size
//! frees, with no per-block bookkeeping that NumPy's own handler does not do.

use std::ptr::NonNull;

use parking_lot::Mutex;

use crate::error::Error;
use crate::memhandler::{MemHandler, Stats};
use crate::system::advise_huge_pages;

/// Sizes below this are cached.
const NBUCKETS: usize = 1024;
/// Freed blocks kept per size.
const NCACHE: usize = 7;

/// NumPy's default handler, natively. Create one with [`NumpyDefault::new`]; the process
/// default is [`crate::nep49::default_handler`].
#[derive(Debug)]
pub struct NumpyDefault {
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// `cache[size]`: freed blocks of exactly `size` usable bytes or more, each with its
    /// usable size, read as it was freed, so that a hit calls nothing.
    cache: Vec<Vec<(usize, u64)>>,
    stats: Stats,
}

impl Default for NumpyDefault {
    fn default() -> Self {
        Self::new()
    }
}

impl NumpyDefault {
    pub fn new() -> Self {
        NumpyDefault {
            inner: Mutex::new(Inner {
                cache: (0..NBUCKETS).map(|_| Vec::with_capacity(NCACHE)).collect(),
                stats: Stats::default(),
            }),
        }
    }

    /// A cached block of `size` bytes, lent and counted as a `calloc` or a `malloc`
    /// under one lock; `None` (nothing counted) when there is none.
    fn take_cached(&self, size: usize, calloc: bool) -> Option<NonNull<u8>> {
        if size >= NBUCKETS {
            return None;
        }
        let mut inner = self.inner.lock();
        let (addr, usable) = inner.cache[size].pop()?;
        inner.stats.magazine_hits += 1;
        count_request(&mut inner.stats, calloc);
        inner.stats.lend(usable);
        NonNull::new(addr as *mut u8)
    }

    /// Count a request the C library answered with `got`.
    fn count_new(&self, calloc: bool, got: Option<NonNull<u8>>) {
        let usable = got.map(usable_size);
        let mut inner = self.inner.lock();
        count_request(&mut inner.stats, calloc);
        match usable {
            Some(usable) => inner.stats.lend(usable),
            None => inner.stats.failed += 1,
        }
    }
}

fn count_request(stats: &mut Stats, calloc: bool) {
    match calloc {
        true => stats.callocs += 1,
        false => stats.mallocs += 1,
    }
}

/// What the C library set aside for a live block from this handler.
pub(crate) fn usable_size(block: NonNull<u8>) -> u64 {
    // SAFETY: every block this handler lends or caches came from C malloc, calloc or
    // realloc and is live (callers pass only such blocks).
    unsafe { libc::malloc_usable_size(block.as_ptr().cast()) as u64 }
}

impl MemHandler for NumpyDefault {
    fn name(&self) -> &str {
        "default_allocator"
    }

    fn malloc(&self, size: usize) -> Result<Option<NonNull<u8>>, Error> {
        if let Some(p) = self.take_cached(size, false) {
            return Ok(Some(p));
        }
        // SAFETY: plain C malloc; a zero size gives a unique pointer or null.
        let got = NonNull::new(unsafe { libc::malloc(size.max(1)) }.cast::<u8>());
        if let Some(p) = got {
            advise_huge_pages(p, size);
        }
        self.count_new(false, got);
        Ok(got)
    }

    fn calloc(&self, nelem: usize, elsize: usize) -> Result<Option<NonNull<u8>>, Error> {
        let Some(size) = nelem.checked_mul(elsize) else {
            self.count_new(true, None);
            return Ok(None);
        };
        if let Some(p) = self.take_cached(size, true) {
            // SAFETY: a cached block has at least `size` usable bytes (see `free`).
            unsafe { std::ptr::write_bytes(p.as_ptr(), 0, size) };
            return Ok(Some(p));
        }
        // SAFETY: plain C calloc; the product was checked for overflow above.
        let got = NonNull::new(unsafe { libc::calloc(nelem.max(1), elsize.max(1)) }.cast::<u8>());
        if let Some(p) = got {
            advise_huge_pages(p, size);
        }
        self.count_new(true, got);
        Ok(got)
    }

    fn realloc(
        &self,
        ptr: Option<NonNull<u8>>,
        new_size: usize,
    ) -> Result<Option<NonNull<u8>>, Error> {
        let old = ptr.map_or(std::ptr::null_mut(), |p| p.as_ptr().cast());
        // Read before the block may move; a failed realloc leaves it as it is.
        let old_size = ptr.map(usable_size);
        // SAFETY: `ptr` is null or a block from this handler, i.e. from C malloc/calloc
        // (cached blocks are never handed out twice); C realloc accepts both.
        let got = NonNull::new(unsafe { libc::realloc(old, new_size.max(1)) }.cast::<u8>());
        let mut inner = self.inner.lock();
        inner.stats.reallocs += 1;
        let Some(moved) = got else {
            inner.stats.failed += 1;
            return Ok(None);
        };
        if let Some(old_size) = old_size {
            inner.stats.take_back(old_size);
        }
        inner.stats.lend(usable_size(moved));
        Ok(got)
    }

    fn free(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<(), Error> {
        let Some(ptr) = ptr else {
            return Ok(());
        };
        let usable = usable_size(ptr);
        let mut inner = self.inner.lock();
        inner.stats.frees += 1;
        inner.stats.take_back(usable);
        // NumPy sometimes frees with a size larger than the block (it reallocs and
        // frees with the original size); caching such a block under that size would
        // hand out too few bytes later, so the C library's own record decides.
        if size < NBUCKETS && size as u64 <= usable && inner.cache[size].len() < NCACHE {
            inner.cache[size].push((ptr.as_ptr() as usize, usable));
            return Ok(());
        }
        drop(inner);
        // SAFETY: as above; the block is not cached, so it is freed once.
        unsafe { libc::free(ptr.as_ptr().cast()) };
        Ok(())
    }

    /// The C library's record of the block is its size: what it set aside, which a
    /// block cached under it has at least.
    fn free_unsized(&self, ptr: NonNull<u8>) -> Result<usize, Error> {
        let size = usable_size(ptr) as usize;
        self.free(Some(ptr), size)?;
        Ok(size)
    }

    fn stats(&self) -> Result<Stats, Error> {
        Ok(self.inner.lock().stats.clone())
    }
}

impl Drop for NumpyDefault {
    fn drop(&mut self) {
        for bucket in &mut self.inner.get_mut().cache {
            for (addr, _) in bucket.drain(..) {
                // SAFETY: cached blocks came from C malloc and are owned by the cache.
                unsafe { libc::free(addr as *mut libc::c_void) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unsized_free_is_counted_with_what_the_c_library_set_aside() {
        let h = NumpyDefault::new();
        let a = h.malloc(100_000).unwrap().unwrap();
        let freed = h.free_unsized(a).unwrap();
        assert!(freed >= 100_000, "{freed}");
        let stats = h.stats().unwrap();
        assert_eq!(
            (stats.frees, stats.live_blocks, stats.live_bytes),
            (1, 0, 0)
        );
    }

    #[test]
    fn small_blocks_are_reused_from_the_exact_size_cache() {
        let h = NumpyDefault::new();
        let a = h.malloc(24).unwrap();
        h.free(a, 24).unwrap();
        let b = h.malloc(24).unwrap();
        assert_eq!(a, b, "the freed block comes back for the same size");
        assert_eq!(h.stats().unwrap().magazine_hits, 1);
        h.free(b, 24).unwrap();
    }

    #[test]
    fn a_block_freed_with_a_too_large_size_is_not_cached_under_it() {
        let h = NumpyDefault::new();
        let a = h.malloc(8).unwrap();
        h.free(a, 1000).unwrap();
        let b = h.malloc(1000).unwrap();
        // SAFETY: `b` is a live block of 1000 bytes from `h`.
        unsafe { std::ptr::write_bytes(b.unwrap().as_ptr(), 1, 1000) };
        h.free(b, 1000).unwrap();
    }

    #[test]
    fn calloc_from_the_cache_is_zeroed_and_overflow_is_none() {
        let h = NumpyDefault::new();
        let a = h.malloc(64).unwrap().unwrap();
        // SAFETY: `a` is a live 64-byte block.
        unsafe { std::ptr::write_bytes(a.as_ptr(), 0xff, 64) };
        h.free(Some(a), 64).unwrap();
        let b = h.calloc(8, 8).unwrap().unwrap();
        // SAFETY: `b` is a live 64-byte block.
        let bytes = unsafe { std::slice::from_raw_parts(b.as_ptr(), 64) };
        assert!(bytes.iter().all(|&x| x == 0));
        h.free(Some(b), 64).unwrap();
        assert_eq!(h.calloc(usize::MAX, 2).unwrap(), None);
    }

    #[test]
    fn live_counters_stay_exact_through_realloc_and_wrong_size_frees() {
        let h = NumpyDefault::new();
        let a = h.malloc(100).unwrap();
        let b = h.realloc(a, 5000).unwrap();
        let big = usable_size(b.unwrap());
        assert!(big >= 5000);
        let s = h.stats().unwrap();
        assert_eq!((s.live_blocks, s.live_bytes), (1, big));
        let c = h.calloc(10, 10).unwrap();
        let small = usable_size(c.unwrap());
        h.free(b, 1).unwrap();
        let s = h.stats().unwrap();
        assert_eq!((s.live_blocks, s.live_bytes), (1, small));
        assert!(s.peak_bytes >= big + small);
        h.free(c, 100).unwrap();
        assert_eq!(
            (
                h.stats().unwrap().live_blocks,
                h.stats().unwrap().live_bytes
            ),
            (0, 0)
        );
    }
}
