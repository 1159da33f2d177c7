"""GPU programs' memory placed by sandboxed, checked policies.

Two kinds of memory, each granted to a policy by name:

- `device`: memory on a GPU, for a *device policy* (`allocbox.cuda.load`), which places
  PyTorch's tensors, CuPy's arrays or Numba's device arrays. The host keeps its own
  ledger of every block, never reads or writes GPU memory, and gives a freed block back
  to its policy only once the work queued on its streams before the free has finished.
- `pinned`: host pages registered with the driver, for a NumPy policy
  (`allocbox.load("gpu-pool", {"memory": "pinned"}, grant=["pinned"])`): its arrays
  copy to a GPU at full speed.

    import allocbox.cuda
    pool = allocbox.cuda.load("gpu-pool")                      # device 0
    torch.cuda.memory.change_current_allocator(allocbox.cuda.torch_allocator(pool))
    cupy.cuda.set_allocator(allocbox.cuda.cupy_allocator(pool))
    allocbox.cuda.use_with_numba(pool)                         # before Numba's context
    pinned = allocbox.load("gpu-pool", {"memory": "pinned"}, grant=["pinned"])
    cupy.cuda.set_pinned_memory_allocator(allocbox.cuda.cupy_pinned_allocator(pinned))

A program of its own frees with the streams that may still use a block:
`pool.free(ptr, size, streams=[torch.cuda.current_stream()])`, or
`block = pool.block(size, stream)` that frees itself on `stream` when dropped. A stream
is a stream object of PyTorch, CuPy or Numba, or its `CUstream` handle as an int; a
block keeps its stream object alive until its free has recorded an event on it.

The CUDA driver is loaded when a GPU is first used: on a machine without one every
request is refused, with the reason. `StandInGpu` is a GPU made of host memory, whose
streams finish when told to, for tests on such machines (`gpu=` of `load`).
"""

import contextlib
import ctypes
import inspect

from . import _check_bounds, _shipped_name, _source
from ._allocbox import DeviceBlock, DevicePolicy, StandInGpu
from ._allocbox import load_device_chain as _load_device_chain
from ._allocbox import torch_blocks as _torch_blocks
from ._allocbox import torch_use as _torch_use

__all__ = [
    "DeviceBlock",
    "DevicePolicy",
    "MemoryManager",
    "StandInGpu",
    "cupy_allocator",
    "cupy_pinned_allocator",
    "load",
    "torch_allocator",
    "use_with_numba",
]


def load(source="gpu-pool", config=None, *, device=0, gpu=None, **limits):
    """A device policy serving memory of GPU `device`: a shipped policy by name (by
    default `gpu-pool`), a path or bytes, started with `config`, granted `device` (and
    whatever `grant=` adds). Bounds as for `allocbox.load`. `gpu` is a `StandInGpu` to
    use instead of the CUDA driver. `record` writes a trace at that path as
    `allocbox.load`'s does: every block any client takes and gives back, each event
    with its GPU (`d=`), a free with the stream it waited for (`q=`);
    `finish_recording()` ends it. `hook` (an `allocbox.load_hook(...)`) is told of every
    block as NumPy's event hook is of arrays."""
    _check_bounds(limits, _DEVICE_BOUNDS, "device=, gpu=")
    item = (_source(source), {str(k): str(v) for k, v in config.items()}) if config else _source(source)
    return _load_device_chain(item, device=device, gpu=gpu, names=[_shipped_name(source)], **limits)


# The bounds the bridge's `load_device_chain` takes, read from its own signature.
_DEVICE_BOUNDS = tuple(
    name for name in inspect.signature(_load_device_chain).parameters if name not in ("chain", "device", "names", "gpu")
)


def _memory_error(policy, size):
    """The MemoryError a GPU client gets for a request `policy` did not serve: the
    driver's reason when the GPU's memory was refused as unavailable (no CUDA driver)."""
    try:
        why = policy.stats().get("gpu_unavailable")
    except allocbox.AllocboxError:  # a stopped policy: its failure says why
        why = None
    if why:
        return MemoryError(f"policy `{policy.name}` got no memory of GPU {policy.device}: {why}")
    return MemoryError(f"policy `{policy.name}` has no {size} bytes of memory of GPU {policy.device} left")


# --- CuPy --------------------------------------------------------------------------


def cupy_allocator(policy):
    """A function for `cupy.cuda.set_allocator`: each array's memory comes from `policy`
    and goes back to it, once the work queued on the stream that was current when it
    was made has finished, when CuPy lets go of it."""
    import cupy

    def allocate(size):
        if size == 0:
            return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0, 0, None, device_id=policy.device), 0)
        try:
            # The block keeps the stream alive until its free records an event on it.
            block = policy.block(size, cupy.cuda.get_current_stream())
        except MemoryError:
            raise cupy.cuda.memory.OutOfMemoryError(size, 0, 0) from None
        memory = cupy.cuda.UnownedMemory(block.ptr, size, block, device_id=policy.device)
        return cupy.cuda.MemoryPointer(memory, 0)

    return allocate


class _PinnedBuffer:
    """What CuPy's `PinnedMemoryPointer` holds: a NumPy array's bytes, placed by a host
    policy of pinned memory, freed by it when CuPy lets go."""

    __slots__ = ("array", "ptr", "size")

    def __init__(self, array):
        self.array = array
        self.ptr = array.ctypes.data
        self.size = array.nbytes


def cupy_pinned_allocator(policy):
    """A function for `cupy.cuda.set_pinned_memory_allocator`: the host buffers CuPy
    stages copies in come from `policy`, a NumPy policy of pinned memory (e.g.
    `allocbox.load("gpu-pool", {"memory": "pinned"}, grant=["pinned"])`)."""
    import cupy
    import numpy as np

    from . import use

    def allocate(size):
        with use(policy):
            array = np.empty(max(size, 1), dtype=np.uint8)
        return cupy.cuda.PinnedMemoryPointer(_PinnedBuffer(array), 0)

    return allocate


# --- PyTorch -----------------------------------------------------------------------


def _extension_path():
    from . import _allocbox

    return _allocbox.__file__


def torch_allocator(policy):
    """The allocator to pass to `torch.cuda.memory.change_current_allocator` (before
    PyTorch starts CUDA): `policy` places the tensors of its device. PyTorch's free says
    the size, checked against the host's ledger; `record_stream` is honoured: a block
    goes back to the policy once the work of every stream it was used on has finished.
    PyTorch's memory statistics (`torch.cuda.memory_stats`) are not kept by a pluggable
    allocator: `policy.stats()` has them."""
    import torch

    _torch_use(policy)
    path = _extension_path()
    allocator = torch.cuda.memory.CUDAPluggableAllocator(path, "allocbox_torch_malloc", "allocbox_torch_free")
    record_stream = ctypes.cast(ctypes.CDLL(path).allocbox_torch_record_stream, ctypes.c_void_p).value
    allocator.allocator().set_record_stream_fn(record_stream)
    return allocator


def torch_blocks():
    """The blocks PyTorch holds from allocbox now: `[(address, [streams])]`."""
    return _torch_blocks()


# --- Numba -------------------------------------------------------------------------

_numba_policy = None


def _manager_class():
    from numba import cuda
    from numba.cuda.cudadrv.driver import AutoFreePointer

    class MemoryManager(cuda.GetIpcHandleMixin, cuda.HostOnlyCUDAMemoryManager):
        """Numba's External Memory Management plugin: device arrays are placed by the
        policy given to `use_with_numba`; host allocations and pinning stay Numba's."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.policy = _numba_policy

        def initialize(self):
            super().initialize()

        def memalloc(self, size):
            import weakref

            if self.policy is None:
                raise RuntimeError(
                    "allocbox's Numba memory manager has no policy: call allocbox.cuda.use_with_numba(policy) first"
                )
            # Numba does not say the stream: the default one, which waits for every
            # blocking stream's work (Numba's streams are blocking).
            block = self.policy.block(size, 0)
            allocations = self.allocations

            def release(addr=block.ptr):
                allocations.pop(addr, None)
                block.free()

            memory = AutoFreePointer(weakref.proxy(self.context), ctypes.c_void_p(block.ptr), size, finalizer=release)
            # As Numba's own manager does: the manager keeps the pointer and lends an
            # owned reference, so the block is freed when the array and every view of
            # it are gone (not when the first view goes), or at `reset`.
            allocations[block.ptr] = memory
            return memory.own()

        def get_memory_info(self):
            free, total = self.policy.device_memory()
            stats = self.policy.stats()
            cached = stats.get("mapped_bytes", 0) - stats["live_bytes"]
            return cuda.MemoryInfo(free=free + max(cached, 0), total=total)

        def reset(self):
            super().reset()
            self.policy.synchronize()
            self.policy.trim()

        @contextlib.contextmanager
        def defer_cleanup(self):
            self.policy.defer_begin()
            try:
                with super().defer_cleanup():
                    yield
            finally:
                self.policy.defer_end()

        @property
        def interface_version(self):
            return 1

    return MemoryManager


def use_with_numba(policy):
    """Make `policy` place Numba's device arrays (`cuda.device_array`, `to_device`, ...)
    through Numba's External Memory Management plugin interface. Call it before Numba
    creates its CUDA context (before the first device array or kernel)."""
    global _numba_policy
    from numba import cuda

    _numba_policy = policy
    cuda.set_memory_manager(_manager_class())


def __getattr__(name):
    # `NUMBA_CUDA_MEMORY_MANAGER=allocbox.cuda` asks this module for its plugin: the
    # shipped `gpu-pool` on device 0 unless `use_with_numba` chose a policy.
    if name == "_numba_memory_manager":
        global _numba_policy
        if _numba_policy is None:
            _numba_policy = load()
        return _manager_class()
    if name == "MemoryManager":
        return _manager_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
