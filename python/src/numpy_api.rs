//! NumPy's handler ABI: the `PyDataMem_Handler` a `mem_handler` capsule holds, and
//! `PyDataMem_SetHandler` / `PyDataMem_GetHandler` (slots 304 and 305 of the
//! `_ARRAY_API` table), which install and read the current context's handler.

use std::cell::Cell;
use std::ffi::{CStr, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use pyo3::ffi;
use pyo3::prelude::*;

use crate::bridge::{Bridge, bridge_calloc, bridge_free, bridge_malloc, bridge_realloc};

/// NumPy's `PyDataMemAllocator`.
#[repr(C)]
pub(crate) struct PyDataMemAllocator {
    pub(crate) ctx: *mut c_void,
    pub(crate) malloc: unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void,
    calloc: unsafe extern "C" fn(*mut c_void, usize, usize) -> *mut c_void,
    realloc: unsafe extern "C" fn(*mut c_void, *mut c_void, usize) -> *mut c_void,
    free: unsafe extern "C" fn(*mut c_void, *mut c_void, usize),
}

/// NumPy's `PyDataMem_Handler`.
#[repr(C)]
pub(crate) struct PyDataMemHandler {
    name: [u8; 127],
    version: u8,
    pub(crate) allocator: PyDataMemAllocator,
}

pub(crate) const CAPSULE_NAME: &CStr = c"mem_handler";

/// Changes whenever one of our capsules is made or destroyed: a capsule address seen
/// before, with the same generation, is still the same capsule (or still not ours), so
/// `numba_route` need not look inside it again.
pub(crate) static CAPSULE_GENERATION: AtomicU64 = AtomicU64::new(0);

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    CAPSULE_GENERATION.fetch_add(1, Ordering::Release);
    // SAFETY: called once by Python when the capsule dies; its pointer is the
    // PyDataMemHandler we boxed in `make_capsule`, and no array uses it any more (each
    // array holds a reference to its handler's capsule).
    unsafe {
        let handler =
            ffi::PyCapsule_GetPointer(capsule, CAPSULE_NAME.as_ptr()).cast::<PyDataMemHandler>();
        if handler.is_null() {
            ffi::PyErr_Clear();
            return;
        }
        let handler = Box::from_raw(handler);
        drop(Arc::from_raw(
            handler.allocator.ctx.cast::<Bridge>().cast_const(),
        ));
    }
}

/// A handler's name as NumPy keeps it: at most 126 bytes (its buffer holds 127 with
/// the NUL), cut where a character starts.
pub(crate) fn numpy_name(name: &str) -> &str {
    &name[..name.floor_char_boundary(126)]
}

/// A `mem_handler` capsule whose callbacks go to `bridge`; it holds one reference to it.
pub(crate) fn make_capsule(py: Python<'_>, bridge: Arc<Bridge>) -> PyResult<Py<PyAny>> {
    let mut name = [0u8; 127];
    let text = numpy_name(bridge.handler.name()).as_bytes();
    name[..text.len()].copy_from_slice(text);
    // The capsule holds one reference to the Bridge the Policy object shares, so what
    // callbacks note is visible from Python.
    let version = bridge.handler.version();
    let ctx = Arc::into_raw(bridge).cast_mut();
    let handler = Box::into_raw(Box::new(PyDataMemHandler {
        name,
        version,
        allocator: PyDataMemAllocator {
            ctx: ctx.cast(),
            malloc: bridge_malloc,
            calloc: bridge_calloc,
            realloc: bridge_realloc,
            free: bridge_free,
        },
    }));
    // SAFETY: `handler` is a valid boxed PyDataMemHandler that the destructor frees;
    // the name is a static C string.
    unsafe {
        let capsule = ffi::PyCapsule_New(
            handler.cast(),
            CAPSULE_NAME.as_ptr(),
            Some(capsule_destructor),
        );
        if capsule.is_null() {
            drop(Box::from_raw(handler));
            drop(Arc::from_raw(ctx.cast_const()));
            return Err(PyErr::fetch(py));
        }
        CAPSULE_GENERATION.fetch_add(1, Ordering::Release);
        Ok(Bound::from_owned_ptr(py, capsule).unbind())
    }
}

/// NumPy's C API table.
fn array_api(py: Python<'_>) -> PyResult<*const *const c_void> {
    let module = py.import("numpy._core._multiarray_umath")?;
    let capsule = module.getattr("_ARRAY_API")?;
    // SAFETY: `_ARRAY_API` is a capsule with no name holding NumPy's function table; it
    // lives as long as the numpy module, which stays imported.
    let table = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), std::ptr::null()) };
    if table.is_null() {
        return Err(PyErr::fetch(py));
    }
    Ok(table.cast())
}

type SetHandler = unsafe extern "C" fn(*mut ffi::PyObject) -> *mut ffi::PyObject;
pub(crate) type GetHandler = unsafe extern "C" fn() -> *mut ffi::PyObject;
const SLOT_SET_HANDLER: usize = 304;
const SLOT_GET_HANDLER: usize = 305;

/// Install `capsule` (or NumPy's default for `None`) in the current context; returns the
/// previous handler's capsule.
pub(crate) fn numpy_set_handler(
    py: Python<'_>,
    capsule: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let table = array_api(py)?;
    // SAFETY: slot 304 of NumPy >= 2's API table is `PyObject *PyDataMem_SetHandler(
    // PyObject *)`; it takes a borrowed capsule (or NULL) and returns a new reference.
    unsafe {
        let set: SetHandler = std::mem::transmute(*table.add(SLOT_SET_HANDLER));
        let old = set(capsule.map_or(std::ptr::null_mut(), |c| c.as_ptr()));
        if old.is_null() {
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, old).unbind())
    }
}

/// NumPy's `PyDataMem_GetHandler`: called with the GIL held, it returns a new
/// reference to the current context's handler capsule (NULL with an error set).
pub(crate) fn get_handler_fn(py: Python<'_>) -> PyResult<GetHandler> {
    let table = array_api(py)?;
    // SAFETY: slot 305 of NumPy >= 2's API table is `PyObject *PyDataMem_GetHandler(void)`.
    Ok(unsafe { std::mem::transmute::<*const c_void, GetHandler>(*table.add(SLOT_GET_HANDLER)) })
}

/// The current context's handler, as the capsule NumPy holds: pass it to `set_handler`
/// to make it current again; `allocbox.handler_name()` names it.
#[pyfunction]
pub(crate) fn get_handler(py: Python<'_>) -> PyResult<Py<PyAny>> {
    let get = get_handler_fn(py)?;
    // SAFETY: `PyDataMem_GetHandler`, called with the GIL held; a new reference.
    unsafe {
        let h = get();
        if h.is_null() {
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, h).unbind())
    }
}

type BridgeMalloc = unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void;

thread_local! {
    /// The last handler capsule this thread looked inside: its address, its bridge
    /// (null: not ours) and the [`CAPSULE_GENERATION`] then.
    static LAST_CAPSULE: Cell<(usize, *const Bridge, u64)> =
        const { Cell::new((0, std::ptr::null(), u64::MAX)) };
}

/// The bridge of a NumPy handler capsule when it is one of ours; what was found for
/// the same capsule last time on this thread when no capsule of ours was made or
/// destroyed since (most calls: the name comparison is most of the work).
///
/// # Safety
/// `capsule` is a live object and this thread is attached to Python.
pub(crate) unsafe fn bridge_in<'a>(capsule: *mut ffi::PyObject) -> Option<&'a Bridge> {
    let generation = CAPSULE_GENERATION.load(Ordering::Acquire);
    let (last, bridge, seen) = LAST_CAPSULE.get();
    if last == capsule as usize && seen == generation {
        // SAFETY: the same live capsule as before (none of ours came or went since, so
        // the address was not reused by one of ours), which holds its bridge.
        return unsafe { bridge.as_ref() };
    }
    // SAFETY: the caller's contract.
    let bridge = unsafe { look_inside(capsule) };
    LAST_CAPSULE.set((
        capsule as usize,
        bridge.map_or(std::ptr::null(), std::ptr::from_ref),
        generation,
    ));
    bridge
}

/// # Safety
/// As for [`bridge_in`].
unsafe fn look_inside<'a>(capsule: *mut ffi::PyObject) -> Option<&'a Bridge> {
    // SAFETY: the caller's contract; a capsule of another name, or another object,
    // gives NULL (error cleared).
    unsafe {
        let handler = ffi::PyCapsule_GetPointer(capsule, CAPSULE_NAME.as_ptr());
        if handler.is_null() {
            ffi::PyErr_Clear();
            return None;
        }
        let handler = &*handler.cast::<PyDataMemHandler>();
        let ours = std::ptr::fn_addr_eq(handler.allocator.malloc, bridge_malloc as BridgeMalloc);
        ours.then(|| &*handler.allocator.ctx.cast::<Bridge>().cast_const())
    }
}
