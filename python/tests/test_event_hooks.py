"""Event hooks from Python: NumPy's removed `PyDataMem_SetEventHook`, for arrays placed
through allocbox's handlers, with Python callables and sandboxed hook components."""

import sys
import traceback

import numpy as np
import pytest

import allocbox


@pytest.fixture(autouse=True)
def no_hook_left_behind():
    yield
    allocbox.set_event_hook(None)


def test_a_python_hook_sees_new_free_and_resize_of_numpy_arrays():
    events = []
    policy = allocbox.load("size-classes")
    assert allocbox.set_event_hook(lambda old, new, size: events.append((old, new, size))) is None
    with allocbox.use(policy):
        a = np.ones(1000, np.uint8)
        address = a.ctypes.data
        a.resize(5000, refcheck=False)
        moved = a.ctypes.data
        del a
    allocbox.set_event_hook(None)
    assert (0, address, 1000) in events, events
    assert (address, moved, 5000) in events, events
    assert (moved, 0, 0) in events, events


def test_set_event_hook_returns_the_previous_hook():
    first = lambda old, new, size: None  # noqa: E731
    assert allocbox.set_event_hook(first) is None
    sizes = allocbox.load_hook("sizes")
    assert allocbox.set_event_hook(sizes) is first
    assert allocbox.set_event_hook(None) is sizes


def test_a_shipped_wasm_hook_counts_numpy_arrays_by_size():
    assert set(allocbox.hooks()) >= {"sizes", "counting"}
    hook = allocbox.load_hook("sizes")
    allocbox.set_event_hook(hook)
    with allocbox.use(allocbox.load("system")):
        arrays = [np.ones(3000, np.uint8) for _ in range(5)]     # 2 KiB - 4 KiB
    allocbox.set_event_hook(None)
    del arrays
    report = hook.report()
    assert len(report) == 64 and report[11] >= 5, report
    assert hook.failure is None


def test_a_hook_is_named_by_path_or_name_and_a_bad_name_is_a_load_error(tmp_path):
    with pytest.raises(allocbox.LoadError, match="no shipped hook or file named 'sises'.*sizes"):
        allocbox.set_event_hook("sises")
    path = tmp_path / "mine.wat"
    path.write_text(allocbox._shipped_hooks()["counting"][1])
    assert allocbox.load_hook(str(path)).name == "mine"


def test_a_raising_hook_is_detached_and_reported_and_the_array_is_made(monkeypatch):
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)

    def broken(old, new, size):
        raise ValueError("hook bug")

    allocbox.set_event_hook(broken)
    with allocbox.use(allocbox.load("system")):
        a = np.arange(100.0)
        b = np.arange(100.0)
    assert a.sum() == b.sum() == 4950.0
    assert allocbox.set_event_hook(None) is None, "detached after its first failure"
    assert len(reported) == 1, reported
    # The hook's own exception, its traceback ending at the hook's line, and a note.
    error = reported[0].exc_value
    assert isinstance(error, ValueError) and str(error) == "hook bug"
    frames = traceback.extract_tb(reported[0].exc_traceback)
    assert frames[-1].name == "broken" and "raise ValueError" in frames[-1].line, frames
    assert any("event hook" in n and "failed and was detached" in n for n in error.__notes__)
    # Printed first: "Exception ignored in: event hook <function ...>, which failed and
    # was detached".
    assert reported[0].object.hook is broken
    assert repr(reported[0].object).startswith("event hook <function") and "was detached" in repr(reported[0].object)


def test_a_trapping_wasm_hook_is_detached_and_reported(monkeypatch):
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    trapping = b"""(module
        (func (export "allocbox:policy/events@0.1.0#on-event") (param i64 i64 i64) unreachable)
        (func (export "allocbox:policy/events@0.1.0#report") (result i32) unreachable)
        (memory (export "memory") 1))"""
    hook = allocbox.load_hook(trapping)
    allocbox.set_event_hook(hook)
    with allocbox.use(allocbox.load("system")):
        a = np.ones(10)
    assert a.sum() == 10.0
    assert allocbox.set_event_hook(None) is None
    assert hook.failure is not None and len(reported) == 1
    error = reported[0].exc_value
    assert any("failed and was detached" in note for note in error.__notes__), error
