//! What a bridge lends to Numba's runtime through (`numba_route`): the
//! `NRT_ExternalAllocator` that NRT keeps in each MemInfo, and the few blocks moved so
//! that NRT's header starts aligned; and where in its block an aligned array goes.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// NRT's `NRT_ExternalAllocator` (numba/core/runtime/nrt_external.h).
#[repr(C)]
pub(crate) struct NrtAllocator {
    pub(crate) malloc: unsafe extern "C" fn(usize, *mut c_void) -> *mut c_void,
    pub(crate) realloc: unsafe extern "C" fn(*mut c_void, usize, *mut c_void) -> *mut c_void,
    pub(crate) free: unsafe extern "C" fn(*mut c_void, *mut c_void),
    pub(crate) opaque: *mut c_void,
}

// SAFETY: the struct is read by Numba's runtime from any thread; `opaque` points to a
// `Bridge`, which is `Send + Sync`, and the struct is never written after it is made.
unsafe impl Send for NrtAllocator {}
// SAFETY: as above.
unsafe impl Sync for NrtAllocator {}

/// What a bridge lends to Numba's runtime through: the allocator NRT keeps in each
/// MemInfo, and the blocks it had to move for NRT's header.
pub(crate) struct NrtLending {
    pub(crate) allocator: NrtAllocator,
    /// A MemInfo header holds atomics, so it must start on 16 bytes; a handler that
    /// promises less (`guard` promises 1, to end each block at its guard page) is asked
    /// for 15 bytes more, and the header moved up: moved address -> block.
    moved: Option<Mutex<HashMap<usize, usize>>>,
}

/// The alignment NRT's header needs.
const HEADER_ALIGNMENT: usize = 16;

impl NrtLending {
    /// Lending through `allocator` for a handler whose blocks have `alignment`.
    pub(crate) fn new(allocator: NrtAllocator, alignment: u64) -> Self {
        let aligned = alignment >= HEADER_ALIGNMENT as u64;
        NrtLending {
            allocator,
            moved: (!aligned).then(|| Mutex::new(HashMap::new())),
        }
    }

    /// A block of `size` bytes for NRT from `malloc` (the handler's), its start on
    /// [`HEADER_ALIGNMENT`].
    pub(crate) fn lend(
        &self,
        size: usize,
        malloc: impl FnOnce(usize) -> *mut c_void,
    ) -> *mut c_void {
        let Some(moved) = &self.moved else {
            return malloc(size);
        };
        let Some(padded) = size.checked_add(HEADER_ALIGNMENT - 1) else {
            return std::ptr::null_mut();
        };
        let block = malloc(padded);
        if block.is_null() {
            return block;
        }
        let header = (block as usize).next_multiple_of(HEADER_ALIGNMENT);
        if header != block as usize {
            lock(moved).insert(header, block as usize);
        }
        header as *mut c_void
    }
    /// The block a pointer this lending gave out starts at.
    pub(crate) fn block_of(&self, ptr: *mut c_void) -> *mut c_void {
        match &self.moved {
            Some(moved) => lock(moved)
                .remove(&(ptr as usize))
                .map_or(ptr, |block| block as *mut c_void),
            None => ptr,
        }
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where an array of `size` bytes aligned to `align` starts in a block whose data part
/// begins at `data` and holds `padded = size + align - 1` bytes: as late as the
/// alignment allows, so that a policy which guards the end of its blocks (`guard`)
/// guards the end of the array to within `align` bytes.
pub(crate) fn aligned_start(data: usize, padded: usize, size: usize, align: usize) -> usize {
    (data + padded - size) / align * align
}

#[cfg(test)]
mod tests {
    use super::*;

    unsafe extern "C" fn never_malloc(_: usize, _: *mut c_void) -> *mut c_void {
        unreachable!()
    }
    unsafe extern "C" fn never_realloc(_: *mut c_void, _: usize, _: *mut c_void) -> *mut c_void {
        unreachable!()
    }
    unsafe extern "C" fn never_free(_: *mut c_void, _: *mut c_void) {
        unreachable!()
    }

    fn lending(alignment: u64) -> NrtLending {
        let allocator = NrtAllocator {
            malloc: never_malloc,
            realloc: never_realloc,
            free: never_free,
            opaque: std::ptr::null_mut(),
        };
        NrtLending::new(allocator, alignment)
    }

    #[test]
    fn an_array_starts_aligned_inside_its_block_and_ends_as_late_as_alignment_allows() {
        for data in [0x1000, 0x1010, 0x1030] {
            for size in [1, 8, 100, 65536] {
                for align in [1, 8, 16, 32, 64] {
                    let padded = size + align - 1;
                    let start = aligned_start(data, padded, size, align);
                    assert_eq!(start % align, 0);
                    assert!(start >= data && start + size <= data + padded);
                    assert!(
                        data + padded - (start + size) < align,
                        "no later start fits"
                    );
                }
            }
        }
    }

    #[test]
    fn a_header_from_a_handler_aligned_to_less_than_16_is_moved_up_and_found_again() {
        let moving = lending(1);
        let header = moving.lend(100, |n| {
            assert_eq!(n, 115, "asked for 15 bytes of room");
            0x2003 as *mut c_void
        });
        assert_eq!(header as usize, 0x2010);
        assert_eq!(moving.block_of(header) as usize, 0x2003);
        assert_eq!(
            moving.block_of(header) as usize,
            0x2010,
            "forgotten once freed"
        );
        assert!(moving.lend(usize::MAX, |_| unreachable!()).is_null());
        assert!(moving.lend(8, |_| std::ptr::null_mut()).is_null());

        let aligned = lending(16);
        assert_eq!(
            aligned.lend(100, |n| n as *mut c_void) as usize,
            100,
            "no room asked"
        );
        assert_eq!(aligned.block_of(0x3000 as *mut c_void) as usize, 0x3000);
    }
}
