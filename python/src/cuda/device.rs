//! Device handlers for GPU programs (`DevicePolicy`, loaded by `load_device_chain`) and
//! the owner object CuPy's and Numba's pointers keep alive (`DeviceBlock`).

use std::sync::Arc;

use std::path::PathBuf;

use allocbox::gpu::Stream;
use allocbox::trace::{DeviceRecorder, Recorder, Served, TraceWriter, Watched, Watcher};
use allocbox::{DeviceHandler, Error, PolicyHandler, WasmHook};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt};
use std::sync::Mutex;

use crate::errors::{AllocboxError, LoadError, to_py};
use crate::hooks::EventHook;
use crate::loading::{Bounds, chain_builder};
use crate::policy::{Policy, finish, link_dicts, recording_options, set_counts};
use crate::stand_in_gpu::StandInGpu;

/// A chain of policies serving one GPU's memory to a GPU program: blocks are device
/// addresses, freed with the streams that may still use them.
#[pyclass(frozen, module = "allocbox")]
pub(crate) struct DevicePolicy {
    pub(crate) handler: Arc<Device>,
}

/// A device handler as its clients (Python, PyTorch's entry points, blocks that free
/// themselves) call it: through its recording when `record=` asked for one, so that
/// every block is in the trace whichever client made it. Everything else is the
/// handler's own.
pub(crate) struct Device {
    watched: Watched<Arc<DeviceHandler>, DeviceWatchers>,
}

/// What is told of a device policy's every call: its recording (`record=`) and its
/// event hook (`hook=`), each when asked for.
type DeviceWatchers = (Option<Recording>, Option<Arc<WasmHook>>);

/// Where a device policy's calls are recorded: a trace of its own, or the trace a host
/// policy records (`allocbox run --record` with a device policy: one trace of the
/// program's host and GPU memory, in one order).
pub(crate) enum Recording {
    Own(TraceWriter),
    Into(Arc<Recorder>),
}

impl Recording {
    fn writer(&self) -> &TraceWriter {
        match self {
            Recording::Own(writer) => writer,
            Recording::Into(recorder) => &recorder.watcher,
        }
    }
}

impl Watcher for Recording {
    fn before(&self) -> u64 {
        self.writer().before()
    }
    fn served(&self, call: Served) {
        self.writer().served(call);
    }
}

impl Device {
    /// [`DeviceHandler::malloc`], recorded and hooked.
    pub(crate) fn malloc(&self, size: u64) -> Result<Option<u64>, Error> {
        self.watched.device_malloc(size)
    }

    /// [`DeviceHandler::free`], recorded and hooked.
    pub(crate) fn free(
        &self,
        addr: u64,
        size: Option<u64>,
        streams: &[Stream],
    ) -> Result<(), Error> {
        self.watched.device_free(addr, size, streams)
    }
}

impl std::ops::Deref for Device {
    type Target = DeviceHandler;
    fn deref(&self) -> &DeviceHandler {
        &self.watched.handler
    }
}

#[pymethods]
impl DevicePolicy {
    /// The chain's name, top first, joined by `>`.
    #[getter]
    fn name(&self) -> String {
        self.handler.name().to_string()
    }

    /// The GPU it serves.
    #[getter]
    fn device(&self) -> u32 {
        self.handler.device()
    }

    /// `size` bytes of device memory: the address, or `MemoryError` when the policy has
    /// none (after every waiting free was waited for).
    fn malloc(&self, py: Python<'_>, size: u64) -> PyResult<u64> {
        let handler = self.handler.clone();
        match py.detach(move || handler.malloc(size)) {
            Ok(Some(addr)) => Ok(addr),
            Ok(None) => Err(pyo3::exceptions::PyMemoryError::new_err(
                match self.handler.gpu_unavailable() {
                    Some(why) => format!(
                        "policy `{}` got no memory of GPU {}: {why}",
                        self.handler.name(),
                        self.handler.device()
                    ),
                    None => format!(
                        "policy `{}` has no {size} bytes of memory of GPU {} left",
                        self.handler.name(),
                        self.handler.device()
                    ),
                },
            )),
            Err(e) => Err(to_py(&e)),
        }
    }

    /// Free the block at `ptr` (`size` as allocated, or None), once the work queued so
    /// far on each of `streams` has finished (at once with none). A stream is a
    /// `CUstream` handle or a stream object ([`stream_handle`]), alive for the call,
    /// which records an event on it.
    #[pyo3(signature = (ptr, size = None, streams = Vec::new()))]
    fn free(
        &self,
        py: Python<'_>,
        ptr: u64,
        size: Option<u64>,
        streams: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let streams = streams
            .iter()
            .map(stream_handle)
            .collect::<PyResult<Vec<_>>>()?;
        let handler = self.handler.clone();
        py.detach(move || handler.free(ptr, size, &streams))
            .map_err(|e| to_py(&e))
    }

    /// A `DeviceBlock` of `size` bytes that frees itself on `stream` when dropped (or
    /// `free()`d): an owner for CuPy's `UnownedMemory` or a Numba finalizer. A stream
    /// object is kept alive by the block until its free has recorded an event on it: a
    /// destroyed stream could take none.
    #[pyo3(signature = (size, stream = None))]
    fn block(
        &self,
        py: Python<'_>,
        size: u64,
        stream: Option<Bound<'_, PyAny>>,
    ) -> PyResult<DeviceBlock> {
        let handle = stream.as_ref().map_or(Ok(0), stream_handle)?;
        let ptr = self.malloc(py, size)?;
        Ok(DeviceBlock {
            ptr,
            size,
            stream: handle,
            stream_object: Mutex::new(
                stream
                    .filter(|s| !s.is_instance_of::<PyInt>())
                    .map(Bound::unbind),
            ),
            handler: Mutex::new(Some(self.handler.clone())),
        })
    }

    /// Wait for every waiting free's streams and give each back to the policy.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let handler = self.handler.clone();
        py.detach(move || handler.synchronize())
            .map_err(|e| to_py(&e))
    }

    /// Give back finished frees, then ask each policy to give back what it caches.
    fn trim(&self, py: Python<'_>) -> PyResult<()> {
        let handler = self.handler.clone();
        py.detach(move || handler.trim()).map_err(|e| to_py(&e))
    }

    /// Start keeping frees from the policy (Numba's `defer_cleanup`); `defer_end` ends it.
    fn defer_begin(&self) {
        self.handler.defer_begin();
    }

    /// End one `defer_begin`.
    fn defer_end(&self) {
        self.handler.defer_end();
    }

    /// `(free, total)` bytes of the GPU, as its driver says.
    fn device_memory(&self) -> PyResult<(u64, u64)> {
        self.handler
            .device_memory()
            .map_err(|e| LoadError::new_err(e.to_string()))
    }

    /// Why the chain was stopped, if it was.
    #[getter]
    fn failure(&self) -> Option<String> {
        self.handler.failure().map(|e| e.to_string())
    }

    /// The client's counters, as `Policy.stats()`, with `pending_frees` and
    /// `pending_bytes`: frees waiting for their streams; `gpu_unavailable`: why a
    /// request for the GPU's memory was last refused as unavailable (no CUDA driver, no
    /// such device), or `None`; and `counters`, the top policy's own.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.handler.stats().map_err(|e| to_py(&e))?;
        let links = self.handler.link_stats().map_err(|e| to_py(&e))?;
        let pending = self.handler.pending_frees();
        let d = PyDict::new(py);
        set_counts(&d, &s)?;
        d.set_item("pending_frees", pending.blocks)?;
        d.set_item("pending_bytes", pending.bytes)?;
        let unavailable = links.iter().find_map(|link| link.gpu_unavailable.clone());
        d.set_item("gpu_unavailable", unavailable)?;
        let counters = PyDict::new(py);
        if let Some(top) = links.into_iter().next() {
            for (name, value) in top.counters {
                counters.set_item(name, value)?;
            }
            d.set_item("mapped_bytes", top.mapped_bytes)?;
        }
        d.set_item("counters", counters)?;
        Ok(d)
    }

    /// What each policy of the chain was asked by the host, top first, as
    /// `Policy.link_stats()`.
    fn link_stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        link_dicts(py, self.handler.link_stats().map_err(|e| to_py(&e))?)
    }

    /// The live blocks, `(address, size)`, by address: blocks whose free waits for
    /// their streams are among them.
    fn snapshot(&self) -> PyResult<Vec<(usize, usize)>> {
        self.handler.live_blocks().map_err(|e| to_py(&e))
    }

    /// End the trace being recorded (`load(..., record=path)`) and write it out, as
    /// `Policy.finish_recording()`.
    fn finish_recording(&self) -> PyResult<()> {
        // A trace shared with a host policy is that policy's to finish.
        match &self.handler.watched.watcher.0 {
            Some(Recording::Own(writer)) => finish(writer),
            _ => Ok(()),
        }
    }

    /// After every block was freed: an error naming what a policy still holds.
    fn leak_check(&self, py: Python<'_>) -> PyResult<()> {
        let handler = self.handler.clone();
        py.detach(move || handler.leak_check())
            .map_err(|e| to_py(&e))
    }
}

/// A block of device memory that gives itself back, on the stream it was made for, when
/// `free()`d or dropped: what CuPy's `UnownedMemory` and Numba's finalizers hold.
#[pyclass(frozen, module = "allocbox")]
pub(crate) struct DeviceBlock {
    #[pyo3(get)]
    ptr: u64,
    #[pyo3(get)]
    size: u64,
    #[pyo3(get)]
    stream: Stream,
    /// The stream object the block was made for, kept until its free's event is on it.
    stream_object: Mutex<Option<Py<PyAny>>>,
    handler: Mutex<Option<Arc<Device>>>,
}

impl DeviceBlock {
    /// Free the block, once; the stream object it kept, for the caller to let go of.
    fn give_back(&self) -> (Result<(), Error>, Option<Py<PyAny>>) {
        let maker = self
            .handler
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let freed = match maker {
            Some(handler) => handler.free(self.ptr, Some(self.size), &[self.stream]),
            None => Ok(()),
        };
        let stream = self
            .stream_object
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        (freed, stream)
    }
}

#[pymethods]
impl DeviceBlock {
    /// Give the block back (once the work queued on its stream has finished); again does
    /// nothing.
    fn free(&self, py: Python<'_>) -> PyResult<()> {
        let (freed, stream) = py.detach(|| self.give_back());
        drop(stream);
        freed.map_err(|e| to_py(&e))
    }
}

/// The `CUstream` a client names: the handle itself (an int; 0 is the default stream),
/// or a stream object of PyTorch (`cuda_stream`), CuPy (`ptr`) or Numba (`handle`, a
/// ctypes pointer or the NVIDIA binding's handle).
pub(crate) fn stream_handle(stream: &Bound<'_, PyAny>) -> PyResult<Stream> {
    if let Ok(handle) = stream.extract::<Stream>() {
        return Ok(handle);
    }
    for attribute in ["cuda_stream", "ptr", "handle"] {
        let Ok(mut value) = stream.getattr(attribute) else {
            continue;
        };
        if let Ok(pointer) = value.getattr("value") {
            // A ctypes pointer: None is the null (default) stream.
            value = pointer;
        }
        if value.is_none() {
            return Ok(0);
        }
        if let Ok(handle) = value.extract::<Stream>() {
            return Ok(handle);
        }
        // The NVIDIA binding's handle converts by `int()`; a float would too, cut to a
        // whole number (1.5 taken as stream 1), and is no stream.
        if value.is_instance_of::<pyo3::types::PyFloat>() {
            break;
        }
        if let Ok(handle) = value
            .call_method0("__int__")
            .and_then(|v| v.extract::<Stream>())
        {
            return Ok(handle);
        }
    }
    Err(PyTypeError::new_err(format!(
        "a stream is a CUstream handle (an int, 0 for the default stream) or a stream of \
         PyTorch (`cuda_stream`), CuPy (`ptr`) or Numba (`handle`); a `{}` is none of them",
        stream.get_type().name()?
    )))
}

impl Drop for DeviceBlock {
    fn drop(&mut self) {
        // A failure here stops the policy, which says so in its `failure` and stats;
        // a destructor has no one to raise it to.
        let _ = self.give_back();
    }
}

/// Load a chain (as `load_chain`) as a device handler of GPU `device`. Its policies
/// get the `device` grant besides any in `grant`. `record` writes its every block to a
/// trace: a path, or a host `Policy` that records (its trace then has both); `hook` (an
/// `EventHook`) is told of each, as NumPy's event hook is of arrays.
#[pyfunction]
#[pyo3(signature = (*chain, device = 0, call_time = None, memory = None, batch = None, overhead = None, compile_bounds = None, grant = None, names = None, gpu = None, record = None, hook = None))]
#[allow(clippy::too_many_arguments, reason = "Python keyword arguments")]
pub(crate) fn load_device_chain(
    chain: Vec<Bound<'_, PyAny>>,
    device: u32,
    call_time: Option<f64>,
    memory: Option<u64>,
    batch: Option<u32>,
    overhead: Option<u64>,
    compile_bounds: Option<Bound<'_, PyDict>>,
    grant: Option<Vec<String>>,
    names: Option<Vec<Option<String>>>,
    gpu: Option<PyRef<'_, StandInGpu>>,
    record: Option<Bound<'_, PyAny>>,
    hook: Option<PyRef<'_, EventHook>>,
) -> PyResult<DevicePolicy> {
    let mut grant = grant.unwrap_or_default();
    grant.push("device".into());
    let bounds = Bounds {
        call_time,
        memory,
        batch,
        overhead,
        host_memory_limit: None,
        compile_bounds,
        grant: Some(grant),
        gpu: gpu.map(|g| g.gpu()),
    };
    let handler = Arc::new(
        chain_builder(chain, bounds, names)?
            .build_device(device)
            .map_err(|e| LoadError::new_err(e.to_string()))?,
    );
    let recorder = match record {
        None => None,
        Some(into) => match into.cast::<Policy>() {
            Ok(policy) => match &policy.get().recorder {
                Some(recorder) => Some(Recording::Into(recorder.clone())),
                None => {
                    return Err(PyValueError::new_err(
                        "record= names a policy that records nothing: load it with record=PATH",
                    ));
                }
            },
            Err(_) => {
                let path: PathBuf = into.extract()?;
                let recorder =
                    DeviceRecorder::create(&path, handler.clone(), recording_options(false))
                        .map_err(|error| AllocboxError::new_err(error.to_string()))?;
                Some(Recording::Own(recorder.watcher))
            }
        },
    };
    let watched = Watched {
        handler,
        watcher: (recorder, hook.map(|h| h.hook.clone())),
    };
    Ok(DevicePolicy {
        handler: Arc::new(Device { watched }),
    })
}
