//! Reports of a client's misuse that the policy found: a canary overwritten past a
//! block's end, a write into a freed block. The host records each one and the embedder
//! shows it (`stats()`, the CLI, a Python warning); the policy goes on.

use crate::bindings::allocbox::policy::diagnostics as imports;

/// The client misused the block at `block` of `size` bytes (as allocated) at `offset`
/// bytes from its start; `message` says what happened in one sentence.
#[inline]
pub fn client_misuse(block: u64, size: u64, offset: u64, message: &str) {
    imports::client_misuse(block, size, offset, message)
}
