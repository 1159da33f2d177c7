//! The allocator below this policy: the next policy in the chain, or the host's memory.
//!
//! The host keeps the same rules towards a policy's upstream requests as towards the
//! policy's own answers: free a block with exactly the size it was (re)allocated with,
//! and free only blocks got here and not freed yet. Every block is 16-byte aligned
//! (when the upstream is the host) and its bytes may be touched through
//! [`bytes`](crate::bytes) while the policy holds it and has not lent it out.

use crate::bindings::allocbox::policy::allocator as imports;

/// A block of at least `size` bytes, or 0 when out of memory.
#[inline]
pub fn malloc(size: u64) -> u64 {
    imports::malloc(size)
}

/// A zero-filled block of `nelem * elsize` bytes, or 0 (also when the product overflows).
#[inline]
pub fn calloc(nelem: u64, elsize: u64) -> u64 {
    imports::calloc(nelem, elsize)
}

/// Resize the block at `ptr` (of `old_size` bytes) to `new_size`; 0 leaves it as it was.
#[inline]
pub fn realloc(ptr: u64, old_size: u64, new_size: u64) -> u64 {
    imports::realloc(ptr, old_size, new_size)
}

/// Give back the block at `ptr`, of exactly `size` bytes.
#[inline]
pub fn free(ptr: u64, size: u64) {
    imports::free(ptr, size)
}

/// Up to `count` blocks of `size` bytes in one call (fewer, possibly none, when memory
/// runs out).
#[inline]
pub fn malloc_many(size: u64, count: u32) -> Vec<u64> {
    imports::malloc_many(size, count)
}

/// Give back several blocks, each of exactly `size` bytes, in one call.
#[inline]
pub fn free_many(ptrs: &[u64], size: u64) {
    imports::free_many(ptrs, size)
}
