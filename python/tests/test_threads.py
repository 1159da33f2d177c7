"""The NumPy bridge under threads and processes: a thread's handler (NumPy's default
in a new thread, `use(threads=True)` for pools and threads, asyncio tasks), arrays made
and freed across threads without the GIL, a policy asked on every call or per thread,
and forked children that inherit a policy."""

import asyncio
import multiprocessing
import os
import threading

import numpy as np
import pytest

import allocbox
from conftest import guest


@pytest.fixture
def size_classes():
    return allocbox.load("size-classes")


def test_a_new_thread_starts_at_numpy_s_default(size_classes):
    seen = []
    with allocbox.use(size_classes):
        t = threading.Thread(target=lambda: seen.append(allocbox.handler_name(np.ones(4))))
        t.start()
        t.join()
    assert seen == ["default_allocator"]


def test_use_with_threads_places_arrays_made_on_pool_workers_and_threads(size_classes):
    from concurrent.futures import ThreadPoolExecutor

    def made_here():
        return allocbox.handler_name(np.ones(4))

    with allocbox.use(size_classes, threads=True):
        with ThreadPoolExecutor(max_workers=3) as pool:
            on_workers = set(pool.map(lambda _: made_here(), range(12)))
        seen = []
        t = threading.Thread(target=lambda: seen.append(made_here()))
        t.start()
        t.join()
    assert on_workers == {"size-classes"} and seen == ["size-classes"]
    assert threading.getprofile() is None, "the thread hook is gone after the block"
    after = []
    t = threading.Thread(target=lambda: after.append(made_here()))
    t.start()
    t.join()
    assert after == ["default_allocator"]


def test_a_thread_started_after_its_policy_stopped_runs_under_it_and_gets_memory_error():
    bad = allocbox.load(guest("broken"), {"fault": "misaligned"})
    seen = []

    def work():
        try:
            np.ones(100)
            seen.append("made")
        except MemoryError:
            seen.append("MemoryError")

    with allocbox.use(bad, threads=True):
        with pytest.raises(MemoryError):
            np.ones(100)
        t = threading.Thread(target=work)
        t.start()
        t.join()
    assert bad.failure is not None and seen == ["MemoryError"]


def test_a_profiler_set_for_new_threads_still_runs_in_them(size_classes):
    calls = []

    def profiler(frame, event, arg):
        calls.append(event)

    threading.setprofile(profiler)
    try:
        with allocbox.use(size_classes, threads=True):
            seen = []
            t = threading.Thread(target=lambda: seen.append(allocbox.handler_name(np.ones(4))))
            t.start()
            t.join()
        assert threading.getprofile() is profiler
    finally:
        threading.setprofile(None)
    assert seen == ["size-classes"] and "call" in calls


def test_a_pool_made_earlier_is_covered_by_its_initializer(size_classes):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2, initializer=allocbox.set_handler, initargs=(size_classes,)) as pool:
        names = set(pool.map(lambda _: allocbox.handler_name(np.ones(4)), range(6)))
    assert names == {"size-classes"}


def test_asyncio_tasks_inherit_and_keep_their_own_handler(size_classes):
    arena = allocbox.load("arena")

    async def task(mine, started):
        inherited = allocbox.handler_name()
        allocbox.set_handler(mine)
        started.set()
        await asyncio.sleep(0)
        return inherited, allocbox.handler_name(np.ones(8))

    async def main():
        allocbox.set_handler(size_classes)
        a_started, b_started = asyncio.Event(), asyncio.Event()
        a = asyncio.create_task(task(arena, a_started))
        b = asyncio.create_task(task(size_classes, b_started))
        results = await asyncio.gather(a, b)
        return results, allocbox.handler_name()

    results, after = asyncio.run(main())
    assert results == [("size-classes", "arena"), ("size-classes", "size-classes")]
    assert after == "size-classes", "a task's handler does not leak back"
    assert allocbox.handler_name() == "default_allocator", "asyncio.run had its own context"


def test_realloc_without_the_gil_from_many_threads(size_classes):
    errors = []

    def work(seed):
        # A new thread starts at NumPy's default; each worker installs the policy.
        allocbox.set_handler(size_classes)
        try:
            rng = np.random.default_rng(seed)
            for _ in range(200):
                a = rng.standard_normal(rng.integers(1, 5000))
                a.resize(a.size * 2, refcheck=False)
                np.sort(a)
        except Exception as e:  # noqa: BLE001 - any failure fails the test below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    size_classes.raise_if_failed()
    assert size_classes.stats()["reallocs"] >= 800


@pytest.mark.parametrize("per_thread", [False, None])
def test_a_policy_asked_on_every_call_serves_eight_threads_and_counts_every_array(per_thread):
    """`magazines=False`: no per-thread magazines, so every array of every thread is a
    call of the policy: of the one instance, the threads' calls served in turn by
    whichever is inside (`per_thread=False`), or of each thread's own (the default for
    a policy that says its state is per instance, as `system` does)."""
    per_call = allocbox.load("system", magazines=False, per_thread=per_thread)
    errors = []

    def work():
        allocbox.set_handler(per_call)
        try:
            for i in range(500):
                a = np.full(8 + i % 64, float(i))
                assert a[-1] == float(i)
        except Exception as e:  # noqa: BLE001 - any failure fails the test below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    per_call.raise_if_failed()
    stats = per_call.stats()
    assert stats["mallocs"] + stats["callocs"] >= 8 * 500, stats
    assert stats["live_blocks"] == 0, stats
    cores = len(os.sched_getaffinity(0))
    assert per_call.instances == (1 if per_thread is False else min(8, cores)), per_call.instances


def test_a_policy_with_magazines_or_that_diagnoses_keeps_one_instance_by_default():
    assert allocbox.load("size-classes").instances == 1
    guard = allocbox.load("guard", magazines=False, grant=["guarded"])
    assert guard.instances == 1


def test_a_per_thread_policy_takes_back_arrays_freed_on_other_threads():
    """`per_thread=True`: each thread's arrays come from a chain of its own, and an
    array dropped on another thread goes back to the chain that made it."""
    per_thread = allocbox.load("size-classes", per_thread=True)
    made = []
    errors = []

    def make():
        allocbox.set_handler(per_thread)
        made.extend(np.full(16 + i % 64, float(i)) for i in range(2000))

    def drop():
        allocbox.set_handler(per_thread)
        try:
            # An array of its own first, so that this thread has an instance too: a
            # thread that only frees is given none.
            assert np.ones(4).sum() == 4.0
            while made:
                a = made.pop()
                assert a[0] == a[-1]
        except Exception as e:  # noqa: BLE001 - any failure fails the test below
            errors.append(e)

    maker = threading.Thread(target=make)
    maker.start()
    maker.join()
    dropper = threading.Thread(target=drop)
    dropper.start()
    dropper.join()
    assert errors == []
    per_thread.raise_if_failed()
    stats = per_thread.stats()
    assert stats["mallocs"] >= 2000, stats
    assert stats["live_blocks"] == 0, stats
    assert per_thread.snapshot() == []
    # The maker's chain and the dropper's: size-classes says it is shardable.
    instances = min(2, len(os.sched_getaffinity(0)))
    assert per_thread.instances == instances, per_thread.instances
    links = per_thread.link_stats()
    assert [link["name"] for link in links] == ["size-classes"] * instances
    assert sum(link["mallocs"] for link in links) >= 2000


def test_per_thread_is_a_bound_of_load():
    with pytest.raises(TypeError, match="per_thread"):
        allocbox.load("system", per_threads=True)


def _sum_of_squares_and_handler(n):
    a = np.arange(float(n)) ** 2
    return float(a.sum()), allocbox.handler_name(a)


@pytest.mark.parametrize("per_thread", [False, True], ids=["one instance", "per thread"])
def test_a_fork_pool_computes_with_a_shipped_policy_while_the_parent_uses_it(per_thread):
    size_classes = allocbox.load("size-classes", per_thread=per_thread)
    stop = threading.Event()

    def churn():
        allocbox.set_handler(size_classes)
        while not stop.is_set():
            np.sort(np.arange(1000.0)[::-1])

    # Another thread calls the policy throughout, so forks land amid its calls.
    churner = threading.Thread(target=churn)
    churner.start()
    try:
        with allocbox.use(size_classes):
            with multiprocessing.get_context("fork").Pool(2) as pool:
                results = pool.map_async(_sum_of_squares_and_handler, range(1, 400)).get(timeout=120)
    finally:
        stop.set()
        churner.join()
    assert results == [(float(sum(i * i for i in range(n))), "size-classes") for n in range(1, 400)]
    size_classes.raise_if_failed()


# The policy a forked pool worker allocates with: inherited through the fork (a policy
# cannot be pickled to a worker).
_FORKED_POLICY = None


def _allocate_with_the_inherited_policy(size):
    with allocbox.use(_FORKED_POLICY):
        try:
            np.ones(size, dtype=np.uint8)
        except MemoryError:
            return "MemoryError", _FORKED_POLICY.failure
    return "allocated", None


def test_a_forked_child_whose_policy_loops_gets_memory_error_at_its_limit():
    global _FORKED_POLICY
    _FORKED_POLICY = allocbox.load(guest("broken"), {"fault": "loop-malloc"}, call_time=0.2)
    try:
        with multiprocessing.get_context("fork").Pool(1) as pool:
            # `loop-malloc` loops on a 13-byte malloc. A child with no clock of its own
            # would loop until this timeout.
            outcome, failure = pool.apply_async(_allocate_with_the_inherited_policy, (13,)).get(timeout=120)
        assert outcome == "MemoryError"
        assert "time limit" in failure, failure
        assert _FORKED_POLICY.failure is None, "the parent's policy never ran"
    finally:
        _FORKED_POLICY = None
