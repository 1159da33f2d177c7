"""Numba's arrays under allocbox policies (`allocbox.numba`): arrays that `@njit` code
makes are placed by NumPy's current handler when it is an allocbox policy, named,
counted, traced and hooked like NumPy's, and freed once, with their size, by the policy
that made them. Hand-offs of allocbox arrays to other consumers: `test_handoff.py`."""

import gc
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import allocbox
from conftest import guest, trace_text

numba = pytest.importorskip("numba")


@numba.njit
def double(a):
    return a * 2


@numba.njit
def churn(n, size):
    total = 0.0
    for i in range(n):
        a = np.empty(size)
        a[0] = i
        total += a[0]
    return total


@numba.njit(parallel=True)
def row_sums(n, width):
    out = np.empty(n)
    for i in numba.prange(n):
        row = np.arange(width + i % 3)  # made on a worker thread, or this one
        out[i] = row[width - 1]
    return out


@numba.njit(nogil=True)
def zeros_without_the_gil(n):
    return np.zeros(n)


@numba.njit
def squares(n):
    for i in range(n):
        yield np.full(3, i * i)


def counts(policy):
    s = policy.stats()
    return {k: s[k] for k in ("mallocs", "frees", "live_blocks", "size_corrections", "failed")}


@pytest.fixture
def size_classes():
    return allocbox.load("size-classes")


def test_an_array_njit_returns_is_named_counted_and_freed_with_its_size_by_its_policy(size_classes):
    a = np.arange(1000.0)
    double(a)  # compiled before the policy is installed
    before = counts(size_classes)
    with allocbox.use(size_classes):
        b = double(a)
    assert allocbox.handler_name(b) == "size-classes"
    np.testing.assert_array_equal(b, a * 2)
    assert b.ctypes.data % 32 == 0, "aligned as Numba asks"
    made = counts(size_classes)
    assert made["mallocs"] == before["mallocs"] + 1 and made["live_blocks"] == before["live_blocks"] + 1
    del b
    gc.collect()
    after = counts(size_classes)
    assert after["frees"] == made["frees"] + 1 and after["live_blocks"] == before["live_blocks"]
    assert after["size_corrections"] == 0, "the ledger supplied the size NRT's free does not say"
    size_classes.raise_if_failed()


def test_arrays_made_outside_the_block_stay_with_numba_s_own_allocator(size_classes):
    with allocbox.use(size_classes):
        pass
    b = double(np.arange(10.0))
    assert allocbox.handler_name(b) is None
    assert counts(size_classes)["mallocs"] == 0


def test_the_route_asks_numpy_only_while_a_block_is_open_or_after_set_handler(tmp_path):
    # In a process of its own: the test session's own `set_handler` calls hold the route.
    program = tmp_path / "holds.py"
    program.write_text(textwrap.dedent("""
        import numba, numpy as np, allocbox, allocbox.numba
        from allocbox._allocbox import numba_route_holds as holds

        @numba.njit
        def double(a):
            return a * 2

        policy = allocbox.load("size-classes")
        with allocbox.use(policy):
            inside = (holds(), allocbox.handler_name(double(np.ones(3))))
        after = (holds(), allocbox.handler_name(double(np.ones(3))))
        allocbox.set_handler(policy)
        set_ = (holds() > 0, allocbox.handler_name(double(np.ones(3))))
        allocbox.set_handler(None)
        reset = (holds() > 0, allocbox.handler_name(double(np.ones(3))))
        print(inside, after, set_, reset)
    """))
    done = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(1, 'size-classes') (0, None) (True, 'size-classes') (True, None)", done.stdout


def test_numba_use_places_every_thread_s_arrays_and_an_allocbox_use_block_inside_comes_first(tmp_path):
    # In a process of its own: the test session's own `set_handler` calls make Numba's
    # arrays follow NumPy's context for good, where the process-wide block steps aside.
    program = tmp_path / "process_wide.py"
    program.write_text(textwrap.dedent("""
        import threading
        import numba, numpy as np, allocbox, allocbox.numba

        @numba.njit
        def double(a):
            return a * 2

        @numba.njit(parallel=True)
        def row_sums(n, width):
            out = np.empty(n)
            for i in numba.prange(n):
                row = np.ones(width + i % 3)
                out[i] = row.sum()
            return out

        def name(array):
            return allocbox.handler_name(array)

        policy, other = allocbox.load("size-classes"), allocbox.load("system")
        with allocbox.numba.use(policy):
            seen = [name(double(np.ones(3))), name(np.ones(3))]
            thread = threading.Thread(target=lambda: seen.append(name(double(np.ones(3)))))
            thread.start()
            thread.join()
            before = policy.stats()["mallocs"]
            row_sums(400, 8)
            seen.append(policy.stats()["mallocs"] - before >= 400)
            with allocbox.use(other):
                seen.append(name(double(np.ones(3))))
            seen.append(name(double(np.ones(3))))
        seen.append(name(double(np.ones(3))))
        print(seen)
        try:
            with allocbox.numba.use("size-classes"):
                pass
        except TypeError as e:
            print(e)
    """))
    done = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    seen, refused = done.stdout.strip().splitlines()
    # Numba's arrays on the main thread, a thread with no handler of its own and the
    # parallel workers, by the policy; NumPy's own arrays by NumPy's context; an
    # `allocbox.use` block's context inside; nothing after the block.
    assert seen == "['size-classes', 'default_allocator', 'size-classes', True, 'system', 'size-classes', None]", seen
    assert refused.startswith("allocbox.numba.use takes a policy") and refused.endswith("not str"), refused


def test_an_array_outlives_a_change_of_policy_and_is_freed_by_its_maker(size_classes):
    other = allocbox.load("system")
    x = np.arange(100.0)
    double(x)  # compiled before either policy counts (run alone, it compiles here)
    with allocbox.use(size_classes):
        b = double(x)
    with allocbox.use(other):
        c = double(x)
        del b
        gc.collect()
    assert counts(size_classes)["frees"] == 1 and counts(size_classes)["live_blocks"] == 0
    assert counts(other)["frees"] == 0 and allocbox.handler_name(c) == "system"
    del c
    gc.collect()
    assert counts(other)["live_blocks"] == 0


def test_an_array_outlives_the_policy_object_that_made_it():
    x = np.arange(5000.0)
    with allocbox.use(allocbox.load("size-classes")):
        b = double(x)
    gc.collect()  # the Policy object is gone; the block holds its handler
    np.testing.assert_array_equal(b, np.arange(5000.0) * 2)
    assert allocbox.handler_name(b) == "size-classes"
    del b
    gc.collect()


def test_arrays_outlive_their_dropped_policy_and_are_freed_on_other_threads():
    # What keeps a policy alive for its Numba arrays is counted per thread: arrays made
    # on Numba's workers and here, freed on other threads after the policy is gone.
    x = np.arange(1000.0)
    with allocbox.use(allocbox.load("size-classes")):
        kept = [double(x) for _ in range(8)] + [row_sums(64, 8) for _ in range(8)]
    gc.collect()
    for a in kept[:8]:
        np.testing.assert_array_equal(a, x * 2)
    freers = [threading.Thread(target=lambda part=kept[i::4]: part.clear()) for i in range(4)]
    kept = None
    for t in freers:
        t.start()
    for t in freers:
        t.join()
    gc.collect()


@pytest.mark.parametrize("block", ["use", "numba.use"])
def test_tracemalloc_sees_a_numba_array_a_policy_made_at_the_line_that_made_it(size_classes, block):
    import tracemalloc

    opened = allocbox.use if block == "use" else allocbox.numba.use
    x = np.arange(5000.0)
    double(x)  # compiled before tracing
    tracemalloc.start()
    try:
        with opened(size_classes):
            made = double(x); line = sys._getframe().f_lineno  # noqa: E702 - one line
        snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    here = [
        stat.size
        for stat in snapshot.statistics("lineno")
        if stat.traceback[0].filename == __file__ and stat.traceback[0].lineno == line
    ]
    assert here and max(here) >= made.nbytes, here
    del made
    gc.collect()


def test_many_small_and_64_kib_arrays_in_a_loop_balance(size_classes):
    with allocbox.use(size_classes):
        assert churn(2000, 8) == sum(range(2000))
        assert churn(200, 8192) == sum(range(200))
    stats = counts(size_classes)
    assert stats["mallocs"] == 2200 and stats["frees"] == 2200 and stats["live_blocks"] == 0, stats
    assert stats["size_corrections"] == 0


def test_numba_s_statistics_count_the_arrays_a_policy_places_while_they_are_on(size_classes):
    from numba.core.runtime import _nrt_python as nrt

    import allocbox.numba

    def counted():
        return [nrt.memsys_get_stats_alloc(), nrt.memsys_get_stats_free(),
                nrt.memsys_get_stats_mi_alloc(), nrt.memsys_get_stats_mi_free()]

    allocbox.numba.enable()
    nrt.memsys_enable_stats()
    try:
        before = counted()
        with allocbox.use(size_classes):
            churn(100, 8)
        after = counted()
    finally:
        nrt.memsys_disable_stats()
    assert [a - b for a, b in zip(after, before)] == [100, 100, 100, 100], (before, after)
    # Off, the route makes each MemInfo itself: placed all the same, and counted nowhere.
    with allocbox.use(size_classes):
        churn(50, 8)
    nrt.memsys_enable_stats()
    try:
        assert counted() == after
    finally:
        nrt.memsys_disable_stats()
    assert counts(size_classes)["mallocs"] == 150 and counts(size_classes)["live_blocks"] == 0


def test_arrays_made_on_parallel_workers_are_placed_by_the_policy_of_the_open_block(size_classes):
    with allocbox.use(size_classes):
        sums = row_sums(64, 100)
    np.testing.assert_array_equal(sums, np.full(64, 99.0))
    stats = counts(size_classes)
    assert stats["mallocs"] == 65 and stats["live_blocks"] == 1, stats  # 64 rows and `out`
    del sums
    gc.collect()
    assert counts(size_classes)["live_blocks"] == 0


def test_a_nogil_function_and_a_generator_place_their_arrays_too(size_classes):
    with allocbox.use(size_classes):
        z = zeros_without_the_gil(1000)
        rows = list(squares(4))
    assert allocbox.handler_name(z) == "size-classes" and not z.any()
    assert [allocbox.handler_name(r) for r in rows] == ["size-classes"] * 4
    assert [int(r[0]) for r in rows] == [0, 1, 4, 9]


def test_a_thread_with_its_own_context_places_its_arrays_with_its_own_policy(size_classes):
    other = allocbox.load("system")
    seen = []

    def work():
        with allocbox.use(other):
            seen.append(allocbox.handler_name(double(np.arange(10.0))))

    with allocbox.use(size_classes):
        t = threading.Thread(target=work)
        t.start()
        t.join()
        mine = double(np.arange(10.0))
    assert seen == ["system"] and allocbox.handler_name(mine) == "size-classes"


def test_a_stopped_policy_makes_numba_raise_memory_error_and_loses_no_array():
    bad = allocbox.load(guest("broken"), {"fault": "misaligned"})
    x = np.arange(100.0)
    kept = double(x)
    with allocbox.use(bad):
        with pytest.raises(MemoryError):
            double(x)
        with pytest.raises(MemoryError):
            double(x)  # stopped: fails cleanly again
    assert bad.failure is not None and bad.stats()["failed"] == 2
    np.testing.assert_array_equal(kept, np.arange(100.0) * 2)


def test_a_policy_that_traps_on_free_is_stopped_and_named_when_numba_frees_its_array():
    bad = allocbox.load(guest("broken"), {"fault": "trap-free"})
    x = np.arange(100_000.0)
    with allocbox.use(bad):
        b = double(x)
    np.testing.assert_array_equal(b, x * 2)
    del b
    gc.collect()
    assert bad.failure is not None and "broken" in bad.failure, bad.failure
    with pytest.raises(allocbox.PoisonedPolicy):
        allocbox.set_handler(bad)


def test_a_cap_refuses_a_numba_array_past_it_with_memory_error():
    capped = allocbox.load(guest("limit"), {"max-bytes": "1MiB"})
    x, large = np.arange(1000.0), np.arange(1_000_000.0)
    with allocbox.use(capped):
        small = double(x)
        with pytest.raises(MemoryError):
            double(large)
    assert allocbox.handler_name(small) == "limit"
    assert capped.failure is None


def test_guarded_memory_places_numba_arrays_when_granted():
    guard = allocbox.load("guard", {"sample": "1"}, grant=["guarded"])
    x = np.arange(2000.0)
    with allocbox.use(guard):
        b = double(x)
    np.testing.assert_array_equal(b, np.arange(2000.0) * 2)
    assert guard.link_stats()[0]["mapped_regions"] >= 1
    del b
    gc.collect()
    assert guard.stats()["live_blocks"] == 0


def test_a_trace_and_an_event_hook_see_numba_s_blocks_with_their_sizes(tmp_path):
    path = tmp_path / "numba.trace"
    policy = allocbox.load("system", record=str(path))
    events = []
    allocbox.set_event_hook(lambda old, new, size: events.append((old, new, size)))
    try:
        x = np.arange(100.0)
        with allocbox.use(policy):
            b = double(x)
            address = b.ctypes.data
            del b
            gc.collect()
    finally:
        allocbox.set_event_hook(None)
    policy.finish_recording()
    news = [e for e in events if e[0] == 0 and e[1] <= address < e[1] + e[2]]
    frees = [e for e in events if e[1] == 0 and e[0] == news[0][1]]
    assert len(news) == 1 and len(frees) == 1, events
    lines = [line.split() for line in trace_text(path).splitlines() if not line.startswith("#")]
    ops = [(op, int(size)) for op, _, size, *_ in lines]
    assert ops == [("m", news[0][2]), ("f", news[0][2])], ops


def run_python(tmp_path, body, **env):
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(body))
    import os

    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
        cwd=tmp_path,
    )


def test_a_function_loaded_from_numba_s_cache_places_its_arrays_with_the_policy(tmp_path):
    body = """
        import numba, numpy as np, allocbox

        @numba.njit(cache=True)
        def triple(a):
            return a * 3

        with allocbox.use(allocbox.load("size-classes")):
            b = triple(np.arange(10.0))
        print(allocbox.handler_name(b), sum(triple.stats.cache_hits.values()))
    """
    first = run_python(tmp_path, body, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    second = run_python(tmp_path, body, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout.split()[0] == "size-classes"
    assert second.stdout.split() == ["size-classes", "1"], second.stdout


def test_numba_s_debugging_allocator_is_routed_too(tmp_path):
    done = run_python(
        tmp_path,
        """
        import numba, numpy as np, allocbox

        @numba.njit
        def double(a):
            return a * 2

        with allocbox.use(allocbox.load("size-classes")):
            b = double(np.arange(10.0))
        print("result:", allocbox.handler_name(b), b.sum())
        """,
        NUMBA_DEBUG_NRT="1",
    )
    assert done.returncode == 0, done.stderr
    result = [line for line in done.stdout.splitlines() if line.startswith("result:")]
    assert result == ["result: size-classes 90.0"], done.stdout[-2000:]


def test_blocks_never_freed_before_exit_are_not_reported_as_errors(tmp_path):
    done = run_python(
        tmp_path,
        """
        import numba, numpy as np, allocbox

        @numba.njit
        def double(a):
            return a * 2

        kept = []
        x = np.arange(10.0)
        double(x)  # compiled outside: the compiler's own arrays are not the program's
        policy = allocbox.load("size-classes")
        with allocbox.use(policy):
            kept.append(double(x))
            kept.append(np.arange(10.0))
        print(policy.stats()["live_blocks"])
        """,
    )
    assert done.returncode == 0 and done.stdout.strip() == "2", done.stdout + done.stderr
    assert done.stderr == ""


def test_a_large_numba_array_is_bound_to_the_numa_node_asked_for():
    from test_numa import placement_of

    policy = allocbox.load("numa", {"node": "0"}, grant=["numa"])
    x = np.ones(1 << 20)  # 8 MiB, past the policy's 1 MiB `min-size`
    with allocbox.use(policy):
        b = double(x)
    assert allocbox.handler_name(b) == "numa"
    assert placement_of(b.ctypes.data) == "bind:0"
    assert float(b.sum()) == 2.0 * (1 << 20)


def test_a_numba_allocbox_cannot_route_is_said_once_and_numpy_s_side_goes_on(monkeypatch, size_classes):
    import allocbox.numba as route

    def refuse():
        raise allocbox.AllocboxError("this Numba's runtime lays out its MemInfo differently")

    monkeypatch.setattr(route, "_enabled", False)
    monkeypatch.setattr(route, "_refused", False)
    monkeypatch.setattr(route, "enable", refuse)
    with pytest.warns(RuntimeWarning, match="lays out its MemInfo differently"):
        with allocbox.use(size_classes):
            a = np.arange(10.0)
    assert allocbox.handler_name(a) == "size-classes"
    with allocbox.use(size_classes):  # said once
        np.arange(10.0)


def test_the_error_a_stopped_policy_causes_in_numba_code_names_the_policy_and_its_failure():
    # Found in issue 52: a policy stopped while prange workers allocate showed the
    # program Numba's "Allocation failed (probably too large)" and a SystemError from
    # its unpickling, neither naming the policy.
    bad = allocbox.load(guest("broken"), {"fault": "misaligned"})
    with pytest.raises(MemoryError) as raised:
        with allocbox.use(bad):
            double(np.arange(100.0))
    assert any("policy `broken` was stopped:" in note and "align" in note for note in raised.value.__notes__)
    stopping = allocbox.load(guest("broken"), {"fault": "misaligned-after-300"})
    with pytest.raises((MemoryError, SystemError)) as raised:
        with allocbox.use(stopping):
            for _ in range(100):
                row_sums(2000, 10)
    assert any("policy `broken` was stopped:" in note for note in raised.value.__notes__), raised.value


STRESS = """
import gc, sys, threading
import numba, numpy as np, allocbox
sys.path.insert(0, sys.argv[2])
from conftest import guest
from test_numba import row_sums

@numba.njit(nogil=True)
def churn(n):
    t = 0.0
    for i in range(n):
        a = np.empty(8 + i % 64)
        a[0] = i
        t += a[0]
    return t

stop = threading.Event()
def worker():
    while not stop.is_set():
        try:
            churn(500)
        except MemoryError:
            pass
workers = [threading.Thread(target=worker) for _ in range(4)]
for t in workers:
    t.start()
try:
    for i in range(int(sys.argv[1])):
        fault = "misaligned-after-300" if i % 5 == 2 else None
        policy = allocbox.load(guest("broken"), {"fault": fault}) if fault else allocbox.load("size-classes")
        try:
            with allocbox.use(policy):
                row_sums(300, 10)
        except (MemoryError, SystemError) as e:
            assert policy.failure is not None and any("was stopped" in n for n in e.__notes__), e
        del policy
        gc.collect()
finally:
    stop.set()
    for t in workers:
        t.join()
print("done")
"""


def test_use_blocks_drops_and_stops_under_nogil_and_prange_allocation_never_hang(tmp_path):
    # Found in issue 52: threads in nogil loops while the main thread opened and closed
    # use blocks and dropped policies (one stopped) hung until killed, in one of two runs.
    # Bounded by a count of blocks; the timeout only turns a hang into a failure.
    script = tmp_path / "stress.py"
    script.write_text(STRESS)
    tests = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(
        [sys.executable, str(script), "60", tests], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stdout + done.stderr
