//! `allocbox._allocbox`: makes an allocbox handler NumPy's data-memory handler.
//!
//! NumPy's handler API (`PyDataMem_SetHandler`, slot 304 of the `_ARRAY_API` table, and
//! `PyDataMem_GetHandler`, slot 305) takes a capsule named `mem_handler` holding a
//! `PyDataMem_Handler`. Ours holds C callbacks whose context is a Rust handler; NumPy
//! calls them with or without the GIL and from several threads at once, so they never
//! touch the Python C-API: the handler is `Send + Sync` on its own.
//!
//! Where each part lives: `numpy_api` (NumPy's handler ABI: the capsule, set and get
//! handler), `bridge` (the C callbacks over a Rust handler), `policy` (`allocbox.Policy`
//! and its statistics), `loading` (`load_chain` and its inputs), `hooks` (event hooks),
//! `errors` (the exceptions), `diagnosis` (allocation sites and misuse warnings),
//! `sites` (the program's line behind an allocation, for traces), `nrt_lending` (what a
//! bridge lends to Numba's runtime through), `numba` (Numba's arrays through the same bridges: `route`, and `blocks`, which bridge
//! a block of Numba's goes back to),
//! `cuda` (device handlers for GPU programs), `stand_in_gpu` (a GPU made of host
//! memory). Each uses only those after it here (`tests/layers.rs`):
//!
//! Module order: `cuda` > `hooks` > `loading` > `numba` > `policy` > `numpy_api` > `bridge` > `diagnosis` > `nrt_lending` > `sites` > `errors` > `stand_in_gpu`

mod bridge;
mod cuda;
mod diagnosis;
mod errors;
mod hooks;
mod loading;
mod nrt_lending;
mod numba;
mod numpy_api;
mod policy;
mod sites;
mod stand_in_gpu;

use pyo3::prelude::*;

use errors::{AllocboxError, ClientError, ContractViolation, LoadError, PoisonedPolicy};
use hooks::{EventHook, load_hook, set_event_hook, shipped_hooks};
use loading::load_chain;
use numpy_api::get_handler;
use policy::{Policy, native_default, set_handler};

/// Run the `allocbox` command line (`argv[0]` the program's name) in this process and
/// return its exit status. Python's own signal handlers run only between bytecodes, so
/// the caller restores the default SIGINT first, for Ctrl-C to stop a long check.
#[pyfunction]
fn run_command(py: Python<'_>, argv: Vec<std::ffi::OsString>) -> u8 {
    py.detach(|| allocbox_cli::run(argv))
}

/// `allocbox run`'s arguments (what follows `run`), parsed by the command line's own
/// grammar: a dict of the chain, grants, recording, report and program, or, when clap
/// printed help or an error, the exit status to end with (0 for help, 2 otherwise).
#[pyfunction]
fn run_arguments(py: Python<'_>, argv: Vec<std::ffi::OsString>) -> PyResult<Py<PyAny>> {
    use pyo3::types::PyDict;
    let run = match allocbox_cli::parse_run(argv) {
        Ok(run) => run,
        Err(code) => return Ok(code.into_pyobject(py)?.into_any().unbind()),
    };
    let d = PyDict::new(py);
    let chain: Vec<(String, Vec<(String, String)>)> = run.chain;
    d.set_item("chain", chain)?;
    d.set_item("grant", run.grants)?;
    d.set_item("record", run.record)?;
    d.set_item("sites", run.sites)?;
    d.set_item("no_sites", run.no_sites)?;
    d.set_item("report", run.report)?;
    d.set_item("compare", run.compare)?;
    d.set_item("device", run.device)?;
    let program = match run.program {
        allocbox_cli::Program::Script(path) => ("script", path.into_os_string()),
        allocbox_cli::Program::Module(name) => ("module", name),
    };
    d.set_item("program", program)?;
    d.set_item("args", run.args)?;
    Ok(d.into_any().unbind())
}

/// The trace a child process `pid` records into beside its parent's `trace`
/// (`trace.PID`, or `trace.PID.gz` for `trace.gz`): where a forked child's recording goes,
/// and where `allocbox run`'s other children write theirs.
#[pyfunction]
fn child_trace_path(trace: std::path::PathBuf, pid: u32) -> std::path::PathBuf {
    allocbox::trace::child_path(&trace, pid)
}

/// Raise `AllocboxError` if `path` cannot be a recording's output (a folder, a device, a
/// link, a read-only file, a folder that does not exist, a file this process reads): what `load(..., record=PATH)`
/// would say, said before any work starts, creating nothing.
#[pyfunction]
fn check_output(path: std::path::PathBuf) -> PyResult<()> {
    allocbox::output::check(&path)
        .map(drop)
        .map_err(|error| AllocboxError::new_err(error.to_string()))
}

// The wheel is built for the stable ABI (abi3, CPython 3.11 and later), which
// free-threaded CPython cannot load. A build from source for one is untested there
// (event hooks call into Python from inside NumPy's allocation callbacks), so the
// module says it uses the GIL, and a free-threaded interpreter turns the GIL back on
// when it imports the module, with a warning, rather than run it untested. What is
// left before it can say otherwise: README.md, "Free-threaded CPython".
#[pymodule(gil_used = true)]
fn _allocbox(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Policy>()?;
    m.add_function(wrap_pyfunction!(load_chain, m)?)?;
    m.add_function(wrap_pyfunction!(set_handler, m)?)?;
    m.add_function(wrap_pyfunction!(get_handler, m)?)?;
    m.add_function(wrap_pyfunction!(native_default, m)?)?;
    m.add_function(wrap_pyfunction!(run_command, m)?)?;
    m.add_function(wrap_pyfunction!(child_trace_path, m)?)?;
    m.add_function(wrap_pyfunction!(check_output, m)?)?;
    m.add_function(wrap_pyfunction!(run_arguments, m)?)?;
    m.add_function(wrap_pyfunction!(numba::route::numba_route, m)?)?;
    m.add_function(wrap_pyfunction!(numba::blocks::numba_threads_use, m)?)?;
    m.add_function(wrap_pyfunction!(numba::blocks::numba_threads_done, m)?)?;
    m.add_function(wrap_pyfunction!(numba::blocks::numba_process_wide_use, m)?)?;
    m.add_function(wrap_pyfunction!(numba::blocks::numba_route_hold, m)?)?;
    m.add_function(wrap_pyfunction!(numba::blocks::numba_route_holds, m)?)?;
    m.add_function(wrap_pyfunction!(numba::route::numba_maker, m)?)?;
    m.add_function(wrap_pyfunction!(numba::route::numba_statistics, m)?)?;
    m.add_class::<EventHook>()?;
    m.add_class::<stand_in_gpu::StandInGpu>()?;
    m.add_class::<cuda::device::DevicePolicy>()?;
    m.add_class::<cuda::device::DeviceBlock>()?;
    m.add_function(wrap_pyfunction!(cuda::device::load_device_chain, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::torch::torch_use, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::torch::torch_blocks, m)?)?;
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
