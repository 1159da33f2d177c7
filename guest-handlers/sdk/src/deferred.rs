//! Frees a policy asks of itself during a call, made once that call has returned.
//!
//! During a client's `realloc` the host holds the block being resized read-only: on an
//! answer of 0 it must still be the client's, unchanged (C4). A policy whose `free`
//! writes into the block it is given (an intrusive free list, a header) cannot free the
//! old block inside its `realloc`; [`free_after_this_call`] gives it to the policy's
//! own `free` at the start of the next call the host makes, when the block is the
//! policy's again. The SDK's default `realloc` frees the old block so.

use std::cell::RefCell;

std::thread_local! {
    /// The host calls a policy on one thread: a plain static without `unsafe`.
    static DEFERRED: RefCell<Vec<(u64, u64)>> = const { RefCell::new(Vec::new()) };
}

/// Give the block at `ptr` (`size` bytes, as it was lent) to this policy's own `free`
/// once the current call has returned: what a `realloc` does with the old block when
/// its `free` writes into the blocks it is given. The free is made at the start of the
/// host's next call to the policy (any call: `trim` and the leak check included), before
/// that call's own work.
pub fn free_after_this_call(ptr: u64, size: u64) {
    DEFERRED.with_borrow_mut(|deferred| deferred.push((ptr, size)));
}

/// Give each deferred block to `free`, oldest first (one `free` may defer another).
#[inline]
pub(crate) fn flush(mut free: impl FnMut(u64, u64)) {
    while let Some((ptr, size)) = DEFERRED.with_borrow_mut(|deferred| {
        if deferred.is_empty() {
            None
        } else {
            Some(deferred.remove(0))
        }
    }) {
        free(ptr, size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deferred_frees_are_made_oldest_first_and_one_a_free_defers_is_made_too() {
        free_after_this_call(16, 8);
        free_after_this_call(32, 8);
        let mut made = Vec::new();
        flush(|ptr, size| {
            if ptr == 16 {
                free_after_this_call(48, 24);
            }
            made.push((ptr, size));
        });
        assert_eq!(made, [(16, 8), (32, 8), (48, 24)]);
        flush(|_, _| panic!("nothing is left"));
    }
}
