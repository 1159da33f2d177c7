//! The bytes of blocks this policy holds from upstream and has not lent out (plus, during
//! the policy's own `realloc`, the block being resized, to read only: it is the client's
//! until the answer, so a `free` of it that writes waits for
//! [`free_after_this_call`](crate::free_after_this_call)): for headers, footers and free
//! lists kept inside the blocks. Any other address is a contract violation and the host
//! stops the policy.
//!
//! Every value is little-endian. `u64` words go straight to the host; narrower ones go
//! through [`read_array`]/[`write_array`].

use crate::bindings::allocbox::policy::bytes as imports;

/// `len` bytes starting at `at`.
#[inline]
pub fn read(at: u64, len: u32) -> Vec<u8> {
    imports::read(at, len)
}

/// Store `data` at `at`.
#[inline]
pub fn write(at: u64, data: &[u8]) {
    imports::write(at, data)
}

/// Set `len` bytes at `at` to `byte`.
#[inline]
pub fn fill(at: u64, len: u64, byte: u8) {
    imports::fill(at, len, byte)
}

/// `ptr`, a block of `len` bytes the policy holds and has not lent, with every byte set
/// to 0: what `calloc` answers. 0 (no block) stays 0.
#[inline]
pub fn zeroed(ptr: u64, len: u64) -> u64 {
    if ptr != 0 {
        fill(ptr, len, 0);
    }
    ptr
}

/// Copy `len` bytes from `src` to `dst`; the ranges may overlap.
#[inline]
pub fn copy(dst: u64, src: u64, len: u64) {
    imports::copy(dst, src, len)
}

/// The `u64` at `at`.
#[inline]
pub fn read_u64(at: u64) -> u64 {
    imports::read_u64(at)
}

/// Store the `u64` `value` at `at`.
#[inline]
pub fn write_u64(at: u64, value: u64) {
    imports::write_u64(at, value)
}

/// The `N` bytes at `at`, for a header of several fields in one call:
/// `let [a, b, c, d, ..] = read_array::<16>(at);` or `u32::from_le_bytes(...)`.
pub fn read_array<const N: usize>(at: u64) -> [u8; N] {
    let mut out = [0; N];
    out.copy_from_slice(&read(at, N as u32));
    out
}

/// Store the `N` bytes of `data` at `at`.
#[inline]
pub fn write_array<const N: usize>(at: u64, data: [u8; N]) {
    write(at, &data)
}

/// The `u32` at `at`.
#[inline]
pub fn read_u32(at: u64) -> u32 {
    u32::from_le_bytes(read_array(at))
}

/// Store the `u32` `value` at `at`.
#[inline]
pub fn write_u32(at: u64, value: u32) {
    write_array(at, value.to_le_bytes())
}

/// The `u16` at `at`.
#[inline]
pub fn read_u16(at: u64) -> u16 {
    u16::from_le_bytes(read_array(at))
}

/// Store the `u16` `value` at `at`.
#[inline]
pub fn write_u16(at: u64, value: u16) {
    write_array(at, value.to_le_bytes())
}
