//! `allocbox._allocbox`: makes an allocbox handler NumPy's data-memory handler.
//!
//! NumPy's handler API (`PyDataMem_SetHandler`, slot 304 of the `_ARRAY_API` table, and
//! `PyDataMem_GetHandler`, slot 305) takes a capsule named `mem_handler` holding a
//! `PyDataMem_Handler`. Ours holds C callbacks whose context is a Rust handler; NumPy
//! calls them with or without the GIL and from several threads at once, so they never
//! touch the Python C-API: the handler is `Send + Sync` on its own.

mod diagnosis;

use std::ffi::{CStr, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use allocbox::nep49::MemHandler;
use allocbox::trace::Recorder;
use allocbox::{
    CompileBound, CompileBounds, Error, Handler, HandlerBuilder, Limits, Runtime, WasmHook,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use pyo3::{create_exception, ffi};

create_exception!(
    allocbox,
    AllocboxError,
    pyo3::exceptions::PyException,
    "Any allocbox failure."
);
create_exception!(
    allocbox,
    LoadError,
    AllocboxError,
    "A file or bytes that are not a usable policy."
);
create_exception!(
    allocbox,
    ContractViolation,
    AllocboxError,
    "A policy broke the handler contract."
);
create_exception!(
    allocbox,
    PoisonedPolicy,
    AllocboxError,
    "A policy that was stopped earlier (violation, trap, time or memory limit)."
);
create_exception!(
    allocbox,
    ClientError,
    AllocboxError,
    "A client double or unknown free."
);

/// NumPy's `PyDataMemAllocator`.
#[repr(C)]
struct PyDataMemAllocator {
    ctx: *mut c_void,
    malloc: unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void,
    calloc: unsafe extern "C" fn(*mut c_void, usize, usize) -> *mut c_void,
    realloc: unsafe extern "C" fn(*mut c_void, *mut c_void, usize) -> *mut c_void,
    free: unsafe extern "C" fn(*mut c_void, *mut c_void, usize),
}

/// NumPy's `PyDataMem_Handler`.
#[repr(C)]
struct PyDataMemHandler {
    name: [u8; 127],
    version: u8,
    allocator: PyDataMemAllocator,
}

const CAPSULE_NAME: &CStr = c"mem_handler";

/// The context behind a capsule: the handler and what went wrong inside callbacks,
/// where no Python exception can be raised (NumPy sees NULL and raises MemoryError).
struct Bridge {
    handler: Arc<dyn MemHandler>,
    /// `handler` itself when it is a wasm chain with nothing in between: malloc and free
    /// call it without the trait object, so its magazine path is inlined into them and
    /// a small array's malloc and free touch fewer instruction-cache lines.
    direct: Option<Arc<Handler>>,
    failures: Mutex<Vec<Error>>,
    /// Set when a callback panicked: the handler's books may be half-updated, so from
    /// then on every request is refused (NULL) and frees are left to the handler's drop,
    /// which releases all its memory once no array holds the capsule.
    panicked: OnceLock<String>,
    /// The wasm chain when one of its policies diagnoses its client
    /// ([`Handler::diagnoses`]): every block's allocation site is recorded, and the
    /// misuse its policies report becomes a warning.
    diagnosing: Option<Arc<Handler>>,
}

impl Bridge {
    fn new(handler: Arc<dyn MemHandler>, direct: Option<Arc<Handler>>) -> Self {
        Bridge {
            handler,
            direct,
            failures: Mutex::new(Vec::new()),
            panicked: OnceLock::new(),
            diagnosing: None,
        }
    }

    /// A bridge to `chain`, which diagnoses its client.
    fn diagnosing(mut self, chain: Arc<Handler>) -> Self {
        diagnosis::install_fault_handler();
        self.diagnosing = Some(chain);
        self
    }

    /// Record where `new` (of `size` bytes) was allocated and forget `old`, for a
    /// diagnosing bridge; and warn about misuse its policies reported meanwhile.
    #[inline(always)]
    fn diagnose(&self, old: *mut c_void, new: *mut c_void, size: usize) {
        if self.diagnosing.is_some() {
            self.diagnose_slowly(old, new, size);
        }
    }

    #[cold]
    #[inline(never)]
    fn diagnose_slowly(&self, old: *mut c_void, new: *mut c_void, size: usize) {
        self.guard((), || {
            let Some(chain) = &self.diagnosing else {
                return;
            };
            if let Ok(reports) = chain.take_client_misuse()
                && !reports.is_empty()
            {
                diagnosis::warn(reports);
            }
            if !old.is_null() && old != new {
                diagnosis::forget_site(old);
            }
            diagnosis::record_site(new, size);
        });
    }

    /// Run one callback unless the bridge has stopped; a panic stops it for good.
    fn guard<R>(&self, refused: R, f: impl FnOnce() -> R) -> R {
        if self.panicked.get().is_some() {
            return refused;
        }
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(r) => r,
            Err(payload) => {
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic without a message".into());
                let _ = self.panicked.set(format!(
                    "handler `{}` stopped: the host panicked inside a NumPy callback ({message})",
                    self.handler.name()
                ));
                refused
            }
        }
    }

    /// Tell the event hook (`allocbox.set_event_hook`) about an event NumPy's call
    /// caused, as `PyDataMem_UserNEW` and its siblings did before NumPy 2.0: nothing
    /// for a request that got no block or a free of NULL. Every malloc and free crosses
    /// this: without a hook it is one relaxed load.
    #[inline(always)]
    fn tell_hook(&self, old: *mut c_void, new: *mut c_void, size: usize) {
        if allocbox::nep49::event_hook_set() {
            self.tell_hook_slowly(old, new, size);
        }
    }

    #[cold]
    #[inline(never)]
    fn tell_hook_slowly(&self, old: *mut c_void, new: *mut c_void, size: usize) {
        let (old, new) = (NonNull::new(old.cast()), NonNull::new(new.cast()));
        if new.is_some() || old.is_some() {
            self.guard((), || allocbox::nep49::notify_event_hook(old, new, size));
        }
    }

    fn note(&self, error: Error) {
        let mut failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        // The first failures say what happened; a bound keeps a flood from growing.
        if failures.len() < 64 {
            failures.push(error);
        }
    }

    /// A block for NumPy: NULL for none, for a failure (noted), or once stopped.
    fn block(&self, f: impl FnOnce() -> Result<Option<NonNull<u8>>, Error>) -> *mut c_void {
        self.guard(std::ptr::null_mut(), || match f() {
            Ok(Some(p)) => p.as_ptr().cast(),
            Ok(None) => std::ptr::null_mut(),
            Err(e) => {
                self.note(e);
                std::ptr::null_mut()
            }
        })
    }
}

/// # Safety
/// `ctx` is the `Bridge` of a live capsule (NumPy passes the allocator's ctx back).
unsafe fn bridge<'a>(ctx: *mut c_void) -> &'a Bridge {
    // SAFETY: the caller's contract; the capsule owns the Bridge until its destructor.
    unsafe { &*ctx.cast::<Bridge>() }
}

unsafe extern "C" fn bridge_malloc(ctx: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: NumPy calls this with the ctx of the handler it found in our capsule.
    let b = unsafe { bridge(ctx) };
    if let Some(h) = &b.direct
        && let Some(block) = b.guard(None, || h.malloc_from_magazine(size))
    {
        b.tell_hook(std::ptr::null_mut(), block.as_ptr().cast(), size);
        return block.as_ptr().cast();
    }
    malloc_slowly(b, size)
}

/// Out of line, so that the magazine hit above stays short.
#[inline(never)]
fn malloc_slowly(b: &Bridge, size: usize) -> *mut c_void {
    let block = b.block(|| b.handler.malloc(size));
    b.diagnose(std::ptr::null_mut(), block, size);
    b.tell_hook(std::ptr::null_mut(), block, size);
    block
}

unsafe extern "C" fn bridge_calloc(ctx: *mut c_void, nelem: usize, elsize: usize) -> *mut c_void {
    // SAFETY: as in `bridge_malloc`.
    let b = unsafe { bridge(ctx) };
    let block = b.block(|| b.handler.calloc(nelem, elsize));
    b.diagnose(std::ptr::null_mut(), block, nelem.saturating_mul(elsize));
    b.tell_hook(std::ptr::null_mut(), block, nelem.saturating_mul(elsize));
    block
}

unsafe extern "C" fn bridge_realloc(
    ctx: *mut c_void,
    ptr: *mut c_void,
    size: usize,
) -> *mut c_void {
    // SAFETY: as in `bridge_malloc`.
    let b = unsafe { bridge(ctx) };
    let old = NonNull::new(ptr.cast::<u8>());
    let block = b.block(|| b.handler.realloc(old, size));
    // A refused realloc left the old block as it was: no event.
    if !block.is_null() {
        b.diagnose(ptr, block, size);
        b.tell_hook(ptr, block, size);
    }
    block
}

unsafe extern "C" fn bridge_free(ctx: *mut c_void, ptr: *mut c_void, size: usize) {
    // SAFETY: as in `bridge_malloc`.
    let b = unsafe { bridge(ctx) };
    let block = NonNull::new(ptr.cast::<u8>());
    if let Some(h) = &b.direct
        && let Some(block) = block
        && b.guard(false, || h.free_to_magazine(block, size))
    {
        b.tell_hook(ptr, std::ptr::null_mut(), 0);
        return;
    }
    free_slowly(b, block, size);
    // The policy checked the block as it was freed: its report names the block's site,
    // which is forgotten after.
    b.diagnose(ptr, std::ptr::null_mut(), 0);
    b.tell_hook(ptr, std::ptr::null_mut(), 0);
}

/// Out of line, so that the magazine hit above stays short.
#[inline(never)]
fn free_slowly(b: &Bridge, block: Option<NonNull<u8>>, size: usize) {
    b.guard((), || {
        if let Err(e) = b.handler.free(block, size) {
            b.note(e);
        }
    });
}

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
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
fn numpy_name(name: &str) -> &str {
    &name[..name.floor_char_boundary(126)]
}

fn make_capsule(py: Python<'_>, bridge: Arc<Bridge>) -> PyResult<Py<PyAny>> {
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
type GetHandler = unsafe extern "C" fn() -> *mut ffi::PyObject;
const SLOT_SET_HANDLER: usize = 304;
const SLOT_GET_HANDLER: usize = 305;

/// Install `capsule` (or NumPy's default for `None`) in the current context; returns the
/// previous handler's capsule.
fn numpy_set_handler(py: Python<'_>, capsule: Option<&Bound<'_, PyAny>>) -> PyResult<Py<PyAny>> {
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

/// The current context's handler, as the capsule NumPy holds: pass it to `set_handler`
/// to make it current again; `allocbox.handler_name()` names it.
#[pyfunction]
fn get_handler(py: Python<'_>) -> PyResult<Py<PyAny>> {
    let table = array_api(py)?;
    // SAFETY: slot 305 is `PyObject *PyDataMem_GetHandler(void)`, a new reference.
    unsafe {
        let get: GetHandler = std::mem::transmute(*table.add(SLOT_GET_HANDLER));
        let h = get();
        if h.is_null() {
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, h).unbind())
    }
}

fn to_py(error: &Error) -> PyErr {
    let text = error.to_string();
    match error {
        Error::Violation(_) => ContractViolation::new_err(text),
        Error::Poisoned { .. } => PoisonedPolicy::new_err(text),
        Error::Client(_) => ClientError::new_err(text),
        // No policy is at fault: the host cannot reach the handler (a fork mid-call).
        Error::Unreachable { .. } => AllocboxError::new_err(text),
        _ => PoisonedPolicy::new_err(text),
    }
}

/// A policy chain ready to be NumPy's handler.
#[pyclass(frozen, module = "allocbox")]
struct Policy {
    handler: Option<Arc<Handler>>,
    bridge: Arc<Bridge>,
    recorder: Option<Arc<Recorder>>,
    capsule: Mutex<Option<Py<PyAny>>>,
}

#[pymethods]
impl Policy {
    /// The handler's name, as NumPy reports it: the policy's, or for a chain every
    /// policy's, top first, joined by `>` (`aligned>size-classes`).
    #[getter]
    fn name(&self) -> String {
        numpy_name(self.bridge.handler.name()).to_string()
    }

    /// The `mem_handler` capsule NumPy holds for arrays this policy placed.
    fn capsule(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let mut slot = self.capsule.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = &*slot {
            return Ok(c.clone_ref(py));
        }
        let c = make_capsule(py, self.bridge.clone())?;
        *slot = Some(c.clone_ref(py));
        Ok(c)
    }

    /// What NumPy asked of this handler and got, counted by the host (never by the
    /// policy), as a dict:
    ///
    /// - `mallocs`, `callocs`, `reallocs`, `frees`: NumPy's calls;
    /// - `failed`: requests that got no block (NumPy raised `MemoryError`): out of
    ///   memory, or refused because the policy broke a rule or was stopped;
    /// - `live_blocks`, `live_bytes`: what NumPy holds now (the sizes it asked for);
    /// - `peak_bytes`: the most `live_bytes` ever; `total_bytes`: all bytes ever lent;
    /// - `size_corrections`: frees whose size was not the block's (corrected);
    /// - `magazine_hits`: requests served from the host's per-thread magazines without
    ///   calling the policy;
    /// - `cached_blocks`: blocks freed by NumPy that wait in those magazines, still
    ///   lent by the policy;
    /// - `budget_refusals`: upstream requests refused for passing `overhead`;
    /// - `client_misuse`: misuse of arrays the policies reported (each also a
    ///   `ClientMisuseWarning`);
    /// - `counters`: the top policy's own counters, `{name: value}` (a policy built
    ///   against contract 0.2.0 reports them; `link_stats()` has every policy's).
    ///
    /// The top entry of `link_stats()` always has `live_blocks` equal to this
    /// `live_blocks + cached_blocks`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.bridge.handler.stats().map_err(|e| to_py(&e))?;
        let d = PyDict::new(py);
        let links = match &self.handler {
            Some(h) => h.link_stats().map_err(|e| to_py(&e))?,
            None => Vec::new(),
        };
        d.set_item(
            "client_misuse",
            links.iter().map(|l| l.client_misuse).sum::<u64>(),
        )?;
        let top = links.into_iter().next().map(|l| l.counters);
        d.set_item("counters", counters_dict(py, top.unwrap_or_default())?)?;
        for (k, v) in [
            ("mallocs", s.mallocs),
            ("callocs", s.callocs),
            ("reallocs", s.reallocs),
            ("frees", s.frees),
            ("failed", s.failed),
            ("live_blocks", s.live_blocks),
            ("live_bytes", s.live_bytes),
            ("peak_bytes", s.peak_bytes),
            ("total_bytes", s.total_bytes),
            ("size_corrections", s.size_corrections),
            ("magazine_hits", s.magazine_hits),
            ("cached_blocks", s.cached_blocks),
            ("budget_refusals", s.budget_refusals),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// What each policy of the chain was asked by the host, top first, one dict each
    /// (where `stats()` counts what NumPy asked):
    ///
    /// - `name`; `failure`: why it was stopped, or `None`;
    /// - `mallocs`, `callocs`, `reallocs`, `frees`: single calls it answered;
    ///   `malloc_many`, `free_many`: batch calls (each many blocks: magazine refills
    ///   and flushes);
    /// - `live_blocks`, `live_bytes`: blocks it has lent and not got back, to NumPy, to
    ///   the host's magazines, or to the policy above it; `peak_bytes` the most bytes;
    /// - `observed`, `renewals`: deliveries of events to an observing policy, and
    ///   renewals of its lease;
    /// - `budget_refusals`: its upstream requests refused for passing `overhead`;
    /// - `mapped_regions`, `mapped_bytes`: memory of a granted kind mapped for it;
    ///   `ungranted`: the regions it asked for of a kind not granted, `{kind: count}`
    ///   (`grant=` at `load` gives them);
    /// - `client_misuse`: misuse of arrays it reported; `recent_misuse`: the latest
    ///   reports, as sentences;
    /// - `counters`: its own counters, `{name: value}` (contract 0.2.0).
    fn link_stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let Some(h) = &self.handler else {
            return Ok(Vec::new());
        };
        h.link_stats()
            .map_err(|e| to_py(&e))?
            .into_iter()
            .map(|l| {
                let d = PyDict::new(py);
                d.set_item("name", l.name)?;
                for (k, v) in [
                    ("mallocs", l.mallocs),
                    ("callocs", l.callocs),
                    ("reallocs", l.reallocs),
                    ("frees", l.frees),
                    ("malloc_many", l.malloc_many),
                    ("free_many", l.free_many),
                    ("observed", l.observed),
                    ("renewals", l.renewals),
                    ("live_blocks", l.live_blocks),
                    ("live_bytes", l.live_bytes),
                    ("peak_bytes", l.peak_bytes),
                    ("budget_refusals", l.budget_refusals),
                    ("mapped_regions", l.mapped_regions),
                    ("mapped_bytes", l.mapped_bytes),
                    ("client_misuse", l.client_misuse),
                ] {
                    d.set_item(k, v)?;
                }
                d.set_item("failure", l.failure)?;
                let recent: Vec<String> = l.recent_misuse.iter().map(|m| m.to_string()).collect();
                d.set_item("recent_misuse", recent)?;
                d.set_item("counters", counters_dict(py, l.counters)?)?;
                let ungranted = PyDict::new(py);
                for (kind, refused) in l.ungranted {
                    ungranted.set_item(kind.name(), refused)?;
                }
                d.set_item("ungranted", ungranted)?;
                Ok(d)
            })
            .collect()
    }

    /// The live blocks, `(address, size)`, by address.
    fn snapshot(&self) -> PyResult<Vec<(usize, usize)>> {
        match &self.handler {
            Some(h) => h.live_blocks().map_err(|e| to_py(&e)),
            None => Ok(Vec::new()),
        }
    }

    /// Why the chain was stopped, or `None`.
    #[getter]
    fn failure(&self) -> Option<String> {
        self.handler.as_ref()?.failure().map(|e| e.to_string())
    }

    /// Raise the first failure seen inside NumPy's calls (where only NULL could be
    /// returned) as its exception: ContractViolation, PoisonedPolicy or ClientError.
    fn raise_if_failed(&self) -> PyResult<()> {
        if let Some(message) = self.bridge.panicked.get() {
            return Err(AllocboxError::new_err(message.clone()));
        }
        if let Some(h) = &self.handler
            && let Some(e) = h.failure()
        {
            return Err(to_py(&e));
        }
        let failures = self
            .bridge
            .failures
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match failures.first() {
            Some(e) => Err(to_py(e)),
            None => Ok(()),
        }
    }

    /// Everything that went wrong inside NumPy's calls, as text, oldest first.
    fn failures(&self) -> Vec<String> {
        let failures = self
            .bridge
            .failures
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let panicked = self.bridge.panicked.get().cloned();
        failures
            .iter()
            .map(ToString::to_string)
            .chain(panicked)
            .collect()
    }

    /// Flush the trace being recorded (`load(..., record=path)`).
    fn finish_recording(&self) -> PyResult<()> {
        if let Some(r) = &self.recorder {
            r.finish()
                .map_err(|e| AllocboxError::new_err(e.to_string()))?;
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("<allocbox.Policy {:?}>", self.name())
    }
}

/// `CompileBounds` from `{"functions": 100000, "code-bytes": ...}` (`_` for `-` too), the
/// others at their defaults.
/// A policy's counters as a dict that keeps its order.
fn counters_dict(py: Python<'_>, counters: Vec<(String, u64)>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (name, value) in counters {
        d.set_item(name, value)?;
    }
    Ok(d)
}

fn compile_bounds_from(given: Option<Bound<'_, PyDict>>) -> PyResult<CompileBounds> {
    let mut bounds = CompileBounds::default();
    for (key, value) in given.iter().flat_map(|d| d.iter()) {
        let name = key.str()?.to_string().replace('_', "-");
        let Some(bound) = CompileBound::named(&name) else {
            let names: Vec<&str> = CompileBound::ALL.iter().map(|b| b.name()).collect();
            return Err(PyValueError::new_err(format!(
                "no compile bound is called '{name}'; the bounds are {}",
                names.join(", ")
            )));
        };
        let value: u64 = value.extract().map_err(|_| {
            PyValueError::new_err(format!(
                "compile bound '{name}' must be a whole number of at least 0, got {value}"
            ))
        })?;
        bounds.set(bound, value);
    }
    Ok(bounds)
}

fn source_bytes(source: &Bound<'_, PyAny>) -> PyResult<(Vec<u8>, String)> {
    if let Ok(b) = source.cast::<PyBytes>() {
        return Ok((b.as_bytes().to_vec(), "<bytes>".into()));
    }
    let path: PathBuf = source
        .extract()
        .map_err(|_| PyTypeError::new_err("a policy is a path or bytes"))?;
    let bytes = std::fs::read(&path)
        .map_err(|e| LoadError::new_err(format!("cannot read `{}`: {e}", path.display())))?;
    Ok((bytes, path.display().to_string()))
}

/// `call_time` in seconds as a bound on one call, or the library's default.
fn call_time_or_default(call_time: Option<f64>) -> PyResult<Duration> {
    let Some(secs) = call_time else {
        return Ok(Limits::default().call_time);
    };
    Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "call_time must be a positive number of seconds, got {secs}"
            ))
        })
}

/// Load a chain of policies, top first. Each item is a source (path or bytes) or a
/// `(source, {key: value})` pair. `record` writes a trace of every call. The bounds
/// default to allocbox's (`Limits::default`): `call_time` in seconds per call, imports
/// included; `memory`, a guest's own memory in bytes; `batch`, blocks in one batch
/// call; `overhead`, bytes a policy may hold beyond what its client holds; and
/// `host_memory_limit`, bytes lent from the host at once (default unlimited).
/// `compile_bounds` ({"functions": 100000, ...}) allows policies of a larger shape to be
/// compiled (`allocbox::CompileBounds`: functions, code-bytes, function-bytes,
/// data-bytes, modules, text-bytes).
#[pyfunction]
#[pyo3(signature = (*chain, record = None, call_time = None, memory = None, batch = None, overhead = None, host_memory_limit = None, compile_bounds = None, grant = None))]
#[allow(clippy::too_many_arguments, reason = "Python keyword arguments")]
fn load_chain(
    chain: Vec<Bound<'_, PyAny>>,
    record: Option<PathBuf>,
    call_time: Option<f64>,
    memory: Option<u64>,
    batch: Option<u32>,
    overhead: Option<u64>,
    host_memory_limit: Option<u64>,
    compile_bounds: Option<Bound<'_, PyDict>>,
    grant: Option<Vec<String>>,
) -> PyResult<Policy> {
    let runtime = Runtime::shared();
    let bounds = compile_bounds_from(compile_bounds)?;
    let defaults = Limits::default();
    let kinds = allocbox::mapped::KindGrants::from_names(grant.unwrap_or_default())
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let limits = Limits {
        call_time: call_time_or_default(call_time)?,
        memory: memory.unwrap_or(defaults.memory),
        batch: batch.unwrap_or(defaults.batch),
        overhead: overhead.unwrap_or(defaults.overhead),
        grants: allocbox::Grants {
            memory: kinds,
            ..defaults.grants
        },
        ..defaults
    };
    let mut builder = HandlerBuilder::new(runtime).limits(limits);
    if let Some(bytes) = host_memory_limit {
        builder = builder.host_memory_limit(bytes);
    }
    if chain.is_empty() {
        return Err(LoadError::new_err("a chain needs at least one policy"));
    }
    for item in &chain {
        let (source, config): (Bound<'_, PyAny>, Vec<(String, String)>) =
            match item.extract::<(Bound<'_, PyAny>, Bound<'_, PyDict>)>() {
                Ok((s, d)) => {
                    let mut config = Vec::new();
                    for (k, v) in d.iter() {
                        config.push((k.str()?.to_string(), v.str()?.to_string()));
                    }
                    (s, config)
                }
                Err(_) => (item.clone(), Vec::new()),
            };
        let (bytes, _label) = source_bytes(&source)?;
        let policy = runtime
            .load_bounded(&bytes, &bounds)
            .map_err(|e| LoadError::new_err(e.to_string()))?;
        let config: Vec<(&str, &str)> = config
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        builder = builder.link_with(&policy, &config);
    }
    let handler = Arc::new(
        builder
            .build()
            .map_err(|e| LoadError::new_err(e.to_string()))?,
    );
    let (shared, direct, recorder): (Arc<dyn MemHandler>, _, _) = match record {
        None => (handler.clone(), Some(handler.clone()), None),
        Some(path) => {
            let file = std::fs::File::create(&path)
                .map_err(|e| AllocboxError::new_err(format!("{}: {e}", path.display())))?;
            let rec = Arc::new(Recorder::new(
                handler.clone(),
                std::io::BufWriter::new(file),
            ));
            (rec.clone(), None, Some(rec))
        }
    };
    let bridge = match handler.diagnoses() {
        true => Bridge::new(shared, direct).diagnosing(handler.clone()),
        false => Bridge::new(shared, direct),
    };
    Ok(Policy {
        handler: Some(handler),
        bridge: Arc::new(bridge),
        recorder,
        capsule: Mutex::new(None),
    })
}

/// NumPy's own default handler (C malloc behind NumPy's small-block cache), natively,
/// behind the same bridge as the wasm policies: what any handler installed through this
/// module costs NumPy before a policy does anything. For benchmarks and comparisons.
#[pyfunction]
fn native_default() -> Policy {
    Policy {
        handler: None,
        bridge: Arc::new(Bridge::new(allocbox::nep49::default_handler(), None)),
        recorder: None,
        capsule: Mutex::new(None),
    }
}

/// Install a policy (or a capsule `set_handler` returned earlier, or `None` for NumPy's
/// default) as NumPy's handler in the current context. Returns the previous capsule.
#[pyfunction]
fn set_handler(py: Python<'_>, handler: Option<&Bound<'_, PyAny>>) -> PyResult<Py<PyAny>> {
    match handler {
        None => numpy_set_handler(py, None),
        Some(h) => {
            if let Ok(policy) = h.cast::<Policy>() {
                let policy = policy.get();
                policy.raise_if_failed().map_err(|e| {
                    PoisonedPolicy::new_err(format!("refusing a stopped policy: {}", e.value(py)))
                })?;
                let capsule = policy.capsule(py)?;
                numpy_set_handler(py, Some(capsule.bind(py)))
            } else {
                // SAFETY: only the name is read; PyCapsule_IsValid accepts any object.
                let valid = unsafe {
                    ffi::PyCapsule_IsValid(h.as_ptr(), CAPSULE_NAME.as_ptr() as *const c_char)
                };
                if valid == 0 {
                    return Err(PyTypeError::new_err(
                        "set_handler takes an allocbox.Policy, a `mem_handler` capsule, or None",
                    ));
                }
                numpy_set_handler(py, Some(h))
            }
        }
    }
}

/// A sandboxed event hook (a component of the `hook` world), for `set_event_hook`.
#[pyclass(frozen, module = "allocbox")]
struct EventHook {
    hook: Arc<WasmHook>,
}

#[pymethods]
impl EventHook {
    /// The hook's name: its shipped name, or its file's stem.
    #[getter]
    fn name(&self) -> String {
        self.hook.name().to_string()
    }

    /// The numbers the hook keeps, in the order it documents.
    fn report(&self) -> PyResult<Vec<u64>> {
        self.hook.report().map_err(|e| to_py(&e))
    }

    /// Why the hook was stopped (it trapped, ran too long or grew too much), or `None`.
    #[getter]
    fn failure(&self) -> Option<String> {
        self.hook.failure().map(|e| e.to_string())
    }

    fn __repr__(&self) -> String {
        format!("<allocbox.EventHook {:?}>", self.hook.name())
    }
}

/// The event hooks this package ships: `{name: (what its report holds, WAT source)}`.
#[pyfunction]
fn shipped_hooks() -> std::collections::HashMap<&'static str, (&'static str, &'static str)> {
    allocbox_cli::SHIPPED_HOOKS
        .iter()
        .map(|&(name, about, source)| (name, (about, source)))
        .collect()
}

/// Start a hook component from a path or bytes, named `name`, under allocbox's default
/// bounds (memory, and `call_time` seconds per event).
#[pyfunction]
#[pyo3(signature = (source, name, call_time = None))]
fn load_hook(source: &Bound<'_, PyAny>, name: &str, call_time: Option<f64>) -> PyResult<EventHook> {
    let (bytes, _) = source_bytes(source)?;
    let limits = Limits {
        call_time: call_time_or_default(call_time)?,
        ..Limits::default()
    };
    let hook = WasmHook::start(Runtime::shared(), &bytes, name, limits)
        .map_err(|e| LoadError::new_err(format!("hook `{name}` cannot be loaded: {e}")))?;
    Ok(EventHook { hook })
}

/// What `set_event_hook` was given, kept as the hook's data so that the previous hook
/// can be handed back as the same Python object.
struct PythonHook {
    object: Py<PyAny>,
    wasm: Option<Arc<WasmHook>>,
}

/// Remove `stopped` if it is still the hook, and report why, as Python reports an
/// exception nobody can catch (`sys.unraisablehook`): an event hook never breaks the
/// allocation that called it.
fn detach_hook(py: Python<'_>, stopped: &PythonHook, why: PyErr) {
    let ours = |data: &allocbox::nep49::HookData| {
        data.downcast_ref::<PythonHook>()
            .is_some_and(|h| h.object.is(&stopped.object))
    };
    let current = allocbox::nep49::set_event_hook(None);
    match current {
        Some((_, data)) if ours(&data) => {}
        // Another hook replaced it meanwhile: put that one back.
        other => drop(allocbox::nep49::set_event_hook(other)),
    }
    let object = stopped.object.bind(py);
    let report = AllocboxError::new_err(format!(
        "event hook {} failed and was detached: {why}",
        object.repr().map_or_else(|_| "?".into(), |r| r.to_string())
    ));
    report.set_cause(py, Some(why));
    report.write_unraisable(py, Some(object));
}

fn on_python_hook_event(
    old: Option<NonNull<u8>>,
    new: Option<NonNull<u8>>,
    size: usize,
    data: &allocbox::nep49::HookData,
) {
    let Some(hook) = data.downcast_ref::<PythonHook>() else {
        return;
    };
    let address = |p: Option<NonNull<u8>>| p.map_or(0, |p| p.as_ptr() as usize);
    if let Some(wasm) = &hook.wasm {
        if let Err(e) = wasm.on_event(old, new, size) {
            let why = AllocboxError::new_err(e.to_string());
            // Interpreter shutting down: nobody to tell, and nothing left to hook.
            Python::try_attach(|py| detach_hook(py, hook, why));
        }
        return;
    }
    Python::try_attach(|py| {
        if let Err(why) = hook.object.call1(py, (address(old), address(new), size)) {
            detach_hook(py, hook, why);
        }
    });
}

/// Make `hook` the event hook (`None` removes it) and return the previous one: a Python
/// callable `(old, new, size)` or an `EventHook`. It sees every event of arrays placed
/// through allocbox's handlers (and `native_default()`), as NumPy's event hook did
/// before NumPy 2.0 removed it; allocations it makes itself are not reported to it.
#[pyfunction]
fn set_event_hook(py: Python<'_>, hook: Option<Bound<'_, PyAny>>) -> PyResult<Option<Py<PyAny>>> {
    let installed = match hook {
        None => None,
        Some(object) => {
            let wasm = object
                .cast::<EventHook>()
                .ok()
                .map(|h| h.get().hook.clone());
            if wasm.is_none() && !object.is_callable() {
                return Err(PyTypeError::new_err(
                    "an event hook is a callable (old, new, size) or an allocbox.EventHook",
                ));
            }
            let data: allocbox::nep49::HookData = Arc::new(PythonHook {
                object: object.unbind(),
                wasm,
            });
            let hook: allocbox::nep49::Hook = Arc::new(on_python_hook_event);
            Some((hook, data))
        }
    };
    let previous = allocbox::nep49::set_event_hook(installed);
    Ok(previous.and_then(|(_, data)| {
        data.downcast_ref::<PythonHook>()
            .map(|h| h.object.clone_ref(py))
    }))
}

/// Run the `allocbox` command line (`argv[0]` the program's name) in this process and
/// return its exit status. Python's own signal handlers run only between bytecodes, so
/// the caller restores the default SIGINT first, for Ctrl-C to stop a long check.
#[pyfunction]
fn run_command(py: Python<'_>, argv: Vec<std::ffi::OsString>) -> u8 {
    py.detach(|| allocbox_cli::run(argv))
}

// The wheel is built for the stable ABI (abi3, CPython 3.11 and later), which
// free-threaded CPython cannot load. A build from source for one is untested there
// (event hooks call into Python from inside NumPy's allocation callbacks), so the
// module says it uses the GIL, and a free-threaded interpreter turns the GIL back on
// when it imports the module, with a warning, rather than run it untested.
#[pymodule(gil_used = true)]
fn _allocbox(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Policy>()?;
    m.add_function(wrap_pyfunction!(load_chain, m)?)?;
    m.add_function(wrap_pyfunction!(set_handler, m)?)?;
    m.add_function(wrap_pyfunction!(get_handler, m)?)?;
    m.add_function(wrap_pyfunction!(native_default, m)?)?;
    m.add_function(wrap_pyfunction!(run_command, m)?)?;
    m.add_class::<EventHook>()?;
    m.add_function(wrap_pyfunction!(load_hook, m)?)?;
    m.add_function(wrap_pyfunction!(shipped_hooks, m)?)?;
    m.add_function(wrap_pyfunction!(set_event_hook, m)?)?;
    m.add("AllocboxError", py.get_type::<AllocboxError>())?;
    m.add("LoadError", py.get_type::<LoadError>())?;
    m.add("ContractViolation", py.get_type::<ContractViolation>())?;
    m.add("PoisonedPolicy", py.get_type::<PoisonedPolicy>())?;
    m.add("ClientError", py.get_type::<ClientError>())?;
    m.add(
        "ClientMisuseWarning",
        py.get_type::<diagnosis::ClientMisuseWarning>(),
    )?;
    m.add("DEFAULT_POLICY_WAT", allocbox::DEFAULT_POLICY_WAT)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A handler whose every call panics, as a bug in the host would.
    #[derive(Debug)]
    struct Panicking;

    impl MemHandler for Panicking {
        fn name(&self) -> &str {
            "panicking"
        }
        fn malloc(&self, _: usize) -> Result<Option<NonNull<u8>>, Error> {
            panic!("books half-updated")
        }
        fn calloc(&self, _: usize, _: usize) -> Result<Option<NonNull<u8>>, Error> {
            panic!("books half-updated")
        }
        fn realloc(&self, _: Option<NonNull<u8>>, _: usize) -> Result<Option<NonNull<u8>>, Error> {
            panic!("books half-updated")
        }
        fn free(&self, _: Option<NonNull<u8>>, _: usize) -> Result<(), Error> {
            panic!("books half-updated")
        }
        fn stats(&self) -> Result<allocbox::Stats, Error> {
            Ok(allocbox::Stats::default())
        }
    }

    #[test]
    fn a_panic_in_a_callback_stops_the_bridge_with_a_message_naming_the_handler() {
        let bridge = Bridge::new(Arc::new(Panicking), None);
        assert!(bridge.block(|| bridge.handler.malloc(16)).is_null());
        let message = bridge.panicked.get().expect("the bridge stopped");
        assert!(
            message.contains("panicking") && message.contains("books half-updated"),
            "{message}"
        );
        // Stopped: later calls are refused without reaching the handler (which would
        // panic again).
        let mut reached = false;
        assert!(
            bridge
                .block(|| {
                    reached = true;
                    Ok(None)
                })
                .is_null()
        );
        bridge.guard((), || reached = true);
        assert!(!reached);
    }
}
