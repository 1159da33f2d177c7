"""A device policy for a GPU program that was not written for one (`allocbox run
--device-policy`): installed for PyTorch, CuPy and Numba's CUDA target as each is
imported, before it starts CUDA, so the program runs unedited.

Each library's own switch is used (`torch.cuda.memory.change_current_allocator`,
`cupy.cuda.set_allocator`, Numba's External Memory Management plugin), right after the
library's import has run. A program that then sets an allocator of its own keeps it:
the switch is wrapped so that a line says so, once. Without a GPU (no CUDA driver, no
such device) one line says so and nothing is installed: the libraries keep their own
allocators.
"""

import os
import sys

from _allocbox_hooks import AfterImport

# Set to `stand-in` to run device policies on a stand-in GPU of host memory (what the
# tests run on: no CUDA driver is needed, and no library's memory is really a GPU's).
GPU_VARIABLE = "ALLOCBOX_GPU"

# The hooks armed by `install`, kept so that they stay on `sys.meta_path` until used.
_armed = []


def load(source, config, grant, recording):
    """The device policy `source` with `config`, recording into `recording` (a host
    policy that records, or None); None, after one line on standard error, when there
    is no GPU to place memory on. Raises `ValueError` or `AllocboxError` for a policy
    that will not load."""
    import allocbox
    import allocbox.cuda

    gpu = allocbox.cuda.StandInGpu() if os.environ.get(GPU_VARIABLE) == "stand-in" else None
    policy = allocbox.cuda.load(source, config or None, gpu=gpu, grant=grant, record=recording)
    try:
        policy.device_memory()
    except allocbox.AllocboxError as why:
        _say(
            f"allocbox: no GPU for device policy `{policy.name}` ({why}): PyTorch, CuPy and "
            "Numba keep their own allocators"
        )
        return None
    return policy


def install(policy):
    """Place the GPU memory of PyTorch, CuPy and Numba's CUDA target by `policy`, each
    once the program imports it (at once for one already imported)."""
    for name, place in (("torch", _torch), ("cupy", _cupy), ("numba.cuda", _numba)):
        if name in sys.modules:
            place(policy)
            continue
        hook = AfterImport(name, lambda place=place: place(policy))
        _armed.append(hook)
        hook.arm()


def _say(line):
    try:
        print(line, file=sys.stderr)
    except (OSError, ValueError):
        pass


def _keeps_its_own(owner, attribute, library, policy):
    """Wrap `owner.attribute`, the library's switch of allocator, so that a program
    that calls it says, once, that it keeps its own allocator."""
    switch = getattr(owner, attribute)
    said = []

    def switched(*args, **kwargs):
        if not said:
            said.append(True)
            _say(
                f"allocbox: the program sets {library}'s allocator itself: it keeps its own, and "
                f"device policy `{policy.name}` places none of {library}'s memory"
            )
        return switch(*args, **kwargs)

    setattr(owner, attribute, switched)


def _cupy(policy):
    import cupy

    import allocbox.cuda

    cupy.cuda.set_allocator(allocbox.cuda.cupy_allocator(policy))
    _keeps_its_own(cupy.cuda, "set_allocator", "CuPy", policy)


def _torch(policy):
    import torch

    import allocbox.cuda

    torch.cuda.memory.change_current_allocator(allocbox.cuda.torch_allocator(policy))
    _keeps_its_own(torch.cuda.memory, "change_current_allocator", "PyTorch", policy)


def _numba(policy):
    from numba import cuda

    import allocbox.cuda

    allocbox.cuda.use_with_numba(policy)
    _keeps_its_own(cuda, "set_memory_manager", "Numba", policy)
