//! What a bridge lends to Numba's runtime through (`numba_route`): the
//! `NRT_ExternalAllocator` that NRT keeps in each MemInfo, the few blocks moved so that
//! NRT's header starts aligned, how many blocks are out, and where in its block an
//! aligned array goes.
//!
//! **The blocks keep their lender alive without a count every thread writes.** NRT
//! frees a block through the allocator it was made with, possibly after the policy was
//! dropped, so the lender (and the handler behind it) must outlive its last block. A
//! shared reference count per block put a locked instruction on every array, on a line
//! every Numba worker wrote: the larger part of an `@njit` array's cost, and several
//! times Numba's own allocator in a `prange` loop. Instead each thread counts the blocks
//! it lent and took back on a line of its own (a load and a store, no read-modify-write;
//! a block freed on another thread leaves its maker's line one up and the freer's one
//! down, and only the sum means anything).
//!
//! While its bridge lives no block is lent without it, so when the bridge is dropped its
//! lender goes to the orphans, which are freed once their lines sum to zero. Each line
//! only falls from then on, so a sum of zero read at any moment means the last block is
//! back. Who sees it: a thread giving a block back writes its line, then (a light
//! barrier between) reads whether an orphan with its lender's bit waits; the bridge's
//! drop sets that bit, then (a heavy barrier between) sums the lines. The pair orders
//! memory as two full fences would, so either the freer sees the orphan and sums under
//! the orphans' lock itself, or the drop's sum sees the freer's line: the last sum taken
//! sees every line's last value and frees the lender. A thread's line store is the last
//! it touches of a lender, so a lender freed by another thread is never touched again.

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Mutex;
use std::sync::atomic::{AtomicIsize, AtomicU64, AtomicUsize, Ordering};

use allocbox_ledger::by_thread::ByThread;
use allocbox_ledger::platform::barrier;

/// NRT's `NRT_ExternalAllocator` (numba/core/runtime/nrt_external.h).
#[repr(C)]
pub(crate) struct NrtAllocator {
    pub(crate) malloc: unsafe extern "C" fn(usize, *mut c_void) -> *mut c_void,
    pub(crate) realloc: unsafe extern "C" fn(*mut c_void, usize, *mut c_void) -> *mut c_void,
    pub(crate) free: unsafe extern "C" fn(*mut c_void, *mut c_void),
    pub(crate) opaque: *mut c_void,
}

// SAFETY: the struct is read by Numba's runtime from any thread; `opaque` points to a
// `Lender`, which is `Send + Sync`, and the struct is never written after it is made.
unsafe impl Send for NrtAllocator {}
// SAFETY: as above.
unsafe impl Sync for NrtAllocator {}

/// What a bridge lends to Numba's runtime through: the allocator NRT keeps in each
/// MemInfo (whose opaque pointer is this lender), who lends (`owner`: a bridge over
/// the same handler as the one that made the lender), and its blocks.
pub(crate) struct Lender<B> {
    pub(crate) allocator: NrtAllocator,
    pub(crate) owner: B,
    /// A MemInfo header holds atomics, so it must start on 16 bytes; a handler that
    /// promises less (`guard` promises 1, to end each block at its guard page) is asked
    /// for 15 bytes more, and the header moved up: moved address -> block.
    moved: Option<Mutex<HashMap<usize, usize>>>,
    /// Blocks lent less blocks given back, a line per thread (see the module's doc),
    /// found by thread pointer: a thread-local variable in a shared library (this one)
    /// costs a call into the dynamic linker, most of what counting a block cost.
    out: ByThread<Line>,
    /// This lender's bit of [`ORPHANED`], one of 64 lenders share.
    bit: u64,
}

/// One thread's count, on a cache line of its own: written only by its thread.
#[derive(Default)]
#[repr(align(128))]
struct Line(AtomicIsize);

/// The alignment NRT's header needs.
const HEADER_ALIGNMENT: usize = 16;

impl<B> Lender<B> {
    /// A block of `size` bytes for NRT from `malloc` (the handler's), its start on
    /// [`HEADER_ALIGNMENT`], counted out.
    pub(crate) fn lend(
        &self,
        size: usize,
        malloc: impl FnOnce(usize) -> *mut c_void,
    ) -> *mut c_void {
        let block = match &self.moved {
            None => malloc(size),
            Some(moved) => {
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
        };
        if !block.is_null() {
            let line = &self.out.get_or(Line::default).0;
            line.store(line.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        }
        block
    }

    /// The block a pointer this lender gave out starts at.
    #[inline]
    pub(crate) fn block_of(&self, ptr: *mut c_void) -> *mut c_void {
        match &self.moved {
            Some(moved) => lock(moved)
                .remove(&(ptr as usize))
                .map_or(ptr, |block| block as *mut c_void),
            None => ptr,
        }
    }

    /// Count one block back. The lender may be freed by then (by this thread or
    /// another), so `this` is a pointer, not a reference that would outlive it.
    ///
    /// # Safety
    /// `this` is a live lender that lent the block now back, and the caller touches it
    /// no more.
    pub(crate) unsafe fn given_back(this: *const Self) {
        // SAFETY: the caller's contract: the lender is alive until its line says the
        // block is back.
        let (line, bit) = unsafe { (&(*this).out.get_or(Line::default).0, (*this).bit) };
        // Release: whoever reads this and frees the lender does so after every access
        // of this thread's to it.
        line.store(line.load(Ordering::Relaxed) - 1, Ordering::Release);
        barrier::light();
        if ORPHANED.load(Ordering::Relaxed) & bit != 0 {
            reap();
        }
    }

    /// Blocks lent and not given back, as far as this thread sees the lines.
    fn blocks_out(&self) -> isize {
        let lines = self.out.iter();
        lines.map(|line| line.0.load(Ordering::Acquire)).sum()
    }
}

/// A bridge's lender, in a box of its own whose address NRT keeps in each MemInfo.
/// Dropped with its bridge, it passes the box to the orphans (see the module's doc).
pub(crate) struct NrtLending<B: Send + Sync + 'static>(NonNull<Lender<B>>);

// SAFETY: the lender is `Send + Sync` when `B` is, and this handle only reads it.
unsafe impl<B: Send + Sync + 'static> Send for NrtLending<B> {}
// SAFETY: as above.
unsafe impl<B: Send + Sync + 'static> Sync for NrtLending<B> {}

/// The functions of an [`NrtAllocator`], without its opaque pointer.
pub(crate) struct NrtFunctions {
    pub(crate) malloc: unsafe extern "C" fn(usize, *mut c_void) -> *mut c_void,
    pub(crate) realloc: unsafe extern "C" fn(*mut c_void, usize, *mut c_void) -> *mut c_void,
    pub(crate) free: unsafe extern "C" fn(*mut c_void, *mut c_void),
}

impl<B: Send + Sync + 'static> NrtLending<B> {
    /// A lender for `owner`, whose handler's blocks have `alignment`, calling
    /// `functions` with the lender as their opaque pointer.
    pub(crate) fn new(owner: B, alignment: u64, functions: NrtFunctions) -> Self {
        // Decided before a given-back block relies on the light barrier.
        barrier::prepare();
        let aligned = alignment >= HEADER_ALIGNMENT as u64;
        let lender = Box::into_raw(Box::new(Lender {
            allocator: NrtAllocator {
                malloc: functions.malloc,
                realloc: functions.realloc,
                free: functions.free,
                opaque: std::ptr::null_mut(),
            },
            owner,
            moved: (!aligned).then(|| Mutex::new(HashMap::new())),
            out: ByThread::default(),
            bit: 1 << (NEXT_BIT.fetch_add(1, Ordering::Relaxed) % u64::BITS as usize),
        }));
        // SAFETY: just made, and no one else has it yet.
        unsafe { (*lender).allocator.opaque = lender.cast() };
        NrtLending(NonNull::new(lender).expect("a box is never null"))
    }

    pub(crate) fn lender(&self) -> &Lender<B> {
        // SAFETY: the box lives at least as long as this handle (it is freed only
        // after the handle is dropped, see `Drop`).
        unsafe { self.0.as_ref() }
    }
}

impl<B: Send + Sync + 'static> Drop for NrtLending<B> {
    fn drop(&mut self) {
        let orphan: NonNull<dyn Orphan> = self.0;
        {
            let mut orphans = lock(&ORPHANS);
            orphans.push(Orphaned(orphan));
            ORPHANED.store(bits_of(&orphans), Ordering::Relaxed);
        }
        barrier::heavy();
        reap();
    }
}

/// A lender whose bridge is gone, kept until its last block is back.
trait Orphan: Send + Sync {
    fn blocks_out(&self) -> isize;
    fn bit(&self) -> u64;
}

impl<B: Send + Sync> Orphan for Lender<B> {
    fn blocks_out(&self) -> isize {
        Lender::blocks_out(self)
    }
    fn bit(&self) -> u64 {
        self.bit
    }
}

/// A box the orphans own, which other threads may still be reading (so not a `Box`,
/// which would claim it alone).
struct Orphaned(NonNull<dyn Orphan>);

// SAFETY: a pointer to a `Send + Sync` lender.
unsafe impl Send for Orphaned {}

/// Lenders whose bridges are gone and whose blocks are not all back.
static ORPHANS: Mutex<Vec<Orphaned>> = Mutex::new(Vec::new());
/// The bits of the lenders among [`ORPHANS`], read by every block given back: a lender
/// whose bit is clear has no orphan to look for, so an orphan whose arrays live on for
/// good sends only the frees of the lenders that share its bit (one in 64) to the lock.
static ORPHANED: AtomicU64 = AtomicU64::new(0);
/// Where the next lender's bit is.
static NEXT_BIT: AtomicUsize = AtomicUsize::new(0);

/// The bits of `orphans`; under the orphans' lock, so that two writers never cross.
fn bits_of(orphans: &[Orphaned]) -> u64 {
    // SAFETY: an orphan in the list is alive (it is freed only after leaving it).
    let bits = orphans.iter().map(|o| unsafe { o.0.as_ref() }.bit());
    bits.fold(0, |all, bit| all | bit)
}

/// Free every orphan whose blocks are all back.
#[cold]
fn reap() {
    let ended: Vec<Orphaned> = {
        let mut orphans = lock(&ORPHANS);
        // SAFETY: an orphan is freed only here, after it leaves the list under the lock.
        let ended = orphans
            .extract_if(.., |o| unsafe { o.0.as_ref() }.blocks_out() == 0)
            .collect();
        ORPHANED.store(bits_of(&orphans), Ordering::Relaxed);
        ended
    };
    // Freed after the lock: the last reference to a bridge ends its handler.
    for orphan in ended {
        // SAFETY: made by `Box::into_raw` in `NrtLending::new`; its bridge is gone and
        // its lines sum to zero, so no thread will touch it again (see the module's doc).
        drop(unsafe { Box::from_raw(orphan.0.as_ptr()) });
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
    let latest = data + padded - size;
    match align.is_power_of_two() {
        // What Numba asks for: a mask, where a division took a tenth of the shim's time.
        true => latest & !(align - 1),
        false => latest / align * align,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

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

    const NEVER: NrtFunctions = NrtFunctions {
        malloc: never_malloc,
        realloc: never_realloc,
        free: never_free,
    };

    /// An owner that says when it is dropped.
    struct Owner(Arc<AtomicBool>);

    impl Drop for Owner {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn lending(alignment: u64) -> NrtLending<()> {
        NrtLending::new((), alignment, NEVER)
    }

    #[test]
    fn an_array_starts_aligned_inside_its_block_and_ends_as_late_as_alignment_allows() {
        for data in [0x1000, 0x1010, 0x1030] {
            for size in [1, 8, 100, 65536] {
                for align in [1, 8, 16, 24, 32, 64] {
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
        let moving = moving.lender();
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
            aligned.lender().lend(100, |n| n as *mut c_void) as usize,
            100,
            "no room asked"
        );
        assert_eq!(
            aligned.lender().block_of(0x3000 as *mut c_void) as usize,
            0x3000
        );
    }

    #[test]
    fn a_lender_outlives_its_bridge_until_its_last_block_is_given_back_on_any_thread() {
        let dropped = Arc::new(AtomicBool::new(false));
        let lending = NrtLending::new(Owner(dropped.clone()), 16, NEVER);
        let lender: *const Lender<Owner> = lending.lender();
        struct Shared(*const Lender<Owner>);
        // SAFETY: a pointer to a `Sync` lender, kept alive by its blocks.
        unsafe impl Send for Shared {}
        // SAFETY: as above.
        unsafe impl Sync for Shared {}
        let shared = Arc::new(Shared(lender));
        // Four threads lend 1,000 blocks each; each block is given back by another.
        let lent: Vec<Vec<usize>> = std::thread::scope(|s| {
            let makers: Vec<_> = (0..4)
                .map(|t| {
                    let shared = shared.clone();
                    s.spawn(move || {
                        // SAFETY: the lending is alive for the whole scope.
                        let lender = unsafe { &*shared.0 };
                        (0..1000)
                            .map(|i| {
                                lender.lend(16, |_| ((t * 1000 + i + 1) * 16) as *mut c_void)
                                    as usize
                            })
                            .collect()
                    })
                })
                .collect();
            makers.into_iter().map(|m| m.join().unwrap()).collect()
        });
        // SAFETY: alive: the bridge's lending is not dropped yet.
        assert_eq!(unsafe { &*lender }.blocks_out(), 4000);
        let (early, late): (Vec<_>, Vec<_>) = lent.into_iter().flatten().partition(|b| b % 32 == 0);
        let give_back = |blocks: Vec<usize>| {
            std::thread::scope(|s| {
                for chunk in blocks.chunks(blocks.len().div_ceil(3)) {
                    let shared = shared.clone();
                    s.spawn(move || {
                        for _ in chunk {
                            // SAFETY: each block was lent by this lender and is given
                            // back once; the lender lives until the last one.
                            unsafe { Lender::given_back(shared.0) };
                        }
                    });
                }
            })
        };
        give_back(early);
        drop(lending);
        assert!(!dropped.load(Ordering::SeqCst), "blocks are still out");
        let last = late.len();
        give_back(late);
        assert!(
            dropped.load(Ordering::SeqCst),
            "the last of {last} blocks freed it"
        );
    }

    #[test]
    fn a_lender_with_no_blocks_out_ends_with_its_bridge() {
        let dropped = Arc::new(AtomicBool::new(false));
        let lending = NrtLending::new(Owner(dropped.clone()), 16, NEVER);
        let block = lending.lender().lend(8, |_| 0x4000 as *mut c_void);
        let lender: *const Lender<Owner> = lending.lender();
        // SAFETY: lent by this lender, given back once, while its bridge lives.
        unsafe { Lender::given_back(lender) };
        assert!(!block.is_null());
        drop(lending);
        assert!(dropped.load(Ordering::SeqCst));
    }
}
