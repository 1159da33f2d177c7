//! Where the program was when it asked for an array: the innermost frame of its own
//! code (not NumPy's, allocbox's or the import machinery's), for traces recorded with
//! sites. It runs inside every allocation of such a recording, so it walks frames
//! through the C API and looks at each code object's names once.

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::{Arc, Mutex};

use allocbox::trace::Site;
use pyo3::ffi;
use pyo3::prelude::*;

// Every CPython the wheel supports exports these, though PyO3's abi3 bindings leave
// some out. Each returns a new reference, or NULL.
unsafe extern "C" {
    fn PyEval_GetFrame() -> *mut ffi::PyObject;
    fn PyFrame_GetCode(frame: *mut ffi::PyObject) -> *mut ffi::PyObject;
    fn PyFrame_GetBack(frame: *mut ffi::PyObject) -> *mut ffi::PyObject;
    fn PyFrame_GetLineNumber(frame: *mut ffi::PyObject) -> c_int;
}

/// What a code object is: the program's own (its file and function), or a library's.
struct Code {
    /// Keeps the code object, so that its address names it for as long as it is here.
    _alive: Py<PyAny>,
    own: Option<(Arc<str>, Arc<str>)>,
}

/// Code objects seen so far, by address.
static CODES: Mutex<Option<HashMap<usize, Code>>> = Mutex::new(None);

/// The most code objects [`CODES`] keeps alive: a program that makes code without end
/// (`exec` in a loop) would otherwise keep all of it. Past this they are forgotten
/// (and released), and looked at again when next seen.
const MAX_CODES_KEPT: usize = 1 << 14;

/// Code in these is NumPy's, allocbox's or Python's import machinery, not the program's.
const LIBRARIES: [&str; 3] = ["/numpy/", "/allocbox/", "<frozen "];

/// The site of the innermost frame of the program's own code on this thread, or
/// `None` (no Python frame, e.g. a thread of Numba's).
pub(crate) fn program_site() -> Option<Site> {
    Python::attach(|py| {
        // NumPy may be inside a call that failed: its exception is kept.
        let pending = PyErr::take(py);
        let site = innermost_own_frame(py);
        if let Some(pending) = pending {
            pending.restore(py);
        }
        site
    })
}

fn innermost_own_frame(py: Python<'_>) -> Option<Site> {
    {
        // SAFETY: the GIL is held (attach); the frame is borrowed from the thread state.
        let mut frame = unsafe { PyEval_GetFrame() };
        if frame.is_null() {
            return None;
        }
        // SAFETY: a borrowed frame, owned from here on as every frame below it is.
        unsafe { ffi::Py_INCREF(frame) };
        let mut codes = CODES.lock().unwrap_or_else(|p| p.into_inner());
        let codes = codes.get_or_insert_with(HashMap::new);
        let mut found = None;
        while !frame.is_null() {
            // SAFETY: `frame` is a frame we own a reference to.
            let code = unsafe { PyFrame_GetCode(frame) };
            let own = match code.is_null() {
                true => None,
                // SAFETY: `code` is a new reference, handed to `describe` or released.
                false => unsafe { describe(py, codes, code) },
            };
            if let Some((file, function)) = own {
                // SAFETY: `frame` is alive.
                let line = unsafe { PyFrame_GetLineNumber(frame) }.max(0) as u32;
                found = Some(Site {
                    file,
                    line,
                    function,
                });
                // SAFETY: our reference.
                unsafe { ffi::Py_DECREF(frame) };
                break;
            }
            // SAFETY: `frame` is alive; the next one is a new reference; ours is given up.
            unsafe {
                let back = PyFrame_GetBack(frame);
                ffi::Py_DECREF(frame);
                frame = back;
            }
        }
        found
    }
}

/// The program's file and function for `code`, or `None` for a library's code.
///
/// # Safety
/// The GIL is held and `code` is a new reference to a code object, which this takes.
unsafe fn describe(
    py: Python<'_>,
    codes: &mut HashMap<usize, Code>,
    code: *mut ffi::PyObject,
) -> Option<(Arc<str>, Arc<str>)> {
    let address = code as usize;
    // SAFETY: the caller's contract: a new reference, owned here.
    let code = unsafe { Bound::from_owned_ptr(py, code) };
    if let Some(known) = codes.get(&address) {
        return known.own.clone();
    }
    if codes.len() >= MAX_CODES_KEPT {
        codes.clear();
    }
    let name = |attribute| {
        code.getattr(attribute)
            .and_then(|v| v.extract::<String>())
            .unwrap_or_else(|_| "?".into())
    };
    let file = name("co_filename");
    let library = LIBRARIES.iter().any(|part| file.contains(part));
    let own = (!library).then(|| (Arc::from(file), Arc::from(name("co_name"))));
    codes.insert(
        address,
        Code {
            _alive: code.unbind().into_any(),
            own: own.clone(),
        },
    );
    own
}
