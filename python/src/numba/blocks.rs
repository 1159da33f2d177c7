//! Which handler places the arrays Numba's compiled code makes, beyond NumPy's context:
//! whether any allocbox handler may be current at all (the route's holds), the
//! `allocbox.use` blocks open in the process (for Numba's threads that run no Python),
//! and `allocbox.numba.use`'s process-wide blocks. Every count here is read on every
//! array; what they protect is said beside each.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use allocbox_ledger::published::Published;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::bridge::Bridge;
use crate::nrt_lending::lock;
use crate::policy::Policy;

/// The handlers Numba's threads that run no Python use (`parallel=True` workers, and
/// `nogil` functions): the one of the innermost block open in the process, an
/// `allocbox.use` block or an `allocbox.numba.use` one (`None`: Numba's own allocator),
/// each entry by the token its block holds. Changed only with the interpreter let go
/// (see [`change_lists`]).
static WITHOUT_PYTHON: Mutex<Vec<(u64, Option<Arc<Bridge>>)>> = Mutex::new(Vec::new());
/// [`WITHOUT_PYTHON`]'s innermost bridge, read on every such array.
static WITHOUT_PYTHON_INNERMOST: LazyLock<Published<Bridge>> = LazyLock::new(Published::default);

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
/// [`PROCESS_WIDE`]'s innermost bridge, read on every array it places: no count per
/// array, no thread-local variable (a call into the dynamic linker in this library).
static PROCESS_WIDE_INNERMOST: LazyLock<Published<Bridge>> = LazyLock::new(Published::default);

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
    PROCESS_WIDE_INNERMOST.read(|bridge| bridge.map(f))
}

/// `f` with the bridge of the innermost block open in the process, for a thread that
/// runs no Python; `None` when there is none or it is Numba's own allocator.
pub(crate) fn with_innermost_without_python<R>(f: impl FnOnce(&Bridge) -> R) -> Option<R> {
    WITHOUT_PYTHON_INNERMOST.read(|bridge| bridge.map(f))
}

/// Change the lists with `change`, then make each list's innermost bridge the one its
/// readers see. Done with the interpreter let go: a replaced bridge comes back only once
/// no array's allocation reads it, and one may be running an event hook, which needs
/// the interpreter. The lists' locks are held throughout, so writers take turns and the
/// last lists are what is published. What comes back (what `change` answers, and the
/// replaced bridges) is dropped after the locks: the last reference to a bridge ends
/// its handler.
fn change_lists<R: Send>(
    py: Python<'_>,
    change: impl FnOnce(&mut Vec<(u64, Option<Arc<Bridge>>)>, &mut Vec<(u64, Arc<Bridge>)>) -> R + Send,
) -> (R, Vec<Arc<Bridge>>) {
    py.detach(|| {
        let mut without_python = lock(&WITHOUT_PYTHON);
        let mut process_wide = lock(&PROCESS_WIDE);
        let answer = change(&mut without_python, &mut process_wide);
        let mut replaced = Vec::new();
        let innermost = without_python.last().and_then(|(_, b)| b.clone());
        if !WITHOUT_PYTHON_INNERMOST.holds(innermost.as_deref()) {
            replaced.extend(WITHOUT_PYTHON_INNERMOST.replace(innermost));
        }
        let innermost = process_wide.last().map(|(_, b)| b.clone());
        if !PROCESS_WIDE_INNERMOST.holds(innermost.as_deref()) {
            replaced.extend(PROCESS_WIDE_INNERMOST.replace(innermost));
        }
        (answer, replaced)
    })
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
    let ((), replaced) = change_lists(handler.py(), |without_python, _| {
        without_python.push((token, bridge));
    });
    CONTEXT_HOLDS.fetch_add(1, Ordering::Relaxed);
    HOLDS.fetch_add(1, Ordering::Relaxed);
    drop(replaced);
    token
}

/// The block that [`numba_threads_use`] or [`numba_process_wide_use`] opened with
/// `token` is over.
#[pyfunction]
pub(crate) fn numba_threads_done(py: Python<'_>, token: u64) {
    let ((ended, process_wide), replaced) = change_lists(py, |without_python, process_wide| {
        let at = without_python.iter().position(|(t, _)| *t == token);
        let ended: Vec<_> = at.map(|at| without_python.remove(at)).into_iter().collect();
        let at = process_wide.iter().position(|(t, _)| *t == token);
        let process_wide: Vec<_> = at.map(|at| process_wide.remove(at)).into_iter().collect();
        (ended, process_wide)
    });
    if !ended.is_empty() {
        match process_wide.is_empty() {
            true => CONTEXT_HOLDS.fetch_sub(1, Ordering::Relaxed),
            false => PROCESS_WIDE_OPEN.fetch_sub(1, Ordering::Relaxed),
        };
        HOLDS.fetch_sub(1, Ordering::Relaxed);
    }
    // After the locks: the last reference to a bridge ends its handler.
    drop((ended, process_wide, replaced));
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
    let ((), replaced) = change_lists(handler.py(), |without_python, process_wide| {
        without_python.push((token, Some(bridge.clone())));
        process_wide.push((token, bridge));
    });
    PROCESS_WIDE_OPEN.fetch_add(1, Ordering::Relaxed);
    HOLDS.fetch_add(1, Ordering::Relaxed);
    drop(replaced);
    Ok(token)
}
