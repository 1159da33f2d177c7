//! The C functions PyTorch's `CUDAPluggableAllocator` calls (`allocbox_torch_malloc`,
//! `allocbox_torch_free`, `allocbox_torch_record_stream`), each block placed by the
//! device policy `torch_use` named for its device.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex};

use super::device::Device;
use allocbox::gpu::Stream;
use pyo3::prelude::*;
use pyo3::types::PyList;

use super::device::DevicePolicy;

/// PyTorch's allocator: the policy of each device, and every block it lent with the
/// streams that may use it (the one it was made for, and those `record_stream` added).
#[derive(Default)]
struct Torch {
    policies: HashMap<c_int, Arc<Device>>,
    blocks: HashMap<u64, (Arc<Device>, Vec<Stream>)>,
}

/// Read and changed only under its lock: PyTorch calls its allocator from any thread,
/// with or without the GIL.
static TORCH: Mutex<Option<Torch>> = Mutex::new(None);

fn torch() -> std::sync::MutexGuard<'static, Option<Torch>> {
    TORCH.lock().unwrap_or_else(|e| e.into_inner())
}

/// Make `policy` the one PyTorch's allocator places tensors of its device with.
#[pyfunction]
pub(crate) fn torch_use(policy: PyRef<'_, DevicePolicy>) {
    let device = c_int::try_from(policy.handler.device()).unwrap_or(c_int::MAX);
    torch()
        .get_or_insert_with(Torch::default)
        .policies
        .insert(device, policy.handler.clone());
}

/// Blocks PyTorch holds now, `(address, streams)`, for tests.
#[pyfunction]
pub(crate) fn torch_blocks(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let mut blocks: Vec<(u64, Vec<Stream>)> = torch()
        .as_ref()
        .map(|t| {
            t.blocks
                .iter()
                .map(|(&addr, (_, streams))| (addr, streams.clone()))
                .collect()
        })
        .unwrap_or_default();
    blocks.sort();
    PyList::new(py, blocks)
}

/// `CUDAPluggableAllocator`'s alloc: `size` bytes on `device` for work on `stream`.
/// Null when out of memory or when no policy serves the device: PyTorch's pluggable
/// path takes no error.
///
/// # Safety
///
/// Called by PyTorch with its own arguments; nothing is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn allocbox_torch_malloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let Some(handler) = torch()
        .as_ref()
        .and_then(|t| t.policies.get(&device).cloned())
    else {
        return std::ptr::null_mut();
    };
    if size == 0 {
        // PyTorch never frees a null block: nothing to lend.
        return std::ptr::null_mut();
    }
    // The policy runs without PyTorch's lock of ours held: a free from another thread
    // meanwhile only waits for the map.
    match handler.malloc(size as u64) {
        Ok(Some(addr)) => {
            torch()
                .get_or_insert_with(Torch::default)
                .blocks
                .insert(addr, (handler, vec![stream as Stream]));
            addr as *mut c_void
        }
        // The failure, if any, is the policy's: its stats and `failure` say it.
        Ok(None) | Err(_) => std::ptr::null_mut(),
    }
}

/// `CUDAPluggableAllocator`'s free: PyTorch says the size and the stream the block was
/// made for; it goes back to its maker once that stream's work, and the work of every
/// stream `record_stream` named, has finished. The size is checked against the ledger.
///
/// # Safety
///
/// Called by PyTorch with its own arguments; nothing is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn allocbox_torch_free(
    ptr: *mut c_void,
    size: usize,
    _device: c_int,
    stream: *mut c_void,
) {
    let Some((handler, mut streams)) = torch()
        .as_mut()
        .and_then(|t| t.blocks.remove(&(ptr as u64)))
    else {
        return;
    };
    if !streams.contains(&(stream as Stream)) {
        streams.push(stream as Stream);
    }
    // A client error (a wrong size is corrected, not an error) is the policy's record.
    let _ = handler.free(ptr as u64, Some(size as u64), &streams);
}

/// `record_stream`: the block at `ptr` is used on `stream` too; its free waits for it.
///
/// # Safety
///
/// Called by PyTorch with its own arguments; nothing is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn allocbox_torch_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    if let Some(torch) = torch().as_mut()
        && let Some((_, streams)) = torch.blocks.get_mut(&(ptr as u64))
        && !streams.contains(&(stream as Stream))
    {
        streams.push(stream as Stream);
    }
}
