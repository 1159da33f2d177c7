//! Which handler places the arrays Numba's compiled code makes, beyond NumPy's context:
//! whether any allocbox handler may be current at all (the route's holds), the
//! `allocbox.use` blocks open in the process (for Numba's threads that run no Python),
//! and `allocbox.numba.use`'s process-wide blocks. Every count here is read on every
//! array; what they protect is said beside each.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::bridge::Bridge;
use crate::nrt_lending::lock;
use crate::policy::Policy;

/// The handlers Numba's threads that run no Python use (`parallel=True` workers, and
/// `nogil` functions): the one of the innermost block open in the process, an
/// `allocbox.use` block or an `allocbox.numba.use` one (`None`: Numba's own allocator),
/// each entry by the token its block holds.
static WITHOUT_PYTHON: Mutex<Vec<(u64, Option<Arc<Bridge>>)>> = Mutex::new(Vec::new());

/// Whether any allocbox handler may be current anywhere: each open block holds one,
/// and `set_handler` with a handler holds one for good ([`numba_route_hold`]: the
/// contexts it reached may live on). While none is held, the route hands every array to
/// Numba's own allocator after this one load, without asking NumPy for its handler.
/// Relaxed: a thread's own hold is in its program order, and a worker Numba starts
/// inside a block starts after it.
static HOLDS: AtomicUsize = AtomicUsize::new(0);

/// The holds that make Numba's arrays follow NumPy's context: open `allocbox.use`
/// blocks and `set_handler`'s holds. While there are none, an open process-wide block
/// places every array. Relaxed, as [`HOLDS`].
static CONTEXT_HOLDS: AtomicUsize = AtomicUsize::new(0);

/// `allocbox.numba.use` blocks open, innermost last, each by its token.
static PROCESS_WIDE: Mutex<Vec<(u64, Arc<Bridge>)>> = Mutex::new(Vec::new());
/// How many [`PROCESS_WIDE`] holds: read without its lock on every array.
static PROCESS_WIDE_OPEN: AtomicUsize = AtomicUsize::new(0);
/// Changed, under [`PROCESS_WIDE`]'s lock, whenever its innermost block may have:
/// a thread's [`PROCESS_WIDE_HERE`] is the innermost while it matches. From 1, so that
/// a thread's first look (at 0) always reads the list.
static PROCESS_WIDE_GENERATION: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's reference to the innermost process-wide block's bridge, and
    /// [`PROCESS_WIDE_GENERATION`] when it was taken: the reference keeps the bridge
    /// alive while this thread lends through it, with no count touched per array.
    static PROCESS_WIDE_HERE: RefCell<(u64, Option<Arc<Bridge>>)> =
        const { RefCell::new((0, None)) };
}

/// No allocbox handler can be current: Numba's own allocator places the array.
#[inline]
pub(crate) fn nothing_held() -> bool {
    HOLDS.load(Ordering::Relaxed) == 0
}

/// `f` with the bridge of the innermost process-wide block, when one is open and no
/// hold makes arrays follow NumPy's context.
#[inline]
pub(crate) fn with_process_wide<R>(f: impl FnOnce(&Bridge) -> R) -> Option<R> {
    if CONTEXT_HOLDS.load(Ordering::Relaxed) != 0 || PROCESS_WIDE_OPEN.load(Ordering::Relaxed) == 0
    {
        return None;
    }
    let generation = PROCESS_WIDE_GENERATION.load(Ordering::Acquire);
    PROCESS_WIDE_HERE.with(|here| {
        if here.borrow().0 != generation {
            let innermost = {
                let open = lock(&PROCESS_WIDE);
                let now = PROCESS_WIDE_GENERATION.load(Ordering::Relaxed);
                (now, open.last().map(|(_, bridge)| bridge.clone()))
            };
            let ended = match here.try_borrow_mut() {
                Ok(mut cached) => std::mem::replace(&mut *cached, innermost),
                // Re-entered from inside `f` (an event hook that makes a Numba array):
                // served by the fresh reference, kept by the outer call's next look.
                Err(_) => return innermost.1.as_deref().map(f),
            };
            // Dropped after the lock and the borrow: the last reference to a bridge
            // ends its handler.
            drop(ended);
        }
        here.borrow().1.as_deref().map(f)
    })
}

/// The bridge of the innermost block open in the process, for a thread that runs no
/// Python.
pub(crate) fn without_python() -> Option<Arc<Bridge>> {
    let open = lock(&WITHOUT_PYTHON);
    open.last().and_then(|(_, bridge)| bridge.clone())
}

/// `set_handler` installed a handler that may be one of allocbox's: the route asks NumPy
/// for the handler from now on.
#[pyfunction]
pub(crate) fn numba_route_hold() {
    CONTEXT_HOLDS.fetch_add(1, Ordering::Relaxed);
    HOLDS.fetch_add(1, Ordering::Relaxed);
}

/// How many holds the route has: 0 while it hands every array to Numba's own.
#[pyfunction]
pub(crate) fn numba_route_holds() -> usize {
    HOLDS.load(Ordering::Relaxed)
}

/// The bridge of `handler`, a `Policy` or a capsule of allocbox's.
fn bridge_of_handler(handler: &Bound<'_, PyAny>) -> Option<Arc<Bridge>> {
    match handler.cast::<Policy>() {
        Ok(policy) => Some(policy.get().bridge.clone()),
        // SAFETY: this thread is attached to Python (we have a `Bound`); the object is alive.
        Err(_) => unsafe { crate::numpy_api::bridge_in(handler.as_ptr()) }.map(|bridge| {
            let ptr = std::ptr::from_ref(bridge);
            // SAFETY: a capsule's bridge lives in an Arc whose reference the capsule
            // holds (`make_capsule`); this adds one for the entry.
            unsafe {
                Arc::increment_strong_count(ptr);
                Arc::from_raw(ptr)
            }
        }),
    }
}

fn next_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Make `handler` (a `Policy` or a capsule) the handler of Numba's threads that run no
/// Python until [`numba_threads_done`] with the returned token: an `allocbox.use`
/// block, which also makes Numba's arrays follow NumPy's context.
#[pyfunction]
pub(crate) fn numba_threads_use(handler: &Bound<'_, PyAny>) -> u64 {
    let bridge = bridge_of_handler(handler);
    let token = next_token();
    let mut open = lock(&WITHOUT_PYTHON);
    open.push((token, bridge));
    CONTEXT_HOLDS.fetch_add(1, Ordering::Relaxed);
    HOLDS.fetch_add(1, Ordering::Relaxed);
    token
}

/// The block that [`numba_threads_use`] or [`numba_process_wide_use`] opened with
/// `token` is over.
#[pyfunction]
pub(crate) fn numba_threads_done(token: u64) {
    let ended: Vec<_> = {
        let mut open = lock(&WITHOUT_PYTHON);
        let at = open.iter().position(|(t, _)| *t == token);
        at.map(|at| open.remove(at)).into_iter().collect()
    };
    if ended.is_empty() {
        return;
    }
    let process_wide: Vec<_> = {
        let mut open = lock(&PROCESS_WIDE);
        let at = open.iter().position(|(t, _)| *t == token);
        let ended: Vec<_> = at.map(|at| open.remove(at)).into_iter().collect();
        if !ended.is_empty() {
            PROCESS_WIDE_OPEN.fetch_sub(1, Ordering::Relaxed);
            PROCESS_WIDE_GENERATION.fetch_add(1, Ordering::Release);
        }
        ended
    };
    if process_wide.is_empty() {
        CONTEXT_HOLDS.fetch_sub(1, Ordering::Relaxed);
    }
    HOLDS.fetch_sub(1, Ordering::Relaxed);
    // Dropped after the locks: the last reference to a bridge ends its handler, which
    // must not keep Numba's workers from the lists meanwhile.
    drop((ended, process_wide));
}

/// Make `handler` place every array Numba's compiled code makes in the process, on any
/// thread, without asking NumPy, until [`numba_threads_done`] with the returned token
/// (`allocbox.numba.use`); while an `allocbox.use` block is open or `set_handler` was
/// given a handler, arrays follow NumPy's context as before.
#[pyfunction]
pub(crate) fn numba_process_wide_use(handler: &Bound<'_, PyAny>) -> PyResult<u64> {
    let Some(bridge) = bridge_of_handler(handler) else {
        return Err(PyTypeError::new_err(format!(
            "allocbox.numba.use takes a policy (allocbox.load, allocbox.native_default) or \
             a handler allocbox.set_handler returned for one, not {}",
            handler.get_type().name()?
        )));
    };
    let token = next_token();
    lock(&WITHOUT_PYTHON).push((token, Some(bridge.clone())));
    {
        let mut open = lock(&PROCESS_WIDE);
        open.push((token, bridge));
        PROCESS_WIDE_OPEN.fetch_add(1, Ordering::Relaxed);
        PROCESS_WIDE_GENERATION.fetch_add(1, Ordering::Release);
    }
    HOLDS.fetch_add(1, Ordering::Relaxed);
    Ok(token)
}
