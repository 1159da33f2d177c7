//! A global allocator for the library's unit tests that counts, per thread, the bytes
//! allocated and not yet freed, so that a test can measure what a structure really
//! costs the host while other tests run on other threads.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
}

struct Counting;

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the
// thread-local counter allocates nothing (a `const` initialised `Cell`).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: the caller's contract for `GlobalAlloc::alloc`, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as isize));
        // SAFETY: as in `alloc`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size as isize - layout.size() as isize);
        // SAFETY: as in `alloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Memory freed on another thread than it was allocated on shows as a loss there and a
/// gain here; a test measures what one thread builds and drops itself.
fn count(bytes: isize) {
    // `try_with`: during thread teardown the counter may be gone already.
    let _ = LIVE.try_with(|live| live.set(live.get() + bytes));
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Bytes this thread allocated and has not freed, since it started.
pub(crate) fn live_bytes() -> isize {
    LIVE.with(Cell::get)
}
