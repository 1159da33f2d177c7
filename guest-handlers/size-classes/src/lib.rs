//! `size-classes`: NumPy's small-block cache (`numpy/_core/src/multiarray/alloc.c`).
//!
//! Sizes below [`NBUCKETS`] bytes get one exact-size bucket each; a bucket keeps at most
//! `bucket-depth` freed blocks and hands them out again before asking upstream. Larger
//! sizes, and frees that find their bucket full, go straight upstream — except, with
//! `large-cache = N`, the last N freed blocks of at least [`LARGE`] bytes, which `malloc`
//! reuses for the same size: NumPy's `a + b + c` on big arrays makes temporaries of one
//! size over and over, and a reused block skips the kernel's page faults (NumPy's default
//! handler does not do this). A miss for a larger size first gives back the smaller
//! blocks kept: held idle, they made NumPy's 8-32 MiB bench slower than the default
//! handler (1.02-1.06x) although it faulted less; given back, 0.88-0.90x.
//!
//! Every cached block is a whole upstream block of exactly its bucket's size (it was got
//! upstream with that size, and the sized-free rule means it comes back with it), so
//! handing it out again and finally freeing it upstream with the bucket's size both keep
//! the host's rules.

wit_bindgen::generate!({ path: "../../wit", world: "policy" });

use std::cell::RefCell;

use allocbox::policy::{allocator as upstream, bytes};
use exports::allocbox::policy::allocator::Guest as Allocator;
use exports::allocbox::policy::lifecycle::{Guest as Lifecycle, Info};

/// Sizes `1..NBUCKETS` are cached, as in NumPy.
const NBUCKETS: u64 = 1024;
const DEFAULT_DEPTH: usize = 7;
const MAX_DEPTH: usize = 64;
/// Blocks at least this large may be kept by `large-cache`.
const LARGE: u64 = 1 << 20;
const MAX_LARGE_CACHE: usize = 16;

struct Cache {
    depth: usize,
    /// `buckets[size]` holds freed blocks of exactly `size` bytes; index 0 is unused.
    buckets: Vec<Vec<u64>>,
    /// Most large blocks kept.
    large_limit: usize,
    /// Freed large blocks, `(size, ptr)`, oldest first.
    large: Vec<(u64, u64)>,
}

impl Cache {
    fn bucket(&mut self, size: u64) -> Option<&mut Vec<u64>> {
        // Bucket 0 stays unused: the host never sends size 0, and `trim` skips it.
        if (1..NBUCKETS).contains(&size) {
            Some(&mut self.buckets[size as usize])
        } else {
            None
        }
    }

    /// A cached block of `size` bytes, if there is one.
    fn take(&mut self, size: u64) -> Option<u64> {
        if size >= LARGE {
            let i = self.large.iter().rposition(|&(s, _)| s == size)?;
            return Some(self.large.remove(i).1);
        }
        self.bucket(size)?.pop()
    }

    /// On a miss for a large `size`: the cached large blocks smaller than it, taken out.
    /// They cannot serve it, and a program that moved on to larger arrays seldom comes
    /// back; given back first, they let upstream serve the request from memory still
    /// warm rather than hold it idle beside the new arrays.
    fn smaller_large(&mut self, size: u64) -> Vec<(u64, u64)> {
        if size < LARGE || !self.large.iter().any(|&(s, _)| s < size) {
            return Vec::new();
        }
        let (smaller, kept) = self.large.drain(..).partition(|&(s, _)| s < size);
        self.large = kept;
        smaller.into_iter().map(|(s, p)| (p, s)).collect()
    }

    /// Keeps `ptr` if it can. Returns the block, `(ptr, size)`, that the caller must free
    /// upstream: `ptr` itself when its bucket is full, or the oldest large block, which
    /// a large one displaces. A full large cache that refused newcomers would keep the
    /// sizes a program used first: NumPy's bench of 8-32 MiB then 64 MiB temporaries
    /// ran at 1.00-1.05x NumPy's default with a cache of 4 that never reused a block.
    fn keep(&mut self, ptr: u64, size: u64) -> Option<(u64, u64)> {
        if size >= LARGE {
            if self.large_limit == 0 {
                return Some((ptr, size));
            }
            let displaced = (self.large.len() == self.large_limit).then(|| self.large.remove(0));
            self.large.push((size, ptr));
            return displaced.map(|(size, ptr)| (ptr, size));
        }
        let depth = self.depth;
        match self.bucket(size) {
            Some(bucket) if bucket.len() < depth => {
                bucket.push(ptr);
                None
            }
            _ => Some((ptr, size)),
        }
    }
}

thread_local! {
    // Guests are single-threaded; a thread-local is just a static without `unsafe`.
    // No borrow is held across a call to our own exports, so the RefCell never panics.
    static CACHE: RefCell<Cache> = RefCell::new(Cache {
        depth: DEFAULT_DEPTH,
        buckets: vec![Vec::new(); NBUCKETS as usize],
        large_limit: 0,
        large: Vec::new(),
    });
}

fn with_cache<R>(f: impl FnOnce(&mut Cache) -> R) -> R {
    CACHE.with(|c| f(&mut c.borrow_mut()))
}

struct SizeClasses;

impl Allocator for SizeClasses {
    fn malloc(size: u64) -> u64 {
        let (hit, stale) = with_cache(|c| match c.take(size) {
            Some(ptr) => (Some(ptr), Vec::new()),
            None => (None, c.smaller_large(size)),
        });
        for (ptr, size) in stale {
            upstream::free(ptr, size);
        }
        hit.unwrap_or_else(|| upstream::malloc(size))
    }

    fn calloc(nelem: u64, elsize: u64) -> u64 {
        // Large zeroed blocks come fresh from upstream: untouched zero pages cost less
        // than clearing a cached block.
        if let Some(size) = nelem.checked_mul(elsize).filter(|&s| s < LARGE)
            && let Some(ptr) = with_cache(|c| c.take(size))
        {
            // A recycled block still holds its previous owner's bytes.
            bytes::fill(ptr, size, 0);
            return ptr;
        }
        // Upstream handles an overflowing product too (it returns 0).
        upstream::calloc(nelem, elsize)
    }

    fn realloc(ptr: u64, old_size: u64, new_size: u64) -> u64 {
        if ptr == 0 {
            return Self::malloc(new_size);
        }
        if old_size >= NBUCKETS && new_size >= NBUCKETS {
            // A block handed out is a plain upstream block of its size, whichever cache
            // it came from.
            return upstream::realloc(ptr, old_size, new_size);
        }
        let new = Self::malloc(new_size);
        if new == 0 {
            return 0;
        }
        bytes::copy(new, ptr, old_size.min(new_size));
        Self::free(ptr, old_size);
        new
    }

    fn free(ptr: u64, size: u64) {
        if ptr == 0 {
            return;
        }
        if let Some((ptr, size)) = with_cache(|c| c.keep(ptr, size)) {
            upstream::free(ptr, size);
        }
    }

    fn malloc_many(size: u64, count: u32) -> Vec<u64> {
        let mut ptrs = with_cache(|c| match c.bucket(size) {
            Some(bucket) => {
                let n = bucket.len().min(count as usize);
                bucket.split_off(bucket.len() - n)
            }
            None => Vec::new(),
        });
        let rest = count - ptrs.len() as u32;
        if rest > 0 {
            ptrs.extend(upstream::malloc_many(size, rest));
        }
        ptrs
    }

    fn free_many(mut ptrs: Vec<u64>, size: u64) {
        ptrs.retain(|&p| p != 0);
        with_cache(|c| {
            let depth = c.depth;
            if let Some(bucket) = c.bucket(size) {
                let n = depth.saturating_sub(bucket.len()).min(ptrs.len());
                bucket.extend(ptrs.drain(ptrs.len() - n..));
            }
        });
        if !ptrs.is_empty() {
            upstream::free_many(&ptrs, size);
        }
    }
}

fn parse_count(key: &str, value: &str, max: usize) -> Result<usize, String> {
    match value.trim().parse::<usize>() {
        Ok(d) if d <= max => Ok(d),
        _ => Err(format!(
            "size-classes: bad value `{value}` for `{key}`: want an integer in 0..={max}"
        )),
    }
}

impl Lifecycle for SizeClasses {
    fn init(config: Vec<(String, String)>) -> Result<Info, String> {
        let mut depth = None;
        let mut large = None;
        for (key, value) in &config {
            let (slot, max) = match key.as_str() {
                "bucket-depth" => (&mut depth, MAX_DEPTH),
                "large-cache" => (&mut large, MAX_LARGE_CACHE),
                _ => {
                    return Err(format!(
                        "size-classes: unknown config key `{key}` (value `{value}`); \
                         known: bucket-depth, large-cache"
                    ));
                }
            };
            if slot.is_some() {
                return Err(format!("size-classes: `{key}` given more than once"));
            }
            *slot = Some(parse_count(key, value, max)?);
        }
        let depth = depth.unwrap_or(DEFAULT_DEPTH);
        with_cache(|c| {
            c.depth = depth;
            c.large_limit = large.unwrap_or(0);
            for bucket in &mut c.buckets[1..] {
                bucket.reserve_exact(depth);
            }
        });
        Ok(Info {
            name: "size-classes".into(),
            version: 1,
            // Blocks are whole upstream blocks, which the host aligns to 16.
            alignment: 16,
            batch: true,
        })
    }

    fn trim() {
        // Upstream cannot call back into us, so holding the borrow across its calls is fine.
        with_cache(|c| {
            for (size, bucket) in c.buckets.iter_mut().enumerate().skip(1) {
                if !bucket.is_empty() {
                    upstream::free_many(bucket, size as u64);
                    bucket.clear();
                }
            }
            for (size, ptr) in c.large.drain(..) {
                upstream::free(ptr, size);
            }
        });
    }
}

export!(SizeClasses);
