"""allocbox.cuda on the stand-in GPU (host memory the host treats as a GPU's, whose
streams finish when told to): device policies, stream-ordered frees, and the three
clients' shims — PyTorch's C entry points through ctypes, CuPy's allocator against a
stand-in `cupy` module, Numba's EMM plugin against a stand-in context."""

import ctypes
import gc
import sys

import numpy as np
import pytest

import allocbox
import allocbox.cuda
from allocbox.cuda import StandInGpu
from conftest import guest


@pytest.fixture
def gpu():
    return StandInGpu()


@pytest.fixture
def pool(gpu):
    return allocbox.cuda.load("gpu-pool", gpu=gpu)


def test_a_device_policy_places_blocks_in_its_gpus_memory_and_gives_them_back(gpu, pool):
    blocks = [(pool.malloc(size), size) for size in (1, 1000, 1 << 20, 9 << 20)]
    assert all(ptr % 256 == 0 for ptr, _ in blocks)
    assert gpu.allocated() >= (64 << 20) + (9 << 20)
    assert pool.name == "gpu-pool" and pool.device == 0
    for ptr, size in blocks:
        pool.free(ptr, size)
    pool.trim()
    pool.leak_check()
    stats = pool.stats()
    assert (stats["mallocs"], stats["frees"], stats["live_blocks"]) == (4, 4, 0)
    del pool
    gc.collect()
    assert gpu.allocated() == 0


def test_a_block_freed_on_a_busy_stream_goes_back_only_once_the_stream_finishes(gpu, pool):
    ptr = pool.malloc(1 << 20)
    gpu.queue(stream=5)
    pool.free(ptr, 1 << 20, streams=[5])
    assert pool.stats()["pending_frees"] == 1
    other = pool.malloc(1 << 20)
    assert other != ptr
    assert pool.stats()["pending_frees"] == 1
    gpu.finish(stream=5)
    pool.free(other, 1 << 20)
    assert pool.stats()["pending_frees"] == 0
    pool.leak_check()


class _TorchStream:
    """A stream as PyTorch's `torch.cuda.Stream` names its driver handle."""

    def __init__(self, handle):
        self.cuda_stream = handle


class _NumbaStream:
    """A stream as Numba's names it: a ctypes pointer, None for the default stream."""

    def __init__(self, handle):
        self.handle = ctypes.c_void_p(handle)


def test_a_block_keeps_its_stream_object_alive_until_its_free_has_waited_on_it(gpu, pool):
    import weakref

    stream = _TorchStream(6)
    alive = weakref.ref(stream)
    block = pool.block(1 << 20, stream)
    del stream
    gc.collect()
    assert alive() is not None and block.stream == 6
    gpu.queue(stream=6)
    block.free()
    # The event is on the stream: the object may go, and the block waits for the work.
    gc.collect()
    assert alive() is None
    assert pool.stats()["pending_frees"] == 1
    gpu.finish(stream=6)
    pool.synchronize()
    assert pool.stats()["pending_frees"] == 0


def test_free_takes_the_streams_of_pytorch_cupy_and_numba_and_refuses_anything_else(gpu, pool):
    import types

    streams = [_TorchStream(7), types.SimpleNamespace(ptr=8), _NumbaStream(9), _NumbaStream(None), 10]
    ptr = pool.malloc(1000)
    gpu.queue(stream=9)
    pool.free(ptr, 1000, streams=streams)
    assert pool.stats()["pending_frees"] == 1
    gpu.finish(stream=9)
    pool.synchronize()
    assert pool.stats()["pending_frees"] == 0
    ptr = pool.malloc(1000)
    with pytest.raises(TypeError, match="a `str` is none of them"):
        pool.free(ptr, 1000, streams=["default"])
    with pytest.raises(TypeError, match="is none of them"):
        pool.block(100, object())
    # Issue 72: a stream whose `cuda_stream` is 1.5 was taken as stream 1.
    with pytest.raises(TypeError, match="a `_TorchStream` is none of them"):
        pool.free(ptr, 1000, streams=[_TorchStream(1.5)])
    pool.free(ptr, 1000)
    pool.leak_check()


def test_a_second_free_and_a_free_of_an_unknown_block_are_client_errors(gpu, pool):
    ptr = pool.malloc(100)
    gpu.queue(stream=1)
    pool.free(ptr, 100, streams=[1])
    with pytest.raises(allocbox.ClientError, match="double free"):
        pool.free(ptr, 100, streams=[1])
    with pytest.raises(allocbox.ClientError, match="never lent"):
        pool.free(ptr + (1 << 24), 100)
    gpu.finish(stream=1)


def test_device_memory_without_a_gpu_driver_is_refused_with_the_reason():
    # On a machine without a driver (CI), the policy is refused `unavailable` and the
    # request is a MemoryError naming the policy; with one, it is served.
    pool = allocbox.cuda.load("gpu-pool")
    try:
        ptr = pool.malloc(1000)
    except MemoryError as e:
        # Issue 64: it said "has no 1000 bytes of memory of GPU 0 left" with no GPU at all.
        assert "gpu-pool" in str(e) and "GPU 0" in str(e)
        assert "CUDA driver" in str(e) and "left" not in str(e), str(e)
        assert pool.stats()["counters"]["refused"] >= 1
        assert "CUDA driver" in pool.stats()["gpu_unavailable"]
    else:
        pool.free(ptr, 1000)


def test_a_numpy_array_a_pinned_policy_cannot_place_without_a_driver_names_the_policy_and_why():
    # Issue 64: NumPy's bare "MemoryError: Unable to allocate 781. KiB" named neither.
    policy = allocbox.load("gpu-pool", {"memory": "pinned"}, grant=["pinned"])
    try:
        with allocbox.use(policy):
            a = np.ones(100_000)
    except MemoryError as error:
        notes = getattr(error, "__notes__", [])
        assert any(
            "policy `gpu-pool` was refused the GPU memory it asked for" in note and "CUDA driver" in note
            for note in notes
        ), notes
    else:  # a machine with a driver serves it
        assert a.sum() == 100_000


@pytest.mark.parametrize("abuse", ["unmap-wrong-size", "unmap-twice", "unmap-unmapped"])
def test_a_device_policy_that_unmaps_wrongly_in_a_free_is_stopped_and_named(gpu, abuse):
    # Issue 64: such a policy's client got a ContractViolation while `failure` stayed
    # None and it went on serving.
    probe = allocbox.cuda.load(guest("kinds-probe"), {"kind": "device", "abuse": abuse}, gpu=gpu)
    ptr = probe.malloc(4096)
    with pytest.raises(allocbox.ContractViolation, match=r"^\[(wrong-size|unknown)-free\] policy `kinds-probe`"):
        probe.free(ptr, 4096)
    assert probe.failure is not None and "kinds-probe" in probe.failure
    with pytest.raises(allocbox.PoisonedPolicy):
        probe.malloc(4096)


def test_a_device_policy_s_bounds_are_checked_as_load_checks_them(gpu):
    # Issue 65: `allocbox.cuda.load` skipped `load`'s check of its keywords.
    with pytest.raises(TypeError, match="'memry' is not a bound allocbox knows; the bounds are .*memory"):
        allocbox.cuda.load("gpu-pool", gpu=gpu, memry=1 << 20)
    assert allocbox.cuda.load("gpu-pool", gpu=gpu, memory=64 << 20).name == "gpu-pool"


def test_a_device_policy_is_never_numpys_handler(pool):
    with pytest.raises(TypeError):
        allocbox.set_handler(pool)


def test_pinned_numpy_arrays_come_from_registered_host_memory(gpu):
    policy = allocbox.load("gpu-pool", {"memory": "pinned"}, grant=["pinned"], gpu=gpu)
    with allocbox.use(policy):
        a = np.arange(1 << 20, dtype=np.float64)
        z = np.zeros(1000)
    assert allocbox.handler_name(a) == "gpu-pool"
    assert gpu.registered() >= 64 << 20
    assert a[-1] == (1 << 20) - 1 and not z.any()
    counters = policy.stats()["counters"]
    assert counters["regions"] >= 1 and counters["refused"] == 0


# --- PyTorch's entry points, called as PyTorch calls them ----------------------------


def test_pytorchs_entry_points_place_free_and_wait_for_recorded_streams(gpu, pool):
    lib = ctypes.CDLL(allocbox._allocbox.__file__)
    malloc = lib.allocbox_torch_malloc
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free = lib.allocbox_torch_free
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    record = lib.allocbox_torch_record_stream
    record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]

    # No policy for device 3: null, as PyTorch's pluggable path expects for a failure.
    assert malloc(1000, 3, None) is None
    allocbox.cuda._torch_use(pool)
    ptr = malloc(1 << 20, 0, 7)
    assert ptr and ptr % 256 == 0
    assert allocbox.cuda.torch_blocks() == [(ptr, [7])]
    record(ptr, 9)
    assert allocbox.cuda.torch_blocks() == [(ptr, [7, 9])]
    gpu.queue(stream=9)
    # PyTorch says a wrong size: corrected from the ledger and counted, never passed on.
    free(ptr, 12, 0, 7)
    assert allocbox.cuda.torch_blocks() == []
    stats = pool.stats()
    assert stats["pending_frees"] == 1
    gpu.finish(stream=9)
    pool.trim()
    stats = pool.stats()
    assert (stats["pending_frees"], stats["live_blocks"], stats["size_corrections"]) == (0, 0, 1)
    # A pointer PyTorch never got from here is ignored, not freed.
    free(12345, 10, 0, None)
    assert malloc(0, 0, None) is None


# --- CuPy's allocator, against a stand-in `cupy` --------------------------------------


@pytest.fixture
def fake_cupy(monkeypatch):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent / "stand_in_cupy.py"
    spec = importlib.util.spec_from_file_location("cupy", path)
    cupy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cupy)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cupy


def test_cupys_arrays_free_on_the_stream_they_were_made_on_when_cupy_lets_go(gpu, pool, fake_cupy):
    allocate = allocbox.cuda.cupy_allocator(pool)
    pointer = allocate(4096)
    assert pointer.ptr % 256 == 0 and pointer.mem.device_id == 0
    assert allocate(0).ptr == 0
    gpu.queue(stream=4)
    del pointer
    gc.collect()
    assert pool.stats()["pending_frees"] == 1
    gpu.finish(stream=4)
    pool.trim()
    assert pool.stats()["live_blocks"] == 0
    small = allocbox.cuda.load("gpu-pool", gpu=StandInGpu(memory=1 << 20))
    with pytest.raises(fake_cupy.cuda.memory.OutOfMemoryError):
        allocbox.cuda.cupy_allocator(small)(1 << 30)


def test_cupys_pinned_staging_buffers_come_from_a_pinned_numpy_policy(gpu, fake_cupy):
    policy = allocbox.load("gpu-pool", {"memory": "pinned"}, grant=["pinned"], gpu=gpu)
    allocate = allocbox.cuda.cupy_pinned_allocator(policy)
    pointer = allocate(10_000)
    assert pointer.mem.size == 10_000 and gpu.registered() >= 10_000
    assert policy.stats()["live_blocks"] == 1
    del pointer
    gc.collect()
    assert policy.stats()["live_blocks"] == 0


# --- Numba's EMM plugin, against a stand-in context -----------------------------------


def test_numbas_memory_manager_places_device_arrays_and_reports_memory(gpu, pool):
    from numba import cuda

    class Context:
        pass

    allocbox.cuda._numba_policy = pool
    try:
        manager_class = allocbox.cuda._manager_class()
        assert manager_class(context=None).interface_version == 1
        context = Context()
        manager = manager_class(context=context)
        manager.initialize()
        pointer = manager.memalloc(1 << 20)
        assert pointer.device_pointer_value % 256 == 0
        assert pool.stats()["live_blocks"] == 1
        # A view that dies before its array leaves the array's block alone (Numba's
        # `copy_to_host` of a broadcast array makes one: freed early, it was reused).
        view = pointer.view(256)
        del view
        gc.collect()
        assert pool.stats()["live_blocks"] == 1
        info = manager.get_memory_info()
        assert isinstance(info, cuda.MemoryInfo) and info.total == 1 << 30
        with manager.defer_cleanup():
            pointer.free()
            assert pool.stats()["pending_frees"] == 1
        manager.reset()
        stats = pool.stats()
        assert (stats["pending_frees"], stats["live_blocks"]) == (0, 0)
    finally:
        allocbox.cuda._numba_policy = None


def test_a_device_policy_reports_its_policies_and_live_blocks_as_a_numpy_policy_does(gpu, pool):
    # Issue 65: every handler answers the same questions; a device policy had no
    # `link_stats()` or `snapshot()`.
    ptr = pool.malloc(4096)
    gpu.queue(stream=3)
    pool.free(pool.malloc(100), 100, streams=[3])
    assert [size for _, size in pool.snapshot()] == [4096, 100], "a waiting free is still live"
    [top] = pool.link_stats()
    assert top["name"] == "gpu-pool" and top["live_blocks"] >= 2 and top["failure"] is None
    assert top["mapped_regions"] >= 1
    gpu.finish(stream=3)
    pool.free(ptr, 4096)
    assert pool.snapshot() == []
    pool.leak_check()


def test_a_device_policy_records_its_blocks_with_their_gpu_and_stream_as_load_records(tmp_path, gpu):
    # Issue 65: device blocks were in no trace. Every client's block is recorded: the
    # policy's own malloc and free, and a block that frees itself on its stream.
    from conftest import trace_text

    path = tmp_path / "gpu.trace"
    pool = allocbox.cuda.load("gpu-pool", gpu=gpu, record=str(path))
    ptr = pool.malloc(4096)
    block = pool.block(1 << 20, stream=5)
    pool.free(ptr, 4096)
    block.free()
    gpu.finish(stream=5)
    pool.finish_recording()
    events = [line.split() for line in trace_text(path).splitlines() if not line.startswith("#")]
    assert [(e[0], e[2]) for e in events] == [("m", "4096"), ("m", "1048576"), ("f", "4096"), ("f", "1048576")]
    assert all("d=0" in e for e in events), events
    assert "q=5" in events[3] and not any(w.startswith("q=") for w in events[2]), events
    pool.leak_check()


def test_a_device_policy_tells_its_event_hook_of_every_block(gpu):
    # Issue 65: a device policy's blocks reached no event hook.
    sizes = allocbox.load_hook("sizes")
    pool = allocbox.cuda.load("gpu-pool", gpu=gpu, hook=sizes)
    ptrs = [pool.malloc(size) for size in (100, 5000, 5000)]
    for ptr, size in zip(ptrs, (100, 5000, 5000)):
        pool.free(ptr, size)
    # `sizes` counts requests in [2^k, 2^(k+1)): one of [64, 128), two of [4096, 8192).
    counts = sizes.report()
    assert sum(counts) == 3 and counts[6] == 1 and counts[12] == 2, counts
    assert sizes.failure is None


def _allocbox(*args, cwd):
    import subprocess

    return subprocess.run([sys.executable, "-m", "allocbox", *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_a_pytorch_memory_snapshot_replays_under_device_policies(tmp_path):
    # Issue 62: the snapshot a user who hit a CUDA out-of-memory error has, in the shape
    # `torch.cuda.memory._snapshot()` gives (no GPU here to make a real one).
    import pickle

    def entry(action, addr, size, time_us, stream=0):
        frames = [
            {"filename": "/venv/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
            {"filename": "/job/train.py", "line": 42, "name": "step"},
        ]
        return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": time_us, "frames": frames}

    trace = [entry("segment_alloc", 0x7F0000000000, 20 << 20, 0)]
    for i in range(64):
        trace.append(entry("alloc", 0x7F0000000000 + i * (1 << 20), 256 << 10, 10 + i))
        if i % 2:
            trace.append(entry("free_requested", 0x7F0000000000 + i * (1 << 20), 256 << 10, 11 + i, stream=3))
            trace.append(entry("free_completed", 0x7F0000000000 + i * (1 << 20), 256 << 10, 12 + i, stream=3))
    with open(tmp_path / "snapshot.pickle", "wb") as f:
        pickle.dump({"segments": [], "device_traces": [trace]}, f)
    done = _allocbox("report", "snapshot.pickle", "-p", "default", "-o", "r.html", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "snapshot.pickle, GPU 0:" in done.stdout, done.stdout
    assert "`gpu-pool` fit" in done.stdout, done.stdout
    assert "/job/train.py:42" in (tmp_path / "r.html").read_text(), "the program's line behind the tensors"
    done = _allocbox("trace-convert", "snapshot.pickle", "snap.txt", "--to", "text", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "snap.txt").read_text()
    assert "m 1 262144 1 s=1 t=0 d=0" in text and " q=3" in text, text[:500]


class _Pwned:
    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    import pickle

    with open(tmp_path / "evil.pickle", "wb") as f:
        pickle.dump({"device_traces": [[_Pwned()]]}, f)
    done = _allocbox("report", "evil.pickle", "-p", "default", "-o", "r.html", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "names code to run" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "pwned").exists(), "nothing of the pickle ran"
