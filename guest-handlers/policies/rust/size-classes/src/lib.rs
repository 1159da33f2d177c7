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
//! handler (1.02-1.06x) although it faulted less; given back, 0.88-0.90x. A request
//! upstream refuses is asked again after every large block kept is given back.
//!
//! Every cached block is a whole upstream block of exactly its bucket's size (it was got
//! upstream with that size, and the sized-free rule means it comes back with it), so
//! handing it out again and finally freeing it upstream with the bucket's size both keep
//! the host's rules.

use std::cell::RefCell;

use allocbox_policy::{Config, Info, Policy, bytes, export_policy, upstream};

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

/// The policy: the cache behind a `RefCell`, since the SDK lends it as `&self`. No
/// borrow is held across a call to our own methods, so the `RefCell` never panics.
struct SizeClasses {
    cache: RefCell<Cache>,
}

impl SizeClasses {
    fn with<R>(&self, f: impl FnOnce(&mut Cache) -> R) -> R {
        f(&mut self.cache.borrow_mut())
    }

    /// A block from `get` (an upstream request), asked again once the large blocks kept
    /// are given back when upstream had none: what the cache holds idle counts against
    /// the host's overhead budget, and a second 1 GiB `np.zeros` was refused while the
    /// first one's block sat here (calloc never reuses a kept block).
    fn or_after_giving_back_large(&self, get: impl Fn() -> u64) -> u64 {
        let block = get();
        if block != 0 {
            return block;
        }
        let kept = self.with(|c| std::mem::take(&mut c.large));
        if kept.is_empty() {
            return 0;
        }
        for (size, ptr) in kept {
            upstream::free(ptr, size);
        }
        get()
    }
}

/// A count of at most `max`, for `config.get_with`.
fn count_up_to(max: usize) -> impl FnOnce(&str) -> Result<usize, String> {
    move |value| match value.parse::<usize>() {
        Ok(n) if n <= max => Ok(n),
        _ => Err(format!("want an integer in 0..={max}")),
    }
}

impl Policy for SizeClasses {
    /// Its state (its free lists, its held memory) is this instance's alone: one per
    /// thread serves the same as one for all.
    fn info(&self) -> Info {
        Info::new().shardable(true)
    }

    fn init(config: &mut Config) -> Result<Self, String> {
        let depth = config
            .get_with("bucket-depth", count_up_to(MAX_DEPTH))?
            .unwrap_or(DEFAULT_DEPTH);
        let large_limit = config
            .get_with("large-cache", count_up_to(MAX_LARGE_CACHE))?
            .unwrap_or(0);
        let mut buckets = vec![Vec::new(); NBUCKETS as usize];
        for bucket in &mut buckets[1..] {
            bucket.reserve_exact(depth);
        }
        Ok(SizeClasses {
            cache: RefCell::new(Cache {
                depth,
                buckets,
                large_limit,
                large: Vec::new(),
            }),
        })
    }

    // The default `info` holds: blocks are whole upstream blocks, which the host aligns
    // to 16, and batching is what makes this policy fast.

    fn malloc(&self, size: u64) -> u64 {
        let (hit, stale) = self.with(|c| match c.take(size) {
            Some(ptr) => (Some(ptr), Vec::new()),
            None => (None, c.smaller_large(size)),
        });
        for (ptr, size) in stale {
            upstream::free(ptr, size);
        }
        hit.unwrap_or_else(|| self.or_after_giving_back_large(|| upstream::malloc(size)))
    }

    fn calloc(&self, nelem: u64, elsize: u64) -> u64 {
        // Large zeroed blocks come fresh from upstream: untouched zero pages cost less
        // than clearing a cached block.
        if let Some(size) = nelem.checked_mul(elsize).filter(|&s| s < LARGE)
            && let Some(ptr) = self.with(|c| c.take(size))
        {
            // A recycled block still holds its previous owner's bytes.
            return bytes::zeroed(ptr, size);
        }
        // Upstream handles an overflowing product too (it returns 0).
        self.or_after_giving_back_large(|| upstream::calloc(nelem, elsize))
    }

    fn realloc(&self, ptr: u64, old_size: u64, new_size: u64) -> u64 {
        if ptr == 0 {
            return self.malloc(new_size);
        }
        if old_size >= NBUCKETS && new_size >= NBUCKETS {
            // A block handed out is a plain upstream block of its size, whichever cache
            // it came from.
            return upstream::realloc(ptr, old_size, new_size);
        }
        let new = self.malloc(new_size);
        if new == 0 {
            return 0;
        }
        bytes::copy(new, ptr, old_size.min(new_size));
        self.free(ptr, old_size);
        new
    }

    fn free(&self, ptr: u64, size: u64) {
        if ptr == 0 {
            return;
        }
        if let Some((ptr, size)) = self.with(|c| c.keep(ptr, size)) {
            upstream::free(ptr, size);
        }
    }

    fn malloc_many(&self, size: u64, count: u32) -> Vec<u64> {
        let mut ptrs = self.with(|c| match c.bucket(size) {
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

    fn free_many(&self, mut ptrs: Vec<u64>, size: u64) {
        ptrs.retain(|&p| p != 0);
        self.with(|c| {
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

    fn trim(&self) {
        // Upstream cannot call back into us, so holding the borrow across its calls is fine.
        self.with(|c| {
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

export_policy!(SizeClasses, name = "size-classes");
