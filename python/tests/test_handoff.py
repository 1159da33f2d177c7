"""Zero-copy hand-offs of allocbox arrays (DLPack, the buffer protocol, an argument to
a Numba function that returns a view of it) keep their blocks alive until the last
consumer lets go, past a change and a stop of the policy that made them, and the block
is freed once, by its maker."""

import gc

import numpy as np
import pytest

import allocbox
from conftest import guest


@pytest.fixture
def size_classes():
    return allocbox.load("size-classes")


def test_dlpack_and_buffer_consumers_keep_a_block_past_a_change_and_a_stop_of_its_policy():
    policy = allocbox.load(guest("broken"), {"fault": "trap-realloc"})
    with allocbox.use(policy):
        a = np.arange(4096, dtype=np.int64)
    through_dlpack = np.from_dlpack(a)
    through_buffer = np.frombuffer(memoryview(a), dtype=np.int64)
    view = memoryview(a)
    del a
    with allocbox.use(allocbox.load("system")):
        np.ones(10)
    with allocbox.use(policy):
        doomed = np.ones(10_000)
        with pytest.raises(MemoryError):
            doomed.resize(20_000, refcheck=False)  # realloc traps: the policy stops
    del doomed
    assert policy.failure is not None
    gc.collect()
    expected = np.arange(4096, dtype=np.int64)
    np.testing.assert_array_equal(through_dlpack, expected)
    np.testing.assert_array_equal(through_buffer, expected)
    assert view.tobytes() == expected.tobytes()
    frees = policy.stats()["frees"]
    del through_dlpack, through_buffer
    gc.collect()
    assert policy.stats()["frees"] == frees, "a consumer is still holding the block"
    view.release()
    gc.collect()
    assert policy.stats()["frees"] == frees + 1, "freed once, by its maker, when the last let go"


def test_an_allocbox_array_handed_to_numba_stays_alive_in_the_view_numba_returns(size_classes):
    numba = pytest.importorskip("numba")
    first_half = numba.njit(lambda a: a[: a.size // 2])
    with allocbox.use(size_classes):
        a = np.arange(1000.0)
    half = first_half(a)
    del a
    gc.collect()
    assert size_classes.stats()["live_blocks"] == 1
    np.testing.assert_array_equal(half, np.arange(500.0))
    del half
    gc.collect()
    assert size_classes.stats()["live_blocks"] == 0
