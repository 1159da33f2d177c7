//! Numba's arrays through allocbox: the functions Numba's compiled code calls for a new
//! array (`NRT_MemInfo_alloc_aligned` and its debug twin, rebound by `allocbox.numba`
//! through llvmlite's symbol table), which place the array with the handler NumPy has
//! current, and the `NRT_ExternalAllocator` each bridge lends through, so that every
//! MemInfo remembers its maker and Numba's unsized free reaches it.
//!
//! NRT puts a MemInfo header and the data in one block from the allocator and frees it
//! with no size: the handler's ledger supplies it ([`MemHandler::free_unsized`]). While
//! Numba's runtime counts nothing, the shim lays the header out itself as NRT would. A
//! bridge's blocks keep what it lends through alive (`nrt_lending`), as each NumPy
//! array holds its handler's capsule, so a block outlives a policy that was changed or
//! dropped.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use pyo3::exceptions::PyRuntimeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;

use super::blocks;
use crate::bridge::{Bridge, bridge_malloc};
use crate::nrt_lending::{Lender, NrtAllocator, NrtFunctions, aligned_start, lock};
use crate::numpy_api::{bridge_in, get_handler_fn};

type NrtMalloc = unsafe extern "C" fn(usize, *mut c_void) -> *mut c_void;

/// What `bridge` lends to Numba's runtime through.
fn lending(bridge: &Bridge) -> &Lender<Bridge> {
    bridge.nrt_lender(|| NrtFunctions {
        malloc: nrt_malloc,
        realloc: nrt_realloc,
        free: nrt_free,
    })
}

/// The `Lender` an allocator's opaque pointer names.
///
/// # Safety
/// `opaque` came from [`lending`] and its lender is alive: NRT passes the opaque
/// pointer of the allocator a live block was made by, and a lender lives until its
/// last block is back.
unsafe fn lender_of<'a>(opaque: *mut c_void) -> &'a Lender<Bridge> {
    // SAFETY: the caller's contract.
    unsafe { &*opaque.cast::<Lender<Bridge>>().cast_const() }
}

unsafe extern "C" fn nrt_malloc(size: usize, opaque: *mut c_void) -> *mut c_void {
    // SAFETY: NRT passes back the opaque pointer of our allocator, whose bridge the
    // calling shim holds alive for the call.
    lend(unsafe { lender_of(opaque) }, size)
}

/// `size` bytes from `lender`'s bridge, counted as lent.
fn lend(lender: &Lender<Bridge>, size: usize) -> *mut c_void {
    let ctx = std::ptr::from_ref(&lender.owner).cast_mut().cast();
    // SAFETY: `ctx` is the lender's bridge, alive as long as the lender.
    lender.lend(size, |n| unsafe { bridge_malloc(ctx, n) })
}

/// NRT never resizes a MemInfo's block (only its separately allocated "varsize" data,
/// which comes from its own allocator): refused, which leaves the block as it was.
unsafe extern "C" fn nrt_realloc(_: *mut c_void, _: usize, _: *mut c_void) -> *mut c_void {
    std::ptr::null_mut()
}

unsafe extern "C" fn nrt_free(ptr: *mut c_void, opaque: *mut c_void) {
    // SAFETY: callable on any thread, with or without the GIL.
    unsafe { PyTraceMalloc_Untrack(TRACEMALLOC_DOMAIN, ptr as usize) };
    // SAFETY: NRT frees a block with the opaque pointer of the allocator that made it;
    // the block keeps its lender alive until `given_back`.
    let lender = unsafe { lender_of(opaque) };
    let Some(block) = NonNull::new(lender.block_of(ptr).cast::<u8>()) else {
        return;
    };
    lender.owner.free_unsized(block);
    // SAFETY: the lender lent this block, now back; nothing here touches it after.
    unsafe { Lender::given_back(opaque.cast::<Lender<Bridge>>().cast_const()) };
}

/// NRT's MemInfo header (numba/core/runtime/nrt.cpp), which `allocate_external` puts
/// at the start of the block, the data right after it. Checked against the running
/// Numba before any shim is installed ([`probe_layout`]).
#[repr(C)]
struct MemInfo {
    refct: usize,
    dtor: *mut c_void,
    dtor_info: *mut c_void,
    data: *mut c_void,
    size: usize,
    external_allocator: *const NrtAllocator,
}

type AllocAligned = unsafe extern "C" fn(usize, u32) -> *mut MemInfo;
type AllocExternal = unsafe extern "C" fn(usize, *const NrtAllocator) -> *mut MemInfo;
type AllocSafeAlignedExternal =
    unsafe extern "C" fn(usize, u32, *const NrtAllocator) -> *mut MemInfo;
type Release = unsafe extern "C" fn(*mut MemInfo);
type Data = unsafe extern "C" fn(*mut MemInfo) -> *mut c_void;
type GetHandler = unsafe extern "C" fn() -> *mut ffi::PyObject;

/// What the shims call: Numba's own functions, and NumPy's current handler.
struct Route {
    own_aligned: AllocAligned,
    own_safe_aligned: AllocAligned,
    alloc_external: AllocExternal,
    safe_aligned_external: AllocSafeAlignedExternal,
    numpy_get_handler: GetHandler,
}

/// Set once, by the first `numba_route` to finish its probe; read without a lock by
/// every shim.
static ROUTE: OnceLock<Route> = OnceLock::new();

/// Held while the route is built: the probe has one slot ([`PROBE`]), so two threads
/// enabling the route at once (no GIL orders them on a free-threaded build) probe one
/// after the other, and the second finds the route made.
static BUILDING: Mutex<()> = Mutex::new(());

// Every CPython the wheel supports exports these, though the limited API (and so
// PyO3's abi3 bindings) leaves them out.
unsafe extern "C" {
    /// Whether the calling thread holds the GIL (on a free-threaded build: whether it
    /// is attached to Python).
    fn PyGILState_Check() -> std::ffi::c_int;
    /// Tell `tracemalloc` of a block (when it is tracing); takes the GIL.
    fn PyTraceMalloc_Track(domain: std::ffi::c_uint, ptr: usize, size: usize) -> std::ffi::c_int;
    /// Tell `tracemalloc` a block is gone (when it is tracing); needs no GIL.
    fn PyTraceMalloc_Untrack(domain: std::ffi::c_uint, ptr: usize) -> std::ffi::c_int;
}

/// Whether `tracemalloc` is tracing, asked without the GIL: untracking a block from
/// any thread answers -2 when it is not (CPython 3.11 and later check that first), and
/// no block lies at address 0. A few instructions, where asking whether this thread
/// holds the GIL (which tracking needs) took fifty on every array.
fn tracing() -> bool {
    // SAFETY: callable on any thread, with or without the GIL.
    unsafe { PyTraceMalloc_Untrack(TRACEMALLOC_DOMAIN, 0) != -2 }
}

/// The `tracemalloc` domain of Numba's own blocks (they come from `PyMem_RawMalloc`),
/// so that a snapshot shows a Numba array's block at the Python line that made it
/// whichever allocator placed it.
const TRACEMALLOC_DOMAIN: std::ffi::c_uint = 0;

/// Numba's functions by the addresses its `_nrt_python.c_helpers` lists, as the
/// `allocbox.numba` module passes them.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub(crate) struct NrtHelpers {
    get_api: usize,
    alloc_aligned: usize,
    alloc_safe_aligned: usize,
    alloc_safe_aligned_external: usize,
    release: usize,
    data: usize,
}

/// Check Numba's MemInfo layout and make the route; returns the addresses of the two
/// shims (`NRT_MemInfo_alloc_aligned`, `NRT_MemInfo_alloc_safe_aligned`) for llvmlite
/// to bind. Called once, by `allocbox.numba.enable`.
#[pyfunction]
pub(crate) fn numba_route(py: Python<'_>, helpers: NrtHelpers) -> PyResult<(usize, usize)> {
    if ROUTE.get().is_none() {
        // Taken detached from Python while it waits: the holder runs Python (Numba's
        // probe) and may need this thread to let the interpreter go on.
        let _building = BUILDING
            .lock_py_attached(py)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if ROUTE.get().is_none() {
            let route = make_route(py, &helpers)?;
            let _ = ROUTE.set(route);
        }
    }
    let aligned: AllocAligned = shim_aligned;
    let safe_aligned: AllocAligned = shim_safe_aligned;
    Ok((aligned as usize, safe_aligned as usize))
}

fn make_route(py: Python<'_>, h: &NrtHelpers) -> PyResult<Route> {
    if [
        h.get_api,
        h.alloc_aligned,
        h.alloc_safe_aligned,
        h.alloc_safe_aligned_external,
        h.release,
        h.data,
    ]
    .contains(&0)
    {
        return Err(PyRuntimeError::new_err(
            "this Numba's runtime lacks a function allocbox needs (NRT_get_api and the \
             MemInfo allocation functions); Numba's arrays stay with Numba's own allocator",
        ));
    }
    // SAFETY: each address is the C function Numba's runtime lists under that name in
    // `c_helpers`, with the signature nrt.h gives it; `NRT_get_api` returns a pointer
    // to `NRT_api_functions`, whose second member is `allocate_external`.
    let route = unsafe {
        let get_api: unsafe extern "C" fn() -> *const usize = std::mem::transmute(h.get_api);
        let api = get_api();
        if api.is_null() || *api.add(1) == 0 {
            return Err(PyRuntimeError::new_err(
                "Numba's runtime gave no external allocation function; Numba's arrays stay \
                 with Numba's own allocator",
            ));
        }
        Route {
            own_aligned: std::mem::transmute::<usize, AllocAligned>(h.alloc_aligned),
            own_safe_aligned: std::mem::transmute::<usize, AllocAligned>(h.alloc_safe_aligned),
            alloc_external: std::mem::transmute::<usize, AllocExternal>(*api.add(1)),
            safe_aligned_external: std::mem::transmute::<usize, AllocSafeAlignedExternal>(
                h.alloc_safe_aligned_external,
            ),
            numpy_get_handler: get_handler_fn(py)?,
        }
    };
    // SAFETY: as above for `release` and `data`.
    let (release, data) = unsafe {
        (
            std::mem::transmute::<usize, Release>(h.release),
            std::mem::transmute::<usize, Data>(h.data),
        )
    };
    probe_layout(&route, release, data)?;
    Ok(route)
}

/// What the probe's allocator saw: the block it lent and whether it got it back. One
/// probe at a time: it runs under [`BUILDING`].
static PROBE: Mutex<(usize, bool)> = Mutex::new((0, false));

unsafe extern "C" fn probe_malloc(size: usize, _: *mut c_void) -> *mut c_void {
    // SAFETY: plain C malloc.
    let block = unsafe { libc::malloc(size) };
    lock(&PROBE).0 = block as usize;
    block
}

unsafe extern "C" fn probe_realloc(_: *mut c_void, _: usize, _: *mut c_void) -> *mut c_void {
    std::ptr::null_mut()
}

unsafe extern "C" fn probe_free(ptr: *mut c_void, _: *mut c_void) {
    let mut seen = lock(&PROBE);
    seen.1 = seen.0 == ptr as usize;
    // SAFETY: the block `probe_malloc` lent.
    unsafe { libc::free(ptr) };
}

/// Make one MemInfo through a plain allocator and check that Numba lays it out as
/// [`MemInfo`] says (the shims move its data pointer to the alignment asked for) and
/// frees the block it was given.
fn probe_layout(route: &Route, release: Release, data: Data) -> PyResult<()> {
    let allocator = NrtAllocator {
        malloc: probe_malloc,
        realloc: probe_realloc,
        free: probe_free,
        opaque: std::ptr::null_mut(),
    };
    // SAFETY: `alloc_external` is NRT's; the allocator outlives the MemInfo, which is
    // released (and its block freed through `probe_free`) before it goes out of scope.
    let laid_out_as_known = unsafe {
        let mi = (route.alloc_external)(64, &allocator);
        if mi.is_null() {
            return Err(PyRuntimeError::new_err(
                "Numba's runtime could not allocate 64 bytes while allocbox checked it",
            ));
        }
        let lent = lock(&PROBE).0;
        let header = size_of::<MemInfo>();
        let known = lent == mi as usize
            && (*mi).refct == 1
            && (*mi).size == 64
            && std::ptr::eq((*mi).external_allocator, &allocator)
            && (*mi).data == data(mi)
            && (*mi).data as usize == mi as usize + header;
        release(mi);
        known && lock(&PROBE).1
    };
    match laid_out_as_known {
        true => Ok(()),
        false => Err(PyRuntimeError::new_err(
            "this Numba's runtime lays out its MemInfo differently from the Numba allocbox \
             was built against (0.68); Numba's arrays stay with Numba's own allocator",
        )),
    }
}

/// A shim's answer: an aligned MemInfo through the current handler when it is an
/// allocbox one, else from Numba's own allocator (`own`).
#[inline]
fn route_alloc(size: usize, align: u32, safe: bool) -> *mut MemInfo {
    let Some(route) = ROUTE.get() else {
        return std::ptr::null_mut();
    };
    let own = || {
        // SAFETY: Numba's own functions, with the arguments its compiled code passed.
        unsafe {
            match safe {
                true => (route.own_safe_aligned)(size, align),
                false => (route.own_aligned)(size, align),
            }
        }
    };
    if blocks::nothing_held() {
        return own();
    }
    if let Some(mi) =
        blocks::with_process_wide(|bridge| alloc_through(route, bridge, size, align, safe))
    {
        // SAFETY: `PyGILState_Check` may be called from any thread.
        if !mi.is_null() && tracing() && unsafe { PyGILState_Check() } == 1 {
            // SAFETY: this thread is attached to Python, so tracemalloc has nothing to wait for.
            unsafe { PyTraceMalloc_Track(TRACEMALLOC_DOMAIN, mi as usize, block_size(mi)) };
        }
        return mi;
    }
    // SAFETY: `PyGILState_Check` may be called from any thread.
    let with_python = unsafe { PyGILState_Check() } == 1;
    if with_python {
        // SAFETY: this thread is attached to Python; NumPy's `PyDataMem_GetHandler` returns a
        // new reference (or NULL with an exception set).
        let capsule = unsafe { (route.numpy_get_handler)() };
        if capsule.is_null() {
            // SAFETY: this thread is attached to Python; the error says nothing the fallback changes.
            unsafe { ffi::PyErr_Clear() };
            return own();
        }
        // SAFETY: the capsule reference keeps its bridge alive for the call; released
        // after, still attached.
        let mi = match unsafe { bridge_in(capsule) } {
            Some(bridge) => {
                let mi = alloc_through(route, bridge, size, align, safe);
                if !mi.is_null() {
                    // SAFETY: this thread is attached to Python, so tracemalloc has nothing to wait for.
                    unsafe { PyTraceMalloc_Track(TRACEMALLOC_DOMAIN, mi as usize, block_size(mi)) };
                }
                mi
            }
            None => own(),
        };
        // SAFETY: the reference `PyDataMem_GetHandler` gave.
        unsafe { ffi::Py_DECREF(capsule) };
        return mi;
    }
    blocks::with_innermost_without_python(|bridge| alloc_through(route, bridge, size, align, safe))
        .unwrap_or_else(own)
}

/// An aligned MemInfo from `bridge`'s allocator: NRT's own external allocation (which
/// counts in Numba's statistics, puts the header first and the data after it) asked
/// for `align - 1` more bytes, and its data pointer moved to an aligned byte.
fn alloc_through(
    route: &Route,
    bridge: &Bridge,
    size: usize,
    align: u32,
    safe: bool,
) -> *mut MemInfo {
    let lender = lending(bridge);
    let allocator = &lender.allocator;
    if safe {
        // SAFETY: NRT's function; it aligns the data itself and fills it with its
        // debugging bytes, as `NRT_MemInfo_alloc_safe_aligned` does.
        return unsafe { (route.safe_aligned_external)(size, align, allocator) };
    }
    let align = (align as usize).max(1);
    // NRT adds its header to the size unchecked: a size near the top would wrap.
    let Some(padded) = size
        .checked_add(align - 1)
        .filter(|&n| n <= isize::MAX as usize / 2)
    else {
        return std::ptr::null_mut();
    };
    let mi = if NRT_STATISTICS.load(Ordering::Relaxed) {
        // SAFETY: NRT's function with an allocator that lives as long as its bridge,
        // which each block keeps alive.
        unsafe { (route.alloc_external)(padded, allocator) }
    } else {
        made_here(lender, padded)
    };
    if mi.is_null() {
        return mi;
    }
    // SAFETY: `mi` is the header NRT just laid out as `MemInfo` (checked by
    // `probe_layout`), with `padded` bytes of data after it, in which `aligned_start`
    // leaves `size` bytes.
    unsafe {
        (*mi).data = aligned_start((*mi).data as usize, padded, size, align) as *mut c_void;
        (*mi).size = size;
    }
    mi
}

/// Whether Numba's runtime counts its allocations (`NRT_MemSys_stats_enabled`, which
/// no other library can call), as `allocbox.numba` learns it from the two functions
/// that switch it ([`numba_statistics`]). Off, a MemInfo is made here.
static NRT_STATISTICS: AtomicBool = AtomicBool::new(true);

/// Numba's runtime counts its allocations from now on, or not: said before it starts
/// and after it stops, so that the runtime never counts while MemInfos are made here.
#[pyfunction]
pub(crate) fn numba_statistics(on: bool) {
    NRT_STATISTICS.store(on, Ordering::Relaxed);
}

/// What `NRT_MemInfo_alloc_external` makes with `lender`'s allocator while the
/// runtime counts nothing: a block of the header and `size` bytes, the header first,
/// with one reference. Here its reference count is written as plain memory: no thread
/// but this one knows the block yet, where NRT's atomic store of it cost a full
/// barrier, a quarter of Numba's own time per small array.
fn made_here(lender: &Lender<Bridge>, size: usize) -> *mut MemInfo {
    let header = size_of::<MemInfo>();
    let Some(block) = size.checked_add(header).map(|total| lend(lender, total)) else {
        return std::ptr::null_mut();
    };
    if block.is_null() {
        return std::ptr::null_mut();
    }
    let mi = block.cast::<MemInfo>();
    // SAFETY: `block` is `header + size` fresh bytes this thread alone knows, aligned for
    // a MemInfo (the lender starts every block on 16 bytes), laid out as NRT lays it out
    // (checked by `probe_layout` against NRT's own function before any shim ran).
    unsafe {
        mi.write(MemInfo {
            refct: 1,
            dtor: std::ptr::null_mut(),
            dtor_info: std::ptr::null_mut(),
            data: block.cast::<u8>().add(header).cast(),
            size,
            external_allocator: &lender.allocator,
        })
    };
    mi
}

/// The bytes of a MemInfo's block past its header, as `tracemalloc` should count them.
fn block_size(mi: *mut MemInfo) -> usize {
    // SAFETY: a MemInfo just made, laid out as `MemInfo` (see `probe_layout`).
    let (data, size) = unsafe { ((*mi).data as usize, (*mi).size) };
    data + size - mi as usize
}

unsafe extern "C" fn shim_aligned(size: usize, align: u32) -> *mut MemInfo {
    route_alloc(size, align, false)
}

unsafe extern "C" fn shim_safe_aligned(size: usize, align: u32) -> *mut MemInfo {
    route_alloc(size, align, true)
}

/// The name of the handler whose allocator made `meminfo`'s block (a
/// `numba.core.runtime._nrt_python._MemInfo`), when it is one of ours.
#[pyfunction]
pub(crate) fn numba_maker(meminfo: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    let numba_type = meminfo
        .py()
        .import("numba.core.runtime._nrt_python")?
        .getattr("_MemInfo")?;
    if !meminfo.get_type().is(&numba_type) {
        return Ok(None);
    }
    let address: usize = meminfo.getattr("external_allocator")?.extract()?;
    if address == 0 {
        return Ok(None);
    }
    // SAFETY: a live MemInfo's external allocator is the one that made its block, alive
    // as long as the block (ours: the block holds the bridge that holds it; anyone
    // else's: NRT's rule); its first member is its malloc.
    let allocator = unsafe { &*(address as *const NrtAllocator) };
    if !std::ptr::fn_addr_eq(allocator.malloc, nrt_malloc as NrtMalloc) {
        return Ok(None);
    }
    // SAFETY: ours: the opaque pointer is its lender, alive (see above).
    let lender = unsafe { lender_of(allocator.opaque) };
    Ok(Some(
        crate::numpy_api::numpy_name(lender.owner.handler.name()).to_string(),
    ))
}
