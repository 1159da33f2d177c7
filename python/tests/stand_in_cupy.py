"""A stand-in for CuPy, as much of it as allocbox's CuPy shims use: memory pointers,
the current stream, the allocator switches, and an allocation through the allocator
set. Loaded as `cupy` by `test_cuda.py`'s fixture, and copied beside programs that
`test_run.py` runs unedited."""

import types


class UnownedMemory:
    def __init__(self, ptr, size, owner, device_id=-1):
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id


class MemoryPointer:
    def __init__(self, mem, offset):
        self.mem, self.ptr = mem, mem.ptr + offset


class PinnedMemoryPointer:
    def __init__(self, mem, offset):
        self.mem, self.ptr = mem, mem.ptr + offset


class OutOfMemoryError(MemoryError):
    pass


_allocator = []
_current = types.SimpleNamespace(ptr=4)


def set_allocator(allocator=None):
    _allocator[:] = [allocator]


def alloc(size):
    """An allocation of `size` bytes through the allocator set, as CuPy makes one."""
    return _allocator[0](size)


cuda = types.SimpleNamespace(
    UnownedMemory=UnownedMemory,
    MemoryPointer=MemoryPointer,
    PinnedMemoryPointer=PinnedMemoryPointer,
    set_allocator=set_allocator,
    alloc=alloc,
    get_current_stream=lambda: _current,
    memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
)
