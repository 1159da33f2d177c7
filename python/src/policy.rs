//! `allocbox.Policy`: a chain of policies ready to be NumPy's handler, its statistics and
//! failures; NumPy's own default behind the same bridge; and `set_handler`, which makes
//! one of them current.

use std::ffi::c_char;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use allocbox::nep49::MemHandler;

use allocbox::PolicyHandler;
use allocbox::trace::{RecordOptions, Recorder, SiteOf, TraceWriter};
use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::PyDict;

use crate::bridge::Bridge;
use crate::errors::{AllocboxError, PoisonedPolicy, to_py};
use crate::numpy_api::{CAPSULE_NAME, make_capsule, numpy_name, numpy_set_handler};

/// A policy chain ready to be NumPy's handler.
#[pyclass(frozen, module = "allocbox")]
pub(crate) struct Policy {
    /// The chain, or one per thread with `per_thread=True` (`None` for NumPy's own
    /// default).
    pub(crate) handle: Option<Arc<dyn PolicyHandler>>,
    pub(crate) bridge: Arc<Bridge>,
    pub(crate) recorder: Option<Arc<Recorder>>,
    pub(crate) capsule: Mutex<Option<Py<PyAny>>>,
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
        // Waited for detached from Python: its holder makes a capsule, a Python object.
        let mut slot = self
            .capsule
            .lock_py_attached(py)
            .unwrap_or_else(|p| p.into_inner());
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
        let links = self.links()?;
        d.set_item(
            "client_misuse",
            links.iter().map(|l| l.client_misuse).sum::<u64>(),
        )?;
        let top = links.into_iter().next().map(|l| l.counters);
        d.set_item("counters", counters_dict(py, top.unwrap_or_default())?)?;
        set_counts(&d, &s)?;
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
    ///   (`grant=` at `load` gives them); `gpu_unavailable`: why its latest request
    ///   for GPU memory (pinned or device) was refused as unavailable (no CUDA
    ///   driver, no such device), or `None`;
    /// - `client_misuse`: misuse of arrays it reported; `recent_misuse`: the latest
    ///   reports, as sentences;
    /// - `counters`: its own counters, `{name: value}` (contract 0.2.0).
    ///
    /// With `per_thread=True`, every instance's chain in turn, in the order they started.
    fn link_stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        link_dicts(py, self.links()?)
    }

    /// The live blocks, `(address, size)`, by address.
    fn snapshot(&self) -> PyResult<Vec<(usize, usize)>> {
        match &self.handle {
            Some(h) => h.live_blocks().map_err(|e| to_py(&e)),
            None => Ok(Vec::new()),
        }
    }

    /// The chains started so far: with `per_thread=True`, one per thread that called
    /// the policy, up to one per core; otherwise 1.
    #[getter]
    fn instances(&self) -> usize {
        self.handle.as_ref().map_or(1, |h| h.instances())
    }

    /// Why the chain was stopped, or `None`.
    #[getter]
    fn failure(&self) -> Option<String> {
        self.stopped_by().map(|e| e.to_string())
    }

    /// Raise the first failure seen inside NumPy's calls (where only NULL could be
    /// returned) as its exception: ContractViolation, PoisonedPolicy or ClientError.
    fn raise_if_failed(&self) -> PyResult<()> {
        if let Some(message) = self.bridge.panicked.get() {
            return Err(AllocboxError::new_err(message.clone()));
        }
        if let Some(e) = self.stopped_by() {
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

    /// Everything that went wrong inside NumPy's calls, as text, oldest first (a
    /// property, as `failure` is: both say what state the policy is in).
    #[getter]
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

    /// End the trace being recorded (`load(..., record=path)`) and flush it: the policy
    /// goes on serving, unrecorded, so the blocks live now are the ones the trace never
    /// frees (what leaked, where the recording ends).
    fn finish_recording(&self) -> PyResult<()> {
        match &self.recorder {
            Some(recorder) => finish(&recorder.watcher),
            None => Ok(()),
        }
    }

    fn __repr__(&self) -> String {
        format!("<allocbox.Policy {:?}>", self.name())
    }
}
impl Policy {
    /// Every policy's counters, top first; with `per_thread=True` every chain's in turn.
    fn links(&self) -> PyResult<Vec<allocbox::LinkStats>> {
        let links = self.handle.as_ref().map(|h| h.link_stats());
        links.unwrap_or(Ok(Vec::new())).map_err(|e| to_py(&e))
    }

    /// What stopped the chain (the first chain to stop, with `per_thread=True`).
    fn stopped_by(&self) -> Option<Arc<allocbox::Error>> {
        self.handle.as_ref().and_then(|h| h.failure())
    }
}

/// The client's counts of `stats` in `d`, by the names `Policy.stats()` documents.
pub(crate) fn set_counts(d: &Bound<'_, PyDict>, s: &allocbox::Stats) -> PyResult<()> {
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
    Ok(())
}

/// Each policy's counters as the dicts `Policy.link_stats()` documents, top first.
pub(crate) fn link_dicts(
    py: Python<'_>,
    links: Vec<allocbox::LinkStats>,
) -> PyResult<Vec<Bound<'_, PyDict>>> {
    links
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
            d.set_item("gpu_unavailable", l.gpu_unavailable)?;
            Ok(d)
        })
        .collect()
}

/// A policy's counters as a dict that keeps its order.
fn counters_dict(py: Python<'_>, counters: Vec<(String, u64)>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (name, value) in counters {
        d.set_item(name, value)?;
    }
    Ok(d)
}
/// NumPy's own default handler (C malloc behind NumPy's small-block cache), natively,
/// behind the same bridge as the wasm policies: what any handler installed through this
/// module costs NumPy before a policy does anything. For benchmarks and comparisons, and
/// for recording what NumPy's default does (`record`, as for `load`).
#[pyfunction]
#[pyo3(signature = (record = None, record_sites = false))]
pub(crate) fn native_default(record: Option<PathBuf>, record_sites: bool) -> PyResult<Policy> {
    let handler = allocbox::nep49::default_handler();
    let (shared, recorder) = match record {
        None => (handler, None),
        Some(path) => {
            let recorder = recorder_to(&path, handler, record_sites)?;
            (recorder.clone() as Arc<dyn MemHandler>, Some(recorder))
        }
    };
    Ok(Policy {
        handle: None,
        bridge: Arc::new(Bridge::new(shared, None)),
        recorder,
        capsule: Mutex::new(None),
    })
}

/// `handler`, with every call it serves written to a trace at `path` (gzip for `.gz`),
/// each with its time, and with `sites` the line of the program that asked.
pub(crate) fn recorder_to(
    path: &Path,
    handler: Arc<dyn MemHandler>,
    sites: bool,
) -> PyResult<Arc<Recorder>> {
    let recorder = Recorder::create(path, handler, recording_options(sites))
        .map_err(|error| AllocboxError::new_err(error.to_string()))?;
    Ok(Arc::new(recorder))
}

/// What a recording writes beside each call: its time, and with `sites` the line of the
/// program that asked.
pub(crate) fn recording_options(sites: bool) -> RecordOptions {
    if sites {
        Python::attach(crate::sites::prepare);
    }
    RecordOptions {
        time: true,
        sites: sites.then(|| -> SiteOf { Box::new(crate::sites::program_site) }),
    }
}

/// End a recording and write it out, or say which file could not be written.
pub(crate) fn finish(recorder: &TraceWriter) -> PyResult<()> {
    recorder.finish().map_err(|e| {
        let file = recorder.file().map(|f| format!(" `{}`", f.display()));
        AllocboxError::new_err(format!(
            "the trace{} could not be written: {e}",
            file.unwrap_or_default()
        ))
    })
}

/// Install a policy (or a capsule `set_handler` returned earlier, or `None` for NumPy's
/// default) as NumPy's handler in the current context. Returns the previous capsule.
#[pyfunction]
pub(crate) fn set_handler(
    py: Python<'_>,
    handler: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
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
