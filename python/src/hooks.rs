//! Event hooks as Python sees them (`set_event_hook`): a Python callable, or a sandboxed
//! hook component (`EventHook`); a hook that fails is detached and reported as an
//! unraisable exception, never breaking the allocation that called it.

use std::ptr::NonNull;
use std::sync::Arc;

use allocbox::{Limits, Runtime, WasmHook};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::errors::{AllocboxError, LoadError, to_py};
use crate::loading::{call_time_or_default, source_bytes};

/// A sandboxed event hook (a component of the `hook` world), for `set_event_hook`.
#[pyclass(frozen, module = "allocbox")]
pub(crate) struct EventHook {
    pub(crate) hook: Arc<WasmHook>,
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
pub(crate) fn shipped_hooks()
-> std::collections::HashMap<&'static str, (&'static str, &'static str)> {
    allocbox_cli::SHIPPED_HOOKS
        .iter()
        .map(|&(name, about, source)| (name, (about, source)))
        .collect()
}

/// Start a hook component from a path or bytes, named `name`, under allocbox's default
/// bounds (memory, and `call_time` seconds per event).
#[pyfunction]
#[pyo3(signature = (source, name, call_time = None))]
pub(crate) fn load_hook(
    source: &Bound<'_, PyAny>,
    name: &str,
    call_time: Option<f64>,
) -> PyResult<EventHook> {
    let (bytes, _) = source_bytes(source, &allocbox::CompileBounds::default())?;
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
    // Only if it is still the hook: one set by another thread meanwhile stays.
    drop(allocbox::nep49::remove_event_hook_if(ours));
    // The hook's own exception, so that its traceback ends at the hook's line; what
    // became of the hook is the object it is reported "in" (Python prints
    // "Exception ignored in: " and its repr first), and a note on it (PEP 678).
    let object = stopped.object.bind(py);
    let said = format!(
        "event hook {}, which failed and was detached",
        object.repr().map_or_else(|_| "?".into(), |r| r.to_string())
    );
    let _ = why
        .value(py)
        .call_method1("add_note", (format!("allocbox: {said}"),));
    let detached = DetachedHook {
        hook: stopped.object.clone_ref(py),
        said,
    };
    match Bound::new(py, detached) {
        Ok(detached) => why.write_unraisable(py, Some(detached.as_any())),
        Err(_) => why.write_unraisable(py, Some(object)),
    }
}

/// What an event hook that failed is reported in (`sys.unraisablehook`'s `object`):
/// the hook, and a repr that says it was detached.
#[pyclass(frozen, module = "allocbox")]
pub(crate) struct DetachedHook {
    /// The hook that failed.
    #[pyo3(get)]
    hook: Py<PyAny>,
    said: String,
}

#[pymethods]
impl DetachedHook {
    fn __repr__(&self) -> String {
        self.said.clone()
    }
}

/// Called on whichever thread made the event, with or without the GIL, so on a
/// free-threaded build two threads' events reach a Python hook at once (it must be
/// thread-safe itself); the table of hooks is behind `allocbox::nep49`'s lock.
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
pub(crate) fn set_event_hook(
    py: Python<'_>,
    hook: Option<Bound<'_, PyAny>>,
) -> PyResult<Option<Py<PyAny>>> {
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
