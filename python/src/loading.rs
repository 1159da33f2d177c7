//! `allocbox.load_chain` and what it reads: sources (a path or bytes), configurations,
//! bounds and grants, each refused with a sentence naming the input at fault.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use allocbox::nep49::MemHandler;
use allocbox::{
    CompileBound, CompileBounds, Handler, HandlerBuilder, Limits, PolicyHandler, Runtime,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::bridge::Bridge;
use crate::errors::LoadError;
use crate::policy::{Policy, recorder_to};

/// `CompileBounds` from `{"functions": 100000, "code-bytes": ...}` (`_` for `-` too), the
/// others at their defaults.
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

/// A policy's bytes and a label for it, from a path or bytes; a file past
/// `bounds.file_bytes` is refused before it is read.
pub(crate) fn source_bytes(
    source: &Bound<'_, PyAny>,
    bounds: &CompileBounds,
) -> PyResult<(Vec<u8>, String)> {
    if let Ok(b) = source.cast::<PyBytes>() {
        return Ok((b.as_bytes().to_vec(), "<bytes>".into()));
    }
    let path: PathBuf = source
        .extract()
        .map_err(|_| PyTypeError::new_err("a policy is a path or bytes"))?;
    let bytes = allocbox::read_policy_file(&path, bounds).map_err(|e| match e {
        allocbox::LoadError::Io { .. } => LoadError::new_err(e.to_string()),
        _ => LoadError::new_err(format!("`{}`: {e}", path.display())),
    })?;
    Ok((bytes, path.display().to_string()))
}

/// `call_time` in seconds as a bound on one call, or the library's default.
pub(crate) fn call_time_or_default(call_time: Option<f64>) -> PyResult<Duration> {
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

/// The bounds and grants a chain is loaded with, as Python gives them.
pub(crate) struct Bounds<'py> {
    pub(crate) call_time: Option<f64>,
    pub(crate) memory: Option<u64>,
    pub(crate) batch: Option<u32>,
    pub(crate) overhead: Option<u64>,
    pub(crate) host_memory_limit: Option<u64>,
    pub(crate) compile_bounds: Option<Bound<'py, PyDict>>,
    pub(crate) grant: Option<Vec<String>>,
    /// The stand-in GPU's, or the CUDA driver (`None`).
    pub(crate) gpu: Option<allocbox::gpu::Gpu>,
}

/// A builder of the chain `chain` (top first; each a source or a `(source, config)`
/// pair) under `bounds`, each policy loaded and named as `names` says.
pub(crate) fn chain_builder(
    chain: Vec<Bound<'_, PyAny>>,
    bounds: Bounds<'_>,
    names: Option<Vec<Option<String>>>,
) -> PyResult<HandlerBuilder> {
    let runtime = Runtime::shared();
    let compile_bounds = compile_bounds_from(bounds.compile_bounds)?;
    let defaults = Limits::default();
    let kinds = allocbox::mapped::KindGrants::from_names(bounds.grant.unwrap_or_default())
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let limits = Limits {
        call_time: call_time_or_default(bounds.call_time)?,
        memory: bounds.memory.unwrap_or(defaults.memory),
        batch: bounds.batch.unwrap_or(defaults.batch),
        overhead: bounds.overhead.unwrap_or(defaults.overhead),
        grants: allocbox::Grants {
            memory: kinds,
            gpu: bounds.gpu.unwrap_or_default(),
            ..defaults.grants
        },
        ..defaults
    };
    let mut builder = HandlerBuilder::new(runtime).limits(limits);
    if let Some(bytes) = bounds.host_memory_limit {
        builder = builder.host_memory_limit(bytes);
    }
    if chain.is_empty() {
        return Err(LoadError::new_err("a chain needs at least one policy"));
    }
    let names = names.unwrap_or_default();
    for (at, item) in chain.iter().enumerate() {
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
        let (bytes, label) = source_bytes(&source, &compile_bounds)?;
        let name = names.get(at).cloned().flatten().unwrap_or(label);
        let policy = runtime
            .load_named(&bytes, &name, &compile_bounds)
            .map_err(|e| LoadError::new_err(e.to_string()))?;
        let config: Vec<(&str, &str)> = config
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        builder = builder.link_with(&policy, &config);
    }
    Ok(builder)
}

/// Load a chain of policies, top first. Each item is a source (path or bytes) or a
/// `(source, {key: value})` pair. `record` writes a trace of every call (gzip for a
/// `.gz` name), each with its time, and with `record_sites` the program's line. The bounds
/// default to allocbox's (`Limits::default`): `call_time` in seconds per call, imports
/// included; `memory`, a guest's own memory in bytes; `batch`, blocks in one batch
/// call; `overhead`, bytes a policy may hold beyond what its client holds; and
/// `host_memory_limit`, bytes lent from the host at once (default unlimited).
/// `compile_bounds` ({"functions": 100000, ...}) allows policies of a larger shape to be
/// compiled (`allocbox::CompileBounds`: functions, code-bytes, function-bytes,
/// data-bytes, modules, text-bytes). `names` says what to call each policy in messages
/// before it names itself (a shipped policy's name); by default its path, or `<bytes>`.
/// `gpu` is a stand-in GPU for the `pinned` kind (by default the CUDA driver's).
/// `magazines=False` asks the top policy on every call even when it declares `batch`
/// (per-thread magazines are the default for such a policy). `per_thread=True` starts
/// one chain per thread that calls it, up to one per core, when every policy of the
/// chain says its state is per instance (contract 0.2.0 `sharding`): each asked on
/// every call, the limits shared evenly between them. A chain with a policy that does
/// not say so, or that diagnoses its client, is loaded as without `per_thread`. By
/// default (`per_thread=None`) a chain asked on every call (no magazines) is per
/// thread when it can be: its threads then run at once instead of in turn, for about a
/// tenth more per call on one thread; `per_thread=False` keeps one instance.
#[pyfunction]
#[pyo3(signature = (*chain, record = None, record_sites = false, call_time = None, memory = None, batch = None, overhead = None, host_memory_limit = None, compile_bounds = None, grant = None, names = None, gpu = None, magazines = true, per_thread = None))]
#[allow(clippy::too_many_arguments, reason = "Python keyword arguments")]
pub(crate) fn load_chain(
    chain: Vec<Bound<'_, PyAny>>,
    record: Option<PathBuf>,
    record_sites: bool,
    call_time: Option<f64>,
    memory: Option<u64>,
    batch: Option<u32>,
    overhead: Option<u64>,
    host_memory_limit: Option<u64>,
    compile_bounds: Option<Bound<'_, PyDict>>,
    grant: Option<Vec<String>>,
    names: Option<Vec<Option<String>>>,
    gpu: Option<PyRef<'_, crate::stand_in_gpu::StandInGpu>>,
    magazines: bool,
    per_thread: Option<bool>,
) -> PyResult<Policy> {
    let bounds = Bounds {
        call_time,
        memory,
        batch,
        overhead,
        host_memory_limit,
        compile_bounds,
        grant,
        gpu: gpu.map(|g| g.gpu()),
    };
    let builder = chain_builder(chain, bounds, names)?.magazines(magazines);
    let handler = builder
        .clone()
        .build()
        .map_err(|e| LoadError::new_err(e.to_string()))?;
    let per_thread = per_thread.unwrap_or(!handler.keeps_magazines());
    if per_thread && handler.shardable() {
        drop(handler);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let sharded = builder
            .build_sharded(cores)
            .map_err(|e| LoadError::new_err(e.to_string()))?;
        return policy_of(Arc::new(sharded), None, record, record_sites);
    }
    let handler = Arc::new(handler);
    policy_of(handler.clone(), Some(handler), record, record_sites)
}

/// A policy over `handle` (one chain, or one per thread with `per_thread=True`), the
/// bridge asking it directly, recording when asked, and diagnosing when a policy
/// diagnoses its client. `direct` is `handle` when it is one chain: the bridge calls
/// it without the trait object on its fast path.
fn policy_of(
    handle: Arc<dyn PolicyHandler>,
    direct: Option<Arc<Handler>>,
    record: Option<PathBuf>,
    record_sites: bool,
) -> PyResult<Policy> {
    let recorder = match record {
        Some(path) => Some(recorder_to(&path, handle.clone(), record_sites)?),
        None => None,
    };
    let shared: Arc<dyn MemHandler> = match &recorder {
        Some(recorder) => recorder.clone(),
        None => handle.clone(),
    };
    let mut bridge = Bridge::new(shared, direct);
    if let Some(recorder) = &recorder {
        bridge = bridge.recording(recorder.clone());
    }
    if handle.diagnoses() {
        bridge = bridge.diagnosing(handle.clone());
    }
    Ok(Policy {
        handle: Some(handle),
        bridge: Arc::new(bridge),
        recorder,
        capsule: Mutex::new(None),
    })
}
