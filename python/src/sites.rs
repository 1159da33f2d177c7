//! Where the program was when it asked for an array, for traces recorded with sites:
//! the innermost frame of its own code (not the standard library's, an installed
//! package's, NumPy's, allocbox's or the import machinery's), and the innermost frame
//! of a library inside it, when the array was made in a library's code (SciPy's
//! `cdist`, called from the program's line). It runs inside every allocation of such a
//! recording, so it walks frames through the C API and looks at each code object's
//! names once.

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::{Arc, Mutex, OnceLock};

use allocbox::trace::Site;
use foldhash::fast::RandomState;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::{MutexExt, OnceLockExt};

// Every CPython the wheel supports exports these, though PyO3's abi3 bindings leave
// some out. Each returns a new reference, or NULL.
unsafe extern "C" {
    fn PyEval_GetFrame() -> *mut ffi::PyObject;
    fn PyFrame_GetCode(frame: *mut ffi::PyObject) -> *mut ffi::PyObject;
    fn PyFrame_GetBack(frame: *mut ffi::PyObject) -> *mut ffi::PyObject;
    fn PyFrame_GetLineNumber(frame: *mut ffi::PyObject) -> c_int;
    fn PyFrame_GetLasti(frame: *mut ffi::PyObject) -> c_int;
}

/// Whose code a code object is.
#[derive(Clone)]
enum Whose {
    /// The program's own: its file and function.
    Own(Arc<str>, Arc<str>),
    /// A library's (the standard library, an installed package): its file and function.
    Library(Arc<str>, Arc<str>),
    /// NumPy's, allocbox's or the import machinery's: never a line to show.
    Machinery,
}

/// What a code object is.
struct Code {
    /// Keeps the code object, so that its address names it for as long as it is here.
    _alive: Py<PyAny>,
    whose: Whose,
    lines: Lines,
}

/// The line of each instruction of a code object asked about so far: CPython finds a
/// line by reading the code's line table from its start, most of the cost of a site.
#[derive(Default)]
struct Lines(HashMap<c_int, u32, RandomState>);

/// The most instructions' lines one code object keeps (a function of thousands of
/// lines allocating on every one).
const MAX_LINES_KEPT: usize = 1 << 12;

impl Lines {
    /// The line `frame`, running this code, is at.
    ///
    /// # Safety
    /// This thread is attached to Python and `frame` is a live frame running this code.
    unsafe fn line(&mut self, frame: *mut ffi::PyObject) -> u32 {
        // SAFETY: the caller's contract.
        let at = unsafe { PyFrame_GetLasti(frame) };
        if let Some(&line) = self.0.get(&at) {
            return line;
        }
        // SAFETY: the caller's contract.
        let line = unsafe { PyFrame_GetLineNumber(frame) }.max(0) as u32;
        if self.0.len() < MAX_LINES_KEPT {
            self.0.insert(at, line);
        }
        line
    }
}

/// Code objects seen so far, by address. Its lock is what protects it (threads record
/// sites at once without the GIL on a free-threaded build); a thread that must wait
/// for it waits detached from Python ([`MutexExt::lock_py_attached`]), since its
/// holder calls into Python.
static CODES: Mutex<Option<HashMap<usize, Code, RandomState>>> = Mutex::new(None);

/// The most code objects [`CODES`] keeps alive: a program that makes code without end
/// (`exec` in a loop) would otherwise keep all of it. Past this they are forgotten
/// (and released), and looked at again when next seen.
const MAX_CODES_KEPT: usize = 1 << 14;

/// The folders NumPy, Numba and allocbox are installed in, each ending in `/`
/// (`allocbox._machinery_folders`): code in them is never a line to show. By where the
/// packages are, never by a word in a path: a program under a folder named `numpy` or
/// `allocbox` (a clone of this repository) has its own lines.
static MACHINERY_FOLDERS: OnceLock<Vec<String>> = OnceLock::new();

/// Whether code in `file` is NumPy's, Numba's, allocbox's or Python's import
/// machinery's.
pub(crate) fn is_machinery(py: Python<'_>, file: &str) -> bool {
    let folders = MACHINERY_FOLDERS.get_or_init_py_attached(py, || {
        py.import("allocbox")
            .and_then(|allocbox| allocbox.getattr("_machinery_folders")?.call0())
            .and_then(|folders| folders.extract::<Vec<String>>())
            .unwrap_or_default()
    });
    file.starts_with("<frozen ")
        || folders
            .iter()
            .any(|folder| file.starts_with(folder.as_str()))
}

/// The folders of the standard library and of installed packages, each ending in `/`
/// ([`prepare`]).
static LIBRARY_FOLDERS: OnceLock<Vec<String>> = OnceLock::new();

/// Find the library folders (`allocbox._library_folders`) before the first
/// allocation is recorded: not inside one, where running Python code could allocate.
pub(crate) fn prepare(py: Python<'_>) {
    is_machinery(py, "");
    // Detached while another thread runs the initialiser, which runs Python.
    LIBRARY_FOLDERS.get_or_init_py_attached(py, || {
        py.import("allocbox")
            .and_then(|allocbox| allocbox.getattr("_library_folders")?.call0())
            .and_then(|folders| folders.extract::<Vec<String>>())
            .unwrap_or_default()
    });
}

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
    // SAFETY: attached to Python (`attach`); the frame is borrowed from the thread state.
    let mut frame = unsafe { PyEval_GetFrame() };
    if frame.is_null() {
        return None;
    }
    // SAFETY: a borrowed frame, owned from here on as every frame below it is.
    unsafe { ffi::Py_INCREF(frame) };
    let mut codes = CODES
        .lock_py_attached(py)
        .unwrap_or_else(|p| p.into_inner());
    let codes = codes.get_or_insert_with(HashMap::default);
    let folders = LIBRARY_FOLDERS.get().map_or(&[][..], Vec::as_slice);
    // The innermost library frame, until the program's own is found.
    let mut via: Option<Site> = None;
    while !frame.is_null() {
        // SAFETY: `frame` is a frame we own a reference to.
        let code = unsafe { PyFrame_GetCode(frame) };
        let found = match code.is_null() {
            true => None,
            false => {
                // SAFETY: `code` is a new reference, handed to `describe`.
                let code = unsafe { describe(py, codes, folders, code) };
                match &code.whose {
                    Whose::Own(file, function) => Some(Site {
                        file: file.clone(),
                        // SAFETY: `frame` is alive and runs `code`.
                        line: unsafe { code.lines.line(frame) },
                        function: function.clone(),
                        via: via.take().map(Arc::new),
                    }),
                    Whose::Library(file, function) => {
                        if via.is_none() {
                            via = Some(Site {
                                file: file.clone(),
                                // SAFETY: as above.
                                line: unsafe { code.lines.line(frame) },
                                function: function.clone(),
                                via: None,
                            });
                        }
                        None
                    }
                    Whose::Machinery => None,
                }
            }
        };
        if found.is_some() {
            // SAFETY: our reference.
            unsafe { ffi::Py_DECREF(frame) };
            return found;
        }
        // SAFETY: `frame` is alive; the next one is a new reference; ours is given up.
        unsafe {
            let back = PyFrame_GetBack(frame);
            ffi::Py_DECREF(frame);
            frame = back;
        }
    }
    // No frame of the program's own (it is itself an installed package's): the
    // library line it was in.
    via
}

/// What `code` is, looked at once.
///
/// # Safety
/// This thread is attached to Python and `code` is a new reference to a code object, which this takes.
unsafe fn describe<'a>(
    py: Python<'_>,
    codes: &'a mut HashMap<usize, Code, RandomState>,
    folders: &[String],
    code: *mut ffi::PyObject,
) -> &'a mut Code {
    let address = code as usize;
    // SAFETY: the caller's contract: a new reference, owned here.
    let code = unsafe { Bound::from_owned_ptr(py, code) };
    if codes.len() >= MAX_CODES_KEPT && !codes.contains_key(&address) {
        codes.clear();
    }
    let new = match codes.entry(address) {
        std::collections::hash_map::Entry::Occupied(known) => return known.into_mut(),
        std::collections::hash_map::Entry::Vacant(new) => new,
    };
    let name = |attribute| {
        code.getattr(attribute)
            .and_then(|v| v.extract::<String>())
            .unwrap_or_else(|_| "?".into())
    };
    let file = name("co_filename");
    let whose = if is_machinery(py, &file) {
        Whose::Machinery
    } else if folders
        .iter()
        .any(|folder| file.starts_with(folder.as_str()))
        // Code made at run time (`<string>`: a dataclass's or namedtuple's generated
        // `__init__`, an `exec`): the line that ran it is the program's.
        || file.starts_with('<')
    {
        Whose::Library(Arc::from(file), Arc::from(name("co_name")))
    } else {
        Whose::Own(Arc::from(file), Arc::from(name("co_name")))
    };
    new.insert(Code {
        _alive: code.unbind().into_any(),
        whose,
        lines: Lines::default(),
    })
}
